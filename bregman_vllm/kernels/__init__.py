"""The Triton kernels of the decoding step (imports Triton; `bregman_vllm.core` imports this
package only when ``BREGMAN_BACKEND`` chooses it: `core.step.backend`).

    formulas   the step's formulas as Triton functions, one per torch function they restate
    search     the search (`core.search`) on one row's candidates, in registers
    wide       the same search over a whole sorted row in global memory, a block at a time
    step       the kernels and their launches (four; six with the search pass; seven and a
               sort with the wide pass), the warm-up
"""

from .formulas import INTERPRET
from .step import KernelStep, decode, decode_plan, usable, warm_up

#: The kernels run under Triton's interpreter (CPU tensors).
INTERPRETED = bool(INTERPRET)

__all__ = ["INTERPRETED", "KernelStep", "decode", "decode_plan", "usable", "warm_up"]
