"""Fast tests of the server's parts: request merging, CLI parsing, settings, errors, OpenAPI.

No vLLM here (see tests/test_server.py for the live tests). The in-process app tests run the real
app over ASGI; requests that would reach vLLM are not made, except the 503 case, which points the
app at a closed loopback port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from bregman_vllm.params import FIELD_SPECS, REQUEST_KEYS, BregmanParamError, BregmanParams
from server.app import create_app
from server.bregman import apply_bregman
from server.cli import parse_args
from server.embedded import child_environment, free_port
from server.proxy import UpstreamPool
from server.settings import ServerSettings

ROOT = Path(__file__).resolve().parent.parent
OFF = BregmanParams(mode="off").validated()
PRIMAL = BregmanParams(mode="primal", alpha=1.5, lam=0.01).validated()


# --- import hygiene ----------------------------------------------------------------------------

def test_server_never_imports_torch_or_vllm() -> None:
    code = textwrap.dedent("""
        import sys
        import server, server.app, server.cli, server.proxy, server.embedded, server.models
        from server.app import create_app
        from server.proxy import UpstreamPool
        from server.settings import ServerSettings
        settings = ServerSettings(upstream=["http://127.0.0.1:9"])
        app = create_app(settings, UpstreamPool(settings.upstream))
        app.openapi()
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("torch", "vllm")
                       or m.startswith(("bregman_vllm.core", "bregman_vllm.adapter")))
        assert not heavy, heavy
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# --- merging the Bregman fields into vllm_xargs -------------------------------------------------

def test_request_without_bregman_fields_is_untouched() -> None:
    body = {"prompt": "hi", "max_tokens": 3, "vllm_xargs": {"other": 1}}
    mode, changed = apply_bregman(body, OFF)
    assert (mode, changed) == ("off", False)
    assert body == {"prompt": "hi", "max_tokens": 3, "vllm_xargs": {"other": 1}}


def test_top_level_fields_move_into_vllm_xargs_next_to_the_users_keys() -> None:
    body = {"prompt": "hi", "bregman_mode": "dual", "bregman_alpha": "inf", "bregman_top_k": 4,
            "unknown_field": [1, 2], "vllm_xargs": {"other": "x"}}
    mode, changed = apply_bregman(body, OFF)
    assert (mode, changed) == ("dual", True)
    assert body == {"prompt": "hi", "unknown_field": [1, 2], "vllm_xargs": {
        "other": "x", "bregman_mode": "dual", "bregman_alpha": "inf",
        "bregman_lambda": 0.01, "bregman_top_k": 4}}


def test_top_level_field_beats_the_users_vllm_xargs() -> None:
    body = {"bregman_alpha": 3, "vllm_xargs": {"bregman_alpha": 2, "bregman_lambda": 0.5}}
    apply_bregman(body, OFF)
    assert body["vllm_xargs"]["bregman_alpha"] == 3.0
    assert body["vllm_xargs"]["bregman_lambda"] == 0.5  # not overridden: kept from vllm_xargs


def test_vllm_xargs_alone_beats_the_server_default() -> None:
    defaults = BregmanParams(mode="primal", alpha=1.5, lam=0.01, top_k=7).validated()
    body = {"vllm_xargs": {"bregman_top_k": 2}}
    assert apply_bregman(body, defaults) == ("primal", True)
    assert body["vllm_xargs"]["bregman_top_k"] == 2


def test_server_default_applies_to_requests_that_do_not_say() -> None:
    defaults = BregmanParams(mode="primal", alpha=2.0, lam=0.001).validated()
    body: dict[str, Any] = {"prompt": "hi"}
    assert apply_bregman(body, defaults) == ("primal", True)
    assert body["vllm_xargs"] == {"bregman_mode": "primal", "bregman_alpha": 2.0,
                                  "bregman_lambda": 0.001}


def test_explicit_off_beats_the_server_default_and_strips_vllm_xargs() -> None:
    body = {"bregman_mode": "off", "vllm_xargs": {"bregman_alpha": 2, "seed_hint": 1}}
    assert apply_bregman(body, PRIMAL) == ("off", True)
    assert body == {"vllm_xargs": {"seed_hint": 1}}


def test_any_field_turns_decoding_on_when_the_server_default_is_off() -> None:
    defaults = BregmanParams(mode="off", alpha=2.5, lam=0.2).validated()
    body = {"bregman_lambda": 0.3}
    assert apply_bregman(body, defaults) == ("primal", True)
    assert body["vllm_xargs"] == {"bregman_mode": "primal", "bregman_alpha": 2.5,
                                  "bregman_lambda": 0.3}


def test_null_fields_count_as_absent() -> None:
    body = {"bregman_alpha": None, "prompt": "x"}
    assert apply_bregman(body, OFF) == ("off", True)
    assert body == {"prompt": "x"}


INVALID = [
    ({"bregman_mode": "greedy"}, "bregman_mode"),
    ({"bregman_mode": 1}, "bregman_mode"),
    ({"bregman_alpha": 0}, "bregman_alpha"),  # adaptive primal: (0, inf)
    ({"bregman_alpha": -1}, "bregman_alpha"),
    ({"bregman_alpha": "inf"}, "bregman_alpha"),  # inf needs bregman_top_k
    ({"bregman_alpha": "abc"}, "bregman_alpha"),
    ({"bregman_alpha": True}, "bregman_alpha"),
    ({"bregman_mode": "dual", "bregman_alpha": 1}, "bregman_alpha"),  # adaptive dual: (1, inf)
    ({"bregman_mode": "dual", "bregman_alpha": 0.5, "bregman_top_k": 3}, "bregman_alpha"),
    ({"bregman_top_k": 3, "bregman_alpha": 0}, "bregman_alpha"),  # fixed-k primal: not 0
    ({"bregman_lambda": -0.1}, "bregman_lambda"),
    ({"bregman_lambda": "lots"}, "bregman_lambda"),
    ({"bregman_top_k": 0}, "bregman_top_k"),
    ({"bregman_top_k": 2.5}, "bregman_top_k"),
    ({"bregman_k_max": 0}, "bregman_k_max"),
    ({"vllm_xargs": {"bregman_alpha": -2}}, "bregman_alpha"),
    ({"vllm_xargs": "bregman_alpha=2"}, "vllm_xargs"),
]


@pytest.mark.parametrize(("fields", "param"), INVALID)
def test_invalid_fields_name_the_parameter(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BregmanParamError) as info:
        apply_bregman(dict(fields), OFF)
    assert info.value.field == param


@pytest.mark.parametrize("fields", [
    {"bregman_alpha": "inf", "bregman_top_k": 5},
    {"bregman_alpha": "-inf", "bregman_top_k": 5},
    {"bregman_mode": "dual", "bregman_alpha": 1, "bregman_top_k": 5},
    {"bregman_mode": "dual", "bregman_alpha": 1.01},
    {"bregman_alpha": 0.3, "bregman_lambda": 0, "bregman_k_max": 1},
])
def test_valid_edge_values_are_accepted(fields: dict[str, Any]) -> None:
    body = dict(fields)
    mode, _ = apply_bregman(body, OFF)
    assert mode == fields.get("bregman_mode", "primal")
    assert BregmanParams.from_mapping(body["vllm_xargs"]) is not None


# --- command line and settings ----------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("BREGMAN_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_cli_forwards_unknown_arguments_to_vllm_in_order(clean_env: pytest.MonkeyPatch) -> None:
    # The command line a GPU Dockerfile would use.
    settings, vllm_args = parse_args([
        "--model", "/models/smollm2", "--host", "0.0.0.0", "--port", "8000",
        "--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager",
        "--gpu-memory-utilization=0.9", "--default-mode", "primal", "--default-alpha", "1.5",
        "--default-lambda", "0.01"])
    assert settings.embedded and settings.model == "/models/smollm2"
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert vllm_args == ["--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager",
                         "--gpu-memory-utilization=0.9"]
    assert settings.bregman_defaults() == BregmanParams("primal", 1.5, 0.01).validated()


def test_cli_upstream_mode_from_a_compose_command_line(clean_env: pytest.MonkeyPatch) -> None:
    settings, vllm_args = parse_args([
        "--upstream", "http://vllm-a:8000", "http://vllm-b:8000/v1/", "--host", "0.0.0.0"])
    assert not settings.embedded and vllm_args == []
    assert settings.upstream == ["http://vllm-a:8000", "http://vllm-b:8000"]


def test_environment_settings_and_flags_over_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("BREGMAN_UPSTREAM", "http://a:1, http://b:2")
    clean_env.setenv("BREGMAN_API_KEY", "from-env")
    clean_env.setenv("BREGMAN_PORT", "9001")
    clean_env.setenv("BREGMAN_DEFAULT_MODE", "dual")
    clean_env.setenv("BREGMAN_DEFAULT_ALPHA", "inf")
    clean_env.setenv("BREGMAN_DEFAULT_TOP_K", "8")
    settings, _ = parse_args(["--port", "9002"])
    assert settings.upstream == ["http://a:1", "http://b:2"]
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "from-env"
    assert "from-env" not in repr(settings)  # SecretStr
    assert settings.port == 9002
    assert settings.bregman_defaults().to_request() == {
        "bregman_mode": "dual", "bregman_alpha": "inf", "bregman_lambda": 0.01,
        "bregman_top_k": 8}


@pytest.mark.parametrize("argv", [
    [],  # embedded mode needs --model
    ["--upstream", "http://a:1", "--max-model-len", "5"],  # nothing to forward engine args to
    ["--model", "m", "--default-mode", "dual", "--default-alpha", "1"],  # adaptive dual: > 1
    ["--model", "m", "--default-lambda", "-1"],
    ["--model", "m", "--default-mode", "beam"],
    ["--upstream", "ftp://a"],
])
def test_cli_rejects_bad_command_lines(argv: list[str], clean_env: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_flags_are_not_abbreviated(clean_env: pytest.MonkeyPatch) -> None:
    # "--mod" must reach vLLM untouched rather than be taken for our --model.
    settings, vllm_args = parse_args(["--model", "m", "--mod", "x", "--port", "1"])
    assert settings.model == "m" and vllm_args == ["--mod", "x"]


def test_child_environment_keeps_user_values() -> None:
    env = child_environment({"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "8"}, "k", 4)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8" and env["PATH"] == "/bin"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["VLLM_API_KEY"] == "k"
    env = child_environment({"VLLM_USE_V2_MODEL_RUNNER": "1"}, "k", 4)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"


# --- the app in-process: errors, auth, limits, docs -------------------------------------------

def make_client(**overrides: Any) -> TestClient:
    """The real app, pointed at a closed loopback port (so every upstream is down)."""
    settings = ServerSettings(upstream=[f"http://127.0.0.1:{free_port()}"], **overrides)
    pool = UpstreamPool(settings.upstream, connect_timeout=0.5, health_timeout=0.5)
    return TestClient(create_app(settings, pool), raise_server_exceptions=False)


def assert_openai_error(response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize(("fields", "param"), INVALID)
def test_invalid_field_is_an_openai_400(fields: dict[str, Any], param: str) -> None:
    with make_client() as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = client.post(path, json={"model": "m", "prompt": "x", **fields})
            error = assert_openai_error(response, 400, param)
            assert error["type"] == "invalid_request_error"
            assert param in error["message"]


def test_alpha_error_message_names_the_allowed_range() -> None:
    with make_client() as client:
        response = client.post("/v1/completions", json={"prompt": "x", "bregman_alpha": -1})
        assert "(0, inf)" in assert_openai_error(response, 400, "bregman_alpha")["message"]
        response = client.post("/v1/completions",
                               json={"prompt": "x", "bregman_mode": "dual", "bregman_alpha": 1})
        assert "(1, inf)" in assert_openai_error(response, 400, "bregman_alpha")["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"a": NaN}', b"\xff\xfe"])
def test_body_that_is_not_a_json_object_is_an_openai_400(raw: bytes) -> None:
    with make_client() as client:
        response = client.post("/v1/completions", content=raw,
                               headers={"content-type": "application/json"})
        assert_openai_error(response, 400)


def test_body_size_limit() -> None:
    with make_client(max_body_bytes=1000) as client:
        response = client.post("/v1/completions", json={"prompt": "x" * 2000})
        assert assert_openai_error(response, 413)["code"] == "request_too_large"

        def chunked():  # no content-length: the limit is enforced while reading
            for _ in range(10):
                yield b" " * 200

        response = client.post("/v1/completions", content=chunked())
        assert_openai_error(response, 413)


def test_api_key_is_required_when_configured() -> None:
    with make_client(api_key="s3cret") as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}):
            response = client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert assert_openai_error(response, 401)["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
        # Pass-through routes are guarded too; probes and docs are not.
        assert client.get("/v1/embeddings").status_code == 401
        assert client.get("/metrics").status_code == 200
        assert client.get("/openapi.json").status_code == 200
        # The right key gets past auth (then 400 for the invalid field, before any upstream).
        response = client.post("/v1/completions", json={"prompt": "x", "bregman_top_k": 0},
                               headers={"authorization": "Bearer s3cret"})
        assert_openai_error(response, 400, "bregman_top_k")


def test_api_key_on_the_generation_routes_and_on_the_fastapi_routes_agree() -> None:
    """The generation routes bypass FastAPI's dependencies (GenerationFastPath): the same key
    check must hold there and on the routes FastAPI serves, chat included."""
    with make_client(api_key="s3cret") as client:
        for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                             ("GET", "/v1/models")):
            for headers, status in (({"authorization": "bearer s3cret"}, None),
                                    ({"authorization": "Bearer s3cret2"}, 401),
                                    ({"authorization": "Bearer"}, 401)):
                response = client.request(method, path, json={"prompt": "x"}, headers=headers)
                if status is None:  # past auth: no upstream behind this app, so 503
                    assert response.status_code == 503, (method, path, response.text)
                else:
                    assert_openai_error(response, status)


def test_unexpected_error_on_a_generation_route_is_an_openai_500(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: a monkeypatched `apply_bregman` raises, since no request can make our
    own handler fail. The answer is OpenAI's shape with no detail, and the server goes on."""
    import server.app as app_module

    def broken(body: dict[str, Any], defaults: Any) -> Any:
        raise RuntimeError("internal detail")

    monkeypatch.setattr(app_module, "apply_bregman", broken)
    with make_client() as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = client.post(path, json={"prompt": "x"})
            assert assert_openai_error(response, 500)["type"] == "server_error"
            assert "internal detail" not in response.text
        assert client.get("/health").status_code == 503  # still answering


def test_no_healthy_upstream_is_an_openai_503_and_health_says_so() -> None:
    with make_client() as client:
        response = client.post("/v1/completions", json={"prompt": "x", "bregman_alpha": 2})
        assert assert_openai_error(response, 503)["code"] == "upstream_unavailable"
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["healthy_upstreams"] == 0
        metrics = client.get("/metrics").text
        assert 'bregman_server_upstream_errors_total{kind="unavailable",upstream="none"} 1.0' \
            in metrics
        assert 'bregman_server_upstream_healthy{upstream="http://127.0.0.1:' in metrics


def test_unknown_routes_are_a_clear_openai_404() -> None:
    with make_client() as client:
        for method, path in (("GET", "/nope"), ("POST", "/sleep"), ("POST", "/collective_rpc"),
                             ("POST", "/v1/load_lora_adapter")):
            response = client.request(method, path)
            error = assert_openai_error(response, 404)
            assert "/v1/completions" in error["message"]


def test_openapi_documents_every_bregman_field_on_both_endpoints() -> None:
    with make_client(default_mode="primal", default_alpha=2.0, default_top_k=5) as client:
        spec = client.get("/openapi.json").json()
        assert client.get("/docs").status_code == 200
    defaults = {"bregman_mode": "primal", "bregman_alpha": 2.0, "bregman_lambda": 0.01,
                "bregman_top_k": 5, "bregman_k_max": None}
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        properties = spec["components"]["schemas"][model]["properties"]
        for field in FIELD_SPECS:
            prop = properties[field.name]
            assert field.allowed in prop["description"]
            assert field.default in prop["description"]
            assert prop["default"] == defaults[field.name]
    assert set(REQUEST_KEYS) == {field.name for field in FIELD_SPECS}
    assert "/health" in spec["paths"] and "/metrics" in spec["paths"]


# --- the child dies with us ---------------------------------------------------------------------

def test_child_preexec_makes_the_child_die_with_its_parent(tmp_path: Path) -> None:
    """A real parent (using the same preexec as the vLLM child) is SIGKILLed: its child goes."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    pid_file = tmp_path / "child.pid"
    parent_code = textwrap.dedent(f"""
        import subprocess, time
        from server.embedded import _child_preexec
        child = subprocess.Popen(["sleep", "120"], preexec_fn=_child_preexec())
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=ROOT)
    child_pid = None
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        assert os.getpgid(child_pid) == child_pid  # its own process group
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child_pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_error_body_is_json_serializable_shape() -> None:
    from server.errors import error_body, sse_error_event

    assert error_body("m", param="p") == {"error": {"message": "m", "type":
                                                     "invalid_request_error", "param": "p",
                                                     "code": None}}
    event = sse_error_event("broke", code="upstream_read").decode()
    first, second = event.strip().split("\n\n")
    assert json.loads(first.removeprefix("data: "))["error"]["message"] == "broke"
    assert second == "data: [DONE]"


def test_docs_reference_tables_are_generated_from_the_code() -> None:
    from server.docs import render

    document = (ROOT / "docs" / "server.md").read_text()
    assert render(document) == document, "run: python -m server.docs --write docs/server.md"
    for spec in FIELD_SPECS:
        assert f"| `{spec.name}` |" in document
    assert "`BREGMAN_API_KEY`" in document and "`--default-mode`" in document


def _run_cli(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREGMAN_")}
    return subprocess.Popen([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kwargs)


def test_taken_port_fails_before_starting_vllm() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = _run_cli(["--model", "models/none", "--port", str(port)])
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 1, output
    assert "address in use" in output and "starting vLLM" not in output


def test_upstream_mode_serves_and_stops_cleanly_on_sigterm() -> None:
    import httpx

    port = free_port()
    process = _run_cli(["--upstream", f"http://127.0.0.1:{free_port()}", "--port", str(port),
                        "--health-interval", "0.2"])
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[0]
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert health.status_code == 503  # nothing listens upstream
        assert health.json()["reason"] == "no vLLM upstream answers /health"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
        assert process.returncode == 0, output
        assert "Traceback" not in output
    finally:
        process.kill()


def test_upstream_health_state_machine() -> None:
    pool = UpstreamPool(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    a, b = pool.upstreams
    for upstream in (a, b):
        pool._set_health(upstream, None)
    assert {u.url for u in pool.candidates()} == {a.url, b.url}
    # Round-robin: successive requests start with different upstreams.
    assert {pool.candidates()[0].url for _ in range(4)} == {a.url, b.url}
    pool._set_health(a, "timeout", at_once=False)  # one slow health check: still in
    assert a.healthy
    pool._set_health(a, "timeout", at_once=False)  # two in a row: out
    assert not a.healthy and [u.url for u in pool.candidates()] == [b.url]
    pool._set_health(a, None)
    assert a.healthy
    pool.mark_down(b, "connect failed")  # a refused connection: out at once
    assert [u.url for u in pool.candidates()] == [a.url]
    pool.mark_down(a, "connect failed")
    assert len(pool.candidates()) == 2  # none healthy: fail open, try them all
    pool.force_down("the vLLM child exited with code -9")
    assert pool.candidates() == [] and pool.healthy_count == 0


def test_cpu_children_prefill_whole_prompts(tmp_path):
    """vLLM 0.32 on CPU kills its engine when a seeded request's prompt is prefilled in chunks
    ("CPU Generator does not use offset"), so a vllm-cpu child gets whole-prompt prefill unless
    the user chose the batching; vLLM's own parser must accept the result."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from server.embedded import CPU_MAX_MODEL_LEN, cpu_safe_engine_args

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 2048}')
    assert cpu_safe_engine_args(str(model), ["--dtype", "float32"]) == [
        "--dtype", "float32", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"]
    long_model = tmp_path / "long"
    long_model.mkdir()
    (long_model / "config.json").write_text('{"max_position_embeddings": 131072}')
    assert cpu_safe_engine_args(str(long_model), []) == [
        "--max-model-len", str(CPU_MAX_MODEL_LEN), "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", str(CPU_MAX_MODEL_LEN)]
    assert cpu_safe_engine_args("org/hub-model", ["--max-model-len=4096"])[-1] == "4096"
    chosen = ["--enable-chunked-prefill", "--max-num-batched-tokens", "512"]
    assert cpu_safe_engine_args(str(model), chosen) == chosen
    parser = make_arg_parser(FlexibleArgumentParser())
    parsed = parser.parse_args(["--model", str(model),
                                *cpu_safe_engine_args(str(model), ["--enforce-eager"])])
    assert parsed.enable_chunked_prefill is False and parsed.max_num_batched_tokens == 2048
