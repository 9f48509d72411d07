"""The one writer of decoded rows: log q on the support, -inf (logits) or 0 (probabilities) off it.

Both the fixed-shape step (`step`, every row of a pass at once, rows chosen by a device mask)
and the exact path (`search`, the rows it finished, chosen on the host) write with
`write_support`; `output_values` turns log q into what is written. The write is the step's one
pass over the batch that is not a read: off the support a row is filled (write-only), its K
support values are scattered in; nothing else of the row is read.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

#: Device types whose write fills rows with a read-write op (a one-sided clamp, a product)
#: instead of the write-only masked fill: on a CPU the masked fill with a per-row mask is a
#: scalar loop, 6 to 8 times slower than a vectorized clamp (3.1 ms against 0.5 ms at
#: [64, 128256]); on a GPU the write-only fill saves a read of the batch.
READ_WRITE_FILL: dict[str, bool] = {"cpu": True}


def output_values(log_q: Tensor, logits: bool, dtype: torch.dtype,
                  temperature: Tensor | None = None) -> Tensor:
    """The values written for log q ([n, K]): log q itself (logits; times the row's temperature
    ``temperature`` [n] when the caller divides the logits by it afterwards, as vLLM's Model
    Runner V2 does), or q (probabilities), in the output dtype."""
    if not logits:
        return torch.exp(log_q).to(dtype)
    if temperature is not None:
        log_q = log_q * temperature.to(log_q.dtype).unsqueeze(-1)
    return log_q.to(dtype)


def write_support(out: Tensor | None, index: Tensor, values: Tensor, fill: float, *,
                  keep: Tensor | None = None, rows: Tensor | None = None,
                  source: Tensor | None = None) -> Tensor:
    """Write decoded rows into ``out`` ([N, V], in place): ``fill`` everywhere, then ``values``
    ([n, K]) at ``index`` ([n, K]).

    ``keep`` ([N] bool, one row of ``index`` per row of ``out``): only those rows are written,
    the others keep their values (a fixed sequence of ops, no sync); with ``source`` instead of
    ``out``, a new tensor holding ``source``'s rows, written the same way (one read of
    ``source``, one write). ``rows`` ([n] positions in ``out``, known on the host): only those
    rows are written. Returns the written tensor.
    """
    if rows is not None:
        assert out is not None
        out.index_fill_(0, rows, fill)
        # (row, column) pairs: ``out`` may be a strided view (the caller's scores, in place).
        out.index_put_((rows.unsqueeze(-1).expand_as(index), index), values)
        return out
    assert keep is not None
    keep = keep.unsqueeze(-1)
    device = (out if out is not None else source).device
    if READ_WRITE_FILL.get(device.type):
        if fill == 0.0:  # probabilities: kept rows are finite, the others are multiplied by 1
            factor = (~keep).to(values.dtype)
            out = source * factor if out is None else out.mul_(factor)
        else:  # -inf: a one-sided bound, +inf on the rows not kept
            bound = torch.where(keep, fill, math.inf).to(values.dtype)
            out = torch.minimum(source, bound) if out is None else out.clamp_(max=bound)
    elif out is None:
        out = source.masked_fill(keep, fill)
    else:
        out.masked_fill_(keep, fill)
    # Rows not kept get their own values back at ``index`` (K entries per row).
    return out.scatter_(1, index, torch.where(keep, values, torch.gather(out, 1, index)))
