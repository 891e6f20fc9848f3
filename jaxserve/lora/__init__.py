"""Multi-LoRA serving (docs/lora.md): adapters over the base model's linear projections, many
in one step.

``request`` (``LoRARequest``, what a request names), ``checkpoint`` (PEFT folders read and
checked against the model, no JAX), ``layers`` (the device pool inside the params and the
batched delta), ``manager`` (``LoRAModelManager``: host LRU cache and device slots, engine).
"""
