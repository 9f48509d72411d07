"""The Bregman fields of a request body: parse the JSON, validate, map onto vLLM's ``vllm_xargs``.

Precedence, lowest first: the server-wide defaults, the ``bregman_*`` keys of the request's own
``vllm_xargs``, the top-level ``bregman_*`` fields. The merged values are validated with the
shared parameter model (`bregman_vllm.params`), so the server refuses exactly what the vLLM
processor would refuse, with the same message. Everything else in the body is left untouched.

JSON has no infinity, but Python's encoder (and so lm-evaluation-harness) writes
``float("inf")`` as the bare token ``Infinity``: it is accepted as the value of
``bregman_alpha`` (top level or in ``vllm_xargs``), where the alpha range allows it. ``NaN``,
``Infinity`` anywhere else, numbers that overflow a double (``1e999``) and JSON nested deeper
than Python can parse are 400s naming the field where there is one.
"""

from __future__ import annotations

import json
import math
from collections import deque
from typing import Any

from bregman_vllm.params import REQUEST_KEYS, BregmanParamError, BregmanParams

from .errors import APIError


class _Overflow:
    """Stands for a JSON number too large for a double while the body is searched for it."""


def _overflow_error(text: str) -> float:
    raise ValueError(f"the number {text[:40]} overflows a double")


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        _overflow_error(text)
    return value


def _constant(name: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


def parse_json_body(raw: bytes) -> tuple[dict[str, Any], bool]:
    """The body as a JSON object, and whether it holds ``NaN`` / ``Infinity`` tokens.

    Raises an OpenAI-shaped 400 (`APIError`) for anything else than a JSON object, for JSON
    nested too deeply and for numbers that overflow (``param`` names where it sits).
    """
    special = False

    def constant(name: str) -> float:
        nonlocal special
        special = True
        return _constant(name)

    try:
        body = json.loads(raw, parse_constant=constant, parse_float=_parse_float)
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply to be parsed.") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the overflow above
        if "overflows a double" in str(exc):
            marked = json.loads(raw, parse_constant=_constant,
                                parse_float=lambda text: _Overflow() if math.isinf(
                                    float(text)) else float(text))
            raise APIError(400, f"Invalid number: {exc}.",
                           param=find_path(marked, lambda v: isinstance(v, _Overflow))) from None
        raise APIError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return body, special


def encode_json_body(body: dict[str, Any]) -> bytes:
    """The body as JSON for vLLM: ASCII (a lone surrogate travels as its escape, as it came),
    and no ``NaN`` / ``Infinity`` left anywhere (400 naming the field)."""
    try:
        return json.dumps(body, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")
    except ValueError:
        param = find_path(body, lambda v: isinstance(v, float) and not math.isfinite(v))
        raise APIError(400, f"{param}: NaN and Infinity are not valid JSON values here (only "
                       "bregman_alpha accepts Infinity).", param=param) from None


def find_path(node: Any, match: Any, limit: int = 1_000_000) -> str | None:
    """Dotted path (``messages.0.content``) of the first value for which ``match`` is true,
    breadth first, looking at ``limit`` values at most; None if there is none."""
    queue: deque[tuple[str, Any]] = deque([("", node)])
    seen = 0
    while queue and seen < limit:
        path, value = queue.popleft()
        seen += 1
        if match(value):
            return path or None
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        for key, child in items:
            queue.append((f"{path}.{key}" if path else str(key), child))
    return None


def apply_bregman(body: dict[str, Any], defaults: BregmanParams | None) -> tuple[str, bool]:
    """Rewrite ``body`` in place for vLLM.

    Returns the effective mode ("primal" / "dual" / "off") and whether the body changed (an
    unchanged body is forwarded byte for byte).

    * top-level ``bregman_*`` fields are removed from the body (vLLM would ignore them);
    * an enabled result is written to ``body["vllm_xargs"]`` next to the user's other keys;
    * a disabled result ("off", explicitly or by default) removes every ``bregman_*`` key from
      ``vllm_xargs``, so an explicit "off" also beats a server default.

    Raises `BregmanParamError` (``.field`` names the parameter) for invalid values.
    """
    top: dict[str, Any] = {}
    changed = False
    for key in body:
        if isinstance(key, str) and key.startswith("bregman_") and key not in REQUEST_KEYS:
            raise BregmanParamError(key, "unknown Bregman field; the fields are "
                                    + ", ".join(REQUEST_KEYS))
    for key in REQUEST_KEYS:
        if key in body:
            changed = True
            value = body.pop(key)
            if value is not None:  # null means "not given", as in the parameter model
                top[key] = value

    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise BregmanParamError("vllm_xargs", "must be an object (a JSON dictionary)")
    from_xargs = {key: xargs[key] for key in REQUEST_KEYS if xargs and key in xargs}

    if not top and not from_xargs and (defaults is None or not defaults.enabled):
        return "off", changed  # the fast path: nothing to do

    params = BregmanParams.from_mapping({**from_xargs, **top}, defaults=defaults)
    if params is None or not params.enabled:
        if from_xargs:
            body["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in REQUEST_KEYS}
        return "off", True

    merged = {k: v for k, v in xargs.items() if k not in REQUEST_KEYS} if xargs else {}
    merged.update(params.to_request())
    body["vllm_xargs"] = merged
    return params.mode, True


def refuse_bregman_fields(body: dict[str, Any], route: str, honoured: str) -> None:
    """A 400 naming the first top-level ``bregman_*`` field of a route that cannot honour it."""
    for key in body:
        if isinstance(key, str) and key.startswith("bregman_"):
            raise BregmanParamError(
                key, f"Bregman fields are not supported on {route}; send them to {honoured} "
                "(or in the route's own vllm_xargs / sampling_params.extra_args, which vLLM "
                "validates)")
