"""Run an evaluation: every configuration on every task, against one endpoint.

Per task the run has three phases, each with a progress bar:

A. every requested configuration samples every example (requests interleaved across
   configurations, at most ``concurrency`` in flight, so the server batches them); open-ended
   continuations are scored by the base model as soon as they are sampled;
B. k* of every decoding step of the adaptive Bregman configurations (`kstar`);
C. the matched top-k baselines, k = round(mean k*) of each adaptive configuration on that task
   (the paper's matched comparison), unless that top-k configuration already ran.

The result is one JSON-able dict (`run`); `report` turns it into markdown tables.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .client import EndpointClient, LocalTokenizer, Tokenizer, gather_bounded
from .configs import DecodingConfig, matched_baseline
from .corpus import ROOT
from .kstar import LocalKStar, agreement, common_prefix_length
from .metrics import (
    BOOTSTRAP_RESAMPLES,
    bootstrap_mean,
    bootstrap_mean_diff,
    kstar_stats,
    matched_top_k,
)
from .tasks import (
    DEFAULT_CORPUS,
    DEFAULT_FEWSHOT,
    DEFAULT_GSM8K,
    MIN_CONTINUATION,
    PROMPT_TOKENS,
    GSM8KSample,
    OpenSample,
    Passage,
    Problem,
    gsm8k_sample,
    load_passages,
    load_problems,
    open_sample,
    score_passages,
)

logger = logging.getLogger(__name__)

KSTAR_SOURCES = ("auto", "off", "local", "logprobs", "both")
# Below this, reusing the key/value cache of the prompts' common prefix is not worth a copy.
_MIN_SHARED_PREFIX = 64


@dataclass
class RunOptions:
    """Everything a run depends on (recorded in the result's ``meta``)."""

    endpoint: str
    configs: list[DecodingConfig]
    model: str | None = None
    api_key: str | None = None
    ours: bool = False
    tasks: tuple[str, ...] = ("open", "gsm8k")
    matched: bool = True
    passages: int = 32
    max_tokens: int = 256
    prompt_tokens: int = PROMPT_TOKENS
    corpus: Path = DEFAULT_CORPUS
    corpus_field: str = "text"
    min_continuation: int = MIN_CONTINUATION
    gsm8k_path: Path = DEFAULT_GSM8K
    fewshot_path: Path = DEFAULT_FEWSHOT
    limit: int | None = 50
    gsm8k_max_tokens: int = 256
    concurrency: int = 8
    seed: int = 0
    request_seeds: bool = True
    kstar: str = "auto"
    model_dir: str | None = None
    kstar_dtype: str = "auto"
    kstar_logprobs: int = 64
    local_tokenizer: bool = False
    resamples: int = BOOTSTRAP_RESAMPLES
    progress: bool = True
    timeout: float = 900.0
    extra: dict[str, Any] = field(default_factory=dict)

    def kstar_sources(self) -> tuple[bool, bool]:
        """(local, logprobs): which k* sources this run uses."""
        source = self.kstar
        if source == "auto":
            source = "local" if self.model_dir else "off"
        if source in ("local", "both") and not self.model_dir:
            raise ValueError("--kstar local/both needs --model-dir (the model's weights)")
        return source in ("local", "both"), source in ("logprobs", "both")

    def meta(self) -> dict[str, Any]:
        local, logprobs = self.kstar_sources()
        return {
            "endpoint": self.endpoint, "model": self.model, "ours": self.ours,
            "tasks": list(self.tasks), "matched_topk": self.matched, "seed": self.seed,
            "request_seeds": self.request_seeds,
            "concurrency": self.concurrency, "bootstrap_resamples": self.resamples,
            "open": {"passages": self.passages, "prompt_tokens": self.prompt_tokens,
                     "max_tokens": self.max_tokens, "corpus": _short_path(self.corpus),
                     "corpus_field": self.corpus_field,
                     "min_continuation": self.min_continuation},
            "gsm8k": {"limit": self.limit, "max_tokens": self.gsm8k_max_tokens,
                      "shots": 8, "test": _short_path(self.gsm8k_path),
                      "fewshot": _short_path(self.fewshot_path)},
            "kstar": {"local": local, "logprobs": logprobs,
                      "model_dir": self.model_dir, "dtype": self.kstar_dtype,
                      "logprobs_requested": self.kstar_logprobs if logprobs else None},
            **self.extra,
        }


def _short_path(path: Path) -> str:
    """Paths inside the repository are recorded relative to it (``data/...``)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


class _LineWriter:
    """A file for tqdm that ends every refresh with a newline: in a log file (no terminal) each
    update is then one readable line with the rate and the ETA instead of carriage returns."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A progress bar with rate and ETA on stderr; without a terminal, one line every 30 s."""
    import sys

    from tqdm.auto import tqdm

    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit="req", disable=not enabled, dynamic_ncols=True)
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, ascii=True,
                file=_LineWriter(sys.stderr), mininterval=30.0, ncols=100)


class _KStar:
    """Computes and summarizes k* for the adaptive configurations of a run."""

    def __init__(self, options: RunOptions) -> None:
        self.local_on, self.logprobs_on = options.kstar_sources()
        self.options = options
        self._local: LocalKStar | None = None

    def request_logprobs(self, config: DecodingConfig) -> int | None:
        """Top-N logprobs to ask for (N = k_max + 1 when capped: a count of k_max + 1 proves
        the server is not returning processed logprobs)."""
        if not (self.logprobs_on and config.adaptive):
            return None
        n = self.options.kstar_logprobs
        return min(n, config.k_max + 1) if config.k_max is not None else n

    @property
    def enabled(self) -> bool:
        return self.local_on or self.logprobs_on

    def local(self) -> LocalKStar:
        if self._local is None:
            assert self.options.model_dir is not None
            dtype = self.options.kstar_dtype
            if dtype == "auto":
                dtype = _checkpoint_dtype(self.options.model_dir)
            if not self.options.progress:
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
            self._local = LocalKStar(self.options.model_dir, dtype=dtype)
        return self._local

    def stats(self, config: DecodingConfig, prompts: Sequence[list[int]],
              samples: Sequence[Any], desc: str) -> dict[str, Any] | None:
        """k* statistics of one adaptive configuration (None when k* is off)."""
        if not (config.adaptive and self.enabled):
            return None
        out: dict[str, Any] = {}
        reported: list[int] | None = None
        if self.logprobs_on:
            n = self.request_logprobs(config)
            reported = [k for s in samples for k in (s.support_sizes or [])]
            if config.k_max is not None and any(k > config.k_max for k in reported):
                raise RuntimeError(
                    "k* from logprobs exceeds k_max: the server does not return processed "
                    "logprobs; start vLLM with --logprobs-mode processed_logprobs "
                    f"--max-logprobs {n}, or use --kstar local")
            if reported:
                out = kstar_stats(reported).as_dict()
                out["source"] = "logprobs"
                out["saturated_steps"] = sum(1 for k in reported if k >= (n or 0)) \
                    if config.k_max is None else 0
        if self.local_on:
            model = self.local()
            per_sample = []
            shared = common_prefix_length(prompts)
            shared = shared if shared >= _MIN_SHARED_PREFIX else 0
            bar = _progress(len(samples), desc, self.options.progress)
            for prompt, sample in zip(prompts, samples, strict=True):
                per_sample.append(model.support_sizes(prompt, sample.sampled_ids, config,
                                                      prefix_len=shared))
                bar.update(1)
            bar.close()
            local = [k for sizes in per_sample for k in sizes]
            if local:
                local_stats = kstar_stats(local).as_dict()
                local_stats["source"] = "local"
                if reported is not None:
                    out["local"] = local_stats
                    paired = [(a, b) for s, sizes in zip(samples, per_sample, strict=True)
                              for a, b in zip(s.support_sizes or [], sizes, strict=False)]
                    out["agreement_with_local"] = agreement([a for a, _ in paired],
                                                            [b for _, b in paired])
                else:
                    out = local_stats
        return out or None


def _checkpoint_dtype(model_dir: str) -> str:
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


# ----------------------------------------------------------------------------- rows


def _estimate(value: Any) -> dict[str, Any]:
    out = value.as_dict()
    for key in ("value", "std"):
        if isinstance(out[key], float) and not math.isfinite(out[key]):
            out[key] = None
    return out


def open_row(config: DecodingConfig, passages: Sequence[Passage], samples: Sequence[OpenSample],
             kstar: dict[str, Any] | None, resamples: int, seed: int) -> dict[str, Any]:
    """One open-ended result row: perplexity / repetition of the generations and their gaps to
    the human continuations, paired by prompt (prompts with an empty generation have no
    perplexity and leave the perplexity columns)."""
    pairs = [(p.human_ppl, s.ppl) for p, s in zip(passages, samples, strict=True)
             if s.ppl is not None]
    human_ppl = [h for h, _ in pairs]
    gen_ppl = [g for _, g in pairs]
    rep_gen = [float(s.rep) for s in samples]
    rep_human = [float(p.human_rep) for p in passages]
    lengths = [len(s.token_ids) for s in samples]
    return {
        "config": config.label,
        "ppl": _estimate(bootstrap_mean(gen_ppl, resamples=resamples, seed=seed)),
        "ppl_gap": _estimate(bootstrap_mean_diff(human_ppl, gen_ppl, resamples=resamples,
                                                 seed=seed)),
        "rep": _estimate(bootstrap_mean(rep_gen, resamples=resamples, seed=seed)),
        "rep_gap": _estimate(bootstrap_mean_diff(rep_gen, rep_human, resamples=resamples,
                                                 seed=seed)),
        "mean_length": sum(lengths) / len(lengths) if lengths else None,
        "eos_fraction": sum(1 for s in samples if len(s.sampled_ids) > len(s.token_ids))
        / max(1, len(samples)),
        "empty": sum(1 for s in samples if not s.token_ids),
        "kstar": kstar,
    }


def per_prompt(passages: Sequence[Passage], samples: dict[str, list[OpenSample]],
               ) -> dict[str, Any]:
    """The per-prompt values behind the open-ended rows (paired by prompt), so that any paired
    statistic (e.g. the temperature sweep's differences of gaps) can be bootstrapped later:
    the human continuation's perplexity and rep, and each configuration's (ppl is None for an
    empty generation)."""
    return {
        "human_ppl": [p.human_ppl for p in passages],
        "human_rep": [int(p.human_rep) for p in passages],
        "configs": {label: {"ppl": [s.ppl for s in rows], "rep": [int(s.rep) for s in rows]}
                    for label, rows in samples.items()},
    }


def gsm8k_row(config: DecodingConfig, samples: Sequence[GSM8KSample],
              kstar: dict[str, Any] | None, resamples: int, seed: int) -> dict[str, Any]:
    """One GSM8K result row: accuracy in percent with its bootstrap standard deviation."""
    correct = [100.0 * s.correct for s in samples]
    lengths = [len(s.token_ids) for s in samples]
    return {
        "config": config.label,
        "accuracy": _estimate(bootstrap_mean(correct, resamples=resamples, seed=seed)),
        "mean_length": sum(lengths) / len(lengths) if lengths else None,
        "kstar": kstar,
    }


# ----------------------------------------------------------------------------- phases


@dataclass
class _TaskRun:
    """What a task needs to be run generically over configurations."""

    name: str
    examples: list[Any]
    prompts: list[list[int]]
    sample: Callable[[DecodingConfig, Any, int | None], Any]
    row: Callable[[DecodingConfig, list[Any], dict[str, Any] | None], dict[str, Any]]


async def _sample_all(task: _TaskRun, configs: Sequence[DecodingConfig], kstar: _KStar,
                      desc: str, progress: bool) -> dict[str, list[Any]]:
    """Every (configuration, example), interleaved so that concurrent requests mix configs."""
    jobs = [(config, example) for example in task.examples for config in configs]
    bar = _progress(len(jobs), desc, progress)
    try:
        results = await gather_bounded(
            [task.sample(c, e, kstar.request_logprobs(c)) for c, e in jobs], bar)
    finally:
        bar.close()
    out: dict[str, list[Any]] = {c.label: [] for c in configs}
    for (config, _), result in zip(jobs, results, strict=True):
        out[config.label].append(result)
    return out


async def _run_task(task: _TaskRun, configs: list[DecodingConfig], options: RunOptions,
                    kstar: _KStar, all_configs: dict[str, DecodingConfig],
                    samples_log: list[dict[str, Any]]) -> dict[str, Any]:
    started = time.perf_counter()
    mine = [c for c in configs if c.runs_on(task.name)]
    samples = await _sample_all(task, mine, kstar, f"{task.name}: sample", options.progress)
    stats: dict[str, dict[str, Any] | None] = {}
    for config in mine:
        stats[config.label] = await asyncio.to_thread(
            kstar.stats, config, task.prompts, samples[config.label],
            f"{task.name}: k* {config.label}")
    matched: dict[str, str] = {}
    if options.matched:
        extra: list[DecodingConfig] = []
        known = {c.label for c in mine}
        for config in mine:
            ks = stats.get(config.label)
            if not config.adaptive or not ks:
                continue
            baseline = matched_baseline(config, matched_top_k(ks["mean"]), task.name)
            matched[config.label] = baseline.label
            if baseline.label not in known:
                known.add(baseline.label)
                extra.append(baseline)
                same = all_configs.get(baseline.label)
                if same is None:
                    all_configs[baseline.label] = baseline
                elif same.tasks is not None:  # e.g. a grid top-k that ran on another task
                    all_configs[baseline.label] = replace(same, tasks=(*same.tasks, task.name))
        if extra:
            samples.update(await _sample_all(task, extra, kstar, f"{task.name}: matched top-k",
                                             options.progress))
            mine += extra
    rows = [task.row(c, samples[c.label], stats.get(c.label)) for c in mine]
    for config in mine:
        for example, sample in zip(task.examples, samples[config.label], strict=True):
            samples_log.append(_sample_record(task.name, config, example, sample))
    return {"results": rows, "matched": matched, "wall_s": time.perf_counter() - started,
            "generated_tokens": sum(len(s.token_ids) for v in samples.values() for s in v),
            "samples": samples}


def _sample_record(task: str, config: DecodingConfig, example: Any, sample: Any,
                   ) -> dict[str, Any]:
    record: dict[str, Any] = {"task": task, "config": config.label, "index": example.index,
                              "text": sample.text, "tokens": len(sample.token_ids),
                              "finish_reason": sample.finish_reason}
    if isinstance(sample, OpenSample):
        record.update(ppl=sample.ppl, rep=sample.rep)
    else:
        record.update(correct=sample.correct, target=str(example.target))
    if sample.support_sizes:
        record["kstar"] = sample.support_sizes
    return record


async def run(options: RunOptions) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the evaluation; returns (result, per-sample records)."""
    started = time.time()
    t0 = time.perf_counter()
    kstar = _KStar(options)
    all_configs = {c.label: c for c in options.configs}
    if len(all_configs) != len(options.configs):
        raise ValueError("duplicate configurations")
    samples_log: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    async with EndpointClient(options.endpoint, model=options.model, api_key=options.api_key,
                              concurrency=options.concurrency, ours=options.ours,
                              send_seeds=options.request_seeds,
                              timeout=options.timeout) as client:
        options.model = client.model
        tokenizer: Tokenizer = client
        if options.local_tokenizer:
            if not options.model_dir:
                raise ValueError("--local-tokenizer needs --model-dir")
            tokenizer = LocalTokenizer(options.model_dir)
        if "open" in options.tasks:
            result["open"] = await _open_task(client, tokenizer, options, kstar, all_configs,
                                              samples_log)
        if "gsm8k" in options.tasks:
            result["gsm8k"] = await _gsm8k_task(client, tokenizer, options, kstar, all_configs,
                                                samples_log)
    meta = options.meta()
    meta.update(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                wall_s=round(time.perf_counter() - t0, 1))
    ordered = list(all_configs.values())
    return {"meta": meta, "configs": [c.as_dict() for c in ordered], **result}, samples_log


async def _open_task(client: EndpointClient, tokenizer: Tokenizer, options: RunOptions,
                     kstar: _KStar, all_configs: dict[str, DecodingConfig],
                     samples_log: list[dict[str, Any]]) -> dict[str, Any]:
    passages = await load_passages(
        tokenizer, count=options.passages, continuation_tokens=options.max_tokens,
        corpus=options.corpus, field_name=options.corpus_field,
        prompt_tokens=options.prompt_tokens, seed=options.seed,
        min_continuation=options.min_continuation)
    if len(passages) < options.passages:
        logger.warning("the corpus has only %d documents with %d + %d tokens (asked for %d)",
                       len(passages), options.prompt_tokens, options.min_continuation,
                       options.passages)
    bar = _progress(len(passages), "open: score human text", options.progress)
    try:
        await score_passages(client, passages, bar)
    finally:
        bar.close()

    async def sample(config: DecodingConfig, passage: Passage, logprobs: int | None) -> Any:
        return await open_sample(client, passage, config.request_fields(),
                                 temperature=config.temperature, max_tokens=options.max_tokens,
                                 seed=options.seed, support_logprobs=logprobs,
                                 tokenizer=tokenizer)

    def row(config: DecodingConfig, samples: list[Any], ks: dict[str, Any] | None) -> Any:
        return open_row(config, passages, samples, ks, options.resamples, options.seed)

    task = _TaskRun("open", passages, [p.prompt_ids for p in passages], sample, row)
    out = await _run_task(task, options.configs, options, kstar, all_configs, samples_log)
    human_ppl = [p.human_ppl for p in passages]
    human_rep = [float(p.human_rep) for p in passages]
    out["passages"] = len(passages)
    out["human"] = {
        "ppl": _estimate(bootstrap_mean(human_ppl, resamples=options.resamples,
                                        seed=options.seed)),
        "rep": _estimate(bootstrap_mean(human_rep, resamples=options.resamples,
                                        seed=options.seed)),
        "mean_length": sum(len(p.human_ids) for p in passages) / max(1, len(passages)),
    }
    out["per_prompt"] = per_prompt(passages, out.pop("samples"))
    return out


async def _gsm8k_task(client: EndpointClient, tokenizer: Tokenizer, options: RunOptions,
                      kstar: _KStar, all_configs: dict[str, DecodingConfig],
                      samples_log: list[dict[str, Any]]) -> dict[str, Any]:
    problems = await load_problems(tokenizer, limit=options.limit, path=options.gsm8k_path,
                                   fewshot=options.fewshot_path)

    async def sample(config: DecodingConfig, problem: Problem, logprobs: int | None) -> Any:
        return await gsm8k_sample(client, problem, config.request_fields(),
                                  temperature=config.temperature,
                                  max_tokens=options.gsm8k_max_tokens, seed=options.seed,
                                  support_logprobs=logprobs, tokenizer=tokenizer)

    def row(config: DecodingConfig, samples: list[Any], ks: dict[str, Any] | None) -> Any:
        return gsm8k_row(config, samples, ks, options.resamples, options.seed)

    task = _TaskRun("gsm8k", problems, [p.prompt_ids for p in problems], sample, row)
    out = await _run_task(task, options.configs, options, kstar, all_configs, samples_log)
    del out["samples"]
    out["problems"] = len(problems)
    out["mean_prompt_tokens"] = sum(len(p.prompt_ids) for p in problems) / max(1, len(problems))
    return out
