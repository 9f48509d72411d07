"""The Bregman fields of a request body: validate, map onto the route's extra arguments.

The body arrives parsed (`bregman_server.jsonbody`: the object vLLM will read). Where the fields
go depends on the route (`bregman_server.routes`): vLLM's ``vllm_xargs`` (OpenAI and Anthropic
requests, which vLLM copies into ``SamplingParams.extra_args``), or ``sampling_params.extra_args``
(token-in/token-out generation).

Precedence, lowest first: the server-wide defaults, the ``bregman_*`` keys of the request's own
extra arguments, the top-level ``bregman_*`` fields. The merged values are validated with the
shared parameter model (`bregman_vllm.params`), so the server refuses exactly what the vLLM
processor would refuse, with the same message. Everything else in the body is left untouched.

JSON has no infinity, but Python's encoder (and so lm-evaluation-harness) writes
``float("inf")`` as the bare token ``Infinity``: it is accepted as the value of
``bregman_alpha`` (top level or in the extra arguments), where the alpha range allows it.
"""

from __future__ import annotations

from typing import Any

from bregman_vllm.params import REQUEST_KEYS, BregmanParamError, BregmanParams

from .routes import VLLM_XARGS, Target


def apply_bregman(body: dict[str, Any], defaults: BregmanParams | None,
                  target: Target = VLLM_XARGS) -> tuple[str, bool]:
    """Rewrite ``body`` in place for vLLM.

    Returns the effective mode ("primal" / "dual" / "off") and whether the body changed (an
    unchanged body is forwarded byte for byte). ``target`` is where the route's extra arguments
    live (``("vllm_xargs",)`` or ``("sampling_params", "extra_args")``).

    * top-level ``bregman_*`` fields are removed from the body (vLLM would ignore them);
    * an enabled result is written to the extra arguments next to the user's other keys;
    * a disabled result ("off", explicitly or by default) removes every ``bregman_*`` key from
      them, so an explicit "off" also beats a server default.

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

    *outer, name = target
    holder: Any = body
    for key in outer:  # e.g. body["sampling_params"]; vLLM refuses a body where it is no object
        holder = holder.get(key) if isinstance(holder, dict) else None
    holder = holder if isinstance(holder, dict) else None
    xargs = holder.get(name) if holder is not None else None
    if xargs is not None and not isinstance(xargs, dict):
        raise BregmanParamError(".".join(target), "must be an object (a JSON dictionary)")
    from_xargs = {key: xargs[key] for key in REQUEST_KEYS if xargs and key in xargs}

    if not top and not from_xargs and (defaults is None or not defaults.enabled):
        return "off", changed  # the fast path: nothing to do

    params = BregmanParams.from_mapping({**from_xargs, **top}, defaults=defaults)
    if params is None or not params.enabled:
        if from_xargs:
            assert holder is not None and xargs is not None
            holder[name] = {k: v for k, v in xargs.items() if k not in REQUEST_KEYS}
        return "off", True
    if holder is None:
        raise BregmanParamError(outer[0], "must be an object: the Bregman fields go into its "
                                f"{name}")
    merged = {k: v for k, v in xargs.items() if k not in REQUEST_KEYS} if xargs else {}
    merged.update(params.to_request())
    holder[name] = merged
    return params.mode, True


def refuse_bregman_fields(body: dict[str, Any], route: str, honoured: str) -> None:
    """A 400 naming the first top-level ``bregman_*`` field of a route that cannot honour it."""
    for key in body:
        if isinstance(key, str) and key.startswith("bregman_"):
            raise BregmanParamError(
                key, f"Bregman fields are not supported on {route}; send them to {honoured} "
                "(or in the route's own vllm_xargs / sampling_params.extra_args, which vLLM "
                "validates)")
