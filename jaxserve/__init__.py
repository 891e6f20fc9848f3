"""jaxserve: an LLM inference server on JAX/XLA in the shape of vLLM V1."""

import os

# The API process uses transformers for tokenizers only; its "PyTorch was not found" advisory
# reads like an error in a server log.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402


def __getattr__(name):
    # LLM imports JAX; keep `import jaxserve` light for the API process.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob"]
