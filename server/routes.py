"""The routes whose requests take the Bregman fields, read from the app that serves them.

A route takes them when its request body becomes a `SamplingParams` the client controls.
`honoured_routes` reads the route table of vLLM's FastAPI app (the middleware calls it once,
on the first request, with ``scope["app"]``), so that a vLLM upgrade cannot add a route that
silently skips the fields or the server defaults. For each POST route, the request model FastAPI
validates the body with (each member of a union) decides, by what it declares:

1. it declares ``vllm_xargs`` (vLLM copies it into ``SamplingParams.extra_args``): the fields
   go into ``vllm_xargs`` (`VLLM_XARGS`): /v1/completions, /v1/chat/completions,
   /v1/responses, /v1/messages and their /render routes;
2. it declares a field of type ``vllm.sampling_params.SamplingParams``: into that field's
   ``extra_args`` (/inference/v1/generate, token in, token out).

What a model could be converted into says nothing: vLLM 0.33's ``TokenizeChatRequest`` gained a
``to_chat_completion_request()`` without sampling anything. The routes that sample although
their request model says neither were read one by one (`REVIEWED_SAMPLING_ROUTES`); a route
without a request model that reads its body itself and dispatches on its shape takes them when
a request type it dispatches to does (`DISPATCHERS`: SageMaker's /invocations, from vLLM's own
dispatch table; tests/test_vllm_app.py fails when a vLLM upgrade adds a POST route without a
request model that nobody has read). Every other route refuses a Bregman field with a 400
(/tokenize, /pooling, 0.33's /v1/decisions ...). Routes with form bodies (audio transcription)
carry ``vllm_xargs`` as a JSON string that vLLM parses; the middleware does not rewrite forms
(`FORM`).

A server whose engine drops the processor takes the fields nowhere: `processor_dropped` says
when (the middleware then refuses to start).
"""

from __future__ import annotations

import logging
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("bregman_server")

#: Where a route's extra arguments live in its body.
Target = tuple[str, ...]
VLLM_XARGS: Target = ("vllm_xargs",)
FORM: Target = ()
_SAMPLING_PARAMS = "vllm.sampling_params.SamplingParams"


def _generate_invocation_types() -> list[Any]:
    """The request types vLLM's /invocations tries, in order, for a generating model."""
    from vllm.entrypoints.generate.factories import get_generate_invocation_types

    return [request_type for request_type, _ in get_generate_invocation_types(("generate",))]


#: Routes that read their body themselves and dispatch on its shape: the request types they
#: dispatch to (read from vLLM when the route exists).
DISPATCHERS: dict[str, Callable[[], list[Any]]] = {"/invocations": _generate_invocation_types}

#: Routes that sample although their request model declares neither ``vllm_xargs`` nor a
#: SamplingParams field, read in vLLM 0.32 and 0.33's sources: where their fields go. Taken
#: only while the model allows extra fields (else it would refuse ``vllm_xargs``).
#: /v1/chat/completions/batch: ``BatchChatCompletionRequest`` keeps unknown fields, and its
#: handler builds one ``ChatCompletionRequest`` per conversation from all of them.
REVIEWED_SAMPLING_ROUTES: dict[str, Target] = {"/v1/chat/completions/batch": VLLM_XARGS}


@dataclass(frozen=True)
class Routes:
    """The honoured routes of one app: path (as the app writes it) -> `Target`."""

    targets: dict[str, Target] = field(default_factory=dict)
    _patterns: tuple[tuple[re.Pattern[str], str], ...] = ()
    #: The honoured routes whose request declares ``use_beam_search`` (vLLM's beam search,
    #: which builds its own parameters without ``vllm_xargs``).
    beam_search: frozenset[str] = frozenset()

    @classmethod
    def of(cls, targets: dict[str, Target], beam_search: frozenset[str] = frozenset()
           ) -> Routes:
        patterns = tuple((re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", path) + "$"), path)
                         for path in targets if "{" in path)
        return cls(dict(targets), patterns, frozenset(beam_search) & set(targets))

    def match(self, path: str) -> str | None:
        """The route (its template) that serves ``path`` if it takes the Bregman fields."""
        if path in self.targets:
            return path
        for pattern, template in self._patterns:
            if pattern.match(path):
                return template
        return None

    @property
    def text(self) -> str:
        """The routes for messages: "POST /v1/completions, POST /v1/chat/completions, ..."."""
        return ", ".join(f"POST {path}" for path, target in self.targets.items()
                         if target != FORM) or "no route of this server"


def honoured_routes(app: Any) -> Routes:
    """The routes of ``app`` (a FastAPI app such as vLLM's) whose bodies become SamplingParams.

    An app whose routes cannot be read (not FastAPI) has none: every Bregman field is then a
    400, never silently dropped.
    """
    targets: dict[str, Target] = {}
    beam_search: set[str] = set()
    for route in getattr(app, "routes", ()):
        if "POST" not in (getattr(route, "methods", None) or ()):
            continue
        path = route.path
        body_field = getattr(route, "body_field", None)
        if body_field is not None:
            members = _members(body_field.field_info.annotation)
            if type(body_field.field_info).__name__ == "Form":
                if any(_target(member) is not None for member in members):
                    targets[path] = FORM
                    if _declares_beam_search(members):
                        beam_search.add(path)
                continue
        elif path in DISPATCHERS:
            try:
                members = [m for t in DISPATCHERS[path]() for m in _members(t)]
            except Exception:  # vLLM moved its dispatch table: the route takes no fields
                logger.exception("cannot read the request types of %s", path)
                continue
        else:
            continue
        found = [t for t in map(_target, members) if t is not None]
        if not found and path in REVIEWED_SAMPLING_ROUTES and any(
                getattr(m, "model_config", {}).get("extra") == "allow" for m in members):
            found = [REVIEWED_SAMPLING_ROUTES[path]]
        if found:
            targets.setdefault(path, found[0])
            if _declares_beam_search(members):
                beam_search.add(path)
    return Routes.of(targets, frozenset(beam_search))


def processor_dropped(speculative_config: Any, model_runner_v2: bool) -> str | None:
    """Why vLLM's engine would not run the Bregman processor, or None.

    vLLM's V1 model runner leaves out every logits processor of the ``vllm.logits_processors``
    entry points when speculative decoding is on (it refuses only those named with
    ``--logits-processors``), so every Bregman field would be silently ignored. Model Runner V2
    runs them, on every draft row (speculative methods it lacks are refused by vLLM itself).
    """
    if not speculative_config or model_runner_v2:
        return None
    return ("speculative decoding (--speculative-config) is on under vLLM's V1 model runner, "
            "which drops the Bregman logits processor: every bregman_* field would be ignored. "
            "Run Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1), which decodes every draft row, "
            "or serve without speculative decoding.")


def _members(annotation: Any) -> list[type]:
    """The classes a body annotation admits (``Annotated``, unions and ``None`` unwrapped)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation] if isinstance(annotation, type) and annotation is not type(None) else []


def _declares_beam_search(models: list[type]) -> bool:
    return any("use_beam_search" in (getattr(m, "model_fields", None) or {}) for m in models)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _target(model: type) -> Target | None:
    """Where a request model's Bregman fields go (rules 1 and 2 of the module docstring), or
    None."""
    fields = getattr(model, "model_fields", None)
    if not isinstance(fields, dict):
        return None
    if "vllm_xargs" in fields:
        return VLLM_XARGS
    for name, info in fields.items():
        if any(_name(member) == _SAMPLING_PARAMS for member in _members(info.annotation)):
            return (name, "extra_args")
    return None
