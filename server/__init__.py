"""bregman-serve: an OpenAI-compatible FastAPI server with Bregman decoding, in front of vLLM.

Layout:
    server.settings   ServerSettings (pydantic-settings, env prefix BREGMAN_)
    server.cli        `bregman-serve` / `python -m server.cli`: flags, embedded and upstream modes
    server.app        create_app(settings, upstream_pool): the routes
    server.bregman    the Bregman fields of a request mapped into vLLM's vllm_xargs
    server.models     request models for the OpenAPI schema (from bregman_vllm.params.FIELD_SPECS)
    server.proxy      the upstream pool: health checks, round-robin, streaming pass-through
    server.embedded   the vLLM child process: start, watch, stop
    server.auth       optional API key
    server.metrics    Prometheus metrics
    server.errors     OpenAI-shaped errors
    server.docs       reference tables for docs/server.md

Nothing here imports torch or vLLM: the server only needs `bregman_vllm.params`.
"""
