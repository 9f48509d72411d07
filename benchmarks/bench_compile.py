"""Compiled at start, never inside a step: the warm-up's cost and the recompile count (issue 18).

In one run, on ``--device`` (torch alone; no vLLM):

1. ``core.step.warm_up`` for scores of ``--vocab`` entries, timed, with the graphs it compiled;
2. steps over batches of 1 to ``--max-batch`` rows mixing every family of
   `bregman_vllm.diagnostics.MIXED_FAMILIES` (the processor's plan and step), compiled, with the
   graphs compiled meanwhile (the recompile count: 0 is the goal) and the largest |q - q_eager|
   against the same steps run eagerly;
3. at ``--time-batch`` rows, the mixed step and the default configuration's (primal, alpha 1.5,
   lambda 0.01), eager and compiled, beside ``torch.softmax`` (medians over interleaved runs;
   CUDA events on a GPU), printed as ratios to the softmax.

    python benchmarks/bench_compile.py --device cuda --vocab 128256
    python benchmarks/bench_compile.py --max-batch 16 --vocab 4096      # CPU smoke run

The test suite checks the same recompile count on the CPU (`tests/test_gpu_readiness.py`);
this script is the GPU's figure and the timing that sets `BREGMAN_COMPILE`'s default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import torch
from bench_core import timed

from bregman_vllm.core import step as step_module
from bregman_vllm.core.plan import plan_requests
from bregman_vllm.diagnostics import MIXED_FAMILIES
from bregman_vllm.params import BregmanParams


def mixed_plan(batch: int, vocab: int, device: str):
    """The plan of a batch whose rows cycle over `MIXED_FAMILIES` (plain rows left alone)."""
    requests = []
    for row in range(batch):
        params = BregmanParams.from_mapping(MIXED_FAMILIES[row % len(MIXED_FAMILIES)] or None)
        if params is not None and params.enabled:
            requests.append((row, params))
    return plan_requests(requests, batch=batch, vocab=vocab, device=device)


def set_compile(mode: str) -> None:
    os.environ["BREGMAN_COMPILE"] = mode  # read at every pass (cached per value)


def step(logits: torch.Tensor, plan) -> torch.Tensor:
    out = logits.clone()
    step_module.decode_step(out, plan, logits=True, inplace=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--time-batch", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device, vocab = args.device, args.vocab
    print(f"device {device}, torch {torch.__version__}"
          + (f", gpu {torch.cuda.get_device_name()}" if device.startswith("cuda") else ""))
    g = torch.Generator(device="cpu").manual_seed(7)
    rows = max(args.max_batch, *args.time_batch)
    logits = (torch.randn(rows, vocab, generator=g)
              * (3.0 + 4.0 * torch.rand(rows, 1, generator=g))).to(device)

    set_compile("1")
    began = time.perf_counter()
    ready = step_module.warm_up(device, vocab)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    warm = time.perf_counter() - began
    compiled_at_start = step_module.compile_count()
    print(f"warm-up: {warm:.1f} s, {compiled_at_start} graphs compiled, ready {ready}")

    error = 0.0
    for batch in range(1, args.max_batch + 1):
        plan = mixed_plan(batch, vocab, device)
        set_compile("1")
        compiled = step(logits[:batch], plan)
        set_compile("0")
        eager = step(logits[:batch], plan)
        error = max(error, float((compiled.exp() - eager.exp()).abs().max()))
        if not torch.isfinite(compiled.exp()).all():
            raise SystemExit(f"batch {batch}: a compiled step decoded to NaN or inf")
    recompiles = step_module.compile_count() - compiled_at_start
    print(f"batches 1..{args.max_batch}, mixed families: {recompiles} recompilations, "
          f"largest |q - q_eager| {error:.1e}")

    print(f"{'batch':>6} {'case':<38} {'ms':>8} {'x softmax':>10}")
    default = [(row, BregmanParams.from_mapping({"bregman_alpha": 1.5, "bregman_lambda": 1e-2}))
               for row in range(rows)]
    for batch in args.time_batch:
        rows_in = logits[:batch]
        plans = {"mixed families": mixed_plan(batch, vocab, device),
                 "default primal 1.5, 1e-2": plan_requests(default[:batch], batch=batch,
                                                           vocab=vocab, device=device)}
        cases = {"torch.softmax": ("0", partial(torch.softmax, rows_in, -1))}
        for label, plan in plans.items():
            for mode in ("0", "1"):
                cases[f"{label}{' [compiled]' if mode == '1' else ''}"] = (
                    mode, partial(step, rows_in, plan))
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(5):  # interleaved, so that load hits every case alike
            for name, (mode, call) in cases.items():
                set_compile(mode)
                times[name].append(timed(call, device, max(1, args.repeats // 5))[0] * 1e3)
        medians = {name: statistics.median(sample) for name, sample in times.items()}
        for name, ms in medians.items():
            print(f"{batch:>6} {name:<38} {ms:8.3f} {ms / medians['torch.softmax']:10.2f}")
    if step_module.compile_count() != compiled_at_start:
        raise SystemExit("a step compiled after the warm-up")


if __name__ == "__main__":
    main()
