"""The Bregman fields in the OpenAPI document (/docs, /openapi.json).

The descriptions, ranges and defaults come from `bregman_vllm.params.FIELD_SPECS`, the one source
of truth shared with the README and the vLLM processor. `extend_openapi` adds them to the request
schemas of vLLM's own app (in-process server, ``vllm serve --middleware``). Bodies are never
parsed into these models: the middleware reads the JSON, validates the ``bregman_*`` fields and
leaves every other field to vLLM.
"""

from __future__ import annotations

import json
from typing import Any

from bregman_vllm.params import FIELD_SPECS, REQUEST_KEYS, SIZE_FIELDS, FieldSpec

from .routes import FORM, Routes
from .settings import ServerSettings

_SPECS: dict[str, FieldSpec] = {spec.name: spec for spec in FIELD_SPECS}


def field_description(name: str) -> str:
    """Description, allowed range and default of one Bregman field, from FIELD_SPECS."""
    spec = _SPECS[name]
    return (f"{spec.description}\n\nType: {spec.type}. Allowed: {spec.allowed}. "
            f"Default: {spec.default}.")


def field_schema(spec: FieldSpec) -> dict[str, Any]:
    """The JSON schema of one Bregman field, from its `FieldSpec` (absent or null: the
    default)."""
    schema: dict[str, Any] = {
        "anyOf": [*(dict(option) for option in spec.schema), {"type": "null"}],
        "default": None, "title": spec.name.replace("_", " ").title(),
        "description": field_description(spec.name)}
    if spec.examples:
        schema["examples"] = list(spec.examples)
    return schema


def bregman_properties(settings: ServerSettings) -> dict[str, Any]:
    """JSON schemas of the ``bregman_*`` fields (every `FIELD_SPECS` entry, accepted at the top
    level of the body and inside ``vllm_xargs``; a top-level field wins over the same key in
    ``vllm_xargs``, which wins over the server-wide default), with this server's defaults."""
    server_defaults = settings.default_request_values()
    properties = {}
    for key in REQUEST_KEYS:
        prop = field_schema(_SPECS[key])
        prop["default"] = server_defaults.get(key)
        prop["description"] += f" This server's default: {json.dumps(server_defaults.get(key))}."
        if settings.max_support is not None and key in SIZE_FIELDS.values():
            # (the server's largest support size: `BregmanParams.within`)
            for option in prop["anyOf"]:
                if option.get("type") == "integer":
                    option["maximum"] = settings.max_support
            prop["description"] += f" At most {settings.max_support} on this server."
        properties[key] = prop
    return properties


def extend_openapi(app: Any, settings: ServerSettings, routes: Routes) -> None:
    """Make ``app.openapi()`` (vLLM's app) list the Bregman fields in the request schema of every
    route that takes them (``routes``, read from the same app)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        schema = original()
        if schema.get("x-bregman"):
            return schema
        properties = bregman_properties(settings)
        components = schema.get("components", {}).get("schemas", {})
        for path, item in schema.get("paths", {}).items():
            if routes.targets.get(path, FORM) == FORM or "post" not in item:
                continue
            body = item["post"].get("requestBody", {}).get("content", {})
            ref = body.get("application/json", {}).get("schema", {}).get("$ref", "")
            target = components.get(ref.rsplit("/", 1)[-1])
            if target is not None:
                target.setdefault("properties", {}).update(properties)
        schema["x-bregman"] = "bregman_* fields: see the request schemas"
        return schema

    app.openapi = openapi
