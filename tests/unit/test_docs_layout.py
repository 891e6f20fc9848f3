"""docs/architecture.md's Layout table against the tree: every ``.py`` module under the listed
packages has a row, every row names a file that exists, no module has two rows, and every row
gives its process as one of the four the page defines."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("jaxserve", "pallas_kernels", "checkpoints_tools", "scripts")
PROCESSES = {"API", "engine", "both", "tools"}
# A table row whose first cell is one backticked path: | `path.py` | job | process |
ROW = re.compile(r"^\|\s*`([^`]+\.py)`\s*\|(.*)\|\s*([^|]*?)\s*\|\s*$")


def layout_rows() -> list[tuple[str, str]]:
    """(path, process) of each row of the "## Layout" section, in order."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [ROW.match(line) for line in section.splitlines()]
    return [(m.group(1), m.group(3)) for m in rows if m]


def tree_modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_every_module_has_one_row_and_every_row_exists():
    paths = [path for path, _ in layout_rows()]
    assert len(paths) > 50, "the Layout table was not found or not parsed"
    duplicates = sorted({p for p in paths if paths.count(p) > 1})
    assert not duplicates, f"modules with more than one row: {duplicates}"
    missing = sorted(tree_modules() - set(paths))
    assert not missing, f"modules without a row in docs/architecture.md's Layout: {missing}"
    stale = sorted(set(paths) - tree_modules())
    assert not stale, f"rows naming no file of the tree: {stale}"


def test_every_row_names_its_process():
    wrong = [(path, process) for path, process in layout_rows() if process not in PROCESSES]
    assert not wrong, f"rows whose process is not one of {sorted(PROCESSES)}: {wrong}"
