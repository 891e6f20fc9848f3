"""current_platform() follows JAX's backend; the CLI's help states the platforms' defaults."""

import argparse

import jax
import pytest

from jaxserve.engine.arg_utils import add_cli_args
from jaxserve.platforms import CPU, GPU, PLATFORMS, current_platform


def test_current_platform_is_the_backend_s(monkeypatch):
    assert current_platform() is PLATFORMS[jax.default_backend()]
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(RuntimeError, match="unsupported JAX backend 'tpu'"):
        current_platform()


def test_help_states_the_platform_defaults():
    text = " ".join(add_cli_args(argparse.ArgumentParser()).format_help().split())
    for p, name in ((CPU, "CPU"), (GPU, "GPU")):
        for fact in (p.max_num_seqs, p.max_num_batched_tokens, p.dtype, p.attention_backend):
            assert f"{fact} on {name}" in text
    assert f"at most {CPU.max_model_len} on CPU" in text
