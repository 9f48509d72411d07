"""The Bregman fields in the OpenAPI document (/docs, /openapi.json).

The descriptions, ranges and defaults come from `bregman_vllm.params.FIELD_SPECS`, the one source
of truth shared with the README and the vLLM processor. `extend_openapi` adds them to the request
schemas of vLLM's own app (in-process server, ``vllm serve --middleware``); the gateway documents
its two generation routes with `CompletionRequest` / `ChatCompletionRequest`. Bodies are never
parsed into these models: the middleware reads the JSON, validates the ``bregman_*`` fields and
leaves every other field to vLLM.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bregman_vllm.params import FIELD_SPECS, REQUEST_KEYS, FieldSpec

from .settings import ServerSettings

_SPECS: dict[str, FieldSpec] = {spec.name: spec for spec in FIELD_SPECS}


def field_description(name: str) -> str:
    """Description, allowed range and default of one Bregman field, from FIELD_SPECS."""
    spec = _SPECS[name]
    return (f"{spec.description}\n\nType: {spec.type}. Allowed: {spec.allowed}. "
            f"Default: {spec.default}.")


class BregmanFields(BaseModel):
    """The Bregman decoding fields, accepted at the top level of the request body.

    They may also be sent inside ``vllm_xargs``; a top-level field wins over the same key in
    ``vllm_xargs``, which wins over the server-wide default.
    """

    model_config = ConfigDict(extra="allow")

    bregman_mode: Literal["primal", "dual", "off"] | None = Field(
        None, description=field_description("bregman_mode"))
    bregman_alpha: float | Literal["inf", "-inf"] | None = Field(
        None, description=field_description("bregman_alpha"), examples=[1.5, 2, "inf"])
    bregman_lambda: float | None = Field(
        None, ge=0, description=field_description("bregman_lambda"), examples=[0.01])
    bregman_top_k: int | None = Field(
        None, ge=1, le=2**31 - 1, description=field_description("bregman_top_k"),
        examples=[20])
    bregman_k_max: int | None = Field(
        None, ge=1, le=2**31 - 1, description=field_description("bregman_k_max"),
        examples=[100])
    vllm_xargs: dict[str, Any] | None = Field(
        None,
        description="vLLM's per-request extra arguments (SamplingParams.extra_args), forwarded "
        "unchanged except for its bregman_* keys, which the top-level fields override.")


class _GenerationFields(BregmanFields):
    model: str | None = Field(None, description="Model name, as listed by GET /v1/models.")
    max_tokens: int | None = Field(None, ge=0, description="Maximum number of generated tokens.")
    temperature: float | None = Field(
        None, ge=0, description="Softmax temperature, applied before Bregman decoding; 0 is "
        "greedy, which Bregman decoding never changes.")
    top_p: float | None = Field(
        None, gt=0, le=1, description="Nucleus sampling, applied to the Bregman output.")
    top_k: int | None = Field(
        None, description="vLLM's top-k, applied to the Bregman output (-1 or 0: off).")
    stream: bool | None = Field(None, description="Server-sent events, one chunk per token.")


class CompletionRequest(_GenerationFields):
    """POST /v1/completions: OpenAI's completion request plus the Bregman fields.

    Every other OpenAI or vLLM field (n, stop, seed, logprobs, min_p, ...) is forwarded unchanged.
    """

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="The prompt(s): text or token ids.")


class ChatCompletionRequest(_GenerationFields):
    """POST /v1/chat/completions: OpenAI's chat request plus the Bregman fields.

    Every other OpenAI or vLLM field (n, stop, seed, logprobs, tools, ...) is forwarded unchanged.
    """

    messages: list[dict[str, Any]] = Field(
        ..., description='The conversation, e.g. [{"role": "user", "content": "Hi"}].')
    max_completion_tokens: int | None = Field(
        None, ge=0, description="Maximum number of generated tokens (newer OpenAI name).")


def bregman_properties(settings: ServerSettings) -> dict[str, Any]:
    """JSON schemas of the ``bregman_*`` fields, with this server's defaults filled in."""
    schema = BregmanFields.model_json_schema()
    server_defaults = settings.default_request_values()
    properties = {}
    for key in REQUEST_KEYS:
        prop = dict(schema["properties"][key])
        prop["default"] = server_defaults.get(key)
        prop["description"] += f" This server's default: {json.dumps(server_defaults.get(key))}."
        properties[key] = prop
    return properties


def openapi_components(settings: ServerSettings) -> dict[str, Any]:
    """The gateway's request models for ``components.schemas``, with this server's defaults."""
    schemas: dict[str, Any] = {}
    properties = bregman_properties(settings)
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schema["properties"].update(properties)
        schemas[model.__name__] = schema
    return schemas


def extend_openapi(app: Any, settings: ServerSettings) -> None:
    """Make ``app.openapi()`` (vLLM's app) list the Bregman fields in the request schema of every
    route that takes them (`middleware.HONOURED_ROUTES`)."""
    from .middleware import HONOURED_ROUTES

    original = app.openapi

    def openapi() -> dict[str, Any]:
        schema = original()
        if schema.get("x-bregman"):
            return schema
        properties = bregman_properties(settings)
        components = schema.get("components", {}).get("schemas", {})
        for path, item in schema.get("paths", {}).items():
            if path not in HONOURED_ROUTES or "post" not in item:
                continue
            body = item["post"].get("requestBody", {}).get("content", {})
            ref = body.get("application/json", {}).get("schema", {}).get("$ref", "")
            target = components.get(ref.rsplit("/", 1)[-1])
            if target is not None:
                target.setdefault("properties", {}).update(properties)
        schema["x-bregman"] = "bregman_* fields: see the request schemas"
        return schema

    app.openapi = openapi
