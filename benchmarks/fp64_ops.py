"""Float64 operations per row of the Triton step, counted under Triton's interpreter.

The target GPU (an L40S) runs float64 at 1/64 of its float32 rate, so issue 35 asks how many
float64 operations each row costs, per family and path. Counted here by running the kernels
under Triton's interpreter (``TRITON_INTERPRET=1``, set below; CPU tensors) with the
interpreter's builder patched: every elementwise operation whose operands or result are float64
counts as many operations as it has elements (a GPU computes every lane of a vector, masked or
not; a scalar counts 1), split into

* ``arith``: add, sub, mul, div, fma, neg, abs, min / max, comparisons, selects (``where``);
* ``transc``: exp, log, sqrt (libdevice calls on a GPU: each is tens of float64 instructions);
* ``reduce``: the elements of float64 sums, maxima and scans.

Each case is one row (its request alone in a batch of one) at [1, 8192]; the kernels are the
step's (`kernels.step`), counted per kernel: ``decode`` (the window) and ``search`` (the search
pass's kernel, at the candidates the layout chose: 64, 256, or the widest, 512 under the
interpreter and 1024 on a GPU, where the search's vector ops count about twice as many lanes)
and ``wide`` (the wide pass's kernel, over the whole sorted row in blocks of 256 entries under
the interpreter and 1024 on a GPU: a partly used block counts all its lanes, so the GPU's
counts are up to four times these on the blocks a sum stops in).
The read and select kernels are float32 but for the candidates' normalization (a few float64
operations per candidate) and are left out.

    python benchmarks/fp64_ops.py            # prints the table (about a minute on a CPU)
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import collections
import sys

import numpy as np
import torch
from triton.runtime import interpreter

from bregman_vllm.adapter.processor import request_params
from bregman_vllm.backend import decode
from bregman_vllm.core.plan import plan_requests
from bregman_vllm.kernels import step

#: (name, path, request): every family on each path it can take.
CASES = [
    ("KL lambda 1e-2", "window 64", {"bregman_alpha": 1.0, "bregman_lambda": 1e-2}),
    ("primal 3/2 lambda 1e-2", "window 64", {"bregman_alpha": 1.5, "bregman_lambda": 1e-2}),
    ("power 3 lambda 1e-3", "window 64", {"bregman_alpha": 3.0, "bregman_lambda": 1e-3}),
    ("dual 3/2 lambda 1e-2", "window 64",
     {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 1e-2}),
    ("KL lambda 1e-3", "window 256", {"bregman_alpha": 1.0, "bregman_lambda": 1e-3}),
    ("primal 10 lambda 1e-3", "search 64", {"bregman_alpha": 10.0, "bregman_lambda": 1e-3}),
    ("primal 0.5 k_max 50", "search 64",
     {"bregman_alpha": 0.5, "bregman_lambda": 1e-3, "bregman_k_max": 50}),
    ("primal 1.05 k_max 60", "search 64",
     {"bregman_alpha": 1.05, "bregman_lambda": 1e-3, "bregman_k_max": 60}),
    ("dual 4 lambda 1e-3", "search 64",
     {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_lambda": 1e-3}),
    ("dual 10 lambda 1e-3", "search 64",
     {"bregman_mode": "dual", "bregman_alpha": 10.0, "bregman_lambda": 1e-3}),
    ("dual 1.2 k_max 60", "search 64",
     {"bregman_mode": "dual", "bregman_alpha": 1.2, "bregman_lambda": 1e-3, "bregman_k_max": 60}),
    ("primal 10 top_k 40", "search 64 (fixed)", {"bregman_alpha": 10.0, "bregman_top_k": 40}),
    ("dual 4 top_k 40", "search 64 (fixed)",
     {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_top_k": 40}),
    ("KL lambda 2e-4 k_max 500", "past: search wide",
     {"bregman_alpha": 1.0, "bregman_lambda": 2e-4, "bregman_k_max": 500}),
    ("power 3 lambda 1e-8 k_max 500", "past: search wide",
     {"bregman_alpha": 3.0, "bregman_lambda": 1e-8, "bregman_k_max": 500}),
    ("dual 3/2 lambda 1e-6 k_max 500", "past: search wide",
     {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 1e-6,
      "bregman_k_max": 500}),
    ("primal 1.05 lambda 1e-4 k_max 500", "past: search wide",
     {"bregman_alpha": 1.05, "bregman_lambda": 1e-4, "bregman_k_max": 500}),
    ("dual 1.2 lambda 1e-4 k_max 500", "past: search wide",
     {"bregman_mode": "dual", "bregman_alpha": 1.2, "bregman_lambda": 1e-4,
      "bregman_k_max": 500}),
    ("primal 3/2 top_k 300", "search wide (fixed)", {"bregman_alpha": 1.5, "bregman_top_k": 300}),
    ("KL lambda 2e-4", "past: wide pass", {"bregman_alpha": 1.0, "bregman_lambda": 2e-4}),
    ("primal 2 lambda 1e-6", "past: wide pass", {"bregman_alpha": 2.0, "bregman_lambda": 1e-6}),
    ("primal 10 lambda 1e-32", "past: wide pass",
     {"bregman_alpha": 10.0, "bregman_lambda": 1e-32}),
    ("primal 0.5 lambda 3e-2", "past: wide pass", {"bregman_alpha": 0.5, "bregman_lambda": 3e-2}),
    ("dual 3/2 lambda 1e-5", "past: wide pass",
     {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 1e-5}),
    ("dual 4 lambda 1e-14", "past: wide pass",
     {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_lambda": 1e-14}),
    ("dual 1.2 lambda 3e-4", "past: wide pass",
     {"bregman_mode": "dual", "bregman_alpha": 1.2, "bregman_lambda": 3e-4}),
    ("primal 10 top_k 1500", "past: wide pass (fixed)",
     {"bregman_alpha": 10.0, "bregman_top_k": 1500}),
    ("KL top_k 1500", "past: wide pass (fixed)", {"bregman_alpha": 1.0, "bregman_top_k": 1500}),
]
#: The kernels counted (the read and select kernels: see above; the write kernel has none).
KERNELS = ("_decode_kernel", "_search_kernel", "wide_kernel")

_ARITH = {"create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_frem",
          "create_fneg", "create_precise_divf", "create_minimumf", "create_maximumf",
          "create_minnumf", "create_maxnumf", "create_fma", "create_clampf", "create_fabs",
          "create_select"} | {name for name in dir(interpreter.InterpreterBuilder)
                              if name.startswith("create_fcmp")}
_TRANSCENDENTAL = {"create_exp", "create_log", "create_sqrt", "create_precise_sqrt",
                   "create_exp2", "create_log2"}


class Counter:
    """float64 element operations by kind, while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.counts: collections.Counter[str] = collections.Counter()

    def install(self) -> None:
        builder = interpreter.InterpreterBuilder
        for name in _ARITH | _TRANSCENDENTAL:
            if hasattr(builder, name):
                setattr(builder, name, self._wrap(getattr(builder, name),
                                                  "transc" if name in _TRANSCENDENTAL
                                                  else "arith"))
        reduce_apply = interpreter.ReduceScanOpInterface.apply

        def apply(op, input):
            if self.active and isinstance(input, tuple):  # (a single input comes back as one)
                for tensor in input:
                    data = getattr(tensor.handle, "data", None)
                    if data is not None and data.dtype == np.float64:
                        self.counts["reduce"] += data.size
            return reduce_apply(op, input)

        interpreter.ReduceScanOpInterface.apply = apply

    def _wrap(self, method, kind):
        def counted(builder, *args):
            out = method(builder, *args)
            if self.active:
                data = [a.data for a in (*args, out) if hasattr(a, "data")]
                if any(d.dtype == np.float64 for d in data):
                    self.counts[kind] += max(d.size for d in data)
            return out
        return counted


def main() -> int:
    counter = Counter()
    counter.install()
    per_kernel: dict[str, collections.Counter[str]] = {}
    launch = step._launch

    def counted_launch(kernel, grid, *args, **meta):
        name = kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel)
        counter.counts = per_kernel.setdefault(name, collections.Counter())
        counter.active = name in KERNELS
        try:
            launch(kernel, grid, *args, **meta)
        finally:
            counter.active = False

    step._launch = counted_launch
    vocab = 8192
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(1, vocab, generator=g) * 0.8
    peaked = torch.randn(1, vocab, generator=g) * 3.0
    print(f"float64 element operations per row at [1, {vocab}] (C: the search's candidates)")
    print(f"{'case':36s} {'path':22s} {'k*':>5s} {'kernel':8s} {'arith':>10s} "
          f"{'transc':>9s} {'reduce':>9s}")
    for name, path, config in CASES:
        scores = flat if path.startswith("past") else peaked
        plan = plan_requests([(0, request_params(config))], batch=1, vocab=vocab,
                             device="cpu")
        per_kernel.clear()
        out = decode(scores.clone(), plan, logits=True, backend="triton")
        for kernel in KERNELS:
            counts = per_kernel.get(kernel)
            if not counts:
                continue
            label = kernel.strip("_").removesuffix("_kernel")
            print(f"{name:36s} {path:22s} {int(out.k[0]):5d} {label:8s} "
                  f"{counts['arith']:10d} {counts['transc']:9d} {counts['reduce']:9d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
