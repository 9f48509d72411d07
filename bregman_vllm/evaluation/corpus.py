"""The open-ended corpora: WikiText-2 passages (the default) and tinyshakespeare, from ``data/``.

WikiText-2 (Merity et al., 2016; Wikipedia Good and Featured articles, CC BY-SA 3.0) is
distributed word-tokenized: punctuation split off by spaces, ``@-@`` / ``@,@`` / ``@.@`` inside
numbers and compounds, and every word outside its 33k vocabulary replaced by ``<unk>``. The
harness wants ordinary text, so `wikitext_passages` turns the test split into passages:

1. `paragraph_tokens`: each paragraph is split into tokens, each marked "glued" when it attaches
   to the previous one without a space (punctuation, ``'s`` / ``'t`` clitics, closing
   brackets, the second of a pair of straight quotes, both sides of ``@-@``);
2. the tokens are cut into sentences after ``.`` / ``?`` / ``!`` (and a closing quote or
   bracket right after them);
3. a passage is a maximal run of consecutive sentences without ``<unk>`` inside one section of
   one article (it may span paragraphs, joined by a newline), so every passage is contiguous
   human text with no placeholder in it;
4. `detokenize` joins the tokens, and passages shorter than ``min_words`` words are dropped.

``python -m bregman_vllm.evaluation.corpus wikitext2 test.txt valid.txt`` rebuilds
``data/wikitext2/passages.jsonl`` from the tokenized test and validation splits (see
data/README.md for where those files come from and their checksums).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
#: Named corpora for ``bregman-eval --corpus`` (a path works too).
CORPORA: dict[str, Path] = {
    "wikitext2": DATA / "wikitext2" / "passages.jsonl",
    "tinyshakespeare": DATA / "tinyshakespeare" / "input.txt",
}
DEFAULT_CORPUS_NAME = "wikitext2"
UNK = "<unk>"
#: Shorter passages cannot hold a 35-token prompt and a useful continuation.
MIN_WORDS = 50

_JOINERS = {"@-@": "-", "@,@": ",", "@.@": "."}
_NO_SPACE_BEFORE = frozenset({",", ".", ";", ":", "!", "?", ")", "]", "}", "%", "..."})
_NO_SPACE_AFTER = frozenset({"(", "[", "{", "$", "£", "€", "#"})
_CLITIC = re.compile(r"^'[A-Za-z]+$")  # 's, 't, 're, 'll, 'an (Chang 'an): attach to the word
_SENTENCE_END = frozenset({".", "?", "!"})
_CLOSERS = frozenset({'"', ")", "]"})
_HEADING = re.compile(r"((?:=\s*)+)(.*?)((?:\s*=)+)")  # " = Title = ", " = = Section = = "


def resolve_corpus(value: str | Path) -> Path:
    """A corpus name (``wikitext2``, ``tinyshakespeare``) or a path, as a path."""
    if isinstance(value, str) and value in CORPORA:
        return CORPORA[value]
    return Path(value)


def paragraph_tokens(paragraph: str) -> list[tuple[str, bool]]:
    """The tokens of one tokenized paragraph as ``(text, glued)`` pairs (see the module
    docstring); ``@-@`` and friends become ``-`` / ``,`` / ``.`` glued on both sides."""
    out: list[tuple[str, bool]] = []
    glue_next = False
    open_quote = open_single = False
    for token in paragraph.split():
        glued = glue_next
        glue_next = False
        if token in _JOINERS:
            out.append((_JOINERS[token], True))
            glue_next = True
            continue
        if token == '"':
            # Straight quotes alternate: an opening one glues to the next token, a closing one
            # to the previous token.
            if open_quote:
                glued = True
            else:
                glue_next = True
            open_quote = not open_quote
        elif token == "'":
            # A lone apostrophe closes a single-quoted span, marks a plural possessive
            # ("players ' union"), or else opens a single-quoted span.
            previous = out[-1][0] if out else ""
            if open_single or previous[-1:] in ("s", "S"):
                glued = True
                open_single = False
            else:
                glue_next = open_single = True
        elif token in _NO_SPACE_BEFORE or _CLITIC.match(token):
            glued = True
        if token in _NO_SPACE_AFTER:
            glue_next = True
        out.append((token, glued))
    return out


def detokenize(tokens: Sequence[tuple[str, bool]]) -> str:
    """Join ``(text, glued)`` tokens into plain text."""
    parts: list[str] = []
    for index, (token, glued) in enumerate(tokens):
        if index and not glued:
            parts.append(" ")
        parts.append(token)
    return "".join(parts).strip()


def detokenize_wikitext(text: str) -> str:
    """Plain text of a WikiText-tokenized string (one paragraph).

    >>> detokenize_wikitext('a two @-@ part " Wounds " arc ( 2008 ) , 1 @,@ 000 km ; Du Fu \\'s')
    'a two-part "Wounds" arc (2008), 1,000 km; Du Fu\\'s'
    """
    return detokenize(paragraph_tokens(text))


def sentences(tokens: Sequence[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    """Cut a paragraph's tokens after each sentence end (and the quotes or brackets that close
    right after it)."""
    current: list[tuple[str, bool]] = []
    ended = False
    for token in tokens:
        if ended and not (token[1] and token[0] in _CLOSERS):
            yield current
            current = []
            ended = False
        current.append(token)
        if token[0] in _SENTENCE_END:
            ended = True
    if current:
        yield current


def wikitext_passages(raw: str, min_words: int = MIN_WORDS) -> list[dict[str, object]]:
    """Passages of a WikiText file: maximal runs of ``<unk>``-free sentences within one section,
    detokenized; each ``{"text", "title", "section", "words"}`` (a title or section name that
    holds ``<unk>`` is None), in file order."""
    passages: list[dict[str, object]] = []
    title = section = ""
    run: list[str] = []          # detokenized paragraphs (pieces) of the current run
    sentence_buffer: list[tuple[str, bool]] = []

    def close_piece() -> None:
        nonlocal sentence_buffer
        if sentence_buffer:
            run.append(detokenize(sentence_buffer))
            sentence_buffer = []

    def close_run() -> None:
        nonlocal run
        close_piece()
        text = "\n".join(piece for piece in run if piece)
        words = len(text.split())
        if words >= min_words:
            # Headings keep their <unk>s in WikiText; such a name is left out (null).
            passages.append({"text": text, "title": _known(title), "section": _known(section),
                             "words": words})
        run = []

    for line in raw.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        heading = _HEADING.fullmatch(stripped)
        if heading:
            close_run()
            name = detokenize_wikitext(heading.group(2))
            if heading.group(1).count("=") == 1:
                title, section = name, ""
            else:
                section = name
            continue
        for sentence in sentences(paragraph_tokens(stripped)):
            if any(token == UNK for token, _ in sentence):
                close_run()
            else:
                sentence_buffer.extend(sentence)
        close_piece()  # a paragraph ends: the run goes on, on a new line
    close_run()
    return passages


def _known(name: str) -> str | None:
    return None if UNK in name else name


def write_jsonl(rows: Sequence[dict[str, object]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the open-ended corpora in data/.")
    sub = parser.add_subparsers(dest="command", required=True)
    wiki = sub.add_parser("wikitext2", help="tokenized WikiText-2 splits -> detokenized passages")
    wiki.add_argument("raw", type=Path, nargs="+",
                      help="tokenized WikiText-2 splits (test.txt, valid.txt); the file stem "
                      "names the split")
    wiki.add_argument("--out", type=Path, default=CORPORA["wikitext2"])
    wiki.add_argument("--min-words", type=int, default=MIN_WORDS)
    args = parser.parse_args(argv)
    rows: list[dict[str, object]] = []
    for path in args.raw:
        for row in wikitext_passages(path.read_text(encoding="utf-8"), min_words=args.min_words):
            rows.append({**row, "split": path.stem})
    write_jsonl(rows, args.out)
    words = sum(int(r["words"]) for r in rows)  # type: ignore[call-overload]
    print(f"wrote {len(rows)} passages ({words} words) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
