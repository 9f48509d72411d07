"""Map the Bregman fields of an OpenAI request body onto vLLM's ``vllm_xargs``.

Precedence, lowest first: the server-wide defaults, the ``bregman_*`` keys of the request's own
``vllm_xargs``, the top-level ``bregman_*`` fields. The merged values are validated with the
shared parameter model (`bregman_vllm.params`), so the server refuses exactly what the vLLM
processor would refuse, with the same message. Everything else in the body is left untouched.
"""

from __future__ import annotations

from typing import Any

from bregman_vllm.params import REQUEST_KEYS, BregmanParamError, BregmanParams


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
