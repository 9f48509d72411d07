"""The paper's two benchmarks (arXiv 2505.19371, Section 5) against an OpenAI-compatible endpoint.

Open-ended generation
    Prompts are the first ``prompt_tokens`` (35) tokens of human-written documents; the model
    continues each for up to ``max_tokens`` tokens (256 in the paper). Each continuation, human
    and generated, is scored by the base model through the endpoint (prefill-only requests), giving
    ppl(Y) = p_base(Y | X)^(-1/|Y|), and checked for rep(Y). The default corpus is WikiText-2
    (`corpus`: detokenized passages without ``<unk>``, modern encyclopedic English standing in
    for the paper's WebText); tinyshakespeare (documents of consecutive speeches) or any jsonl
    corpus (one document per line, a text field) can be given instead.

GSM8K
    8-shot chain of thought (the exemplars of ``fewshot_train8.jsonl``, in the
    "Question: ... / Answer: ... #### <n>" format of their answers), exact match of the final
    number.

Every request carries a seed derived from (run seed, task, example), the same for every
configuration, so reruns reproduce and configurations see common random numbers.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from .client import EndpointClient, Generation, Tokenizer
from .corpus import CORPORA, DATA, DEFAULT_CORPUS_NAME
from .metrics import exact_match, gsm8k_target, has_repetition, perplexity

DEFAULT_CORPUS = CORPORA[DEFAULT_CORPUS_NAME]
DEFAULT_GSM8K = DATA / "gsm8k" / "test.jsonl"
DEFAULT_FEWSHOT = DATA / "gsm8k" / "fewshot_train8.jsonl"
#: Documents must hold at least this many tokens after the prompt (``min_continuation``).
MIN_CONTINUATION = 16

PROMPT_TOKENS = 35
GSM8K_STOP = ("Question:", "\n\n")
_TASK_SALT = {"open": 1, "gsm8k": 2}


def request_seed(seed: int, task: str, index: int) -> int:
    """The seed of one example's request: the same for every configuration."""
    return (seed * 1_000_003 + _TASK_SALT[task] * 100_003 + index) % (2**31 - 1)


# ----------------------------------------------------------------------------- open-ended


@dataclass
class Passage:
    """One open-ended example: a prompt and the human continuation, as token ids."""

    index: int
    prompt_ids: list[int]
    human_ids: list[int]
    human_logprobs: list[float] = field(default_factory=list)

    @property
    def human_ppl(self) -> float:
        return perplexity(self.human_logprobs)

    @property
    def human_rep(self) -> bool:
        return has_repetition(self.human_ids)


def corpus_documents(path: Path, field_name: str = "text", min_chars: int = 2000) -> list[str]:
    """The documents of a corpus.

    ``.jsonl``: one document per line (its ``field_name``). Plain text: blocks separated by blank
    lines (speeches, for tinyshakespeare), consecutive blocks joined until a document has at
    least ``min_chars`` characters, so that each holds a prompt and a full continuation.
    """
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        docs = []
        for line in text.splitlines():
            if line.strip():
                value = json.loads(line).get(field_name)
                if isinstance(value, str) and value.strip():
                    docs.append(value)
        return docs
    blocks = [b.strip() for b in re.split(r"\n\s*\n", text) if b.strip()]
    docs, current = [], ""
    for block in blocks:
        current = f"{current}\n\n{block}" if current else block
        if len(current) >= min_chars:
            docs.append(current)
            current = ""
    return docs


async def load_passages(
    tokenizer: Tokenizer,
    *,
    count: int,
    continuation_tokens: int,
    corpus: Path = DEFAULT_CORPUS,
    field_name: str = "text",
    prompt_tokens: int = PROMPT_TOKENS,
    seed: int = 0,
    min_continuation: int = MIN_CONTINUATION,
) -> list[Passage]:
    """``count`` documents drawn at random (seeded) from the corpus, each tokenized and split
    into ``prompt_tokens`` prompt tokens and up to ``continuation_tokens`` human tokens.

    The prompt starts with the tokenizer's own special prefix (BOS, when it adds one) and the
    split happens on the tokenization of the whole document, so the human continuation is exactly
    what follows the prompt. Documents with fewer than ``min_continuation`` tokens after the
    prompt are skipped (``min_continuation = continuation_tokens``: every human continuation has
    the full length). Fewer than ``count`` passages come back when the corpus runs out.
    """
    if min_continuation < 1:
        raise ValueError("min_continuation must be >= 1")
    docs = corpus_documents(corpus, field_name,
                            min_chars=max(400, 8 * (prompt_tokens + continuation_tokens)))
    if not docs:
        raise ValueError(f"no documents in {corpus}")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    prefix = await tokenizer.tokenize("", add_special_tokens=True)
    passages: list[Passage] = []
    for doc_index in order:
        if len(passages) == count:
            break
        ids = await tokenizer.tokenize(docs[doc_index], add_special_tokens=False)
        if len(ids) < prompt_tokens + min_continuation:
            continue
        passages.append(Passage(len(passages), prefix + ids[:prompt_tokens],
                                ids[prompt_tokens:prompt_tokens + continuation_tokens]))
    return passages


@dataclass
class OpenSample:
    """One generated continuation and its metrics.

    ``token_ids`` is Y (without a final EOS), scored and checked for repetition;
    ``sampled_ids`` is every sampled token (EOS included), the decoding steps whose k* count.
    """

    index: int
    token_ids: list[int]
    sampled_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float]
    support_sizes: list[int] | None = None

    @property
    def ppl(self) -> float | None:
        return perplexity(self.logprobs) if self.logprobs else None

    @property
    def rep(self) -> bool:
        return has_repetition(self.token_ids)


def strip_eos(generation: Generation) -> list[int]:
    """The continuation Y without its final end-of-sequence token.

    vLLM returns the EOS token in ``token_ids`` (its text is empty) with ``finish_reason ==
    "stop"`` and no ``stop_reason``; the human continuation, a cut of a longer document, has no
    EOS, so Y is compared without it. (Open-ended requests use no stop strings.)
    """
    ids = list(generation.token_ids)
    if ids and generation.finish_reason == "stop" and generation.stop_reason is None:
        ids.pop()
    return ids


async def score_passages(client: EndpointClient, passages: Sequence[Passage],
                         progress: Any | None = None) -> None:
    """Fill each passage's human log-probabilities (one prefill request per passage)."""
    from .client import gather_bounded

    results = await gather_bounded(
        [client.score(p.prompt_ids, p.human_ids) for p in passages], progress)
    for passage, logprobs in zip(passages, results, strict=True):
        passage.human_logprobs = logprobs


async def open_sample(
    client: EndpointClient,
    passage: Passage,
    fields: dict[str, Any],
    *,
    temperature: float,
    max_tokens: int,
    seed: int,
    support_logprobs: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> OpenSample:
    """Generate one continuation, then score it with the base model."""
    generation = await client.generate(
        passage.prompt_ids, max_tokens=max_tokens, temperature=temperature,
        seed=request_seed(seed, "open", passage.index), fields=fields,
        support_logprobs=support_logprobs, tokenizer=tokenizer)
    ids = strip_eos(generation)
    logprobs = await client.score(passage.prompt_ids, ids) if ids else []
    return OpenSample(passage.index, ids, generation.token_ids, generation.text,
                      generation.finish_reason, logprobs, generation.support_sizes)


# ----------------------------------------------------------------------------- GSM8K


@dataclass
class Problem:
    """One GSM8K test problem with its 8-shot prompt."""

    index: int
    question: str
    target: Decimal
    prompt_ids: list[int] = field(default_factory=list)


@dataclass
class GSM8KSample:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    correct: bool
    support_sizes: list[int] | None = None

    @property
    def sampled_ids(self) -> list[int]:
        """Every sampled token (a stop string's token included): the decoding steps."""
        return self.token_ids


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def fewshot_prompt(exemplars: Sequence[dict[str, Any]], question: str) -> str:
    """The 8-shot chain-of-thought prompt: worked exemplars, then the question."""
    shots = "".join(f"Question: {e['question']}\nAnswer: {e['answer']}\n\n" for e in exemplars)
    return f"{shots}Question: {question}\nAnswer:"


async def load_problems(
    tokenizer: Tokenizer,
    *,
    limit: int | None,
    path: Path = DEFAULT_GSM8K,
    fewshot: Path = DEFAULT_FEWSHOT,
) -> list[Problem]:
    """The first ``limit`` test problems (file order, as usual for GSM8K slices), tokenized."""
    rows = read_jsonl(path)
    if limit is not None:
        rows = rows[:limit]
    exemplars = read_jsonl(fewshot)
    problems = []
    for index, row in enumerate(rows):
        text = fewshot_prompt(exemplars, row["question"])
        ids = await tokenizer.tokenize(text, add_special_tokens=True)
        problems.append(Problem(index, row["question"], gsm8k_target(row["answer"]), ids))
    return problems


async def gsm8k_sample(
    client: EndpointClient,
    problem: Problem,
    fields: dict[str, Any],
    *,
    temperature: float,
    max_tokens: int,
    seed: int,
    support_logprobs: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> GSM8KSample:
    generation = await client.generate(
        problem.prompt_ids, max_tokens=max_tokens, temperature=temperature,
        seed=request_seed(seed, "gsm8k", problem.index), fields=fields, stop=GSM8K_STOP,
        support_logprobs=support_logprobs, tokenizer=tokenizer)
    return GSM8KSample(problem.index, generation.token_ids, generation.text,
                       generation.finish_reason, exact_match(generation.text, problem.target),
                       generation.support_sizes)
