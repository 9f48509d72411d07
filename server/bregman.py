"""The Bregman fields of a request body: validate, map onto the route's extra arguments.

The body arrives parsed (`bregman_server.jsonbody`: the object vLLM will read). Where the fields
go depends on the route (`bregman_server.routes`): vLLM's ``vllm_xargs`` (OpenAI and Anthropic
requests, which vLLM copies into ``SamplingParams.extra_args``), or ``sampling_params.extra_args``
(token-in/token-out generation).

A request may write each field at the top level or in its own extra arguments, on top of the
server-wide defaults. No field is ever dropped in silence: each is honoured or refused with a
400 naming it, wherever it is written.

* A key meant as a Bregman field that is not one exactly (``"BREGMAN_TOP_K"``,
  ``"bregman-top-k"``, ``"bregman_topk"``, ``"\\u200bbregman_top_k"``;
  `bregman_vllm.params.check_keys`, the one matching rule) is refused at the top level and in
  the extra arguments alike.
* The two places must agree: a field written in both with different values, or a
  ``"bregman_mode": "off"`` in one place beside Bregman fields in the other (which it would
  switch off), is a 400 naming both places (`_check_agree`).
* A key meant as a Bregman field anywhere else in the body, at any depth (``extra_body``, the
  SDK's argument sent as a field; ``VLLM_XARGS``; ``extra_body.vllm_xargs``;
  ``sampling_params.extra_args`` where the route reads ``vllm_xargs``), is refused with a 400
  naming its JSON path (`stray_field`): vLLM would never read it there. The values of the
  fields vLLM passes on as data (`bregman_vllm.params.DATA_FIELDS`: messages, tools, schemas,
  logit_bias maps, metadata ...) are not looked into: their keys are content, not fields.
* Beam search decodes with parameters vLLM builds without ``vllm_xargs``: with Bregman decoding
  in force (the request's fields or the server's defaults), ``use_beam_search`` is refused on
  the routes whose request declares it (`refuse_beam_search`).

The merged values are validated with the shared parameter model (`bregman_vllm.params`), so the
server refuses exactly what the vLLM processor would refuse, with the same message. Everything
else in the body is left untouched.

JSON has no infinity, but Python's encoder (and so lm-evaluation-harness) writes
``float("inf")`` as the bare token ``Infinity``: it is accepted as the value of
``bregman_alpha`` (top level or in the extra arguments), where the alpha range allows it.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from bregman_vllm.params import (
    DATA_FIELDS,
    REQUEST_KEYS,
    BregmanParamError,
    BregmanParams,
    bregman_keys,
    check_keys,
    dotted,
    parse_field,
    shown,
)

from .routes import VLLM_XARGS, Target


def apply_bregman(body: dict[str, Any], defaults: BregmanParams | None,
                  target: Target = VLLM_XARGS, max_support: int | None = None,
                  beam_search: bool = False) -> tuple[str, bool]:
    """Rewrite ``body`` in place for vLLM.

    Returns the effective mode ("primal" / "dual" / "off") and whether the body changed (an
    unchanged body is forwarded byte for byte). ``target`` is where the route's extra arguments
    live (``("vllm_xargs",)`` or ``("sampling_params", "extra_args")``).

    * top-level ``bregman_*`` fields are removed from the body (vLLM would ignore them);
    * an enabled result is written to the extra arguments next to the user's other keys;
    * a disabled result ("off", explicitly or by default) removes every ``bregman_*`` key from
      them, so an explicit "off" also beats a server default;
    * with ``max_support`` (the server's largest support size), an enabled result is held to it
      (`BregmanParams.within`: sizes above it refused, ``k_max`` filled in when absent);
    * ``beam_search``: the route's request declares ``use_beam_search``; an enabled result with
      beam search asked for is refused (`refuse_beam_search`).

    Raises `BregmanParamError` (``.field`` names the parameter) for invalid values, for keys
    meant as Bregman fields that are not ones, for Bregman keys where vLLM does not read them
    (`stray_field`) and for a request whose two places disagree.
    """
    check_keys(body)
    stray = stray_field(body, target)
    if stray is not None:
        path, holder = stray
        raise BregmanParamError(
            path, f"vLLM does not read {holder!r} for Bregman fields on this route, so the "
            f"field would be ignored: send it at the top level or in {'.'.join(target)}")
    top: dict[str, Any] = {}
    changed = False
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
    from_xargs: dict[str, Any] = {}
    if xargs:
        check_keys(xargs)
        from_xargs = {key: xargs[key] for key in REQUEST_KEYS if xargs.get(key) is not None}

    if not top and not from_xargs and (defaults is None or not defaults.enabled):
        return "off", changed  # the fast path: nothing to do

    _check_agree(top, from_xargs, ".".join(target))
    params = BregmanParams.from_mapping({**from_xargs, **top}, defaults=defaults)
    if params is None or not params.enabled:
        if xargs and any(key in xargs for key in REQUEST_KEYS):
            assert holder is not None
            holder[name] = {k: v for k, v in xargs.items() if k not in REQUEST_KEYS}
        return "off", True
    if holder is None:
        raise BregmanParamError(outer[0], "must be an object: the Bregman fields go into its "
                                f"{name}")
    if beam_search:
        refuse_beam_search(body.get("use_beam_search"))
    params = params.within(max_support)
    merged = {k: v for k, v in xargs.items() if k not in REQUEST_KEYS} if xargs else {}
    merged.update(params.to_request())
    holder[name] = merged
    return params.mode, True


def _check_agree(top: dict[str, Any], xargs: dict[str, Any], where: str) -> None:
    """A 400 unless the top level and the extra arguments (``where``) agree: each field given
    in both has the same value in both (as parsed: 2, "2" and 2.0 agree), and neither place
    says ``"bregman_mode": "off"`` beside Bregman fields in the other, which it would switch
    off."""
    for key in REQUEST_KEYS:
        if key in top and key in xargs and parse_field(key, top[key]) != parse_field(
                key, xargs[key]):
            raise BregmanParamError(
                key, f"given twice with different values: {shown(top[key])} at the top level "
                f"and {shown(xargs[key])} in {where}; send it once")
    top_off, xargs_off = _is_off(top), _is_off(xargs)
    if top_off != xargs_off:
        switched = xargs if top_off else top
        if switched:
            off_place, other = ("at the top level", f"in {where}") if top_off \
                else (f"in {where}", "at the top level")
            raise BregmanParamError(
                "bregman_mode", f'"off" {off_place} would switch off the Bregman fields '
                f"{other} ({', '.join(switched)}); send the fields in one place, or leave "
                "them out to sample plainly")


def _is_off(fields: dict[str, Any]) -> bool:
    return "bregman_mode" in fields and parse_field("bregman_mode", fields["bregman_mode"]) \
        == "off"


def stray_field(body: dict[str, Any], target: Target | None) -> tuple[str, str] | None:
    """(JSON path, the path of the object that holds it) of the first key meant as a Bregman
    field (any spelling the matching rule finds) where vLLM does not read the fields: anywhere
    in ``body`` but its top level and the first level of the route's extra arguments
    ``target`` (None: a route that reads none, where the top level counts too), not looking
    into `DATA_FIELDS`."""
    honoured = {(), target} if target is not None else set()
    for path in bregman_keys(body, data=DATA_FIELDS):
        if path[:-1] not in honoured:
            return dotted(path), dotted(path[:-1])
    return None


_BOOL = TypeAdapter(bool)


def refuse_beam_search(value: Any) -> None:
    """A 400 if ``use_beam_search`` is true as vLLM's request model reads it (pydantic's bool:
    ``true``, ``1``, ``"yes"`` ...; a value it refuses is vLLM's own 400)."""
    try:
        asked = value is not None and _BOOL.validate_python(value)
    except ValidationError:
        return
    if asked:
        raise BregmanParamError(
            "use_beam_search", "beam search does not decode with the Bregman fields (vLLM builds "
            "its beam search parameters without vllm_xargs, so they would be ignored); send "
            '"bregman_mode": "off" for plain beam search, or leave use_beam_search out for '
            "Bregman decoding")


def refuse_bregman_fields(body: dict[str, Any], route: str, honoured: str) -> None:
    """A 400 naming the first Bregman key (any spelling the matching rule finds, anywhere in the
    body but inside `DATA_FIELDS`) of a route that cannot honour it."""
    stray = stray_field(body, None)
    if stray is not None:
        raise BregmanParamError(
            stray[0], f"Bregman fields are not supported on {route}; send them to {honoured} "
            "(or in the route's own vllm_xargs / sampling_params.extra_args, which vLLM "
            "validates)")
