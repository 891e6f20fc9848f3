"""GET /v1/models and GET /v1/models/{model}: the one model served (vLLM's serving_models.py)."""

from __future__ import annotations

from aiohttp import web

from jaxserve.entrypoints.app_state import STATE_KEY
from jaxserve.entrypoints.protocol import ModelCard, ModelList
from jaxserve.entrypoints.responses import json_response
from jaxserve.entrypoints.serving_engine import check_model, llm_of, require_ready, served_name


def _model_card(request: web.Request) -> ModelCard:
    llm = llm_of(request)
    return ModelCard(id=served_name(request), created=request.app[STATE_KEY]["created"],
                     root=llm.model_name, max_model_len=llm.config.max_model_len)


async def show_available_models(request: web.Request) -> web.Response:
    """GET /v1/models: the one model served."""
    require_ready(llm_of(request))
    return json_response(ModelList(data=[_model_card(request)]))


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the model's card, or 404 for a name this server does not serve."""
    require_ready(llm_of(request))
    check_model(request, request.match_info["model"])
    return json_response(_model_card(request))
