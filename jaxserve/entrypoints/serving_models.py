"""GET /v1/models and GET /v1/models/{model}: the model served and its LoRA adapters; POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's serving_models.py; docs/lora.md).

The adapters live in the app's ``lora_requests`` (name -> ``LoRARequest``): ``--lora-modules``
at start-up, then the two POSTs where runtime updating is on (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``,
vLLM's switch). An adapter is checked against the model here (``lora.checkpoint.read_adapter``
on a worker thread, shapes only) before its name serves; the engine reads its weights when a
request first names it. Unloading removes the name: new requests for it get a 404, requests
already running finish with it, and the engine's copies age out of its LRU caches. Loading in
place (``load_inplace``) is an unload and a load under the same name at once.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from jaxserve.entrypoints.app_state import LLM_KEY, STATE_KEY
from jaxserve.entrypoints.errors import APIError
from jaxserve.entrypoints.protocol import (LoadLoRAAdapterRequest, ModelCard, ModelList,
                                          UnloadLoRAAdapterRequest)
from jaxserve.entrypoints.responses import json_response
from jaxserve.entrypoints.serving_engine import (check_model, llm_of, lora_request_of,
                                                 parse_request, require_ready, served_name)
from jaxserve.lora.checkpoint import read_adapter
from jaxserve.lora.request import LoRARequest


def _model_card(request: web.Request, model: str) -> ModelCard:
    llm, state = llm_of(request), request.app[STATE_KEY]
    lora = lora_request_of(request, model)
    if lora is not None:
        return ModelCard(id=model, created=state["created"], root=lora.lora_path,
                         parent=served_name(request), max_model_len=llm.config.max_model_len)
    return ModelCard(id=model, created=state["created"], root=llm.model_name,
                     max_model_len=llm.config.max_model_len)


async def show_available_models(request: web.Request) -> web.Response:
    """GET /v1/models: the model served, then its LoRA adapters."""
    require_ready(llm_of(request))
    names = [served_name(request), *request.app[STATE_KEY]["lora_requests"]]
    return json_response(ModelList(data=[_model_card(request, name) for name in names]))


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the card of the model or an adapter, or 404 for a name this
    server does not serve."""
    require_ready(llm_of(request))
    return json_response(_model_card(request, check_model(request, request.match_info["model"])))


def _already_loaded(name: str) -> APIError:
    return APIError(400, f"The lora adapter '{name}' has already been loaded. If you want to "
                         "load the adapter in place, set 'load_inplace' to True.",
                    param="lora_name")


async def add_lora(app: web.Application, name: str, path: str,
                   base_model_name: str | None = None, load_inplace: bool = False) -> LoRARequest:
    """Serve the PEFT folder ``path`` as ``name`` once it passes the checks; the adapter's
    parent is the served model, which ``base_model_name`` (``--lora-modules``' JSON form, None
    for none) must name. With ``load_inplace`` a name already served becomes the new folder's
    adapter, under a new id: requests that arrive afterwards run with its weights, requests
    already running finish with the weights they started with (docs/lora.md).

    Raises:
      APIError: 400 without --enable-lora, for an empty name or path (vLLM's text), a
        ``base_model_name`` other than the served model's name, the served model's name, a
        name already served without ``load_inplace`` (vLLM's text), or an adapter the checks
        refuse (the message names it and why).
    """
    llm, state = app[LLM_KEY], app[STATE_KEY]
    loras = state["lora_requests"]
    served = state["served_model_name"] or llm.model_name
    if llm.lora_shapes is None:
        raise APIError(400, "LoRA adapters need a server started with --enable-lora")
    if not name or not path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                       param="lora_path" if name else "lora_name")
    if base_model_name not in (None, served):
        raise APIError(400, f"base_model_name {base_model_name!r} is not the served model "
                            f"{served!r}", param="base_model_name")
    if name == served:
        raise APIError(400, f"'{name}' is the served model's name, not a LoRA adapter's",
                       param="lora_name")
    if name in loras and not load_inplace:
        raise _already_loaded(name)
    try:
        await asyncio.to_thread(read_adapter, path, llm.lora_shapes, llm.config.max_lora_rank,
                                with_weights=False)
    except ValueError as e:
        raise APIError(400, str(e), param="lora_path") from None
    if name in loras and not load_inplace:  # loaded by another request meanwhile
        raise _already_loaded(name)
    loras[name] = LoRARequest(name, next(state["lora_ids"]), path)
    return loras[name]


# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter ("1" or "true": served).
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


async def runtime_lora_updating_off(request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter or /v1/unload_lora_adapter while runtime updating is off:
    vLLM's 404 (it does not serve the routes), with how to turn them on."""
    raise APIError(404, f"{request.path} is not served: runtime LoRA updating is off (start "
                        f"the server with {RUNTIME_LORA_ENV}=1 and --enable-lora)")


async def load_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}: 200 with vLLM's text,
    or a 400."""
    require_ready(llm_of(request))
    body = await parse_request(request, LoadLoRAAdapterRequest)
    await add_lora(request.app, body.lora_name, body.lora_path, load_inplace=body.load_inplace)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/unload_lora_adapter {lora_name}: 200 with vLLM's text, or 404 for a name not
    loaded."""
    require_ready(llm_of(request))
    body = await parse_request(request, UnloadLoRAAdapterRequest)
    if request.app[STATE_KEY]["lora_requests"].pop(body.lora_name, None) is None:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                       param="lora_name")
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
