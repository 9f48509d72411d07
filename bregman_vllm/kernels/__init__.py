"""The Triton kernels of the decoding step (imports Triton; `bregman_vllm.core` imports this
package only when ``BREGMAN_BACKEND`` chooses it: `core.step.backend`).

    formulas   the step's formulas as Triton functions, one per torch function they restate
    step       the four kernels, the hand-off to the exact path, the warm-up
"""

from .formulas import INTERPRET
from .step import KernelStep, decode, decode_plan, usable, warm_up

#: The kernels run under Triton's interpreter (CPU tensors).
INTERPRETED = bool(INTERPRET)

__all__ = ["INTERPRETED", "KernelStep", "decode", "decode_plan", "usable", "warm_up"]
