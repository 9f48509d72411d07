"""``bregman-eval``: measure Bregman decoding against any OpenAI-compatible endpoint.

Subcommands::

    bregman-eval run  --endpoint URL [--config SPEC ...] [--grid-k 5,10,20 --grid-alpha 1.5,2]
                      [--tasks open,gsm8k] [--limit N] [--passages N] [--max-tokens N]
                      [--model-dir DIR] [--kstar auto|off|local|logprobs|both] [--out DIR]
    bregman-eval temperature-sweep --endpoint URL [--temperatures 0.7,1,1.5,2]
                      [--alphas 1.5,2] [--lambdas 0.01,1e-4] [--k-max 50] [--passages N]
                      [--max-tokens N] [--corpus wikitext2|tinyshakespeare|FILE] [--out DIR]
    bregman-eval plot [--result DIR/results.json] [--theory] [--out DIR]
    bregman-eval report DIR/results.json

``run`` writes results.json (every number with its configuration), results.md (tables in the
paper's layout), samples.jsonl (every generation) and the result figures into ``--out``.
Configuration specs are described in `bregman_vllm.evaluation.configs`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from .configs import DEFAULT_K_MAX, TASKS, DecodingConfig, grid_configs, parse_config
from .corpus import CORPORA, DEFAULT_CORPUS_NAME, resolve_corpus
from .runner import KSTAR_SOURCES, RunOptions
from .sweep import analyze, sweep_configs
from .tasks import (
    DEFAULT_CORPUS,
    DEFAULT_FEWSHOT,
    DEFAULT_GSM8K,
    MIN_CONTINUATION,
    PROMPT_TOKENS,
)

DEFAULT_CONFIGS = ("primal:1.5:0.01", "primal:2:0.01", "dual:1.5:0.01")


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _add_endpoint(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("endpoint")
    where.add_argument("--endpoint", default="http://127.0.0.1:8000/v1",
                       help="OpenAI-compatible base URL (default %(default)s)")
    where.add_argument("--model", help="model name (default: the first one the endpoint lists)")
    where.add_argument("--api-key", help="bearer key for the endpoint")
    where.add_argument("--ours", action="store_true",
                       help="the endpoint is our server: send bregman_* fields at the top level "
                       "(default: inside vllm_xargs, which vLLM's server and ours both read)")
    where.add_argument("--concurrency", type=int, default=8,
                       help="requests in flight (default %(default)s)")
    where.add_argument("--timeout", type=float, default=900.0, help="seconds per request")


def _add_open_task(parser: argparse.ArgumentParser, passages: int, max_tokens: int,
                   min_continuation: int) -> argparse._ArgumentGroup:
    tasks = parser.add_argument_group("open-ended task")
    tasks.add_argument("--passages", type=int, default=passages,
                       help="open: number of prompts (default %(default)s)")
    tasks.add_argument("--max-tokens", type=int, default=max_tokens,
                       help="open: continuation length, human and generated (paper: 256; "
                       "default %(default)s)")
    tasks.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                       help="open: prompt length in tokens (paper: 35)")
    tasks.add_argument("--corpus", type=resolve_corpus, default=DEFAULT_CORPUS,
                       help="open: a corpus name (" + ", ".join(CORPORA) + "; default "
                       f"{DEFAULT_CORPUS_NAME}) or a .txt (blank-line separated blocks) / .jsonl "
                       "(one document per line) file")
    tasks.add_argument("--corpus-field", default="text", help="open: the jsonl text field")
    default = "the --max-tokens value" if min_continuation < 0 else str(min_continuation)
    tasks.add_argument("--min-continuation", type=int, default=min_continuation,
                       help="open: skip documents with fewer tokens than this after the prompt "
                       f"(default {default}; the --max-tokens value gives every human "
                       "continuation the full length)")
    return tasks


def _add_kstar(parser: argparse.ArgumentParser, default: str) -> None:
    adapt = parser.add_argument_group("k* (adaptivity)")
    adapt.add_argument("--kstar", choices=KSTAR_SOURCES, default=default,
                       help="how k* is obtained: local = recomputed with transformers from "
                       "--model-dir; logprobs = reported by vLLM run with --logprobs-mode "
                       "processed_logprobs and --max-logprobs >= 51; both; off; auto = local if "
                       "--model-dir is given, else off (default %(default)s)")
    adapt.add_argument("--model-dir", help="local copy of the served model's weights")
    adapt.add_argument("--kstar-dtype", default="auto",
                       help="dtype of the local forward pass (default: the checkpoint's)")
    adapt.add_argument("--kstar-logprobs", type=int, default=64,
                       help="top logprobs requested for --kstar logprobs without k_max")
    adapt.add_argument("--local-tokenizer", action="store_true",
                       help="tokenize with --model-dir's tokenizer instead of the endpoint's "
                       "/tokenize")


def _add_output(parser: argparse.ArgumentParser, out: str) -> None:
    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, default=Path(out),
                        help="output directory (default %(default)s)")
    output.add_argument("--seed", type=int, default=0,
                        help="run seed: passage choice, per-request sampling seeds, bootstrap "
                        "(default 0)")
    output.add_argument("--no-request-seeds", dest="request_seeds", action="store_false",
                        help="send no per-request seed (for endpoints that refuse them; the "
                        "generations are then not reproducible)")
    output.add_argument("--resamples", type=int, default=1000,
                        help="bootstrap resamples (default 1000, as in the paper)")
    output.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bars (default: a bar with rate and ETA per phase "
                        "on stderr, one line every 30 s when stderr is not a terminal)")
    output.add_argument("--no-figures", dest="figures", action="store_false")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bregman-eval", description="Reproduce the paper's measurements (open-ended "
        "generation gaps, GSM8K accuracy, adaptivity of k*, the temperature claim) against an "
        "OpenAI-compatible endpoint, and draw its figures.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an evaluation", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_endpoint(run)
    what = run.add_argument_group("configurations")
    what.add_argument("--config", action="append", default=[], metavar="SPEC",
                      help="a decoding configuration, repeatable: primal:1.5:0.01, dual:2:0.001:"
                      "T=0.7, primal:2:k=10, topk:10, sample; suffix @open or @gsm8k restricts "
                      "it to a task (default without --config/--grid-k: "
                      f"{', '.join(DEFAULT_CONFIGS)})")
    what.add_argument("--grid-k", type=_ints, default=[],
                      help="the paper's partial evaluation on the open task: top-k and primal "
                      "generalized top-k for each of these k (e.g. 5,10,20,50)")
    what.add_argument("--grid-alpha", type=_floats, default=[1.5, 2.0],
                      help="alphas of the grid besides top-k (default 1.5,2)")
    what.add_argument("--temperature", type=float, default=1.0,
                      help="default temperature of configurations without T= (default 1)")
    what.add_argument("--k-max", type=int, default=DEFAULT_K_MAX,
                      help="cap on k* for adaptive configurations without kmax= (default "
                      "%(default)s as in the paper; 0: none)")
    what.add_argument("--no-matched-topk", dest="matched", action="store_false",
                      help="skip the matched top-k baselines (k = round(mean k*))")
    what.add_argument("--matched-topk", dest="matched", action="store_true", default=True,
                      help="run a top-k baseline with k = round(mean k*) for every adaptive "
                      "configuration and task (default; needs k*)")
    tasks = _add_open_task(run, passages=32, max_tokens=256, min_continuation=MIN_CONTINUATION)
    tasks.add_argument("--tasks", default="open,gsm8k",
                       help="comma-separated: open, gsm8k (default %(default)s)")
    tasks.add_argument("--limit", type=int, default=50,
                       help="gsm8k: first N test problems (default %(default)s; 0: all 1319)")
    tasks.add_argument("--gsm8k-max-tokens", type=int, default=256,
                       help="gsm8k: answer length (default %(default)s)")
    tasks.add_argument("--gsm8k-test", type=Path, default=DEFAULT_GSM8K)
    tasks.add_argument("--gsm8k-fewshot", type=Path, default=DEFAULT_FEWSHOT)
    _add_kstar(run, default="auto")
    _add_output(run, "out/eval")

    sweep = sub.add_parser(
        "temperature-sweep", help="the temperature claim: adaptive primal decoding vs matched "
        "top-k on open-ended text at several temperatures",
        description="For every (alpha, lambda, T): adaptive primal decoding (k* <= k_max) and "
        "top-k with k = round(mean k*) of that configuration, on the same prompts; perplexity "
        "and repetition gaps against T with joint bootstrap standard deviations, the excess of "
        "top-k over Bregman and its growth with T (results.md), one figure per metric.")
    _add_endpoint(sweep)
    grid = sweep.add_argument_group("sweep")
    grid.add_argument("--temperatures", type=_floats, default=[0.7, 1.0, 1.5, 2.0],
                      help="default 0.7,1,1.5,2 (the paper's GSM8K table has 0.3-1.5)")
    grid.add_argument("--alphas", type=_floats, default=[1.5, 2.0], help="default 1.5,2")
    grid.add_argument("--lambdas", type=_floats, default=[0.01, 1e-4], help="default 0.01,1e-4")
    grid.add_argument("--k-max", type=int, default=DEFAULT_K_MAX,
                      help="cap on k* (default %(default)s as in the paper)")
    _add_open_task(sweep, passages=128, max_tokens=64, min_continuation=-1)
    _add_kstar(sweep, default="logprobs")
    _add_output(sweep, "out/sweep")

    plot = sub.add_parser("plot", help="draw the figures")
    plot.add_argument("--result", type=Path, help="a results.json from `bregman-eval run`")
    plot.add_argument("--theory", action="store_true",
                      help="also draw the paper's explanatory figures (default when no "
                      "--result is given)")
    plot.add_argument("--out", type=Path, default=Path("out/eval"),
                      help="output directory (default %(default)s)")

    rerender = sub.add_parser("report", help="rewrite results.md (and the result figures) "
                              "from a results.json")
    rerender.add_argument("result", type=Path, help="a results.json from `bregman-eval run`")
    rerender.add_argument("--no-figures", dest="figures", action="store_false")
    return parser


def configs_from_args(args: argparse.Namespace) -> list[DecodingConfig]:
    k_max = args.k_max if args.k_max and args.k_max > 0 else None
    specs = list(args.config)
    if not specs and not args.grid_k:
        specs = list(DEFAULT_CONFIGS)
    configs = [parse_config(s, default_temperature=args.temperature, default_k_max=k_max)
               for s in specs]
    if args.grid_k:
        configs += grid_configs(args.grid_k, args.grid_alpha, args.temperature)
    seen: dict[str, DecodingConfig] = {}
    for config in configs:
        seen.setdefault(config.label, config)
    return list(seen.values())


def options_from_args(args: argparse.Namespace, argv: Sequence[str]) -> RunOptions:
    sweep = args.command == "temperature-sweep"
    if sweep:
        tasks: tuple[str, ...] = ("open",)
        k_max = args.k_max if args.k_max > 0 else None
        configs = sweep_configs(args.temperatures, args.alphas, args.lambdas, k_max)
    else:
        tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            raise ValueError(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
        configs = configs_from_args(args)
    min_continuation = args.max_tokens if args.min_continuation < 0 else args.min_continuation
    extra: dict[str, object] = {"command": f"bregman-eval {shlex.join(argv)}"}
    if sweep:
        extra["sweep"] = {"temperatures": args.temperatures, "alphas": args.alphas,
                          "lambdas": args.lambdas, "k_max": args.k_max, "mode": "primal"}
    return RunOptions(
        endpoint=args.endpoint, configs=configs, model=args.model,
        api_key=args.api_key, ours=args.ours, tasks=tasks, matched=sweep or args.matched,
        passages=args.passages, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
        corpus=args.corpus, corpus_field=args.corpus_field, min_continuation=min_continuation,
        gsm8k_path=getattr(args, "gsm8k_test", DEFAULT_GSM8K),
        fewshot_path=getattr(args, "gsm8k_fewshot", DEFAULT_FEWSHOT),
        limit=getattr(args, "limit", 0) or None,
        gsm8k_max_tokens=getattr(args, "gsm8k_max_tokens", 256), concurrency=args.concurrency,
        seed=args.seed, request_seeds=args.request_seeds,
        kstar=args.kstar, model_dir=args.model_dir, kstar_dtype=args.kstar_dtype,
        kstar_logprobs=args.kstar_logprobs, local_tokenizer=args.local_tokenizer,
        resamples=args.resamples, progress=args.progress, timeout=args.timeout, extra=extra)


def cmd_run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .figures import result_figures
    from .report import write_outputs
    from .runner import run

    options = options_from_args(args, argv)
    local, logprobs = options.kstar_sources()  # fail before any request on a bad --kstar
    if args.command == "temperature-sweep" and not (local or logprobs):
        raise ValueError("the sweep needs k* for its matched top-k: --kstar logprobs (the "
                         "server runs with --logprobs-mode processed_logprobs), local or both")
    result, samples = asyncio.run(run(options))
    if args.command == "temperature-sweep":
        result["temperature_sweep"] = analyze(result, resamples=args.resamples, seed=args.seed)
    paths = write_outputs(result, samples, args.out)
    made = result_figures(result, args.out) if args.figures else []
    for path in [*paths.values(), *made]:
        print(f"wrote {path}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from .figures import result_figures, theory_figures

    made = []
    if args.theory or args.result is None:
        made += theory_figures(args.out)
    if args.result is not None:
        made += result_figures(json.loads(args.result.read_text()), args.out)
    for path in made:
        print(f"wrote {path}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .figures import result_figures
    from .report import markdown_report

    result = json.loads(args.result.read_text())
    if result.get("temperature_sweep"):  # recomputed: the report code may have changed
        result["temperature_sweep"] = analyze(
            result, resamples=result["meta"].get("bootstrap_resamples", 1000),
            seed=result["meta"].get("seed", 0))
        args.result.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    path = args.result.with_name("results.md")
    path.write_text(markdown_report(result))
    made = result_figures(result, args.result.parent) if args.figures else []
    for written in [path, *made]:
        print(f"wrote {written}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bregman-eval``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command in ("run", "temperature-sweep"):
            return cmd_run(args, argv)
        if args.command == "report":
            return cmd_report(args)
        return cmd_plot(args)
    except (ValueError, RuntimeError) as exc:
        print(f"bregman-eval: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
