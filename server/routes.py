"""The routes whose requests take the Bregman fields."""

from __future__ import annotations

#: Routes whose request model has ``vllm_xargs`` (vLLM 0.32): top-level Bregman fields and the
#: server defaults are mapped into it. /invocations dispatches to the completion or chat handler
#: by the body's shape; the /render routes show what these would send to the engine.
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                     "/invocations")
HONOURED_ROUTES = frozenset(GENERATION_ROUTES) | frozenset(
    route + "/render" for route in GENERATION_ROUTES if route.startswith("/v1/"))
HONOURED_TEXT = ", ".join(f"POST {route}" for route in GENERATION_ROUTES)
