"""LoRARequest: the adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter by name, id and folder; crosses the pipe inside ``EngineCoreRequest``.

    Attributes:
      lora_name: the name requests give as ``model``.
      lora_int_id: positive and unique per adapter loaded (the server never reuses one, so an
        adapter unloaded and loaded again under the same name is a new adapter to the engine's
        caches and to the prefix cache).
      lora_path: the PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
