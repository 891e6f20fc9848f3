"""Loading a real checkpoint (the default model converted to an HF
safetensors folder) the way EngineCore does keeps live JAX arrays below 1.2x the weights' bytes:
parameters are built once, per layer, in their target dtype."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.model_loader import load_checkpoint
from jaxserve.models import llama
from jaxserve.models.registry import build_params
from jaxserve.worker.model_runner import ModelRunner
from pallas_kernels.reference import attention


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


class PeakSampler:
    """Samples ``live_bytes()`` every ``interval_s`` on a background thread; ``peak`` is the
    largest sample (bytes) seen between ``__enter__`` and ``__exit__``."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, live_bytes())
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, live_bytes())


def test_hf_folder_load_peaks_below_1_2x_weights(smollm_hf_folder):
    baseline = live_bytes()  # arrays other tests of this session keep alive
    with PeakSampler() as sampler:
        # As EngineCore.__init__: checkpoint -> params -> ModelRunner (no KV pool yet).
        ckpt = load_checkpoint(str(smollm_hf_folder))
        config, params = build_params(ckpt.hf_config, ckpt.weights, jnp.float32)
        del ckpt
        runner = ModelRunner(config, params, page_size=16, max_num_seqs=4,
                             max_num_batched_tokens=64, max_model_len=256,
                             kv_dtype=jnp.float32, attention_fn=attention)
        del params
    weights = sum(x.nbytes for x in jax.tree.leaves(runner.params))
    assert weights >= 130e6 * 4  # SmolLM2-135M in float32: every weight is counted
    ratio = (sampler.peak - baseline) / weights
    print(f"load peak {(sampler.peak - baseline) / 2**20:.0f} MiB of live arrays, "
          f"weights {weights / 2**20:.0f} MiB: {ratio:.2f}x")
    assert ratio < 1.2


@pytest.mark.parametrize("arch,tied", [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True),
                                       ("Qwen3ForCausalLM", True)])
def test_dummy_params_have_the_checkpoint_layout(arch, tied):
    config = ModelConfig.from_hf_config({
        "architectures": [arch], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": tied})
    outer, layer = llama.hf_tensor_shapes(config)
    weights = {name: np.zeros(shape, np.float32) for name, shape in outer.items()}
    for i in range(config.num_layers):
        weights |= {f"model.layers.{i}.{n}": np.zeros(s, np.float32) for n, s in layer.items()}
    layout = lambda params: jax.tree.map(lambda x: (x.shape, x.dtype), params)  # noqa: E731
    dummy = llama.random_params(config, jnp.bfloat16, seed=1)
    assert layout(dummy) == layout(llama.params_from_hf(config, weights, jnp.bfloat16))
    assert len(dummy["layers"]) == 3 and ("lm_head" in dummy) == (not tied)
    assert (dummy["norm"] == 1).all() and float(jnp.std(dummy["layers"][2]["down_proj"])) > 0.01
