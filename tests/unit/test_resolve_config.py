"""resolve_config: fields left unset take the platform's defaults; set ones are kept."""

import msgspec
import pytest

from jaxserve.config import EngineConfig, ResolvedConfig, resolve_config
from jaxserve.platforms import CPU, GPU


def test_device_defaults_and_explicit_values():
    cpu = resolve_config(EngineConfig(), CPU, max_position_embeddings=8192)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.max_model_len) == (32, 512, 4096)
    assert (cpu.dtype, cpu.kv_cache_dtype, cpu.attention_backend) == ("float32", "float32",
                                                                       "reference")
    gpu = resolve_config(EngineConfig(), GPU, max_position_embeddings=131072)
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.max_model_len) == (256, 8192, 131072)
    assert (gpu.dtype, gpu.kv_cache_dtype, gpu.attention_backend) == ("bfloat16", "bfloat16",
                                                                       "pallas")
    mine = resolve_config(EngineConfig(max_num_seqs=8, max_model_len=64, dtype="float32",
                                       kv_cache_dtype="fp8", attention_backend="reference"),
                          GPU, max_position_embeddings=4096)
    assert (mine.max_num_seqs, mine.max_num_batched_tokens, mine.max_model_len) == (8, 8192, 64)
    assert (mine.dtype, mine.kv_cache_dtype, mine.attention_backend) == ("float32", "fp8",
                                                                          "reference")


def test_bad_limits_name_the_flag():
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        resolve_config(EngineConfig(max_num_batched_tokens=16), GPU, max_position_embeddings=64)
    with pytest.raises(ValueError, match="--max-model-len 8192 exceeds .* 4096"):
        resolve_config(EngineConfig(max_model_len=8192), GPU, max_position_embeddings=4096)


def test_resolved_config_has_every_field_and_no_unresolved_value():
    r = resolve_config(EngineConfig(model="m", seed=3), CPU, max_position_embeddings=256)
    assert set(ResolvedConfig.__struct_fields__) == set(EngineConfig.__dataclass_fields__)
    assert (r.model, r.seed) == ("m", 3)
    with pytest.raises(msgspec.ValidationError):  # "auto" is not a resolved value
        msgspec.convert({**msgspec.to_builtins(r), "dtype": "auto"}, ResolvedConfig)


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpu_memory_utilization=2), "gpu_memory_utilization must be in (0, 1], got 2"),
    (dict(max_model_len=-1), "max_model_len must be positive, got -1"),
    (dict(max_model_len="abc"), "max_model_len 'abc': Expected `int | null`, got `str`"),
    (dict(max_num_seqs=True), "max_num_seqs True: Expected `int | null`, got `bool`"),
    (dict(dtype="float16"), "dtype 'float16': expected one of 'auto', 'bfloat16', 'float32'"),
    (dict(quantization="int4"), "quantization 'int4': expected one of 'fp8', "),
    (dict(page_size=12), "page_size must be a power of two, got 12"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching 'yes': Expected `bool`"),
    (dict(seed=-1), "seed must be a non-negative 63-bit integer, got -1"),
])
def test_engine_config_checks_each_field_as_its_flag_does(kwargs, message):
    """``LLM(**kwargs)`` reaches EngineConfig without argparse: a bad value is a ValueError
    naming the field, before any model is loaded."""
    with pytest.raises(ValueError) as e:
        EngineConfig(**kwargs)
    assert str(e.value).startswith(message)


def test_engine_config_takes_a_path_and_whole_numbers_for_floats(tmp_path):
    config = EngineConfig(model=tmp_path, kv_cache_gib=3, speculative_config={"method": "ngram"})
    assert config.model == str(tmp_path) and config.kv_cache_gib == 3
