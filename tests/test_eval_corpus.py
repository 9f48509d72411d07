"""The vendored data and the open-ended corpora: WikiText-2 detokenization and passages, the
corpus names of `bregman-eval`, and the self-contained repository (nothing read from outside)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from bregman_vllm.evaluation import corpus
from bregman_vllm.evaluation.corpus import (
    CORPORA,
    detokenize_wikitext,
    resolve_corpus,
    wikitext_passages,
)
from bregman_vllm.evaluation.tasks import (
    DEFAULT_CORPUS,
    DEFAULT_FEWSHOT,
    DEFAULT_GSM8K,
    corpus_documents,
    load_passages,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"


@pytest.mark.parametrize(("tokens", "text"), [
    ("a two @-@ part episode", "a two-part episode"),
    ("1 @,@ 000 people , 52 @.@ 9 million", "1,000 people, 52.9 million"),
    ('he said " Wounds " was ( in 2008 ) the best ; then : no !',
     'he said "Wounds" was (in 2008) the best; then: no!'),
    ("Du Fu 's mother , Chang 'an , you don 't", "Du Fu's mother, Chang'an, you don't"),
    ("about $ 10 , or 40 %", "about $10, or 40%"),
    ("the players ' union", "the players' union"),
    ("we were like , ' Yeah , we love this song '", "we were like, 'Yeah, we love this song'"),
    ('" A " and " B "', '"A" and "B"'),
])
def test_detokenize(tokens: str, text: str) -> None:
    assert detokenize_wikitext(tokens) == text


RAW = """
 = Some Article =

 First sentence is clean . Second sentence has an <unk> word . Third is clean and long enough \
to count as words here . Fourth one too .
 The next paragraph continues the run , which spans paragraphs . It ends here .

 = = History = =

 A short clean run .

 = Other <unk> =

 Only <unk> here .
 One " quoted " sentence ( with brackets ) costs $ 5 @,@ 000 .
"""


def test_passages_are_unk_free_sentence_runs() -> None:
    passages = wikitext_passages(RAW, min_words=1)
    texts = [p["text"] for p in passages]
    assert texts == [
        "First sentence is clean.",
        "Third is clean and long enough to count as words here. Fourth one too.\n"
        "The next paragraph continues the run, which spans paragraphs. It ends here.",
        "A short clean run.",
        'One "quoted" sentence (with brackets) costs $5,000.',
    ]
    assert [(p["title"], p["section"]) for p in passages] == [
        ("Some Article", ""), ("Some Article", ""), ("Some Article", "History"), (None, "")]
    assert [p["words"] for p in passages] == [len(t.split()) for t in texts]
    # min_words drops the short ones
    assert [p["text"] for p in wikitext_passages(RAW, min_words=10)] == [texts[1]]


def test_vendored_wikitext_passages() -> None:
    path = CORPORA["wikitext2"]
    assert path == DEFAULT_CORPUS == DATA / "wikitext2" / "passages.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 481
    assert {r["split"] for r in rows} == {"test", "valid"}
    assert "<unk>" not in path.read_text(encoding="utf-8")
    for row in rows:
        text = row["text"]
        assert row["words"] == len(text.split()) >= corpus.MIN_WORDS
        # (The source writes one ellipsis as a ".." token; it keeps its space.)
        assert not re.search(r" [,;:!?)%]| \.(?!\.)|@[-,.]@|\( ", text), text
    assert corpus_documents(path) == [r["text"] for r in rows]


def test_named_corpora() -> None:
    assert resolve_corpus("wikitext2") == DATA / "wikitext2" / "passages.jsonl"
    assert resolve_corpus("tinyshakespeare") == DATA / "tinyshakespeare" / "input.txt"
    assert resolve_corpus("some/file.jsonl") == Path("some/file.jsonl")
    for path in CORPORA.values():
        assert path.is_file()


def test_vendored_files_match_data_readme() -> None:
    readme = (DATA / "README.md").read_text()
    for line in re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, flags=re.MULTILINE):
        digest, name = line
        if (DATA / name).is_file():
            assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name
    for name in ("tinyshakespeare/input.txt", "gsm8k/test.jsonl", "gsm8k/fewshot_train8.jsonl",
                 "wikitext2/passages.jsonl"):
        assert f"  {name}" in readme
    for licence in ("gsm8k/LICENSE", "wikitext2/LICENSE", "tinyshakespeare/LICENSE"):
        assert (DATA / licence).is_file()
    assert DEFAULT_GSM8K == DATA / "gsm8k" / "test.jsonl"
    assert DEFAULT_FEWSHOT == DATA / "gsm8k" / "fewshot_train8.jsonl"
    assert len(DEFAULT_GSM8K.read_text().splitlines()) == 1319
    # No tracked-or-new file is too big for git, and the data stays small.
    sizes = [p.stat().st_size for p in DATA.rglob("*") if p.is_file()]
    assert max(sizes) < 5 * 2**20 and sum(sizes) < 4 * 2**20


def test_nothing_reads_outside_the_repository() -> None:
    """Code, tests, scripts and docs never point at the shared folder next to the checkout (a
    fresh clone has none)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    pattern = re.compile(r"\.\./shared|shared/data|parent / \"shared\"")
    offenders = []
    for name in listed.splitlines():
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".json",
                               ".cfg", ".ini", ""} or not path.is_file() or name.startswith(
                                   "data/"):
            continue
        if path.stat().st_size > 4 * 2**20:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if pattern.search(text) and path != Path(__file__):
            offenders.append(name)
    assert offenders == []


class WordTokenizer:
    """One token per whitespace-separated word (the Tokenizer protocol of the harness)."""

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        prefix = [0] if add_special_tokens else []
        return prefix + [len(word) for word in text.split()]

    async def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join("x" * i for i in ids)


def test_load_passages_min_continuation() -> None:
    path = CORPORA["wikitext2"]
    tokenizer = WordTokenizer()
    full = asyncio.run(load_passages(tokenizer, count=1000, continuation_tokens=40,
                                     corpus=path, prompt_tokens=20, min_continuation=40))
    loose = asyncio.run(load_passages(tokenizer, count=1000, continuation_tokens=40,
                                      corpus=path, prompt_tokens=20))
    words = [json.loads(line)["words"] for line in path.read_text().splitlines()]
    assert len(full) == sum(1 for w in words if w >= 60)
    assert len(loose) == sum(1 for w in words if w >= 36)
    assert all(len(p.human_ids) == 40 for p in full)
    assert all(len(p.prompt_ids) == 21 and p.prompt_ids[0] == 0 for p in full)
    with pytest.raises(ValueError):
        asyncio.run(load_passages(tokenizer, count=1, continuation_tokens=8, corpus=path,
                                  min_continuation=0))
