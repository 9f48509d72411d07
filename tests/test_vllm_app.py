"""vLLM's own app and launcher with the Bregman middleware, without an engine.

What changes when vLLM does, checked against the vLLM that is installed (and, by ``make compat
VLLM=X``, against another version's Python package): no engine runs here, so these run wherever
vLLM imports.

* the routes that take the Bregman fields, read from vLLM's app as ``vllm serve`` builds it
  (`bregman_server.routes`): every route whose request model declares ``vllm_xargs`` or a
  SamplingParams field, the reviewed ones, and nothing else; every POST route without a request
  model has been read (`REVIEWED_UNTYPED_POSTS`);
* the middleware on that app: every POST route that does not sample (/tokenize, /pooling, 0.33's
  /v1/decisions ...) answers a Bregman field with a 400 naming it;
* speculative decoding under vLLM's V1 model runner, which drops the Bregman processor: refused
  by `bregman-serve` before anything starts, and by the middleware at the server's start under
  plain ``vllm serve``;
* `bregman-serve`'s start-up up to the engine, in a process of its own: vLLM's ``run_server``
  gets our uvicorn options (the bounded protocol), vLLM's flags arrive as ``vllm serve`` has
  them (TLS, a tool-parser plugin file, the log level), our environment is set. vLLM's engine
  client is the one thing replaced (an engine cannot start in a test of the launcher).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import httpx
import pytest
from bregman_server import engine
from bregman_server.engine import MIDDLEWARE_PATH
from bregman_server.settings import ServerSettings

from .test_server_support import REVIEWED_UNTYPED_POSTS, TOOL_PARSER_PLUGIN, free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "models/tiny-llama"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'


def vllm_app(*flags: str) -> Any:
    """vLLM's FastAPI app as ``vllm serve --model M FLAGS --middleware (ours)`` builds it (no
    engine: its state is empty)."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = engine.vllm_cli_args().make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--model", MODEL, *flags, "--middleware", MIDDLEWARE_PATH])
    return build_app(args, ("generate",), None)


def _classes(annotation: Any) -> list[type]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        return [c for arg in typing.get_args(annotation) for c in _classes(arg)]
    return [annotation] if isinstance(annotation, type) else []


def _post_routes(app: Any) -> list[Any]:
    from fastapi.routing import APIRoute

    return [route for route in app.routes
            if isinstance(route, APIRoute) and "POST" in route.methods]


# --- the routes that take the Bregman fields ----------------------------------------------------

@pytest.mark.parametrize("flags", [[], ["--enable-scale-out"]])
def test_honoured_routes_are_every_vllm_route_whose_body_becomes_sampling_params(
        flags: list[str]) -> None:
    """Every POST route whose request model declares vllm_xargs takes the Bregman fields there;
    so do the batch route (reviewed: its model keeps extra fields and its handler builds one
    ChatCompletionRequest per conversation from them) and /invocations; a SamplingParams field
    takes them into its extra_args; every POST route without a request model has been read
    (REVIEWED_UNTYPED_POSTS)."""
    from bregman_server.routes import VLLM_XARGS, honoured_routes

    app = vllm_app(*flags)
    targets = honoured_routes(app).targets
    with_xargs = set()
    for route in _post_routes(app):
        if route.body_field is None:
            assert route.path in REVIEWED_UNTYPED_POSTS, route.path
            continue
        models = _classes(route.body_field.field_info.annotation)
        if any("vllm_xargs" in getattr(model, "model_fields", {}) for model in models):
            with_xargs.add(route.path)
            assert targets.get(route.path) == VLLM_XARGS, route.path
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses",
            "/v1/messages"} <= with_xargs
    assert targets["/v1/chat/completions/batch"] == VLLM_XARGS
    assert targets["/invocations"] == VLLM_XARGS
    expected = set(with_xargs) | {"/v1/chat/completions/batch", "/invocations"}
    if flags:
        assert targets["/inference/v1/generate"] == ("sampling_params", "extra_args")
        expected.add("/inference/v1/generate")
    assert set(targets) == expected  # and nothing else: tokenizing and scoring sample nothing


def test_routes_that_do_not_sample_refuse_bregman_fields(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The middleware in front of vLLM's real app: a ``bregman_*`` field on any POST route
    that does not sample is a 400 naming it (the app is never reached: it has no engine)."""
    from bregman_server.routes import honoured_routes

    for name in [name for name in os.environ if name.startswith("BREGMAN_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    app = vllm_app("--enable-scale-out")
    honoured = honoured_routes(app).targets
    paths = sorted({route.path.replace("{", "").replace("}", "")
                    for route in _post_routes(app) if route.path not in honoured})
    assert "/tokenize" in paths and "/detokenize" in paths
    # vLLM 0.33's greedy decisions route (its model forbids extra fields) is refused too.
    assert "/v1/decisions" in paths or "/v1/decisions" not in {r.path for r in app.routes}

    async def refusals() -> dict[str, tuple[int, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            answers = {}
            for path in paths:
                response = await client.post(path, json={"model": MODEL, "prompt": "x",
                                                         "bregman_top_k": 2})
                answers[path] = (response.status_code, response.json())
            return answers

    for path, (status, body) in asyncio.run(refusals()).items():
        assert status == 400 and body["error"]["param"] == "bregman_top_k", (path, body)


# --- speculative decoding -----------------------------------------------------------------------

def test_speculative_decoding_under_the_v1_runner_is_refused_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's V1 runner drops the entry-point processor with speculative decoding on: every
    Bregman field would be ignored, so `bregman-serve` exits 2 saying so; under Model Runner V2
    (which decodes every draft row) the same arguments are accepted."""
    monkeypatch.setattr(engine, "vllm_is_cpu_build", lambda: False)
    settings = ServerSettings(model=MODEL)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(SystemExit) as exited:
        engine.vllm_namespace(settings, ["--speculative-config", NGRAM])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "speculative decoding" in error and "VLLM_USE_V2_MODEL_RUNNER=1" in error
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    args = engine.vllm_namespace(settings, ["--speculative-config", NGRAM])
    assert args.speculative_config["method"] == "ngram"


@pytest.mark.parametrize("v2", [False, True])
def test_the_middleware_refuses_to_start_a_server_whose_engine_drops_the_processor(
        v2: bool) -> None:
    """Plain ``vllm serve --middleware ... --speculative-config ...`` on the V1 runner: the
    app's lifespan fails with the reason, so vLLM's server does not start; on V2 it starts."""
    app = vllm_app()
    app.state.vllm_config = types.SimpleNamespace(speculative_config={"method": "ngram"},
                                                  use_v2_model_runner=v2)
    app.state.log_stats = False  # vLLM's own lifespan reads it
    sent: list[dict[str, Any]] = []

    async def start() -> None:
        messages = iter([{"type": "lifespan.startup"}])

        async def receive() -> dict[str, Any]:
            try:
                return next(messages)
            except StopIteration:
                await asyncio.sleep(3600)  # no shutdown: the test ends here
                raise

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"},
                                        "state": {}}, receive, send))
        for _ in range(200):
            if sent:
                break
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(start())
    if v2:
        assert sent[0]["type"] == "lifespan.startup.complete", sent
    else:
        assert sent[0]["type"] == "lifespan.startup.failed", sent
        assert "V1 model runner" in sent[0]["message"]


# --- bregman-serve's start-up, up to the engine --------------------------------------------------

#: Runs ``python -m bregman_server ARGS`` with vLLM's engine client replaced by one that prints
#: what the launcher was given and exits 42 (the engine cannot start in a launcher's test).
_UP_TO_THE_ENGINE = textwrap.dedent("""
    import json, os, sys
    from contextlib import asynccontextmanager
    from vllm.entrypoints.launchers.api_server import entry

    seen = {}
    launch = entry.run_server_worker

    async def run_server_worker(listen_address, sock, args, client_config=None, **uvicorn):
        protocol = uvicorn["http"]
        seen.update(listen_address=listen_address, protocol=protocol.__name__,
                    max_connections=protocol.settings.max_connections,
                    lifespan=uvicorn["lifespan"])
        return await launch(listen_address, sock, args, client_config, **uvicorn)

    @asynccontextmanager
    async def no_engine(args, **kwargs):
        from vllm.tool_parsers import ToolParserManager

        seen.update(
            middleware=args.middleware, api_key=args.api_key, log_level=args.log_level,
            logging_config=args.logging_config is not None,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            ssl=[args.ssl_keyfile, args.ssl_certfile],
            tool_parser="bregman-probe" in ToolParserManager.list_registered(),
            environment={name: os.environ.get(name) for name in (
                "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_USE_V2_MODEL_RUNNER")},
            metrics_dir=os.path.isdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
        print("SEEN " + json.dumps(seen), flush=True)
        raise SystemExit(42)
        yield

    entry.run_server_worker = run_server_worker
    entry.build_async_engine_client = no_engine
    from bregman_server.cli import run
    sys.exit(run(sys.argv[1:]))
""")


def test_bregman_serve_starts_vllms_launcher_with_our_options(tmp_path: Path) -> None:
    plugin = tmp_path / "probe_tool_parser.py"
    plugin.write_text(TOOL_PARSER_PLUGIN)
    port = free_port()
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("BREGMAN_", "VLLM_", "PROMETHEUS_MULTIPROC_DIR"))}
    env["VLLM_TARGET_DEVICE"] = os.environ.get("VLLM_TARGET_DEVICE", "cpu")
    result = subprocess.run(
        [sys.executable, "-c", _UP_TO_THE_ENGINE, "--model", MODEL, "--port", str(port),
         "--max-connections", "77", "--log-level", "warning",
         "--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "c.pem"),
         "--tool-parser-plugin", str(plugin), "--enable-auto-tool-choice",
         "--tool-call-parser", "bregman-probe"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("SEEN ")]
    assert result.returncode == 42 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    seen = json.loads(lines[0].removeprefix("SEEN "))
    assert seen == {
        "listen_address": f"https://127.0.0.1:{port}",
        "protocol": "BoundedH11Protocol", "max_connections": 77, "lifespan": "on",
        "middleware": [MIDDLEWARE_PATH], "api_key": None, "log_level": "WARNING",
        "logging_config": True, "h11_max_incomplete_event_size": 64 * 1024,
        "ssl": [str(tmp_path / "key.pem"), str(tmp_path / "c.pem")], "tool_parser": True,
        "environment": {"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1",
                        "VLLM_USE_V2_MODEL_RUNNER": None},
        "metrics_dir": True}
