"""The Triton kernels of the CUDA step beside the torch step, on a GPU (issue 24's run).

Sections (``--only`` runs one), in order:

1. ``warm-up``: seconds to compile every kernel a processor's steps run
   (`bregman_vllm.kernels.warm_up`); run it in a fresh process with an empty
   ``TRITON_CACHE_DIR`` for the cold figure, again for a restart (from the cache);
2. ``exact``: at ``--check-shape`` (default [256, 128256]), every family decoded by the kernels
   against the torch step on the same device, in float32 and in float64: rows with the same k*
   and the largest |q - q_torch|;
3. ``time``: GPU time (CUDA events around one in-place step, as the processor runs it; medians)
   of the default configuration and every family, kernels and torch step, beside
   ``torch.softmax`` and ``torch.sort`` of the same batch, at each ``--shapes``, with the
   ratio to the softmax (targets: the default at most 2x, every family at most 3x at
   [256, 128256]), and the host time of the call (what the launches cost);
4. ``flat``: the worst cases, flat rows whose k* is in the tens of thousands (the kernels' wide
   pass: one sort of the batch and the search over whole rows), beside a full ``torch.sort``
   (target: at most one sort);
5. ``counts``: launches (kernel launches plus torch ops, `bregman_vllm.diagnostics.
   DispatchCounter`) and host syncs of one step per family;
6. ``recompiles``: kernels compiled by steps over batch sizes 1 to 256 after the warm-up (0:
   the warm-up covered every variant);
7. ``compile`` (only when named): every kernel variant compiled for a CUDA architecture
   (``--arch``, default 90) without a GPU, through Triton's own ptxas: compile seconds,
   registers per thread and local memory (spills), from ``cuobjdump``.

Needs torch and triton only (no vLLM). ``--smoke`` runs every section at tiny shapes on the
CPU under Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported; tested):

    python benchmarks/bench_triton.py                              # on a GPU
    TRITON_INTERPRET=1 python benchmarks/bench_triton.py --smoke   # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bregman_vllm.backend import decode as decode_step
from bregman_vllm.core.plan import Plan, make_plan, plan_requests
from bregman_vllm.diagnostics import DispatchCounter
from bregman_vllm.params import BregmanParams

#: Every family the kernels decode (as `bregman_decode_logits` keywords).
FAMILIES: dict[str, dict] = {
    "default primal a=1.5 lam=1e-2": dict(alpha=1.5, lam=1e-2),
    "primal a=1 lam=1e-2 (KL)": dict(alpha=1.0, lam=1e-2),
    "primal a=1 lam=1e-3 (KL, window 256)": dict(alpha=1.0, lam=1e-3),
    "primal a=2 lam=1e-2": dict(alpha=2.0, lam=1e-2),
    "primal a=3 lam=1e-3 (Newton)": dict(alpha=3.0, lam=1e-3),
    "primal a=3 lam=1e-3 k_max=50": dict(alpha=3.0, lam=1e-3, k_max=50),
    "dual a=1.5 lam=1e-2": dict(alpha=1.5, lam=1e-2, mode="dual"),
    "dual a=3 lam=1e-2": dict(alpha=3.0, lam=1e-2, mode="dual"),
    "top_k=50 a=1.5": dict(alpha=1.5, lam=0.0, top_k=50),
    "top_k=50 a=inf (water)": dict(alpha=math.inf, lam=0.0, top_k=50),
    "top_k=50 a=-inf (argmax)": dict(alpha=-math.inf, lam=0.0, top_k=50),
    "top_k=50 a=3": dict(alpha=3.0, lam=0.0, top_k=50),
    "keep all (lam=0)": dict(alpha=1.5, lam=0.0),
    # (the search pass: families without a window formula, supports past the window)
    "primal a=10 lam=1e-3 (search)": dict(alpha=10.0, lam=1e-3),
    "primal a=0.5 lam=1e-2 k_max=1024 (search)": dict(alpha=0.5, lam=1e-2, k_max=1024),
    "dual a=1.2 lam=1e-2 (search)": dict(alpha=1.2, lam=1e-2, mode="dual"),
    "dual a=4 lam=1e-3 (search)": dict(alpha=4.0, lam=1e-3, mode="dual"),
    "primal a=1.5 lam=1e-6 k_max=1024 (search)": dict(alpha=1.5, lam=1e-6, k_max=1024),
    # (the wide pass: rows whose k* may pass the search's candidates, a fixed size past them)
    "primal a=10 lam=1e-60 (wide)": dict(alpha=10.0, lam=1e-60),
    "dual a=4 lam=1e-30 (wide)": dict(alpha=4.0, lam=1e-30, mode="dual"),
    "top_k=2000 a=1.5 (wide)": dict(alpha=1.5, lam=0.0, top_k=2000),
    "mixed: every family, one batch": {},
}
#: The configurations the timed section runs.
TIMED = dict(FAMILIES)
#: The flat worst cases (k* in the tens of thousands on flat rows).
FLAT: dict[str, dict] = {
    "primal a=1.5 lam=1e-9": dict(alpha=1.5, lam=1e-9),
    "primal a=1 lam=1e-5": dict(alpha=1.0, lam=1e-5),
    "primal a=3 lam=1e-9": dict(alpha=3.0, lam=1e-9),
    "dual a=3 lam=1e-9": dict(alpha=3.0, lam=1e-9, mode="dual"),
    # (a server's default largest support: the search pass, no wide pass)
    "primal a=1.5 lam=1e-9 k_max=1024": dict(alpha=1.5, lam=1e-9, k_max=1024),
    "dual a=3 lam=1e-9 k_max=1024": dict(alpha=3.0, lam=1e-9, mode="dual", k_max=1024),
}


FLAT_TIMED = dict(FLAT)


def model_logits(batch: int, vocab: int, device: str, flat: bool = False, seed: int = 0
                 ) -> torch.Tensor:
    """Gaussian logits, per-row scale 3 to 7 (peaked rows like a language model's), or 0.3
    (flat rows)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.full((batch, 1), 0.3) if flat else 3.0 + 4.0 * torch.rand(batch, 1, generator=g)
    return (torch.randn(batch, vocab, generator=g) * scale).to(device)


def plan_for(name: str, kwargs: dict, batch: int, vocab: int, device: str) -> Plan:
    """The plan of a configuration: one parameter set, or (the mixed batch) the rows cycling
    over every other configuration."""
    if name.startswith("mixed"):
        configs = [config for key, config in FAMILIES.items() if not key.startswith("mixed")]
        rows = []
        for row in range(batch):
            config = dict(configs[row % len(configs)])
            alpha = config.pop("alpha")
            config["lam"] = config.pop("lam")
            rows.append((row, BregmanParams(alpha=alpha, **config)))
        return plan_requests(rows, batch=batch, vocab=vocab, device=device)
    return make_plan(kwargs.get("mode", "primal"), kwargs["alpha"], kwargs["lam"],
                     kwargs.get("top_k"), kwargs.get("k_max"), batch_shape=batch, vocab=vocab,
                     device=device)


def step(scores: torch.Tensor, plan: Plan, backend: str):
    return decode_step(scores, plan, logits=True, inplace=True, backend=backend)


def gpu_time(call: Callable[[], object], restore: Callable[[], object], device: str,
             repeats: int) -> tuple[float, float]:
    """(median device ms, median host ms) of ``call``, ``restore`` run before each outside
    the timing (the in-place step needs its logits back)."""
    gpu, host = [], []
    for _ in range(repeats + 1):
        restore()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            began = time.perf_counter()
            call()
            host.append((time.perf_counter() - began) * 1e3)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            call()
            host.append((time.perf_counter() - began) * 1e3)
            gpu.append(host[-1])
    return statistics.median(gpu[1:]), statistics.median(host[1:])


# ----------------------------------------------------------------------------- sections


def warm_up(args) -> None:
    from bregman_vllm import kernels

    seconds = kernels.warm_up(args.device, args.vocab)
    print(f"warm-up: {seconds:.1f} s to compile (or load) every kernel for vocabulary "
          f"{args.vocab}; kernels compiled: {compiled()}")


def exactness(args) -> None:
    batch, vocab = args.check_shape
    print(f"\nexactness at [{batch}, {vocab}]: the kernels against the torch step on "
          f"{args.device} (rows with the same k*, largest |q - q_torch|)")
    logits = model_logits(batch, vocab, args.device, seed=1)
    total = {"rows": 0, "same": 0, "error": 0.0}
    for name, kwargs in FAMILIES.items():
        got = step(logits.clone(), plan_for(name, kwargs, batch, vocab, args.device), "triton")
        line = f"  {name:<40}"
        for dtype in (torch.float32, torch.float64):
            # (a copy: the step decodes in place, and .to() of a float32 tensor is the tensor)
            want = step(logits.to(dtype, copy=True),
                        plan_for(name, kwargs, batch, vocab, args.device), "torch")
            decoded = want.k > 0
            same = int(((got.k == want.k) & decoded).sum())
            error = float((got.out.double().exp() - want.out.double().exp()).abs().max())
            line += f"  vs torch {str(dtype)[6:]}: k* {same}/{int(decoded.sum())} " \
                    f"|dq| {error:.1e}"
            if dtype == torch.float64:
                total["rows"] += int(decoded.sum())
                total["same"] += same
                total["error"] = max(total["error"], error)
        print(line + ("" if error <= 1e-5 and same == int(decoded.sum()) else "   <- differs"))
    assert torch.equal(logits, model_logits(batch, vocab, args.device, seed=1)), \
        "the exactness section decoded its own input"
    print(f"  in all: {total['same']}/{total['rows']} rows with the float64 step's k*, "
          f"largest |q - q64| {total['error']:.1e}")


def timings(args) -> None:
    for batch, vocab in args.shapes:
        time_shape(batch, vocab, args)


def time_shape(batch: int, vocab: int, args) -> None:
    logits = model_logits(batch, vocab, args.device)
    scores = logits.clone()

    def restore():
        scores.copy_(logits)

    print(f"\n[{batch}, {vocab}] one in-place step (GPU ms: CUDA events; host ms: the "
          f"call's own time; x sm: GPU time over torch.softmax's)")
    print(f"  {'case':<40} {'gpu ms':>8} {'host ms':>8} {'x sm':>7}")
    base, _ = gpu_time(lambda: torch.softmax(scores, -1), restore, args.device, args.repeats)
    rows = {"torch.softmax": (base, None),
            "torch.sort": gpu_time(lambda: torch.sort(scores, -1, descending=True), restore,
                                   args.device, args.repeats)}
    for name, (gpu, host) in rows.items():
        print(f"  {name:<40} {gpu:8.3f} {'' if host is None else f'{host:8.3f}':>8} "
              f"{gpu / base:7.2f}")
    for name, kwargs in TIMED.items():
        plan = plan_for(name, kwargs, batch, vocab, args.device)
        for backend in ("triton", "torch"):
            step(scores, plan, backend)  # (the plan's tables and constants)
            gpu, host = gpu_time(lambda plan=plan, backend=backend: step(scores, plan, backend),
                                 restore, args.device, args.repeats)
            label = f"{name} [{'kernels' if backend == 'triton' else 'torch'}]"
            print(f"  {label:<40} {gpu:8.3f} {host:8.3f} {gpu / base:7.2f}")


def flat_cases(args) -> None:
    batch, vocab = args.flat_shape
    logits = model_logits(batch, vocab, args.device, flat=True, seed=2)
    scores = logits.clone()

    def restore():
        scores.copy_(logits)

    print(f"\nflat worst cases at [{batch}, {vocab}] (k* in the tens of thousands: the wide "
          "pass), GPU ms and x a full torch.sort")
    sort, _ = gpu_time(lambda: torch.sort(scores, -1, descending=True), restore, args.device,
                       args.repeats)
    print(f"  {'torch.sort':<40} {sort:8.3f} {1.0:7.2f}")
    for name, kwargs in FLAT_TIMED.items():
        plan = plan_for(name, kwargs, batch, vocab, args.device)
        for backend in ("triton", "torch"):
            restore()
            k = step(scores, plan, backend).k
            gpu, _ = gpu_time(lambda plan=plan, backend=backend: step(scores, plan, backend),
                              restore, args.device, max(1, args.repeats // 3))
            label = f"{name} [{'kernels' if backend == 'triton' else 'torch'}]"
            print(f"  {label:<40} {gpu:8.3f} {gpu / sort:7.2f}  (median k* "
                  f"{int(k.float().median())})")


def counts(args) -> None:
    from torch.utils._python_dispatch import _disable_current_modes

    from bregman_vllm.kernels import step as kernel_step

    batch, vocab = args.check_shape
    logits = model_logits(batch, vocab, args.device, seed=3)
    real = kernel_step._launch
    launched: list[object] = []

    def launch(kernel, grid, *rest, **meta):
        launched.append(kernel)
        with _disable_current_modes():  # (the interpreter's own torch ops are no launches)
            real(kernel, grid, *rest, **meta)

    kernel_step._launch = launch
    print(f"\nlaunches and syncs of one in-place step at [{batch}, {vocab}] (kernel launches "
          "+ torch ops; DispatchCounter)")
    try:
        for name, kwargs in FAMILIES.items():
            plan = plan_for(name, kwargs, batch, vocab, args.device)
            step(logits.clone(), plan, "triton")
            scores = logits.clone()
            launched.clear()
            with DispatchCounter() as counter:
                step(scores, plan, "triton")
            print(f"  {name:<40} launches {len(launched)} + {counter.launches}, syncs "
                  f"{counter.syncs}")
    finally:
        kernel_step._launch = real


def compiled() -> int | str:
    """Kernel variants this process holds (compiled, or loaded from Triton's cache)."""
    from bregman_vllm.kernels import step as kernel_step

    try:
        return sum(len(cache[0]) for kernel in (kernel_step._read_kernel,
                                                 kernel_step._select_kernel,
                                                 kernel_step._decode_kernel,
                                                 kernel_step._write_kernel)
                   for cache in kernel.device_caches.values())
    except AttributeError:  # the interpreter, or another Triton: not counted
        return "n/a"


def recompiles(args) -> None:
    from bregman_vllm import kernels

    vocab = args.vocab
    kernels.warm_up(args.device, vocab)
    before = compiled()
    logits = model_logits(args.max_batch, vocab, args.device, seed=4)
    for batch in range(1, args.max_batch + 1):
        plan = plan_for("mixed", {}, batch, vocab, args.device)
        step(logits[:batch].clone(), plan, "triton")
    print(f"\nrecompiles: {before} kernels after the warm-up, {compiled()} after steps over "
          f"batch sizes 1 to {args.max_batch} (every family)")


#: Triton types of the kernels' arguments (for `compile_only`; runtime integers as i32).
_TYPES = dict(
    scores_ptr="*fp32", out_ptr="*fp32", stride="i32", out_stride="i32", vocab="i32",
    blocks="i32", map_ptr="*i64", family_ptr="*i32", route_ptr="*i8", fixed_ptr="*i32",
    size_ptr="*i64", alpha_ptr="*fp64", lam_ptr="*fp64", iterations_ptr="*i32",
    scale_ptr="*fp32", temperature_ptr="*fp32", row_mode_ptr="*i8", max_ptr="*fp32",
    mass_ptr="*fp32", x_ptr="*fp64", log_x_ptr="*fp64", deficit_ptr="*fp64",
    index_ptr="*i64", total_ptr="*fp64", valid_ptr="*i1", values_ptr="*fp32", k_ptr="*i64",
    mode_ptr="*i32", needs_ptr="*i1", flagged_ptr="*i32", low_ptr="*i64", shift_ptr="*fp64",
    bound_ptr="*fp64", found_ptr="*i64", found_values_ptr="*fp32", width="i32",
    past="i32", wide_ptr="*i64", wide_values_ptr="*fp32", wide_stride="i32",
    sorted_ptr="*fp32", tails_ptr="*fp64", tails_stride="i32", inner_ptr="*fp64",
    scores_stride="i32", row_len="i32")


def _variants(vocab: int, widths: list[int] | None = None
              ) -> list[tuple[str, object, dict, int]]:
    """Every (label, kernel, constexprs, warps) a processor's warm-up compiles for ``vocab``
    float32 logits (`kernels.step.warm_up`): both windows, and the search pass at each of its
    widths (``widths``: only those candidate counts)."""
    import triton

    from bregman_vllm.core.candidates import BLOCK, log_smallest, under_smallest
    from bregman_vllm.kernels import step as kernel_step

    blocks = triton.next_power_of_2(triton.cdiv(vocab, BLOCK))
    smallest = under_smallest(torch.float32)

    def select(width: int, gate: bool) -> dict:
        return dict(LOGITS=True, K=width, KB=min(width, blocks), NBP=blocks,
                    CHUNK=min(width, blocks, kernel_step.CHUNK), BLOCK=BLOCK,
                    SMALLEST=smallest, GATE=gate)

    out = [("read", kernel_step._read_kernel,
            dict(LOGITS=True, TILE=kernel_step.TILE, BLOCK=BLOCK), 4)]
    chosen = (lambda width: True) if not widths else (lambda width: width in widths)
    for width in filter(chosen, (kernel_step.WINDOW, kernel_step.WIDE_WINDOW)):
        out += [
            (f"select K={width}", kernel_step._select_kernel, select(width, False), 8),
            (f"decode K={width}", kernel_step._decode_kernel,
             dict(LOGITS=True, K=width, W=kernel_step.WINDOW,
                  LOG_SMALLEST=log_smallest(torch.float32)), 8),
            (f"write K={width}", kernel_step._write_kernel,
             dict(IN_PLACE=True, LOGITS=True, K=width, TILE=1024), 4)]
    for width in sorted({kernel_step.search_width(reach, vocab)[0]
                         for reach in kernel_step.SEARCH_WIDTHS}):
        if not chosen(width):
            continue
        out += [(f"select C={width}", kernel_step._select_kernel, select(width, True), 8),
                (f"search C={width}", kernel_step._search_kernel,
                 dict(LOGITS=True, C=width), 8)]
    if not widths or vocab in widths:
        out.append((f"wide V={vocab}", kernel_step.wide_kernel,
                    dict(LOGITS=True, SMALLEST=smallest, B=kernel_step.WIDE_BLOCK), 8))
    return out


def compile_only(args) -> None:
    """Compile every variant a processor's warm-up compiles, for ``--arch``, with no GPU: the
    seconds each takes from an empty cache (the cold start's JIT, on this host's CPU) and its
    registers and local memory (spills) per thread. Triton's type checks run here as on a GPU
    (the interpreter skips them)."""
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bregman_vllm.kernels import step as kernel_step

    if kernel_step.INTERPRET:
        raise SystemExit("--only compile needs Triton without TRITON_INTERPRET")
    dump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-triton-cache-")
    print(f"\nkernels compiled for sm_{args.arch} (no GPU), vocabulary {args.vocab}, from an "
          "empty cache")
    total = 0.0
    for label, kernel, constexprs, warps in _variants(args.vocab, args.widths):
        signature = {name: _TYPES[name] for name in kernel.arg_names if name not in constexprs}
        began = time.perf_counter()
        compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                  target=GPUTarget("cuda", args.arch, 32),
                                  options={"num_warps": warps})
        seconds = time.perf_counter() - began
        total += seconds
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([str(dump), "--dump-resource-usage", cubin.name],
                                   capture_output=True, text=True).stdout
        line = next((part for part in usage.splitlines() if "REG:" in part), "")
        found = {key: value for key, value in (item.split(":") for item in line.split()
                                                if item.split(":")[0] in ("REG", "LOCAL"))}
        print(f"  {label:<16} {seconds:7.1f} s  registers {found.get('REG', '?'):>4}  "
              f"local memory {found.get('LOCAL', '?')} bytes", flush=True)
    print(f"  in all {total:.1f} s")


SECTIONS = {"warm-up": warm_up, "exact": exactness, "time": timings, "flat": flat_cases,
            "counts": counts, "recompiles": recompiles, "compile": compile_only}
#: Sections run only when named (``--only``).
NAMED_ONLY = ("compile",)


def shape(text: str) -> tuple[int, int]:
    batch, vocab = (int(x) for x in text.lower().split("x"))
    return batch, vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", choices=list(SECTIONS), nargs="*")
    parser.add_argument("--skip", choices=list(SECTIONS), nargs="*", default=[])
    parser.add_argument("--shapes", type=shape, nargs="*",
                        default=[(64, 128256), (256, 128256)])
    parser.add_argument("--check-shape", type=shape, default=(256, 128256))
    parser.add_argument("--flat-shape", type=shape, default=(256, 128256))
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--arch", type=int, default=90, help="--only compile: sm_ARCH")
    parser.add_argument("--widths", type=int, nargs="*",
                        help="--only compile: only these candidate widths (default: all)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, 1 repeat (the CPU under the interpreter)")
    args = parser.parse_args()
    if args.smoke:  # (the timed sections on three configurations)
        # (a row of 1024: past the interpreter's widest search candidates, 512)
        args.shapes, args.check_shape, args.flat_shape = [(2, 512)], (3, 1024), (1, 1024)
        args.vocab, args.max_batch, args.repeats = 512, 2, 1
        for table in (TIMED, FLAT_TIMED):
            for name in list(table)[3:]:
                del table[name]
    import triton

    print(f"device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f", torch {torch.__version__}, triton {triton.__version__}")
    failed = []
    for name, section in SECTIONS.items():
        chosen = name in args.only if args.only else name not in NAMED_ONLY
        if chosen and name not in args.skip:
            try:  # (one failing section must not cost a GPU run the others' figures)
                section(args)
            except Exception:
                traceback.print_exc()
                failed.append(name)
    if failed:
        raise SystemExit(f"sections failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
