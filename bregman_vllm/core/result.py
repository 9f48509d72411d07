"""What one decoding step returns, whichever backend ran it (a leaf: imports only torch)."""

from __future__ import annotations

from typing import NamedTuple

import torch

Tensor = torch.Tensor


class StepResult(NamedTuple):
    """The decoded batch, the support size per row and the rows handed to the search."""

    out: Tensor  # [N, V] the decoded batch (``scores`` itself when in place)
    k: Tensor  # [N] support size per row, on the device (0 for rows not decoded)
    #: Rows the window handed to the search (a host int, read at the step's one sync; 0 when
    #: the step did not sync). Rows only the search decodes are not counted.
    exact_rows: int
