"""The one parameter model of Bregman decoding, shared by every entry point.

The math core (`bregman_decode`), the vLLM logits processor (`SamplingParams.extra_args`) and the
HTTP server (request bodies, server-wide defaults) all validate with the rules below, so a value is
accepted or refused with the same message everywhere. This module is pure Python: the server
imports it without importing torch.

Rules (arXiv 2505.19371, Sections 2-4; Lemma 4.2, dual validity of phi_alpha for alpha > 1;
Proposition 4.1, the special primal maps):

======  ==============  ==========================================================================
mode    k               alpha
======  ==============  ==========================================================================
primal  adaptive        0 < alpha <= 1e8 (for alpha <= 0 dropping a token costs +inf)
primal  fixed top_k     0 < |alpha| <= 1e8, and the limits -inf and +inf (Proposition 4.1)
dual    adaptive        1 < alpha <= 1e8 (dual-valid generators, Lemma 4.2)
dual    fixed top_k     1 <= alpha <= 1e8, and the limit +inf
======  ==============  ==========================================================================

Finite alphas beyond `ALPHA_LIMIT` (1e8) are refused: the map is its infinite limit there to
within float32 resolution, while the powers in the cost leave float64's range.

`lam` (lambda, the l0 price per kept token) is a finite number >= 0; `top_k` and `k_max` are
integers >= 1 or absent. `k_max` caps the support size in both the adaptive and the fixed-k case.

A new request field is written here and where it is used, nowhere in between: a `FieldSpec`
(the OpenAPI schema and the docs/server.md table are generated from it), its key in
`FIELD_KEYS`, its parser in `_PARSERS`, and a `BregmanParams` attribute; the HTTP middleware
and the vLLM processor pass every key of `REQUEST_KEYS` on, and the core receives the value per
row by name (`bregman_vllm.core.plan.ROW_FIELDS`: ``Group.values``, ``ExactPlan.values``, the
compiled pass's columns) in the function that reads it (for a bound on the support size,
`bregman_vllm.core.window.support_range`, which both searches use).
"""

from __future__ import annotations

import collections
import difflib
import functools
import math
import os
import re
import unicodedata
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

MODES: tuple[str, ...] = ("primal", "dual", "off")
DECODING_MODES: tuple[str, ...] = ("primal", "dual")

DEFAULT_MODE = "primal"
DEFAULT_ALPHA = 1.5
DEFAULT_LAMBDA = 0.01

#: The request key (``SamplingParams.extra_args`` / ``vllm_xargs`` / HTTP body field) of each
#: `BregmanParams` field.
FIELD_KEYS: dict[str, str] = {
    "mode": "bregman_mode",
    "alpha": "bregman_alpha",
    "lam": "bregman_lambda",
    "top_k": "bregman_top_k",
    "k_max": "bregman_k_max",
}
REQUEST_KEYS: tuple[str, ...] = tuple(FIELD_KEYS.values())
_FIELD_NAMES = frozenset(REQUEST_KEYS)


class BregmanParamError(ValueError):
    """A Bregman parameter is out of range. ``field`` names the offending parameter."""

    def __init__(self, field: str, message: str) -> None:
        field = field if len(field) <= 60 else field[:57] + "..."  # a key may be any length
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


# --- which keys are meant as Bregman fields ------------------------------------------------------
#
# The one matching rule, used wherever a request's keys are read (the server's whole body, the
# processor's ``SamplingParams.extra_args``): a key whose normalized name (`normalized_key`:
# NFKC, without Unicode format characters, case-folded, dashes as underscores, no spaces at its
# ends) begins with "bregman" once its underscores are left out is meant as a Bregman field.
# Unless it is one of `REQUEST_KEYS` exactly, where the field is read, it is refused, never
# ignored: "BREGMAN_TOP_K", "bregman-top-k", "bregmantopk", "\u200bbregman_top_k" (a zero-width
# space, what a copy and paste leaves) and "ｂregman_top_k" (a fullwidth letter) name
# bregman_top_k to a reader, not to vLLM, which would drop them and sample plainly.

#: Characters read as dashes: Unicode's dash punctuation (category Pd) and the minus sign.
_MINUS = "\u2212"


def normalized_key(key: str) -> str:
    """``key`` as the matching rule reads it: NFKC-normalized, without format characters
    (category Cf: zero-width spaces and joiners, byte-order marks, soft hyphens, direction
    marks), case-folded, every dash an underscore, no spaces at its ends
    ("\ufeffBREGMAN-Top_k" -> "bregman_top_k")."""
    if key.isascii():  # (NFKC and case folding of ASCII: lower case; ASCII has no Cf)
        return key.strip().lower().replace("-", "_")
    text = "".join(c for c in unicodedata.normalize("NFKC", key)
                   if unicodedata.category(c) != "Cf")
    text = unicodedata.normalize("NFKC", text.casefold())
    return "".join("_" if c == _MINUS or unicodedata.category(c) == "Pd" else c
                   for c in text).strip()


def folded_key(key: str) -> str:
    """`normalized_key` without underscores: what the matching rule compares
    ("BREGMAN-top_k" -> "bregmantopk")."""
    return normalized_key(key).replace("_", "")


_FOLDED_KEYS = {folded_key(key): key for key in REQUEST_KEYS}


def is_bregman_key(key: object) -> bool:
    """Whether a request key is meant as a Bregman field (exact or not): its `folded_key`
    begins with "bregman"."""
    return isinstance(key, str) and folded_key(key).startswith("bregman")


def shown_key(key: str) -> str:
    """A key as an error message shows it: as sent when it is printable ASCII, else as a
    Python string literal with escapes, so that an invisible character shows."""
    return key if key.isascii() and key.isprintable() else ascii(key)


def unknown_field(key: str) -> BregmanParamError:
    """The error for a key meant as a Bregman field that is not one: it names the key and,
    where one is close (the same but for case, dashes, underscores, spaces and invisible
    characters, or a typo), the field meant."""
    folded = re.sub(r"[^0-9a-z]", "", folded_key(key))
    meant = _FOLDED_KEYS.get(folded)
    if meant is None:
        close = difflib.get_close_matches(folded, _FOLDED_KEYS, n=1, cutoff=0.8)
        meant = _FOLDED_KEYS[close[0]] if close else None
    hint = f"did you mean `{meant}`? " if meant else ""
    written = "" if shown_key(key) == key else f" (the key is written {shown_key(key)})"
    return BregmanParamError(key, f"unknown Bregman field{written}; {hint}the fields are "
                             + ", ".join(REQUEST_KEYS) + " (lower case, with underscores)")


def check_keys(keys: Iterable[object]) -> None:
    """Raise `unknown_field` for the first key meant as a Bregman field that is not one."""
    for key in keys:
        if key not in _FIELD_NAMES and is_bregman_key(key):
            assert isinstance(key, str)
            raise unknown_field(key)


#: The request fields whose values vLLM passes on as data, not as fields it reads: keys inside
#: them are content (a tool parameter may be called ``bregman_top_k``) and are never looked
#: at, wherever in the body such a field is. Read in vLLM 0.32 and 0.33's request models; every
#: field of theirs that can hold an object is either here or in `FIELD_OBJECTS`
#: (tests/test_vllm_app.py fails on a new one until it is classified). The
#: processor skips them too: vLLM copies ``kv_transfer_params`` into ``extra_args``.
DATA_FIELDS = frozenset({
    # what the model reads: prompts, conversations, documents
    "messages", "prompt", "input", "instructions", "system", "suffix", "documents",
    "content_parts", "previous_input_messages", "prompt_embeds",
    # tools and the shapes of outputs: JSON schemas, grammars, structural tags
    "tools", "functions", "tool_choice", "response_format", "structured_outputs", "text",
    "output_config", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag",
    # maps and arguments handed to other parts: token biases, templates, processors, connectors
    "logit_bias", "metadata", "chat_template", "chat_template_kwargs", "mm_processor_kwargs",
    "media_io_kwargs", "kv_transfer_params", "ec_transfer_params", "reasoning_parser_kwargs",
    "features", "stop", "stop_sequences", "bad_words",
    # what routes that sample nothing take: generated outputs to derender, decision questions
    "chat_request", "completion_request", "generate_chunk", "generate_response",
    "generate_responses", "stream_state", "questions", "state",
})
#: The request fields that can hold an object whose keys vLLM reads as fields: looked into
#: like every key the request models do not declare (``extra_body``, ``VLLM_XARGS`` ...).
FIELD_OBJECTS = frozenset({"vllm_xargs", "sampling_params", "stream_options", "reasoning",
                           "thinking", "repetition_detection"})

#: A place in a JSON body: the keys and array indices that lead to it.
JSONPath = tuple[str | int, ...]


def dotted(path: JSONPath) -> str:
    """A JSON path as error messages and ``param`` write it: ``extra_body.vllm_xargs.x``,
    ``messages.0.content``."""
    return ".".join(map(str, path))


def bregman_keys(node: Any, data: Collection[str] = ()) -> Iterator[JSONPath]:
    """The path of every key meant as a Bregman field in ``node`` (the key last), in its objects
    and arrays at every depth, breadth first, ``node`` itself included. The values of keys
    named in ``data`` are not looked into (their keys are data, not fields)."""
    queue: collections.deque[tuple[JSONPath, Any]] = collections.deque([((), node)])
    while queue:
        path, value = queue.popleft()
        if isinstance(value, dict):
            for key, child in value.items():
                if is_bregman_key(key):
                    yield (*path, key)
                if key not in data and isinstance(child, (dict, list)):
                    queue.append(((*path, key), child))
        elif isinstance(value, list):
            for index, child in enumerate(value):
                if isinstance(child, (dict, list)):
                    queue.append(((*path, index), child))


@dataclass(frozen=True)
class FieldSpec:
    """Documentation of one request field: used for the OpenAPI schema and the README table.
    ``schema``: the JSON schemas a sent value may have (the OpenAPI document adds null)."""

    name: str
    type: str
    allowed: str
    default: str
    description: str
    schema: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    examples: tuple[Any, ...] = ()


_SIZE_SCHEMA = ({"type": "integer", "minimum": 1, "maximum": 2**31 - 1},)


FIELD_SPECS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "bregman_mode",
        'string: "primal" | "dual" | "off"',
        '"primal", "dual" or "off"',
        f'the server default; "{DEFAULT_MODE}" when other bregman fields are sent and the server '
        'default is "off"',
        "Which Bregman problem to solve: primal projection D(q, p), dual projection D(p, q), or "
        "'off' for plain sampling.",
        ({"type": "string", "enum": list(MODES)},),
    ),
    FieldSpec(
        "bregman_alpha",
        'number, or the strings "inf" / "-inf"',
        "adaptive primal: (0, 1e8]; fixed-k primal: [-1e8, 1e8] except 0, or -inf / inf; "
        "adaptive dual: (1, 1e8]; fixed-k dual: [1, 1e8], or inf (beyond 1e8 the map equals "
        "its inf / -inf limit to within 7e-9)",
        str(DEFAULT_ALPHA),
        "Exponent of the generator phi(x) = x^alpha / (alpha (alpha - 1)). alpha = 1 is the KL "
        "divergence (standard top-k renormalization); larger alpha spreads the mass more evenly "
        "over the kept tokens (inf = water-filling); alpha < 1 concentrates it on the top tokens.",
        ({"type": "number"}, {"type": "string", "enum": ["inf", "-inf"]}),
        (1.5, 2, "inf"),
    ),
    FieldSpec(
        "bregman_lambda",
        "number",
        "[0, inf), finite",
        str(DEFAULT_LAMBDA),
        "Sparsity price per kept token. 0 keeps every token with nonzero probability; larger "
        "values keep fewer tokens. Ignored when bregman_top_k is set.",
        ({"type": "number", "minimum": 0},),
        (0.01,),
    ),
    FieldSpec(
        "bregman_top_k",
        "integer",
        "integer >= 1",
        "absent (adaptive k*)",
        "Fixed support size: generalized top-k (keep the k most likely tokens, renormalize with "
        "the primal or dual alpha map) instead of the adaptive k*.",
        _SIZE_SCHEMA,
        (20,),
    ),
    FieldSpec(
        "bregman_k_max",
        "integer",
        "integer >= 1",
        "absent (no cap)",
        "Upper bound on the support size k* (and on bregman_top_k).",
        _SIZE_SCHEMA,
        (100,),
    ),
)


#: Largest finite |alpha| accepted. Beyond it the alpha maps equal their limits, water-filling
#: (alpha -> inf) and the argmax fill (alpha -> -inf, Proposition 4.1), to within about
#: ln 2 / |alpha| < 7e-9 of every probability (q_i = (p_i^b + c^b)^(1/b) lies between max(p_i, c)
#: and 2^(1/b) max(p_i, c)), below float32 resolution; and every power x^alpha of the cost (eq. (6))
#: under- or overflows float64 for x outside [0.99999, 1.00001]. Use "inf" / "-inf" with
#: bregman_top_k for the limits themselves.
ALPHA_LIMIT = 1e8

_LIMIT_WHY = (
    "|alpha| above 1e8 is refused: there the alpha map equals its limit "
    "(water-filling for inf, the argmax fill for -inf) to within ln 2 / |alpha| < 7e-9 "
    "(below float32 resolution) while its cost terms x^alpha leave float64's range; "
    'use alpha "inf" or "-inf" with bregman_top_k for the limits')


@dataclass(frozen=True)
class AlphaRange:
    """The allowed alpha values: a finite interval and, optionally, infinite alphas."""

    low: float
    high: float
    low_closed: bool
    high_closed: bool
    exclude_zero: bool = False
    infinities: tuple[float, ...] = ()
    why: str = ""

    def contains(self, alpha: float) -> bool:
        if math.isnan(alpha):
            return False
        if math.isinf(alpha):
            return alpha in self.infinities
        if self.exclude_zero and alpha == 0.0:
            return False
        above = alpha >= self.low if self.low_closed else alpha > self.low
        below = alpha <= self.high if self.high_closed else alpha < self.high
        return above and below

    def reason(self, alpha: float) -> str:
        """Why ``alpha`` (outside the range) is refused."""
        if math.isfinite(alpha) and abs(alpha) > ALPHA_LIMIT and \
                self.contains(math.copysign(ALPHA_LIMIT, alpha)):
            return _LIMIT_WHY
        return self.why

    def text(self) -> str:
        left = "[" if self.low_closed else "("
        right = "]" if self.high_closed else ")"
        body = f"{left}{_fmt(self.low)}, {_fmt(self.high)}{right}"
        body += " excluding 0" if self.exclude_zero else ""
        if self.infinities:
            body += ", or " + " / ".join(_fmt(value) for value in self.infinities)
        return body


ALPHA_RANGES: dict[tuple[str, bool], AlphaRange] = {
    ("primal", False): AlphaRange(
        0.0, ALPHA_LIMIT, False, True,
        why="adaptive primal decoding needs alpha > 0 (for alpha <= 0 dropping any token costs "
        "+inf) and a finite alpha (use bregman_top_k for the inf / -inf limits)",
    ),
    ("primal", True): AlphaRange(
        -ALPHA_LIMIT, ALPHA_LIMIT, True, True, exclude_zero=True,
        infinities=(-math.inf, math.inf),
        why="the primal alpha family is defined for every alpha except 0",
    ),
    ("dual", False): AlphaRange(
        1.0, ALPHA_LIMIT, False, True,
        why="adaptive dual decoding needs a dual-valid generator, alpha > 1 (Lemma 4.2 of "
            "arXiv 2505.19371), and a finite alpha",
    ),
    ("dual", True): AlphaRange(
        1.0, ALPHA_LIMIT, True, True, infinities=(math.inf,),
        why="the dual renormalization map is defined for alpha >= 1",
    ),
}


def alpha_range(mode: str, fixed_k: bool) -> AlphaRange:
    """The allowed alpha interval for a decoding mode and for fixed-k vs adaptive selection."""
    return ALPHA_RANGES[(mode, fixed_k)]


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value != 0 and abs(value) >= 1e6:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    return f"{value:g}"


#: Largest accepted support size (bregman_top_k, bregman_k_max): a signed 32-bit integer, so
#: that no request can overflow the engine's index tensors; larger supports are clamped to the
#: vocabulary by the engine anyway.
MAX_SUPPORT_SIZE = 2**31 - 1
#: The fields that are support sizes (attribute: request key), held to a deployment's largest
#: support size by `BregmanParams.within`.
SIZE_FIELDS = {"top_k": "bregman_top_k", "k_max": "bregman_k_max"}

#: The environment variable of a deployment's largest support size (`BregmanParams.within`):
#: read by the server's settings and by the vLLM processor at admission; unset or "none": no
#: bound.
MAX_SUPPORT_ENV = "BREGMAN_MAX_SUPPORT"


def lifts_the_bound(value: Any) -> bool:
    """Whether a largest-support setting says "no bound": None, "none" (any case) or empty."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("", "none"))


def parse_max_support(value: Any, field: str = MAX_SUPPORT_ENV) -> int | None:
    """A largest support size: an integer in [1, `MAX_SUPPORT_SIZE`], or None where the
    setting lifts the bound (`lifts_the_bound`)."""
    return None if lifts_the_bound(value) else parse_support_size(value, field)


@functools.lru_cache(maxsize=8)
def _max_support_of(text: str | None) -> int | None:
    return parse_max_support(text)


def max_support_from_env() -> int | None:
    """`MAX_SUPPORT_ENV` of this process (raises `BregmanParamError` for an invalid value)."""
    return _max_support_of(os.environ.get(MAX_SUPPORT_ENV))


# A plain ASCII decimal number: no "1_000", no non-ASCII digits ("²", "١"), no hex, no "nan".
_NUMBER_TEXT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_INTEGER_TEXT = re.compile(r"\+?\d+", re.ASCII)
_INFINITIES = {"inf": math.inf, "+inf": math.inf, "infinity": math.inf, "+infinity": math.inf,
               "-inf": -math.inf, "-infinity": -math.inf}


def shown(value: Any) -> str:
    """``repr(value)``, cut short: an error message never echoes a huge input."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _plain_number(value: Any, field: str, expected: str) -> float:
    """A float from a JSON number or a plain ASCII decimal string; overflow is an error."""
    if isinstance(value, bool):
        raise BregmanParamError(field, f"must be {expected}, got boolean {value!r}")
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            raise BregmanParamError(
                field, f"must be {expected}, got {shown(value)}, which overflows a double"
            ) from None
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 400 or not _NUMBER_TEXT.fullmatch(text):
            raise BregmanParamError(field, f"must be {expected}, got {shown(value)}")
        number = float(text)
        if math.isinf(number):
            raise BregmanParamError(
                field, f"must be {expected}, got {shown(value)}, which overflows a double")
        return number
    raise BregmanParamError(field, f"must be {expected}, got {type(value).__name__}")


def parse_alpha(value: Any, field: str = "bregman_alpha") -> float:
    """A float from a number or from the strings "inf", "+inf", "-inf", "infinity" (any case).

    Strings must be plain ASCII decimal numbers; integers too large for a double and strings
    that overflow (``"1e999"``) are errors, never silently infinite. A float infinity (JSON
    ``Infinity`` as Python parses it) is the infinite alpha.
    """
    expected = 'a number or "inf" / "-inf"'
    if isinstance(value, str) and value.strip().lower() in _INFINITIES:
        return _INFINITIES[value.strip().lower()]
    number = _plain_number(value, field, expected)
    if math.isnan(number):
        raise BregmanParamError(field, "must be a number, got NaN")
    return number


def parse_lambda(value: Any, field: str = "bregman_lambda") -> float:
    """A finite float >= 0 from a number or a plain ASCII decimal string."""
    number = _plain_number(value, field, "a number >= 0")
    if not math.isfinite(number) or number < 0:
        raise BregmanParamError(field, f"must be a finite number in [0, inf), got {shown(value)}")
    return number


def parse_support_size(value: Any, field: str) -> int | None:
    """An integer in [1, `MAX_SUPPORT_SIZE`], or None. Integral floats (5.0, from JSON) and plain
    ASCII digit strings are accepted."""
    if value is None:
        return None
    allowed = f"an integer in [1, {MAX_SUPPORT_SIZE}]"
    original = value
    if isinstance(value, bool):
        raise BregmanParamError(field, f"must be {allowed}, got {value!r}")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    elif isinstance(value, str):
        text = value.strip()
        if not _INTEGER_TEXT.fullmatch(text):
            raise BregmanParamError(field, f"must be {allowed}, got {shown(value)}")
        digits = text.lstrip("+").lstrip("0") or "0"
        value = int(digits) if len(digits) <= 19 else MAX_SUPPORT_SIZE + 1
    if not isinstance(value, int) or not 1 <= value <= MAX_SUPPORT_SIZE:
        raise BregmanParamError(field, f"must be {allowed}, got {shown(original)}")
    return value


def parse_mode(value: Any, field: str = "bregman_mode", allow_off: bool = True) -> str:
    allowed = MODES if allow_off else DECODING_MODES
    if not isinstance(value, str) or value.strip().lower() not in allowed:
        choices = " | ".join(f'"{m}"' for m in allowed)
        raise BregmanParamError(field, f"must be one of {choices}, got {value!r}")
    return value.strip().lower()


_PARSERS = {"bregman_mode": parse_mode, "bregman_alpha": parse_alpha,
            "bregman_lambda": parse_lambda, "bregman_top_k": parse_support_size,
            "bregman_k_max": parse_support_size}


def parse_field(key: str, value: Any) -> Any:
    """One request field's value (``key`` in `REQUEST_KEYS`), parsed and normalized as
    `BregmanParams` does it: "2", 2 and 2.0 are the same ``bregman_top_k``."""
    return _PARSERS[key](value, key)


def _implied_mode(default_mode: str, present: Mapping[str, Any]) -> str:
    """Sending any bregman field turns decoding on, even when the server default is "off"."""
    if default_mode == "off" and present:
        return DEFAULT_MODE
    return default_mode


def check_alpha(alpha: float, mode: str, fixed_k: bool, field: str = "bregman_alpha") -> None:
    """Raise `BregmanParamError` unless alpha is allowed for this mode and k selection."""
    allowed = alpha_range(mode, fixed_k)
    if not allowed.contains(alpha):
        selection = "fixed-k" if fixed_k else "adaptive"
        raise BregmanParamError(
            field,
            f"must be in {allowed.text()} for {selection} {mode} decoding, got {_fmt(alpha)}; "
            f"{allowed.reason(alpha)}",
        )


@dataclass(frozen=True)
class BregmanParams:
    """Validated per-request Bregman parameters.

    Example:
        >>> BregmanParams.from_mapping({"bregman_alpha": 2, "bregman_lambda": 0.001})
        BregmanParams(mode='primal', alpha=2.0, lam=0.001, top_k=None, k_max=None)
        >>> BregmanParams.from_mapping({"unrelated": 1}) is None
        True
    """

    mode: str = DEFAULT_MODE
    alpha: float = DEFAULT_ALPHA
    lam: float = DEFAULT_LAMBDA
    top_k: int | None = None
    k_max: int | None = None

    def __post_init__(self) -> None:
        """Validate and normalize every field (raises `BregmanParamError`): a `BregmanParams`
        is valid by construction, so what carries one never validates it again."""
        for name, key in FIELD_KEYS.items():
            object.__setattr__(self, name, parse_field(key, getattr(self, name)))
        if self.mode != "off":
            check_alpha(self.alpha, self.mode, fixed_k=self.top_k is not None)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @classmethod
    def from_mapping(
        cls,
        values: Mapping[str, Any] | None,
        defaults: BregmanParams | None = None,
    ) -> BregmanParams | None:
        """Parse the ``bregman_*`` keys of a request (other keys are ignored).

        Returns None when the mapping has no bregman key and there are no defaults (the request
        is left untouched). A key that is present but ``None`` counts as absent. A key meant as
        a Bregman field that is not one (`check_keys`: ``"BREGMAN_TOP_K"``, ``"bregman_topk"``)
        raises `BregmanParamError`.
        """
        values = values or {}
        check_keys(values)
        present = {key: values[key] for key in REQUEST_KEYS if values.get(key) is not None}
        if not present and defaults is None:
            return None
        base = defaults if defaults is not None else cls()
        changes = {name: present[key] for name, key in FIELD_KEYS.items() if key in present}
        changes.setdefault("mode", _implied_mode(base.mode, present))
        return replace(base, **changes)

    def within(self, max_support: int | None) -> BregmanParams:
        """These parameters under a deployment's largest support ``max_support`` (None: no
        limit): a `bregman_top_k` or `bregman_k_max` above it raises `BregmanParamError`, and
        decoding without `bregman_k_max` decodes with ``k_max = max_support`` (for adaptive
        decoding k* = min(k*, k_max), by the k-convexity of Theorem 3.3). What a server
        admits, so that no request's rows cost more than the top ``max_support`` of a row.

        Example:
            >>> BregmanParams(lam=1e-9).within(1024)
            BregmanParams(mode='primal', alpha=1.5, lam=1e-09, top_k=None, k_max=1024)
        """
        if max_support is None:
            return self
        for name, key in SIZE_FIELDS.items():
            value = getattr(self, name)
            if value is not None and value > max_support:
                raise BregmanParamError(
                    key, f"must be an integer in [1, {max_support}] on this server (its largest "
                    f"support size), got {value}")
        return self if self.k_max is not None else replace(self, k_max=max_support)

    def to_request(self) -> dict[str, Any]:
        """The ``bregman_*`` keys for ``vllm_xargs`` / ``SamplingParams.extra_args``.

        Infinite alpha is sent as the string "inf" / "-inf" (JSON has no infinity).
        """
        out = {key: getattr(self, name) for name, key in FIELD_KEYS.items()
               if getattr(self, name) is not None}
        if math.isinf(self.alpha):
            out["bregman_alpha"] = "inf" if self.alpha > 0 else "-inf"
        return out
