"""Benchmark of the math core: `bregman_decode` against one softmax pass and vLLM's top-p.

Side by side in one run, on the same inputs, medians over repeated interleaved runs, printed as
ratios to ``torch.softmax`` over the same [B, V] tensor:

* realistic peaked distributions (softmax of Gaussian logits with a per-row scale; the script
  prints their median top-1 probability and 90%-mass size);
* ``bregman_decode`` adaptive primal alpha = 1.5 (closed form), primal alpha = 3 (root finding),
  dual alpha = 1.5 and 3 (nested root finding), fixed top-k;
* vLLM's own ``apply_top_k_top_p`` with top-p 0.9 (when vLLM is importable);
* worst cases: lambda = 0, lambda tiny on flat distributions (k* in the thousands), which grow
  the candidate set up to a full sort of the row;
* extreme parameters (``--only extremes``): every end of every range of the parameter model
  beside the default configuration on the same rows (the cost multiple: timed, and counted as
  elements and launched ops against the bound ``WORK_BOUND``), realistic and flat rows, and
  with ``--baseline`` the old core's time and counts (issue 18);
* the exact path's floor (``--only floor``): for the worst cases of issue 25, the output map
  T_k* alone (k* given, from cold, on the rows already sorted: what any exact path pays after
  its sort and search) beside the whole call and a full ``torch.sort`` of the same rows, and
  the call with the k_max of ``--floor-caps`` (what a server's ``--max-support`` makes of it).

Targets (this CPU): adaptive primal alpha = 1.5 at [64, 128256] within 3x one softmax pass; dual
within 6x.

Then the GPU-readiness table (``--step-shapes``, default [64, 128256] and [256, 128256]): for
each configuration of issue 10, one `bregman_decode_logits` call (the processor's path) beside
``torch.softmax``, ``torch.topk`` and ``torch.sort`` on the same logits, with

* ``gpu ms``: device time between two CUDA events around the call (CUDA only);
* ``wall ms``: host time from the call to the end of its work (``torch.cuda.synchronize``);
* ``x sm``: GPU time (CPU: wall time) over the softmax pass's;
* ``syncs`` / ``launch``: host syncs and launched ops of one call
  (`bregman_vllm.diagnostics.DispatchCounter`, eager path);
* ``peak MiB``: peak extra memory of one call, output included (CUDA: the allocator's peak;
  CPU: `bregman_vllm.diagnostics.MemoryTracker`), beside `step_memory_bound`;
* ``check``: the largest |q - q64| against the float64 exact path on the CPU (`core.search`),
  and ``k`` whether every support size agrees.

It needs torch alone (vLLM's top-p column is skipped without vLLM). On CUDA the calls run the
Triton kernels (``BREGMAN_BACKEND``'s default; `benchmarks/bench_triton.py` sets them beside the
torch step); ``syncs`` / ``launch`` count the torch step's ops.

    python benchmarks/bench_core.py            # the full CPU table
    python benchmarks/bench_core.py --quick    # small sizes (smoke test)
    python benchmarks/bench_core.py --device cuda --batch 64 256 --vocab 128256
    python benchmarks/bench_core.py --only ratios --batch 64 --vocab 128256 --baseline 3ef72a5
    python benchmarks/bench_core.py --only extremes --extremes-shape 8x49152 --baseline d9c8b1c
    python benchmarks/bench_core.py --only floor --extremes-shape 8x49152

``--baseline REV`` adds, interleaved with every decoder row of the ratio tables, the same call
on the core of git revision REV (its ``bregman_vllm`` extracted with ``git archive`` into a
temporary folder and imported under another name): old and new measured side by side in one
process, printed with the ratio new / old.
"""

from __future__ import annotations

import argparse
import importlib
import io
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable

import torch

from bregman_vllm import bregman_decode, bregman_decode_logits
from bregman_vllm.core.plan import exact_plan
from bregman_vllm.core.step import decode_exact, step_memory_bound
from bregman_vllm.diagnostics import DispatchCounter, MemoryTracker


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
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
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


Decoder = Callable[..., object]

#: Module name the ``--baseline`` core is imported under.
BASELINE_PACKAGE = "bregman_vllm_baseline"


def load_baseline(revision: str, name: str = "bregman_decode") -> Decoder:
    """``bregman_decode`` (or another public call of ``decode``) of the core at git
    ``revision``: its package extracted into a temporary folder under `BASELINE_PACKAGE` (the
    core imports itself relatively; the package's lazy top-level names do not, so the decode
    module is imported directly)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", root, "archive", revision, "bregman_vllm"],
                             check=True, capture_output=True).stdout
    folder = tempfile.mkdtemp(prefix="bench-baseline-")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    os.rename(os.path.join(folder, "bregman_vllm"), os.path.join(folder, BASELINE_PACKAGE))
    sys.path.insert(0, folder)
    try:
        try:  # (the public calls' module: ``decode``, ``core.decode`` before it moved)
            module = importlib.import_module(BASELINE_PACKAGE + ".decode")
        except ImportError:
            module = importlib.import_module(BASELINE_PACKAGE + ".core.decode")
        decode = getattr(module, name)
    finally:
        sys.path.remove(folder)
    if decode in (bregman_decode, bregman_decode_logits) or \
            not decode.__module__.startswith(BASELINE_PACKAGE):
        raise RuntimeError(f"the baseline {revision} resolved to the current core")
    return decode


def decoder_cases(decode: Decoder, p: torch.Tensor, worst: bool
                  ) -> dict[str, Callable[[], object]]:
    """The Bregman calls of one table, through ``decode`` (this core's or a baseline's)."""
    if worst:
        return {
            "primal a=1.5 lam=0 (keeps all)": lambda: decode(p, alpha=1.5, lam=0.0),
            "primal a=1.5 lam=1e-9 (flat)": lambda: decode(p, alpha=1.5, lam=1e-9),
            "primal a=1 lam=1e-5 (flat)": lambda: decode(p, alpha=1.0, lam=1e-5),
            "primal a=3 lam=1e-9 (flat)": lambda: decode(p, alpha=3.0, lam=1e-9),
            "dual a=3 lam=1e-9 (flat)": lambda: decode(p, alpha=3.0, lam=1e-9, mode="dual"),
        }
    return {
        "primal a=1.5 lam=0.01 (adaptive)": lambda: decode(p, alpha=1.5, lam=0.01),
        "primal a=1.5 lam=1e-4 (adaptive)": lambda: decode(p, alpha=1.5, lam=1e-4),
        "primal a=1 lam=0.01 (adaptive top-k)": lambda: decode(p, alpha=1.0, lam=0.01),
        "primal a=3 lam=0.01 (root finding)": lambda: decode(p, alpha=3.0, lam=0.01),
        "dual a=1.5 lam=0.01": lambda: decode(p, alpha=1.5, lam=0.01, mode="dual"),
        "dual a=3 lam=0.01": lambda: decode(p, alpha=3.0, lam=0.01, mode="dual"),
        "primal a=1.5 top_k=50 (fixed)": lambda: decode(p, alpha=1.5, lam=0.0, top_k=50),
    }


def with_baseline(cases: dict[str, Callable[[], object]], baseline: Decoder | None,
                  p: torch.Tensor, worst: bool) -> dict[str, Callable[[], object]]:
    """``cases`` with, after each Bregman case, the same call on the baseline core."""
    if baseline is None:
        return cases
    old = decoder_cases(baseline, p, worst)
    merged: dict[str, Callable[[], object]] = {}
    for name, fn in cases.items():
        merged[name] = fn
        if name in old:
            merged[BASELINE_LABEL + name] = old[name]
    return merged


BASELINE_LABEL = "  baseline: "


def decode_cases(p: torch.Tensor, logits: torch.Tensor, top_p, device: str
                 ) -> dict[str, Callable[[], object]]:
    """The timed calls for one [B, V] input (closures over this function's arguments)."""
    cases: dict[str, Callable[[], object]] = {
        "torch.softmax": lambda: torch.softmax(logits, -1),
        **decoder_cases(bregman_decode, p, worst=False),
        "torch.topk k=50": lambda: torch.topk(p, 50),
    }
    if top_p is not None:
        threshold = torch.full((p.shape[0],), 0.9, device=device)
        cases["vLLM apply_top_k_top_p (top-p 0.9)"] = lambda: top_p(logits.clone(), threshold)
    return cases


# ----------------------------------------------------------------------------- GPU readiness

#: Issue 10's configurations (keyword arguments of `bregman_decode_logits`); the first is the
#: default of `bregman_vllm.params` (primal, alpha 1.5, lambda 0.01).
STEP_CONFIGS: dict[str, dict] = {
    "default primal a=1.5 lam=1e-2": dict(alpha=1.5, lam=1e-2),
    **{f"primal a={a:g} lam={lam:g}{' k_max=50' if cap else ''}": dict(
        alpha=a, lam=lam, **({"k_max": 50} if cap else {}))
       for a in (1.0, 1.5, 2.0, 3.0) for lam in (1e-3, 1e-2) for cap in (False, True)
       if not (a == 1.5 and lam == 1e-2 and not cap)},
    "dual a=1.5 lam=1e-2": dict(alpha=1.5, lam=1e-2, mode="dual"),
    "dual a=1.5 lam=1e-3": dict(alpha=1.5, lam=1e-3, mode="dual"),
    "top_k=50 a=1.5": dict(alpha=1.5, lam=0.0, top_k=50),
}


def timed(fn: Callable[[], object], device: str, repeats: int) -> tuple[float, float]:
    """Median (device seconds, wall seconds) of ``fn``; device time from CUDA events on CUDA
    (the wall time elsewhere). Each run starts on an idle device."""
    cuda = device.startswith("cuda")
    fn()  # warm-up (and compilation)
    gpu, wall = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            start_event.record()
            fn()
            end_event.record()
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - start)
            gpu.append(start_event.elapsed_time(end_event) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            wall.append(time.perf_counter() - start)
            gpu.append(wall[-1])
    return statistics.median(gpu), statistics.median(wall)


def counts(fn: Callable[[], object]) -> tuple[int, int]:
    """(host syncs, launched ops) of one eager call in steady state (after a first call has
    made the cached constants, as in a serving engine)."""
    previous = os.environ.get("BREGMAN_BACKEND")
    os.environ["BREGMAN_BACKEND"] = "torch"  # a dispatch mode sees torch ops only
    try:
        fn()
        with DispatchCounter() as counter:
            fn()
    finally:
        if previous is None:
            del os.environ["BREGMAN_BACKEND"]
        else:
            os.environ["BREGMAN_BACKEND"] = previous
    return counter.syncs, counter.launches


def peak_extra(fn: Callable[[], object], device: str) -> int:
    """Peak bytes allocated by one call beyond what was allocated before (output included)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with MemoryTracker() as memory:
        fn()
    return memory.peak


def float64_check(logits: torch.Tensor, kwargs: dict) -> tuple[float, bool]:
    """Largest |q - q64| of the device output against the float64 exact path on the CPU, and
    whether every row's support size agrees."""
    out, k = bregman_decode_logits(logits, return_k=True, **kwargs)
    cpu = logits.detach().to("cpu", torch.float64)
    n = cpu.shape[0]
    p = torch.softmax(cpu, -1)
    want = torch.zeros_like(p)
    k_want = torch.zeros(n, dtype=torch.long)

    def row(value) -> torch.Tensor:
        return torch.full((n,), float(value), dtype=torch.float64)

    top = int(kwargs.get("top_k") or 0)
    cap = int(kwargs.get("k_max") or 0)
    fixed = min(top, cap) if top and cap else top
    if not top and cap and kwargs["lam"] == 0.0:
        fixed = cap
    sizes = torch.full((n,), fixed, dtype=torch.long)
    plan = exact_plan(kwargs.get("mode", "primal"), row(kwargs["alpha"]), row(kwargs["lam"]),
                      sizes, torch.full((n,), cap, dtype=torch.long))
    decode_exact(want, k_want, p, plan, logits=False)
    q = torch.exp(out.detach().to("cpu", torch.float64))
    return float((q - want).abs().max()), bool(torch.equal(k.cpu(), k_want))


def step_table(batch: int, vocab: int, device: str, repeats: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    scale = 3.0 + 4.0 * torch.rand(batch, 1, generator=g)
    logits = (torch.randn(batch, vocab, generator=g) * scale).to(device)
    bound = step_memory_bound(batch, vocab)
    print(f"\n[{batch}, {vocab}] one call of bregman_decode_logits; step_memory_bound "
          f"{bound / 2**20:.0f} MiB")
    print(f"{'case':<34} {'gpu ms':>8} {'wall ms':>8} {'x sm':>6} {'syncs':>5} {'launch':>6} "
          f"{'peak MiB':>8} {'check':>8} {'k':>3}")
    baselines: dict[str, Callable[[], object]] = {
        "torch.softmax": lambda: torch.softmax(logits, -1),
        "torch.topk k=64": lambda: torch.topk(logits, 64, -1),
        "torch.sort": lambda: torch.sort(logits, -1, descending=True),
    }
    base = None
    for name, fn in baselines.items():
        gpu, wall = timed(fn, device, repeats)
        base = base or gpu
        syncs, launches = counts(fn)
        print(f"{name:<34} {gpu * 1e3:8.3f} {wall * 1e3:8.3f} {gpu / base:6.2f} {syncs:5d} "
              f"{launches:6d} {peak_extra(fn, device) / 2**20:8.1f}")
    for name, kwargs in STEP_CONFIGS.items():
        def call(kwargs=kwargs):
            return bregman_decode_logits(logits, **kwargs)

        syncs, launches = counts(call)
        error, same_k = float64_check(logits, kwargs)
        peak = peak_extra(call, device)
        gpu, wall = timed(call, device, repeats)
        print(f"{name:<34} {gpu * 1e3:8.3f} {wall * 1e3:8.3f} {gpu / base:6.2f} "
              f"{syncs:5d} {launches:6d} {peak / 2**20:8.1f} {error:8.1e} "
              f"{'ok' if same_k else 'NO':>3}")


# ----------------------------------------------------------------------------- extremes

TINY, BIGGEST, LIMIT = 5e-324, 1.7976931348623157e308, 1e8
#: The default configuration, then every end of the parameter model's ranges
#: (`bregman_vllm.params`: alpha next to 0, next to 1 and at +-1e8 or +-inf, lambda 0 to the
#: largest double, k_max / top_k 1 to 2^31 - 1), the values of issue 18's findings (now the
#: range ends), and the costliest interior values known: a tiny lambda with an iterative or a
#: general dual alpha (k* in the thousands: the exact path's nested root finding), and the
#: cases of issue 25 (the attack: dual alpha 10, lambda 1e-100; primal alpha 1, 1.5, 3 at a tiny
#: lambda).
EXTREMES: dict[str, dict] = {
    "default primal a=1.5 lam=1e-2": dict(alpha=1.5, lam=1e-2),
    "primal a=5e-324": dict(alpha=TINY, lam=1e-2),
    "primal a=1e-8 lam=1e300": dict(alpha=1e-8, lam=1e300),
    "primal a=1e8": dict(alpha=LIMIT, lam=1e-2),
    "primal a=1e8 lam=5e-324": dict(alpha=LIMIT, lam=TINY),
    "primal a=1e8 k_max=2": dict(alpha=LIMIT, lam=1e-2, k_max=2),
    "primal lam=0": dict(alpha=1.5, lam=0.0),
    "primal lam=5e-324": dict(alpha=1.5, lam=TINY),
    "primal lam=1.8e308": dict(alpha=1.5, lam=BIGGEST),
    "primal k_max=1": dict(alpha=1.5, lam=1e-2, k_max=1),
    "primal k_max=2^31-1": dict(alpha=1.5, lam=1e-9, k_max=2**31 - 1),
    "primal top_k=1 a=-1e8": dict(alpha=-LIMIT, lam=0.0, top_k=1),
    "primal top_k=50 a=-inf": dict(alpha=-math.inf, lam=0.0, top_k=50),
    "primal top_k=50 a=5e-324": dict(alpha=TINY, lam=0.0, top_k=50),
    "primal top_k=50 a=1e8": dict(alpha=LIMIT, lam=0.0, top_k=50),
    "primal top_k=2^31-1 a=3": dict(alpha=3.0, lam=0.0, top_k=2**31 - 1),
    "dual a=1+2^-52": dict(alpha=1 + 2**-52, lam=1e-2, mode="dual"),
    "dual a=1+1e-9": dict(alpha=1 + 1e-9, lam=1e-2, mode="dual"),
    "dual a=1+1e-6": dict(alpha=1 + 1e-6, lam=1e-2, mode="dual"),
    "dual a=1e8": dict(alpha=LIMIT, lam=1e-2, mode="dual"),
    "dual a=1e8 k_max=2": dict(alpha=LIMIT, lam=1e-2, k_max=2, mode="dual"),
    "dual a=1e8 lam=5e-324": dict(alpha=LIMIT, lam=TINY, mode="dual"),
    "dual top_k=50 a=1+2^-52": dict(alpha=1 + 2**-52, lam=0.0, top_k=50, mode="dual"),
    "dual top_k=50 a=1e8": dict(alpha=LIMIT, lam=0.0, top_k=50, mode="dual"),
    "dual top_k=50 a=inf": dict(alpha=math.inf, lam=0.0, top_k=50, mode="dual"),
    "primal a=3 lam=1e-12 (interior)": dict(alpha=3.0, lam=1e-12),
    "primal a=1 lam=1e-12 (interior)": dict(alpha=1.0, lam=1e-12),
    "primal a=1.5 lam=1e-12 (interior)": dict(alpha=1.5, lam=1e-12),
    "dual a=10 lam=1e-100 (interior)": dict(alpha=10.0, lam=1e-100, mode="dual"),
    "dual a=2.5 lam=1e-12 (interior)": dict(alpha=2.5, lam=1e-12, mode="dual"),
    "dual a=1.001 lam=1e-2 (interior)": dict(alpha=1.001, lam=1e-2, mode="dual"),
    # the costliest of the parameter sweep (`sweep_table`, [8, 49152] and [4, 4096]):
    "dual a=4 lam=1e-20 (interior)": dict(alpha=4.0, lam=1e-20, mode="dual"),
    "dual a=7 lam=1e-70 (interior)": dict(alpha=7.0, lam=1e-70, mode="dual"),
    "dual a=20 lam=1e-200 (interior)": dict(alpha=20.0, lam=1e-200, mode="dual"),
    "dual a=20 lam=1e-240 (interior)": dict(alpha=20.0, lam=1e-240, mode="dual"),
    "primal a=20 lam=1e-240 (interior)": dict(alpha=20.0, lam=1e-240),
}
#: The findings of issue 18, refused by the parameter model now (|alpha| above 1e8).
REFUSED = {
    "dual a=1e308": dict(alpha=1e308, lam=1e-2, mode="dual"),
    "primal a=1e308 k_max=2": dict(alpha=1e308, lam=1e-2, k_max=2),
}


def _side_by_side(calls: list[Callable[[], object]], device: str, repeats: int
                  ) -> list[float]:
    """Median seconds of each call, the calls alternating (so that the load of a shared
    machine hits them alike), after a first (warm-up) call of each; calls of more than two
    seconds are timed once (the old core's extremes take up to minutes), calls of a few
    milliseconds up to 40 times (a 2-core machine's noise is largest there); each repetition
    starts with the next call in turn."""
    runs = [timer(call, device) for call in calls]
    first = [run() for run in runs]
    samples: list[list[float]] = [[] for _ in runs]
    count = max(repeats, min(40, int(0.1 / max(max(first), 1e-6))))  # (never below --repeats)
    for turn in range(1 if max(first) > 2.0 else count):
        # (each repetition starts with the next call: the call right after a full sort pays
        # for its cold caches, which is a tenth of a millisecond call)
        for i in (turn + j for j in range(len(runs))):
            samples[i % len(runs)].append(runs[i % len(runs)]())
    return [statistics.median(sample) for sample in samples]


#: The stated bound M on the counted work of one call over the default configuration's on the
#: same rows (`work`: elements and launched ops, each within M times the default's). It holds
#: for every case of this table at [4, 4096] (`tests/test_benchmarks.py` requires it there) and
#: at [8, 49152], realistic and flat rows, and over the parameter sweep (`sweep_table`) at
#: [8, 49152], [4, 4096] and [8, 128256] (the worst: dual alpha 20, lambda 1e-240 on peaked rows
#: of 49152, k* in the tens of thousands, about 285x elements; docs/benchmarks.md). Before the
#: multiplier search the same sweep found 6448x.
WORK_BOUND = 300.0


def work(call: Callable[[], object]) -> tuple[int, int, int]:
    """The counted work of one call (`bregman_vllm.diagnostics.DispatchCounter`, eager path):
    elements (each launched op counted as the element count of its largest tensor), launched
    ops and host syncs. Load-independent, unlike the times beside it."""
    previous = os.environ.get("BREGMAN_BACKEND")
    os.environ["BREGMAN_BACKEND"] = "torch"
    try:
        with DispatchCounter() as counter:
            call()
    finally:
        if previous is None:
            os.environ.pop("BREGMAN_BACKEND", None)
        else:
            os.environ["BREGMAN_BACKEND"] = previous
    return counter.elements, counter.launches, counter.syncs


def extremes_table(args, device: str) -> None:
    """One `bregman_decode_logits` call per extreme configuration, on realistic and on flat
    rows, beside the default configuration on the same rows: the cost multiple (x default: time;
    work x: counted elements, ops x: counted launched ops, both over the default call's) and
    whether the output is a distribution (no NaN, no inf). With ``--baseline``, the same call on
    the old core, alternating with the new one, its counted multiples, and whether the two
    outputs are bit-identical ("differs" where not; the count of both after each table)."""
    from bregman_vllm import BregmanParamError

    batch, vocab = (int(x) for x in args.extremes_shape.lower().split("x"))
    old = load_baseline(args.baseline, "bregman_decode_logits") if args.baseline else None
    g = torch.Generator(device="cpu").manual_seed(0)
    scale = 3.0 + 4.0 * torch.rand(batch, 1, generator=g)
    inputs = {"realistic": torch.randn(batch, vocab, generator=g) * scale,
              "flat": torch.randn(batch, vocab, generator=g) * 0.3}
    for kind, logits in inputs.items():
        logits = logits.to(device)
        print(f"\nextremes at [{batch}, {vocab}], {kind} rows (median ms, calls alternating "
              f"after a warm-up call; x default: over the default configuration on the same rows, "
              f"the median of its calls in this table so far; work x / ops x: counted elements / "
              f"launched ops over the default call's, eager; syncs: host syncs of one call)")
        print(f"{'case':<36} {'ms':>10} {'x default':>10} {'work x':>7} {'ops x':>6} "
              f"{'finite':>6} {'x sort':>7} {'syncs':>5}"
              + (f" {'old ms':>10} {'new/old':>8} {'old work x':>10} {'old ops x':>9} "
                 f"{'old x sort':>10} {'old syncs':>9}" if old else ""))
        default_kwargs = EXTREMES["default primal a=1.5 lam=1e-2"]
        default_call = lambda logits=logits: bregman_decode_logits(  # noqa: E731
            logits, **EXTREMES["default primal a=1.5 lam=1e-2"])
        default_call()  # (counted after a first call, like every case: after its own)
        base_work = work(default_call)
        old_base = None
        if old is not None:
            old(logits, **default_kwargs)
            old_base = work(lambda logits=logits, kwargs=default_kwargs: old(logits, **kwargs))
        worst, worst_work = ("", 0.0), ("", 0.0)
        worst_sort, worst_old_sort = ("", 0.0), ("", 0.0)
        defaults: list[float] = []
        compared = [0, 0]  # cases compared with the old core's output, those that differ
        sort_call = lambda logits=logits: torch.sort(logits, -1, descending=True)  # noqa: E731
        for name, kwargs in {**EXTREMES, **REFUSED}.items():
            call = lambda kwargs=kwargs, logits=logits: bregman_decode_logits(  # noqa: E731
                logits, **kwargs)
            calls, line = [default_call, sort_call], f"{name:<36}"
            out = None
            try:
                out = call()
                finite = bool(torch.isfinite(torch.logsumexp(out.double(), -1)).all()) \
                    and not bool(out.isnan().any()) and not bool(out.isposinf().any())
                calls.append(call)
            except BregmanParamError:
                line += f" {'refused (400)':>21} {'':>7} {'':>6} {'':>6} {'':>7} {'':>5}"
            old_note, old_counts, old_syncs = "", "", 0
            if old is not None:
                try:
                    old_out = old(logits, **kwargs)
                    nan = " NaN" if bool(torch.isnan(old_out).any()) else ""
                    if out is not None:  # (the same output as the old core's, bit for bit)
                        compared[0] += 1
                        if not torch.equal(out, old_out):
                            compared[1] += 1
                            nan += " differs"
                    old_call = lambda kwargs=kwargs, logits=logits: old(  # noqa: E731
                        logits, **kwargs)
                    calls.append(old_call)
                    elements, launches, old_syncs = work(old_call)
                    old_counts = f" {elements / old_base[0]:10.1f} {launches / old_base[1]:9.1f}"
                except Exception as error:  # the old core's own refusal
                    old_note = f" {type(error).__name__:>10}"
            seconds = _side_by_side(calls, device, max(1, args.repeats // 2))
            defaults.append(seconds[0])
            default = statistics.median(defaults)  # (the default of every case so far)
            sort = seconds[1]
            new = seconds[2] if len(calls) > 2 and calls[2] is call else None
            if new is not None:
                elements, launches, syncs = work(call)
                multiple = (elements / base_work[0], launches / base_work[1])
                line += f" {new * 1e3:10.2f} {new / default:10.1f} {multiple[0]:7.1f} " \
                        f"{multiple[1]:6.1f} {'yes' if finite else 'NO':>6} {new / sort:7.2f} " \
                        f"{syncs:5d}"
                if new / default > worst[1]:
                    worst = (name, new / default)
                if max(multiple) > worst_work[1]:
                    worst_work = (name, max(multiple))
                if new / sort > worst_sort[1]:
                    worst_sort = (name, new / sort)
            if old is not None and not old_note:
                ratio = f"{new / seconds[-1]:8.2f}" if new is not None else f"{'':>8}"
                old_note = f" {seconds[-1] * 1e3:10.1f} {ratio}{nan}{old_counts} " \
                           f"{seconds[-1] / sort:10.2f} {old_syncs:9d}"
                if seconds[-1] / sort > worst_old_sort[1]:
                    worst_old_sort = (name, seconds[-1] / sort)
            print(line + old_note, flush=True)
        print(f"default {statistics.median(defaults) * 1e3:.2f} ms (median over the cases), "
              f"{base_work[0] / 1e6:.2f} M elements, {base_work[1]} ops; worst time multiple "
              f"{worst[1]:.0f}x ({worst[0]}); worst counted multiple {worst_work[1]:.1f}x "
              f"({worst_work[0]}); bound M = {WORK_BOUND:.0f}x")
        if old is not None:
            print(f"outputs bit-identical to the old core's: {compared[0] - compared[1]} of "
                  f"{compared[0]} cases")
        print(f"worst multiple of a sort of the same rows: {worst_sort[1]:.2f}x ({worst_sort[0]})"
              + (f"; old core {worst_old_sort[1]:.2f}x ({worst_old_sort[0]})" if old else ""))



#: The worst cases of issue 25 (rows, parameters): the attack, the worst realistic and flat
#: cases of the extremes table, and the worst of the sweep.
FLOOR_CASES = [
    ("realistic", dict(alpha=10.0, lam=1e-100, mode="dual")),
    ("realistic", dict(alpha=20.0, lam=1e-240, mode="dual")),
    ("flat", dict(alpha=4.0, lam=1e-20, mode="dual")),
    ("flat", dict(alpha=2.5, lam=1e-12, mode="dual")),
    ("flat", dict(alpha=1.1, lam=4e-5, mode="dual")),
]


def floor_table(args, device: str) -> None:
    """What any exact path pays for the worst cases, beside what it pays now: a full sort of the
    rows, the output map alone (T_k* on the sorted whole row with k* given, from cold: the
    solve every exact path ends with, its search aside) and the whole call, side by side."""
    from bregman_vllm.core.candidates import candidates
    from bregman_vllm.core.maps import log_deficit, log_renorm
    from bregman_vllm.core.plan import rows_family

    batch, vocab = (int(x) for x in args.extremes_shape.lower().split("x"))
    g = torch.Generator(device="cpu").manual_seed(0)
    scale = 3.0 + 4.0 * torch.rand(batch, 1, generator=g)
    inputs = {"realistic": (torch.randn(batch, vocab, generator=g) * scale).to(device),
              "flat": (torch.randn(batch, vocab, generator=g) * 0.3).to(device)}
    print(f"\nthe exact path's floor at [{batch}, {vocab}] (median ms, calls alternating; "
          f"map: T_k* alone with k* given, from cold, on the rows already sorted in float64: any "
          f"exact path pays at least a sort plus the map)")
    caps = args.floor_caps
    print(f"{'case':<40} {'k* median':>9} {'sort ms':>8} {'map ms':>8} {'call ms':>8} "
          f"{'map x sort':>10} {'call x sort':>11} {'call x map':>10}"
          + "".join(f" {f'k_max={cap} x sort':>17}" for cap in caps))
    for kind, kwargs in FLOOR_CASES:
        logits = inputs[kind]
        _, k = bregman_decode_logits(logits, return_k=True, **kwargs)
        alpha = torch.full((batch,), kwargs["alpha"], dtype=torch.float64, device=device)
        family = rows_family(kwargs["mode"], alpha.tolist(), False)
        cand = candidates(logits, vocab, logits=True)  # the sorted rows, float64 (not timed)

        def output_map(cand=cand, k=k, alpha=alpha, family=family, mode=kwargs["mode"]
                       ) -> torch.Tensor:  # (log T_k on the first max(k) columns, the path's)
            width = int(k.max())
            return log_renorm(family, mode, cand.log_x[:, :width], k, alpha,
                              log_deficit(cand, k))

        capped = [lambda logits=logits, kwargs=kwargs, cap=cap: bregman_decode_logits(
            logits, k_max=cap, **kwargs) for cap in caps]  # (a server's --max-support)
        sort, solve, call, *limited = _side_by_side(
            [lambda logits=logits: torch.sort(logits, -1, descending=True), output_map,
             lambda logits=logits, kwargs=kwargs: bregman_decode_logits(logits, **kwargs),
             *capped], device, max(1, args.repeats // 2))
        name = f"{kind} {kwargs['mode']} a={kwargs['alpha']:g} lam={kwargs['lam']:g}"
        print(f"{name:<40} {int(k.median()):9d} {sort * 1e3:8.1f} {solve * 1e3:8.1f} "
              f"{call * 1e3:8.1f} {solve / sort:10.2f} {call / sort:11.2f} {call / solve:10.2f}"
              + "".join(f" {seconds / sort:17.2f}" for seconds in limited), flush=True)


#: The sweep's grid (``--only sweep``): per mode, alphas across the accepted range, and for each
#: alpha the lambdas 10^(-alpha t), which put p^alpha / alpha (the scale of the gaps, eq. (6))
#: at every size of a row, from a few tokens to the whole vocabulary, on flat and peaked rows.
SWEEP_ALPHAS = {"primal": [0.01, 0.3, 0.7, 1.05, 1.2, 3.0, 7.5, 20.0, 100.0],
                "dual": [1.001, 1.01, 1.1, 1.3, 1.5001, 2.5, 4.0, 7.0, 20.0, 100.0]}
SWEEP_EXPONENTS = [1, 2, 3, 4, 4.5, 5, 5.5, 6, 7, 8, 10, 12, 15]


def sweep_lambdas(alpha: float) -> list[float]:
    """The lambdas of the sweep for ``alpha`` (distinct, within float64's range)."""
    values = [max(10.0 ** (-alpha * t), TINY) for t in SWEEP_EXPONENTS]
    return list(dict.fromkeys(values))


def sweep_table(args, device: str) -> None:
    """The counted work of one `bregman_decode_logits` call (elements and launched ops over the
    default configuration's on the same rows, `work`) across `SWEEP_ALPHAS` x `sweep_lambdas`,
    on flat and on peaked rows: per (mode, alpha) the costliest lambda, then the costliest of
    all against the bound ``WORK_BOUND``. The costliest lambda of each alpha is also timed,
    alternating with a full `torch.sort` of the same rows (``x sort``; with ``--baseline``,
    the old core on the same call beside them; ``--every-lambda``: every lambda timed beside
    the old core, the worst ratio per alpha printed). ``--quick``: every third alpha and
    lambda (a smoke run)."""
    batch, vocab = (int(x) for x in args.sweep_shape.lower().split("x"))
    old = load_baseline(args.baseline, "bregman_decode_logits") if args.baseline else None
    g = torch.Generator(device="cpu").manual_seed(0)
    scale = 3.0 + 4.0 * torch.rand(batch, 1, generator=g)
    inputs = {"peaked": torch.randn(batch, vocab, generator=g) * scale,
              "flat": torch.randn(batch, vocab, generator=g) * 0.3}
    print(f"\nsweep at [{batch}, {vocab}]: the costliest lambda of each alpha (lambda = "
          f"10^(-alpha t), t in {SWEEP_EXPONENTS}); work x / ops x: counted elements / "
          f"launched ops over the default call's (eager); x sort: its time over a full "
          f"torch.sort of the same rows, alternating")
    every = old is not None and args.every_lambda
    print(f"{'rows':<7} {'mode':<7} {'alpha':>7} {'lambda':>10} {'work x':>7} {'ops x':>6} "
          f"{'median k*':>9} {'cases':>5} {'x sort':>7}" + (f" {'old x sort':>10}" if old else "")
          + (f" {'worst new/old of every lambda':>30}" if every else ""))
    worst, worst_sort, worst_old, worst_ratio = (0.0, ""), (0.0, ""), (0.0, ""), (0.0, "")
    for kind, logits in inputs.items():
        logits = logits.to(device)

        def default_call(logits=logits):
            return bregman_decode_logits(logits, **EXTREMES["default primal a=1.5 lam=1e-2"])

        default_call()
        base = work(default_call)
        for mode, alphas in SWEEP_ALPHAS.items():
            for alpha in alphas[1::3] if args.quick else alphas:
                lambdas = sweep_lambdas(alpha)[::3] if args.quick else sweep_lambdas(alpha)
                rows, ratios = [], []
                for lam in lambdas:
                    call = lambda lam=lam, logits=logits, alpha=alpha, mode=mode: (  # noqa: E731
                        bregman_decode_logits(logits, alpha=alpha, lam=lam, mode=mode))
                    if every:  # (every lambda timed beside the old core, not only the costliest)
                        pair = _side_by_side([call, lambda lam=lam, logits=logits, alpha=alpha,
                                              mode=mode: old(logits, alpha=alpha, lam=lam,
                                                             mode=mode)],
                                             device, max(1, args.repeats // 2))
                        ratios.append((pair[0] / pair[1], lam))
                    out = call()
                    if bool(out.isnan().any()) or not bool(
                            torch.isfinite(torch.logsumexp(out.double(), -1)).all()):
                        raise AssertionError(f"not a distribution: {mode} {alpha} {lam}")
                    elements, launches, _ = work(call)
                    k = int((out > -math.inf).sum(-1).float().median())
                    rows.append((max(elements / base[0], launches / base[1]), lam,
                                 elements / base[0], launches / base[1], k))
                top = max(rows)
                lam = top[1]
                calls = [lambda logits=logits: torch.sort(logits, -1, descending=True),
                         lambda logits=logits, alpha=alpha, mode=mode, lam=lam:
                         bregman_decode_logits(logits, alpha=alpha, lam=lam, mode=mode)]
                if old is not None:
                    calls.append(lambda logits=logits, alpha=alpha, mode=mode, lam=lam:
                                 old(logits, alpha=alpha, lam=lam, mode=mode))
                seconds = _side_by_side(calls, device, max(1, args.repeats // 2))
                line = (f"{kind:<7} {mode:<7} {alpha:>7g} {lam:>10.3g} {top[2]:>7.1f} "
                        f"{top[3]:>6.1f} {top[4]:>9d} {len(rows):>5d} "
                        f"{seconds[1] / seconds[0]:>7.2f}")
                if old is not None:
                    line += f" {seconds[2] / seconds[0]:>10.2f}"
                    worst_old = max(worst_old, (seconds[2] / seconds[0], line))
                if every:
                    ratio, at = max(ratios)
                    line += f" {ratio:>19.2f} at {at:>7.3g}"
                    worst_ratio = max(worst_ratio, (ratio, f"{kind} {mode} {alpha:g} {at:.3g}"))
                print(line, flush=True)
                worst = max(worst, (top[0], line))
                worst_sort = max(worst_sort, (seconds[1] / seconds[0], line))
    print(f"worst counted multiple {worst[0]:.1f}x ({' '.join(worst[1].split())}); "
          f"bound M = {WORK_BOUND:.0f}x")
    if every:
        print(f"every lambda: worst time over the old core's {worst_ratio[0]:.2f}x "
              f"({worst_ratio[1]})")
    print(f"worst multiple of a sort of the same rows {worst_sort[0]:.2f}x "
          f"({' '.join(worst_sort[1].split())})"
          + (f"; old core {worst_old[0]:.2f}x ({' '.join(worst_old[1].split())})" if old
             else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 32, 64])
    parser.add_argument("--vocab", type=int, nargs="*", default=[49152, 128256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats")
    parser.add_argument("--step-shapes", nargs="*", default=["64x128256", "256x128256"],
                        help="shapes BxV of the GPU-readiness table (none: skip it)")
    parser.add_argument("--only", choices=["ratios", "steps", "extremes", "sweep", "floor"],
                        help="run only the ratio tables, the GPU-readiness table, the "
                             "extreme-parameter table, the parameter sweep or the exact "
                             "path's floor")
    parser.add_argument("--extremes-shape", default="64x49152",
                        help="BxV of the extreme-parameter table")
    parser.add_argument("--sweep-shape", default="8x49152", help="BxV of the parameter sweep")
    parser.add_argument("--every-lambda", action="store_true",
                        help="--only sweep --baseline REV: also time every lambda of each alpha "
                             "beside the old core, not only the costliest, and print the worst")
    parser.add_argument("--floor-caps", type=int, nargs="*", default=[4096, 1024],
                        help="--only floor: also each case with these k_max (a server's "
                             "--max-support)")
    parser.add_argument("--baseline", metavar="REV",
                        help="ratio tables: also time the core of git revision REV, "
                             "interleaved (e.g. 3ef72a5, the core before the fixed-shape step)")
    parser.add_argument("--skip-typical", action="store_true",
                        help="ratio tables: only the worst cases")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.vocab, args.repeats = [1, 4], [4096], 2
        args.step_shapes = ["4x4096"]
        args.extremes_shape = "4x4096"
        args.sweep_shape = "4x4096"
    device = args.device
    torch.manual_seed(0)
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if device.startswith("cuda"):
        print(f"gpu {torch.cuda.get_device_name()}")
    if args.only in (None, "ratios"):
        ratio_tables(args, device)
    if args.only in (None, "extremes"):
        extremes_table(args, device)
    if args.only in (None, "sweep"):
        sweep_table(args, device)
    if args.only == "floor":
        floor_table(args, device)
    if args.only not in ("ratios", "extremes", "sweep", "floor") and args.step_shapes:
        print("\nGPU readiness: one bregman_decode_logits call per configuration")
        for shape in args.step_shapes:
            batch, vocab = (int(x) for x in shape.lower().split("x"))
            step_table(batch, vocab, device, args.repeats)


def print_timings(timings: dict[str, float], shape: list[int], extra: dict[str, str] | None = None
                  ) -> None:
    """One line per case: ms, the ratio to softmax, and for a baseline row new / old."""
    base = timings["torch.softmax"]
    for name, seconds in timings.items():
        note = (extra or {}).get(name, "")
        if name.startswith(BASELINE_LABEL):
            current = timings[name[len(BASELINE_LABEL):]]
            note = f"  new/old {current / seconds:.2f}"
        print(f"{shape!s:>14} {name:<34} {seconds * 1e3:9.3f} {seconds / base:10.2f}{note}")


def ratio_tables(args, device: str) -> None:
    top_p = vllm_top_p()
    baseline = load_baseline(args.baseline) if args.baseline else None
    if baseline is not None:
        print(f"baseline: the core of {args.baseline}, interleaved with this one")
    header = f"{'shape':>14} {'case':<34} {'ms':>9} {'x softmax':>10}"
    for vocab in [] if args.skip_typical else args.vocab:
        for batch in args.batch:
            p = realistic_probs(batch, vocab, device)
            logits = torch.log(p)
            print(f"\n[{batch}, {vocab}] {describe(p)}")
            print(header)
            cases = with_baseline(decode_cases(p, logits, top_p, device), baseline, p, False)
            print_timings(measure(cases, device, args.repeats), [batch, vocab])

    # Worst cases: k* in the thousands (flat rows, tiny lambda) and lambda = 0.
    vocab, batch = args.vocab[-1], args.batch[-1]
    flat = realistic_probs(batch, vocab, device, seed=1, flat=True)
    flat_logits = torch.log(flat)
    print(f"\nworst cases at [{batch}, {vocab}], flat rows: {describe(flat)}")
    print(header)
    worst = with_baseline({
        "torch.softmax": lambda: torch.softmax(flat_logits, -1),
        **decoder_cases(bregman_decode, flat, worst=True),
        "torch.sort (full rows)": lambda: torch.sort(flat, -1, descending=True),
    }, baseline, flat, True)
    timings = measure(worst, device, max(2, args.repeats // 2))
    k_values = {
        "primal a=1.5 lam=1e-9 (flat)": bregman_decode(flat, alpha=1.5, lam=1e-9).k,
        "primal a=1 lam=1e-5 (flat)": bregman_decode(flat, alpha=1.0, lam=1e-5).k,
        "primal a=3 lam=1e-9 (flat)": bregman_decode(flat, alpha=3.0, lam=1e-9).k,
    }
    print_timings(timings, [batch, vocab], {
        name: f"  (median k* {int(k.float().median().item())})" for name, k in k_values.items()})


if __name__ == "__main__":
    main()
