"""Validate response bodies against OpenAI's published OpenAPI schema objects
(tests/data/openai_openapi_subset.yaml: source and licence inside), with openapi-schema-validator's
OpenAPI 3.0 validator (it knows ``nullable``, which plain JSON Schema does not).

Where the document is narrower than OpenAI's service, the service wins: with ``echo`` and
``logprobs``, the first prompt token of a completion has no log-probability, and OpenAI's legacy
API (and vLLM) send null for it in ``token_logprobs`` and ``top_logprobs``, whose items the
document types as a number and an object: both are read as nullable here.

Two readings of the document, both for streamed chunks, where it contradicts OpenAI's own
streams (every chunk before the last has ``finish_reason: null``):
- a chat chunk's ``finish_reason`` is ``nullable: true`` with an ``enum``; OpenAPI 3.0.3 lets the
  ``enum`` still refuse null, 3.0.0-3.0.2 (the document says ``openapi: 3.0.0``) let
  ``nullable`` admit it. We take the 3.0.0 reading: ``nullable: true`` admits null everywhere.
- completions chunks share CreateCompletionResponse (its description says so), whose
  ``finish_reason`` is required and not nullable: COMPLETION_CHUNK is that schema with
  ``finish_reason`` nullable, nothing else changed.
"""

import copy
import functools
import pathlib

import yaml
from jsonschema import validators
from openapi_schema_validator import OAS30Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT4

SUBSET = pathlib.Path(__file__).parent / "data" / "openai_openapi_subset.yaml"
URI = "urn:openai-openapi-subset"
COMPLETION = "CreateCompletionResponse"
COMPLETION_CHUNK = "CompletionChunk"  # CreateCompletionResponse, finish_reason nullable
CHAT = "CreateChatCompletionResponse"
CHAT_CHUNK = "CreateChatCompletionStreamResponse"


def _enum(validator, enums, instance, schema):
    if instance is None and schema.get("nullable"):
        return  # OpenAPI 3.0.0: nullable admits null whatever the enum (module docstring)
    yield from OAS30Validator.VALIDATORS["enum"](validator, enums, instance, schema)


Validator = validators.extend(OAS30Validator, {"enum": _enum})


@functools.cache
def _document() -> dict:
    doc = yaml.safe_load(SUBSET.read_text())
    schemas = doc["components"]["schemas"]
    logprobs = schemas[COMPLETION]["properties"]["choices"]["items"]["properties"]["logprobs"]
    for key in ("token_logprobs", "top_logprobs"):
        logprobs["properties"][key]["items"]["nullable"] = True
    chunk = copy.deepcopy(schemas[COMPLETION])
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]["nullable"] = True
    schemas[COMPLETION_CHUNK] = chunk
    return doc


@functools.cache
def validator(name: str) -> Validator:
    registry = Registry().with_resource(URI, Resource.from_contents(_document(), DRAFT4))
    return Validator({"$ref": f"{URI}#/components/schemas/{name}"}, registry=registry)


def errors(name: str, body: dict) -> list[str]:
    """Every way ``body`` breaks schema ``name`` (empty when it validates)."""
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator(name).iter_errors(body)]
