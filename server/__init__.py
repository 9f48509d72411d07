"""bregman_server: the serving side of bregman-vllm (the folder ``server/``, installed under
this project's own name).

Layout, in the order a request meets it:
    bregman_server.limits      the bounded h11 protocol uvicorn runs (head size and time, body
                               deadline, a connection cap that keeps room for clients that send
                               their requests, OpenAI-shaped 400/408/431/503)
    bregman_server.middleware  BregmanMiddleware: API key on every route but /health, bounded
                               bodies, the Bregman fields validated and mapped into vllm_xargs,
                               every error in OpenAI's shape, orderly ends on shutdown or engine
                               death (any vLLM server can load it with ``--middleware``)
    bregman_server.routes      the routes whose requests take the Bregman fields, read from
                               vLLM's app
    bregman_server.jsonbody    request bodies as vLLM reads them (encodings, escapes, duplicate
                               keys) and when one may stay unread
    bregman_server.bregman     the Bregman fields of a parsed body (validation, merging)
    bregman_server.lifecycle   the open requests: drain on shutdown, cut on engine death
    bregman_server.serving     the server's lifecycle inside vLLM's server (drain on SIGTERM,
                               engine-death policy), run by the middleware
    bregman_server.engine      `bregman-serve`: vLLM's own launcher (one API server, or its
                               engines and several API server processes) with our options
    bregman_server.cli         `bregman-serve` / ``python -m bregman_server.cli``: the server in
                               a session of its own (``python -m bregman_server``)
    bregman_server.settings    ServerSettings (pydantic-settings, env prefix BREGMAN_)
    bregman_server.auth, errors, metrics, openapi, docs

Importing these modules never imports torch or vLLM; `engine` imports vLLM when it serves.
"""
