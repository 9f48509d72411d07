"""Request bodies as vLLM reads them: when a body is JSON, how it is decoded, and when the
middleware may leave it unread.

vLLM's routes are FastAPI routes. FastAPI reads a body as JSON when the media type of its
Content-Type is ``application/json`` or ``application/*+json`` (`is_json_type` applies FastAPI's
own test), and then calls Starlette's ``Request.json()``: ``json.loads`` on the raw bytes. That
call

* detects the encoding itself (`json.detect_encoding`): UTF-8 with or without a BOM, UTF-16 and
  UTF-32 with or without a BOM, whatever the ``charset`` says;
* reads escapes in keys as in strings: ``"\\u0062regman_top_k"`` is the key ``bregman_top_k``;
* keeps the last of duplicate keys;
* accepts the non-standard constants ``NaN``, ``Infinity`` and ``-Infinity``.

The middleware parses with that same call (`parse_json_body`), so it validates exactly the
object vLLM will use, in any encoding. Nesting is bounded at `MAX_DEPTH` levels, so that a body
the middleware accepts is one vLLM can parse too (its own parse runs deeper in the stack).

`must_parse` is the fast path, the one place the middleware leaves a JSON body unread. It answers
False only when all of these hold:

1. ``json.detect_encoding`` finds UTF-8 (with or without BOM), so the text is the bytes;
2. every byte is ASCII (the BOM aside), and no ``\\uXXXX`` escape stands for a character
   beyond ASCII;
3. the bytes contain neither ``NaN`` nor ``Infinity``, and, once lower-cased with every ``-``
   and ``_`` deleted, no ``bregman``;
4. no ``\\uXXXX`` escape spells a letter of ``bregman`` (either case), ``-`` or ``_`` (only
   ``\\u`` escapes can produce those; ``\\b`` is a backspace);
5. fewer than `MAX_DEPTH` opening brackets, hence fewer levels.

Then ``json.loads`` either fails (vLLM answers 400) or gives an object with no key meant as a
Bregman field at any level (`bregman_vllm.params.is_bregman_key`). By 1-2 every key is ASCII,
which the rule's normalization (NFKC, format characters removed, case folding, dashes as
underscores) only lower-cases: ASCII has no format character, and NFKC and case folding map
an ASCII letter to its lower case and nothing else to a letter; so by 3-4 such a key would put
``bregman`` in the folded bytes. Characters beyond ASCII (a fullwidth ``ｂ``, a zero-width space
or a byte-order mark inside a key) take the full path (2). Neither are there NaN or infinities
(by 1-3: those constants are bare tokens, never escaped), nor depth beyond the bound (5): the
full path would forward the same bytes unchanged, so skipping it changes nothing that vLLM
reads. Server defaults on a route that takes them always need the full path (the middleware's
business, not this module's).
"""

from __future__ import annotations

import email.message
import json
import math
import re
from collections import deque
from typing import Any

from .errors import APIError

#: Deepest JSON nesting accepted (400 above): vLLM's own parse must never run out of stack.
MAX_DEPTH = 256

_JSON = b"application/json"
_FORMS = (b"multipart/form-data", b"application/x-www-form-urlencoded")
_UTF8 = ("utf-8", "utf-8-sig")
# A \\u escape of one of b, r, e, g, m, a, n in either case, "_" or "-" (hex digits in either
# case).
_LETTER_ESCAPE = re.compile(rb"\\u00(?:[46][1257dDeE]|[57]2|5[fF]|2[dD])")
# A \\u escape of a character beyond ASCII (any but \\u0000 to \\u007f).
_WIDE_ESCAPE = re.compile(rb"\\u(?!00[0-7])[0-9a-fA-F]{4}")
_UTF8_BOM = b"\xef\xbb\xbf"


def is_json_type(content_type: bytes | None) -> bool:
    """Whether FastAPI reads a body with this Content-Type as JSON (its test, made fast for the
    common exact value). No Content-Type counts as JSON too: the middleware then reads more than
    vLLM, never less."""
    if content_type is None or content_type == _JSON:
        return True
    message = email.message.Message()
    message["content-type"] = content_type.decode("latin-1")
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def is_form_type(content_type: bytes | None) -> bool:
    return content_type is not None and content_type.lower().lstrip().startswith(_FORMS)


def mentions_bregman(raw: bytes) -> bool:
    """Whether ``raw``, lower-cased (ASCII) with every ``-`` and ``_`` deleted, contains
    ``bregman``: false for bytes that cannot spell a key meant as a Bregman field literally."""
    return b"bregman" in raw.lower().translate(None, b"-_")


def must_parse(raw: bytes) -> bool:
    """False only when the body provably carries no Bregman field, NaN or infinity and no deep
    nesting (the five conditions of the module docstring)."""
    if json.detect_encoding(raw) not in _UTF8:
        return True
    if not raw.removeprefix(_UTF8_BOM).isascii():
        return True
    if b"NaN" in raw or b"Infinity" in raw or mentions_bregman(raw):
        return True
    if b"\\u" in raw and (_LETTER_ESCAPE.search(raw) is not None
                          or _WIDE_ESCAPE.search(raw) is not None):
        return True
    return raw.count(b"[") + raw.count(b"{") >= MAX_DEPTH


# --- parsing -------------------------------------------------------------------------------------

class _Overflow:
    """Stands for a JSON number too large for a double while the body is searched for it."""


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} overflows a double")
    return value


def _constant(name: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


def _too_deep() -> APIError:
    return APIError(400, f"The request body is nested too deeply: at most {MAX_DEPTH} levels of "
                    "JSON arrays and objects.")


def parse_json_body(raw: bytes) -> tuple[dict[str, Any], bool]:
    """The body as vLLM will read it (``json.loads`` on the bytes), and whether it holds
    ``NaN`` / ``Infinity`` tokens.

    Raises an OpenAI-shaped 400 (`APIError`) for anything but a JSON object, for text that is not
    UTF-8/16/32, for JSON nested deeper than `MAX_DEPTH` and for numbers that overflow a double
    (``param`` names where it sits).
    """
    special = False

    def constant(name: str) -> float:
        nonlocal special
        special = True
        return _constant(name)

    try:
        body = json.loads(raw, parse_constant=constant, parse_float=_parse_float)
    except RecursionError:
        raise _too_deep() from None
    except UnicodeDecodeError as exc:
        raise APIError(400, "The request body is not text in UTF-8, UTF-16 or UTF-32: "
                       f"{exc.reason} at byte {exc.start}.") from None
    except ValueError as exc:  # JSONDecodeError, the overflow above
        if "overflows a double" in str(exc):
            marked = json.loads(raw, parse_constant=_constant,
                                parse_float=lambda text: _Overflow() if math.isinf(
                                    float(text)) else float(text))
            raise APIError(400, f"Invalid number: {exc}.",
                           param=find_path(marked, lambda v: isinstance(v, _Overflow))) from None
        raise APIError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    if raw.count(b"[") + raw.count(b"{") >= MAX_DEPTH and _deeper_than(body, MAX_DEPTH):
        raise _too_deep()
    return body, special


def _deeper_than(node: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels deep in ``node``."""
    stack = [(node, 1)]
    while stack:
        value, level = stack.pop()
        if level > limit:
            return True
        for child in (value.values() if isinstance(value, dict) else value):
            if isinstance(child, (dict, list)):
                stack.append((child, level + 1))
    return False


def encode_json_body(body: dict[str, Any]) -> bytes:
    """The body as JSON for vLLM: ASCII (a lone surrogate travels as its escape, as it came),
    and no ``NaN`` / ``Infinity`` left anywhere (400 naming the field)."""
    try:
        return json.dumps(body, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")
    except ValueError:
        raise refuse_special(body) from None


def refuse_special(body: dict[str, Any]) -> APIError:
    """The 400 for a ``NaN`` / ``Infinity`` left in ``body`` (``param`` says where)."""
    param = find_path(body, lambda v: isinstance(v, float) and not math.isfinite(v))
    return APIError(400, f"{param}: NaN and Infinity are not valid JSON values here (only "
                    "bregman_alpha accepts Infinity).", param=param)


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
