"""bregman_server: the serving side of bregman-vllm (the folder ``server/``, installed under
this project's own name).

Layout, in the order a request meets it:
    bregman_server.limits      the bounded h11 protocol uvicorn runs (head size and time, cap on
                               connections, OpenAI-shaped 400/408/431/503)
    bregman_server.middleware  BregmanMiddleware: API key on every route but /health, bounded
                               bodies, the Bregman fields validated and mapped into vllm_xargs,
                               orderly ends on shutdown or engine death (any vLLM server can load
                               it with ``--middleware``)
    bregman_server.routes      the routes whose requests take the Bregman fields
    bregman_server.bregman     the Bregman fields of a request body (JSON parsing, merging)
    bregman_server.lifecycle   the open requests: drain on shutdown, cut on engine death
    bregman_server.engine      `bregman-serve --model`: vLLM's own OpenAI server in this process
    bregman_server.serving     uvicorn under our signal handling
    bregman_server.cli         `bregman-serve` / ``python -m bregman_server.cli``
    bregman_server.settings    ServerSettings (pydantic-settings, env prefix BREGMAN_)
    bregman_server.auth, errors, metrics, openapi, docs

Importing these modules never imports torch or vLLM; `engine` imports vLLM when it serves.
"""
