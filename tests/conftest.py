"""Shared fixtures: the real default model (fetched once into the default cache, shared by all
test runs) loaded once per session, and its conversion to an HF folder."""

import pathlib

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> pathlib.Path:
    from checkpoints_tools.fetch_default import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm(default_gguf):
    from jaxserve.model_loader import load_gguf

    return load_gguf(default_gguf)


@pytest.fixture(scope="session")
def smollm_hf_folder(smollm, tmp_path_factory) -> pathlib.Path:
    from jaxserve.model_loader import save_hf_folder

    return save_hf_folder(tmp_path_factory.mktemp("conv") / "SmolLM2-135M-Instruct", smollm)
