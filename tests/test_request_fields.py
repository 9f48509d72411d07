"""No Bregman field dropped on any path: at any depth, in any spelling, with beam search; the
default largest support size; the rows it holds, counted.

Each attack case that a real server answered with a 200 and plain decoding (the SDK's
``extra_body`` sent raw with ``vllm_xargs`` inside, ``sampling_params.extra_args`` on the
OpenAI routes, a zero-width space, a byte-order mark or a fullwidth letter in a key, beam search
beside the fields or the server's defaults) is a 400 naming where it was found, through the real
middleware and uvicorn in front of a stand-in for vLLM's app (request models declared as vLLM's
are: extra fields allowed, ``vllm_xargs``, ``use_beam_search`` on completions and chat only), in
every body encoding; keys inside what vLLM reads as data (tool schemas, response formats,
metadata ...) are left alone. tests/test_server.py sends the same cases to real servers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import httpx
import numpy as np
import pytest
import torch
from bregman_server.jsonbody import must_parse
from bregman_server.middleware import BregmanMiddleware
from bregman_server.settings import ServerSettings
from fastapi import FastAPI, Form, Request, Response
from pydantic import BaseModel, ConfigDict
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from bregman_vllm import engine_metrics as em
from bregman_vllm.adapter import BregmanLogitsProcessor, request_params, telemetry
from bregman_vllm.params import (
    DATA_FIELDS,
    BregmanParamError,
    is_bregman_key,
    max_support_from_env,
    normalized_key,
)

from .test_server_support import BODY_ENCODINGS, encode_body
from .test_server_units import AUTH, Served, _echo, assert_openai_error

# --- the matching rule ---------------------------------------------------------------------------

#: Keys meant as Bregman fields, as a copy and paste or an input method leaves them.
LOOK_ALIKES = {
    "zero-width space": "\u200bbregman_top_k",
    "byte-order mark": "\ufeffbregman_top_k",
    "fullwidth letter": "\uff42regman_top_k",
    "word joiner inside": "breg\u2060man_top_k",
    "soft hyphen inside": "bregman\u00ad_top_k",
    "en dashes": "bregman\u2013top\u2013k",
    "non-breaking space": "\u00a0bregman_top_k",
    "mathematical bold": "\U0001d41bregman_top_k",
    "capital sharp": "BREGMAN_TOP_K",
}


@pytest.mark.parametrize("key", LOOK_ALIKES.values(), ids=LOOK_ALIKES)
def test_the_matching_rule_reads_what_a_reader_reads(key: str) -> None:
    assert is_bregman_key(key)
    assert normalized_key(key).replace("_", "") == "bregmantopk"


@pytest.mark.parametrize("key", ["bregma", "top_k_bregman", "x_bregman_top_k", "bregmen",
                                 "b\u200bre", "", "bre gman"])
def test_other_keys_are_not_bregman_fields(key: str) -> None:
    assert not is_bregman_key(key)


# --- a stand-in for vLLM's app -------------------------------------------------------------------

class Sampled(BaseModel):
    """Like vLLM's CompletionRequest / ChatCompletionRequest."""

    model_config = ConfigDict(extra="allow")
    vllm_xargs: dict[str, Any] | None = None
    use_beam_search: bool = False


class Responses(BaseModel):
    """Like vLLM's ResponsesRequest: vllm_xargs, no beam search."""

    model_config = ConfigDict(extra="allow")
    vllm_xargs: dict[str, Any] | None = None


class Transcription(BaseModel):
    """Like vLLM's TranscriptionRequest: a form, whose vllm_xargs is a JSON string."""

    model_config = ConfigDict(extra="allow")
    vllm_xargs: str | dict[str, Any] | None = None
    use_beam_search: bool = False


class NoSampling(BaseModel):
    """Like vLLM's TokenizeRequest."""

    model_config = ConfigDict(extra="allow")


async def _sampled(request: Request, body: Sampled) -> Response:
    return await _echo(request)


async def _responses(request: Request, body: Responses) -> Response:
    return await _echo(request)


async def _no_sampling(request: Request, body: NoSampling) -> Response:
    return await _echo(request)


async def _transcription(body: Annotated[Transcription, Form()]) -> Response:
    return Response("ok")


def vllm_like_app() -> FastAPI:
    app = FastAPI()
    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, _sampled, methods=["POST"])
    app.add_api_route("/v1/responses", _responses, methods=["POST"])
    app.add_api_route("/tokenize", _no_sampling, methods=["POST"])
    app.add_api_route("/v1/audio/transcriptions", _transcription, methods=["POST"])
    return app


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with Served(vllm_like_app()) as server:
        yield server


@pytest.fixture(scope="module")
def defaults() -> Iterator[Served]:
    """A server whose default is Bregman decoding (``--default-mode primal --default-top-k 1``)."""
    with Served(vllm_like_app(), default_mode="primal", default_top_k=1) as server:
        yield server


def post(server: Served, path: str, body: dict[str, Any], how: str = "utf-8"
         ) -> httpx.Response:
    raw, headers = encode_body(body, how)
    return httpx.post(server.url + path, content=raw, headers={**AUTH, **headers}, timeout=30)


# --- keys at any depth, in any spelling ----------------------------------------------------------

#: (the fields as sent, the param of the 400): each decoded plainly with a 200 before.
STRAY = {
    "extra_body.vllm_xargs": ({"extra_body": {"vllm_xargs": {"bregman_top_k": 1}}},
                              "extra_body.vllm_xargs.bregman_top_k"),
    "sampling_params.extra_args": ({"sampling_params": {"extra_args": {"bregman_top_k": 1}}},
                                   "sampling_params.extra_args.bregman_top_k"),
    "in an array": ({"extra_body": [{"vllm_xargs": {"bregman_alpha": 2}}]},
                    "extra_body.0.vllm_xargs.bregman_alpha"),
    "in a sub-object vLLM reads": ({"stream_options": {"bregman_top_k": 1}},
                                   "stream_options.bregman_top_k"),
    "deep": ({"a": {"b": {"c": {"d": {"Bregman-Top-K": 1}}}}}, "a.b.c.d.Bregman-Top-K"),
    "a look-alike, deep": ({"extra_body": {"\u200bbregman_top_k": 1}},
                           "extra_body.\u200bbregman_top_k"),
    "vllm_xargs inside vllm_xargs": ({"vllm_xargs": {"vllm_xargs": {"bregman_top_k": 1}}},
                                     "vllm_xargs.vllm_xargs.bregman_top_k"),
}


@pytest.mark.parametrize("case", STRAY)
def test_a_bregman_key_where_vllm_does_not_read_it_is_a_400_naming_its_path(
        served: Served, case: str) -> None:
    """On every route that takes the fields and on one that takes none, in every body
    encoding vLLM reads (the UTF-8 ones with and without escapes take different paths)."""
    fields, param = STRAY[case]
    # ("escaped-keys" writes a key's first character as an escape of the JSON text: a key that
    # is already escaped there, beyond ASCII, would become another key)
    encodings = [how for how in BODY_ENCODINGS if how != "gzip"
                 and (param.isascii() or how != "escaped-keys")]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"):
        for how in encodings:
            response = post(served, path, {"prompt": "x", **fields}, how)
            error = assert_openai_error(response, 400, param)
            where = "not supported on POST /tokenize" if path == "/tokenize" \
                else "for Bregman fields on this route"
            assert where in error["message"], (path, how, error)


@pytest.mark.parametrize("key", LOOK_ALIKES.values(), ids=LOOK_ALIKES)
def test_a_look_alike_key_is_a_400_at_the_top_level_and_in_vllm_xargs(served: Served,
                                                                      key: str) -> None:
    """A zero-width space, a byte-order mark, a fullwidth letter ... in the key (200 and plain
    decoding before): "did you mean `bregman_top_k`?", the key shown with its escapes."""
    for fields in ({key: 1}, {"vllm_xargs": {key: 1}}):
        for how in ("utf-8", "ascii-escapes", "utf-16"):
            error = assert_openai_error(post(served, "/v1/completions",
                                             {"prompt": "x", **fields}, how), 400, key)
            assert "did you mean `bregman_top_k`?" in error["message"], error
            if not key.isascii():
                assert ascii(key) in error["message"], error


#: Bodies whose data holds keys named like Bregman fields: each reaches vLLM byte for byte.
DATA = {
    "a tool parameter": {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "bregman_top_k": {"type": "integer"}}, "required": ["bregman_top_k"]}}}]},
    "a JSON schema response format": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "properties": {"bregman_alpha": {}}}}}},
    "structured outputs": {"structured_outputs": {"json": {"properties": {"Bregman": {}}}}},
    "a guided JSON schema": {"guided_json": {"properties": {"bregman_lambda": {}}}},
    "message content": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "bregman_top_k": 1}]}]},
    "metadata": {"metadata": {"bregman_top_k": "7"}},
    "a logit_bias map": {"logit_bias": {"bregman": 1.0}},
    "chat template arguments": {"chat_template_kwargs": {"bregman_mode": "on"}},
    "kv transfer parameters": {"kv_transfer_params": {"\u200bbregman": {"x": 1}}},
    "responses text format": {"text": {"format": {"type": "json_schema", "schema": {
        "properties": {"bregman_k_max": {}}}}}},
}


@pytest.mark.parametrize("case", DATA)
def test_keys_inside_data_are_left_alone(served: Served, case: str) -> None:
    """The rule's data fields (`DATA_FIELDS`, wherever they are): a tool may have a parameter
    called bregman_top_k. The body reaches the app as sent, on every route."""
    assert set(DATA[case]) <= DATA_FIELDS
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"):
        body = {"prompt": "x", **DATA[case]}
        response = post(served, path, body)
        assert response.status_code == 200, (path, response.text)
        assert response.json()["received"] == body
    # Beside real fields, the fields are mapped and the data is untouched.
    body = {"prompt": "x", "bregman_top_k": 2, **DATA[case]}
    received = post(served, "/v1/completions", body).json()["received"]
    assert received["vllm_xargs"]["bregman_top_k"] == 2
    assert {key: received[key] for key in DATA[case]} == DATA[case]


def test_the_fast_path_reads_every_body_that_could_hide_a_key() -> None:
    """A body with anything beyond ASCII (raw or escaped) is read: NFKC and format characters
    can make a key of it that the bytes do not spell."""
    for key in LOOK_ALIKES.values():
        for how in ("utf-8", "ascii-escapes", "utf-8-bom"):
            raw, _ = encode_body({"extra_body": {key: 1}}, how)
            assert must_parse(raw), (key, how)
    assert not must_parse(b'{"prompt": "plain ASCII, nothing to act on"}')
    assert must_parse('{"prompt": "caf\u00e9"}'.encode())  # (read: it costs a parse, no more)


# --- beam search ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [{"bregman_top_k": 1}, {"vllm_xargs": {"bregman_top_k": 1}},
                                    {"bregman_mode": "dual", "bregman_alpha": 2}],
                         ids=["top level", "vllm_xargs", "dual"])
@pytest.mark.parametrize("beam", [True, "true", 1, "yes"], ids=repr)
def test_beam_search_with_bregman_fields_is_a_400(served: Served, fields: dict[str, Any],
                                                  beam: Any) -> None:
    """vLLM's beam search builds its parameters without vllm_xargs: the fields would be
    dropped (a 200, plain beam search, before). Every value pydantic reads as true."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = assert_openai_error(post(served, path, {
            "prompt": "x", "n": 2, "use_beam_search": beam, **fields}), 400, "use_beam_search")
        assert '"bregman_mode": "off"' in error["message"]
        assert "leave use_beam_search out" in error["message"]


def test_beam_search_without_bregman_decoding_passes(served: Served) -> None:
    for body in ({"use_beam_search": True}, {"use_beam_search": True, "bregman_mode": "off"},
                 {"use_beam_search": False, "bregman_top_k": 1},
                 {"use_beam_search": "false", "bregman_top_k": 1}):
        assert post(served, "/v1/completions", {"prompt": "x", **body}).status_code == 200
    # A value the request model refuses is the app's own answer (vLLM's 400; the stand-in's 422).
    assert post(served, "/v1/completions", {"prompt": "x", "use_beam_search": "maybe",
                                            "bregman_top_k": 1}).status_code == 422
    # A route whose request has no beam search ignores the key: the fields are honoured.
    received = post(served, "/v1/responses", {"prompt": "x", "use_beam_search": True,
                                              "bregman_top_k": 1}).json()["received"]
    assert received["vllm_xargs"]["bregman_top_k"] == 1


def test_beam_search_in_a_form_with_bregman_fields_in_its_vllm_xargs_is_a_400(served: Served
                                                                             ) -> None:
    """Speech to text takes forms, beam search too, and the fields in the form's vllm_xargs
    JSON string (which the processor would validate, but beam search never reaches it)."""
    url = served.url + "/v1/audio/transcriptions"
    asked = {"use_beam_search": "true", "vllm_xargs": '{"bregman_top_k": 1}'}
    for extra in ({}, {"files": {"file": ("a.wav", b"RIFF\x00\xff" * 64)}}):
        response = httpx.post(url, data=asked, headers=AUTH, **extra)
        assert_openai_error(response, 400, "use_beam_search")
        for fine in ({"use_beam_search": "false"}, {"vllm_xargs": '{"bregman_mode": "off"}'},
                     {"vllm_xargs": '{"other": 1}'}):
            response = httpx.post(url, data={**asked, **fine}, headers=AUTH, **extra)
            assert response.status_code == 200, (fine, response.text)


def test_beam_search_under_bregman_server_defaults_is_a_400(defaults: Served) -> None:
    """``--default-mode primal --default-top-k 1``: a beam search request that sends no field
    would be decoded plainly; "off" asks for plain beam search."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_openai_error(post(defaults, path, {"prompt": "x", "use_beam_search": True}),
                            400, "use_beam_search")
        off = post(defaults, path, {"prompt": "x", "use_beam_search": True,
                                    "bregman_mode": "off"})
        assert off.status_code == 200 and "vllm_xargs" not in off.json()["received"]


def test_beam_search_routes_are_read_from_vllms_request_models() -> None:
    """On vLLM's own app: the honoured routes whose request declares use_beam_search."""
    from bregman_server.routes import honoured_routes

    from .test_vllm_app import vllm_app

    routes = honoured_routes(vllm_app("--enable-scale-out"))
    assert {"/v1/completions", "/v1/chat/completions", "/invocations",
            "/v1/chat/completions/batch"} <= routes.beam_search
    assert "/v1/responses" not in routes.beam_search
    assert "/inference/v1/generate" not in routes.beam_search


# --- the largest support size: 1024 by default, in the server and in the engine ------------------

def test_the_server_holds_every_request_to_1024_by_default(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """`bregman-serve` and the middleware under plain vLLM (settings from the environment):
    a request without bregman_k_max decodes with k_max 1024, a larger size is a 400; "none"
    (flag or environment) lifts the bound."""
    from bregman_server.cli import parse_args

    monkeypatch.delenv("BREGMAN_MAX_SUPPORT", raising=False)
    assert parse_args(["--model", "m"])[0].max_support == 1024
    assert parse_args(["--model", "m", "--max-support", "none"])[0].max_support is None
    assert BregmanMiddleware(vllm_like_app()).settings.max_support == 1024
    monkeypatch.setenv("BREGMAN_MAX_SUPPORT", "None")
    assert BregmanMiddleware(vllm_like_app()).settings.max_support is None
    monkeypatch.delenv("BREGMAN_MAX_SUPPORT")
    with Served(vllm_like_app(), max_support=ServerSettings().max_support) as server:
        received = post(server, "/v1/completions", {"prompt": "x", "bregman_lambda": 1e-9})
        assert received.json()["received"]["vllm_xargs"]["bregman_k_max"] == 1024
        assert_openai_error(post(server, "/v1/completions", {"prompt": "x",
                                                             "bregman_top_k": 1025}),
                            400, "bregman_top_k")


def test_bregman_serve_gives_the_engines_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's bound reaches the engine processes (whose processor applies it at
    admission to whatever reaches vLLM)."""
    from bregman_server import engine

    # (`_environment` writes os.environ itself: each name it sets is registered here first, so
    # that the test leaves the environment as it found it, for the engines started after it)
    for name in ("BREGMAN_MAX_SUPPORT", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_API_KEY",
                 "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp")  # (nothing made)
    for flag, env in ((["--max-support", "64"], "64"), ([], "1024"),
                      (["--max-support", "none"], "none")):
        monkeypatch.delenv("BREGMAN_MAX_SUPPORT", raising=False)
        from bregman_server.cli import parse_args

        engine._environment(parse_args(["--model", "m", *flag])[0])
        assert __import__("os").environ["BREGMAN_MAX_SUPPORT"] == env


def test_the_processor_applies_bregman_max_support_at_admission(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """For front ends without the middleware (plain `vllm serve`, forms' vllm_xargs, an
    offline LLM): sizes above the bound are refused by ``validate_params`` (vLLM's 400), and
    a request without bregman_k_max is decoded with k_max = the bound. Unset: no bound."""
    monkeypatch.delenv("BREGMAN_MAX_SUPPORT", raising=False)
    BregmanLogitsProcessor.validate_params(SamplingParams(extra_args={"bregman_top_k": 5000}))
    assert request_params({"bregman_lambda": 1e-9}, max_support_from_env()).k_max is None
    monkeypatch.setenv("BREGMAN_MAX_SUPPORT", "1024")
    for fields, key in (({"bregman_top_k": 5000}, "bregman_top_k"),
                        ({"bregman_k_max": 1025}, "bregman_k_max")):
        with pytest.raises(BregmanParamError, match=rf"{key}: .*\[1, 1024\]"):
            BregmanLogitsProcessor.validate_params(SamplingParams(extra_args=fields))
    assert request_params({"bregman_lambda": 1e-9}, max_support_from_env()).k_max == 1024
    assert request_params({"bregman_k_max": 7}, max_support_from_env()).k_max == 7
    monkeypatch.setenv("BREGMAN_MAX_SUPPORT", "lots")
    with pytest.raises(BregmanParamError, match="BREGMAN_MAX_SUPPORT"):
        BregmanLogitsProcessor(object(), torch.device("cpu"), False)


def test_the_processor_refuses_bregman_keys_below_the_first_level_of_extra_args() -> None:
    """An offline LLM's extra_args, or /inference/v1/generate's without the middleware: the
    processor reads the first level only; deeper keys are refused, data is not."""
    for extra, param in (
            ({"vllm_xargs": {"bregman_top_k": 1}}, "extra_args.vllm_xargs.bregman_top_k"),
            ({"x": [{"\ufeffbregman_alpha": 2}]}, "extra_args.x.0.\ufeffbregman_alpha")):
        with pytest.raises(BregmanParamError) as info:
            BregmanLogitsProcessor.validate_params(SamplingParams(extra_args=extra))
        assert info.value.field == param
    BregmanLogitsProcessor.validate_params(SamplingParams(extra_args={
        "kv_transfer_params": {"bregman_top_k": 1}, "bregman_top_k": 2}))


# --- the rows the bound holds, on /metrics -------------------------------------------------------

class EngineConfig:
    """Stands in for VllmConfig (no instance_id: nothing is written to disk)."""


def held() -> dict[str, float]:
    totals = telemetry.totals()
    return {mode: totals.get(em.held(mode), 0.0) for mode in em.MODES}


def test_rows_held_at_their_k_max_are_counted() -> None:
    """``bregman_support_held_total{mode}``: one per adaptive row whose k* was held at its
    k_max (a tiny lambda on flat rows: k* would be the vocabulary); rows under their cap, fixed
    top-k rows and plain rows are not counted."""
    proc = BregmanLogitsProcessor(EngineConfig(), torch.device("cpu"), False)
    configs = [{"bregman_lambda": 1e-9, "bregman_k_max": 16},                  # held
               {"bregman_mode": "dual", "bregman_alpha": 2, "bregman_lambda": 1e-9,
                "bregman_k_max": 8},                                         # held (dual)
               {"bregman_lambda": 0.5, "bregman_k_max": 16},                   # k* 1: under
               {"bregman_top_k": 16, "bregman_k_max": 16},                     # fixed k
               None]                                                         # plain
    added = [(i, SamplingParams(temperature=1.0, extra_args=extra), None, [])
             for i, extra in enumerate(configs)]
    proc.update_state(BatchUpdate(len(configs), [], added, []))
    logits = torch.randn(len(configs), 512) * 1e-3  # flat rows
    before = held()
    proc.apply(logits)
    assert proc.last_step is not None
    assert proc.last_step.k.tolist()[:4] == [16, 8, 1, 16]
    after = held()
    assert {mode: after[mode] - before[mode] for mode in em.MODES} == {"primal": 1, "dual": 1}
    shown = "\n".join(str(metric) for metric in em.InProcessCollector(
        telemetry.totals).collect())
    assert em.HELD in shown and np.isfinite(after["primal"])


def _holds_objects(annotation: Any, depth: int = 0) -> bool:
    """Whether a field of this annotation can hold a JSON object (a dict, Any, a model, a
    TypedDict, a dataclass or msgspec struct), itself or inside lists and unions."""
    import typing

    if annotation is typing.Any or annotation is dict or depth > 8:
        return True
    origin = typing.get_origin(annotation)
    if origin is dict:
        return True
    if origin is not None:
        return any(_holds_objects(arg, depth + 1) for arg in typing.get_args(annotation))
    return isinstance(annotation, type) and any(
        hasattr(annotation, name) for name in ("model_fields", "__total__",
                                               "__dataclass_fields__", "__struct_fields__"))


def test_every_vllm_request_field_that_holds_objects_is_classified() -> None:
    """Each field of vLLM's request models (every route that takes the fields, and every one
    that refuses them) that can hold an object is either data (`DATA_FIELDS`: its keys are left
    alone) or read as fields (`FIELD_OBJECTS`: a Bregman key in it is refused): a vLLM upgrade
    that adds one fails here until someone has read it."""
    from bregman_server.routes import DISPATCHERS, _members

    from bregman_vllm.params import FIELD_OBJECTS

    from .test_vllm_app import _post_routes, vllm_app

    unclassified = set()
    for route in _post_routes(vllm_app("--enable-scale-out")):
        if route.body_field is not None:
            models = _members(route.body_field.field_info.annotation)
        elif route.path in DISPATCHERS:
            models = [m for t in DISPATCHERS[route.path]() for m in _members(t)]
        else:
            continue
        for model in models:
            for name, info in getattr(model, "model_fields", {}).items():
                if _holds_objects(info.annotation) and name not in DATA_FIELDS | FIELD_OBJECTS:
                    unclassified.add((route.path, model.__name__, name))
    assert not unclassified, sorted(unclassified)
    assert not DATA_FIELDS & FIELD_OBJECTS


def test_the_support_grid_benchmark_runs_and_says_whether_the_bound_binds(
        capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/support_grid.py at a tiny size on the tiny model: a table row per grid point,
    and exit status 1 when a row's k* exceeds the bound (a bound of 1 binds wherever k* > 1)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "support_grid.py"
    spec = importlib.util.spec_from_file_location("support_grid", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = str(path.parent.parent / "models" / "tiny-llama")
    assert module.main(["--passages", "1", "--tokens", "8", "--model", model,
                        "--bound", "1"]) == 1
    assert module.main(["--passages", "1", "--tokens", "8", "--model", model,
                        "--bound", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n    2  0.0001  1.5 |") == 2 and "never binds" in out
