"""Benchmark of the math core: `bregman_decode` against one softmax pass and vLLM's top-p.

Side by side in one run, on the same inputs, medians over repeated interleaved runs, printed as
ratios to ``torch.softmax`` over the same [B, V] tensor:

* realistic peaked distributions (softmax of Gaussian logits with a per-row scale; the script
  prints their median top-1 probability and 90%-mass size);
* ``bregman_decode`` adaptive primal alpha = 1.5 (closed form), primal alpha = 3 (root finding),
  dual alpha = 1.5 and 3 (nested root finding), fixed top-k;
* vLLM's own ``apply_top_k_top_p`` with top-p 0.9 (when vLLM is importable);
* worst cases: lambda = 0, lambda tiny on flat distributions (k* in the thousands), which grow
  the candidate set up to a full sort of the row.

Targets (this CPU): adaptive primal alpha = 1.5 at [64, 128256] within 3x one softmax pass; dual
within 6x.

    python benchmarks/bench_core.py            # the full table
    python benchmarks/bench_core.py --quick    # small sizes (smoke test)
    python benchmarks/bench_core.py --device cuda --batch 256  # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bregman_vllm import bregman_decode


def realistic_probs(batch: int, vocab: int, device: str, seed: int = 0,
                    flat: bool = False) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    scale = torch.full((batch, 1), 0.3) if flat else 3.0 + 4.0 * torch.rand(batch, 1, generator=g)
    logits = torch.randn(batch, vocab, generator=g) * scale
    return torch.softmax(logits, -1).to(device)


def describe(p: torch.Tensor) -> str:
    top1 = p.max(-1).values
    cum = torch.cumsum(torch.sort(p[:8].float().cpu(), -1, descending=True).values, -1)
    k90 = (cum < 0.9).sum(-1) + 1
    return f"median top-1 {top1.median().item():.3f}, median 90%-mass size {k90.median().item()}"


def timer(fn: Callable[[], object], device: str) -> Callable[[], float]:
    def run() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start
    return run


def measure(cases: dict[str, Callable[[], object]], device: str, repeats: int
            ) -> dict[str, float]:
    """Median seconds per case; cases run interleaved so drift hits all of them alike."""
    runs = {name: timer(fn, device) for name, fn in cases.items()}
    for run in runs.values():  # warm-up
        run()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
    return {name: statistics.median(values) for name, values in samples.items()}


def vllm_top_p() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    except Exception:  # vLLM absent (e.g. a bare GPU box): skip that column
        return None
    return lambda logits, p: apply_top_k_top_p(logits, None, p)


def decode_cases(p: torch.Tensor, logits: torch.Tensor, top_p, device: str
                 ) -> dict[str, Callable[[], object]]:
    """The timed calls for one [B, V] input (closures over this function's arguments)."""
    cases: dict[str, Callable[[], object]] = {
        "torch.softmax": lambda: torch.softmax(logits, -1),
        "primal a=1.5 lam=0.01 (adaptive)": lambda: bregman_decode(p, alpha=1.5, lam=0.01),
        "primal a=1.5 lam=1e-4 (adaptive)": lambda: bregman_decode(p, alpha=1.5, lam=1e-4),
        "primal a=1 lam=0.01 (adaptive top-k)": lambda: bregman_decode(p, alpha=1.0, lam=0.01),
        "primal a=3 lam=0.01 (root finding)": lambda: bregman_decode(p, alpha=3.0, lam=0.01),
        "dual a=1.5 lam=0.01": lambda: bregman_decode(p, alpha=1.5, lam=0.01, mode="dual"),
        "dual a=3 lam=0.01": lambda: bregman_decode(p, alpha=3.0, lam=0.01, mode="dual"),
        "primal a=1.5 top_k=50 (fixed)": lambda: bregman_decode(p, alpha=1.5, lam=0.0, top_k=50),
        "torch.topk k=50": lambda: torch.topk(p, 50),
    }
    if top_p is not None:
        threshold = torch.full((p.shape[0],), 0.9, device=device)
        cases["vLLM apply_top_k_top_p (top-p 0.9)"] = lambda: top_p(logits.clone(), threshold)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 32, 64])
    parser.add_argument("--vocab", type=int, nargs="*", default=[49152, 128256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.vocab, args.repeats = [1, 4], [4096], 2
    device = args.device
    torch.manual_seed(0)
    top_p = vllm_top_p()
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    header = f"{'shape':>14} {'case':<34} {'ms':>9} {'x softmax':>10}"
    for vocab in args.vocab:
        for batch in args.batch:
            p = realistic_probs(batch, vocab, device)
            logits = torch.log(p)
            print(f"\n[{batch}, {vocab}] {describe(p)}")
            print(header)
            cases = decode_cases(p, logits, top_p, device)
            timings = measure(cases, device, args.repeats)
            base = timings["torch.softmax"]
            for name, seconds in timings.items():
                print(f"{[batch, vocab]!s:>14} {name:<34} {seconds * 1e3:9.3f} "
                      f"{seconds / base:10.2f}")

    # Worst cases: k* in the thousands (flat rows, tiny lambda) and lambda = 0.
    vocab, batch = args.vocab[-1], args.batch[-1]
    flat = realistic_probs(batch, vocab, device, seed=1, flat=True)
    flat_logits = torch.log(flat)
    print(f"\nworst cases at [{batch}, {vocab}], flat rows: {describe(flat)}")
    print(header)
    worst: dict[str, Callable[[], object]] = {
        "torch.softmax": lambda: torch.softmax(flat_logits, -1),
        "primal a=1.5 lam=0 (keeps all)": lambda: bregman_decode(flat, alpha=1.5, lam=0.0),
        "primal a=1.5 lam=1e-9 (flat)": lambda: bregman_decode(flat, alpha=1.5, lam=1e-9),
        "primal a=1 lam=1e-5 (flat)": lambda: bregman_decode(flat, alpha=1.0, lam=1e-5),
        "primal a=3 lam=1e-9 (flat)": lambda: bregman_decode(flat, alpha=3.0, lam=1e-9),
        "dual a=3 lam=1e-9 (flat)": lambda: bregman_decode(flat, alpha=3.0, lam=1e-9,
                                                           mode="dual"),
        "torch.sort (full rows)": lambda: torch.sort(flat, -1, descending=True),
    }
    timings = measure(worst, device, max(2, args.repeats // 2))
    base = timings["torch.softmax"]
    k_values = {
        "primal a=1.5 lam=1e-9 (flat)": bregman_decode(flat, alpha=1.5, lam=1e-9).k,
        "primal a=1 lam=1e-5 (flat)": bregman_decode(flat, alpha=1.0, lam=1e-5).k,
        "primal a=3 lam=1e-9 (flat)": bregman_decode(flat, alpha=3.0, lam=1e-9).k,
    }
    for name, seconds in timings.items():
        extra = ""
        if name in k_values:
            extra = f"  (median k* {int(k_values[name].float().median().item())})"
        print(f"{[batch, vocab]!s:>14} {name:<34} {seconds * 1e3:9.3f} "
              f"{seconds / base:10.2f}{extra}")


if __name__ == "__main__":
    main()
