"""GPU readiness, measured on any device: host syncs, launched ops and peak extra memory.

A decoding step that runs on a GPU should launch few kernels and never wait for the device. Both
can be counted on the CPU by watching the ATen ops a call dispatches
(`torch.utils._python_dispatch.TorchDispatchMode`):

* **syncs**: ops whose result the host needs before it can go on (``.item()``, ``bool()`` and
  ``int()`` of a tensor, ``nonzero``, ``unique``, ``masked_select``, indexing with a boolean mask,
  ``repeat_interleave`` without an output size, ``.tolist()``), tensors made from host data
  (``torch.tensor([...])``) and copies between the host and a device;
* **launches**: every op that is not a view (on a GPU each one is at least one kernel launch);
* **elements**: the work of those ops, each counted as the element count of the largest tensor
  it reads or writes (a load-independent measure of a call's cost on a CPU, where the time of
  a step is about launches x overhead + elements x time per element);
* **passes** over the batch (with ``full``, the element count of the batch): ops that read a
  whole [n, V] tensor, and ops that write one (a new tensor or in place), one pass each; the
  time of a memory-bound GPU step is about passes x n x V x 4 bytes / bandwidth. Gathers and
  scatters of K entries per row, views and allocations are no pass; ``full_tensors`` counts the
  [n, V] tensors made (the output of an out-of-place call is one);
* **peak extra memory**: the largest number of bytes held at once by tensors the call created.

Example:
    >>> import torch
    >>> from bregman_vllm import bregman_decode_logits
    >>> logits = torch.randn(8, 1000)
    >>> with DispatchCounter() as counter:
    ...     _ = bregman_decode_logits(logits, alpha=1.5, lam=0.01, k_max=50)
    >>> counter.syncs
    0
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: A batch mixing six formula families (issue 10's configurations, as a request's
#: ``extra_args``) and a plain request: what the GPU-readiness tests and benchmarks cycle over
#: the rows of a batch.
MIXED_FAMILIES: list[dict[str, Any]] = [
    {"bregman_alpha": 1.0, "bregman_lambda": 1e-2},
    {"bregman_alpha": 1.5, "bregman_lambda": 1e-3},
    {"bregman_alpha": 2.0, "bregman_lambda": 1e-2, "bregman_k_max": 50},
    {"bregman_alpha": 3.0, "bregman_lambda": 1e-3},
    {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 1e-2},
    {"bregman_alpha": 1.5, "bregman_lambda": 0.0, "bregman_top_k": 50},
    {},  # a plain request
]

#: ATen ops that need a value on the host, or make a tensor from host data.
SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_numpy", "aten::unique",
    "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::masked_select", "aten::lift_fresh", "aten::is_nonzero", "aten::equal",
    "aten::item",
})
#: Ops that are bookkeeping, not kernels.
_NOT_LAUNCHES = frozenset({"aten::detach", "aten::alias", "aten::lift_fresh",
                           "aten::_local_scalar_dense", "aten::empty", "aten::empty_strided"})


def _qualified(func: Any) -> str:
    return func.overloadpacket._qualified_op_name


def _is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    if name in SYNC_OPS:
        return True
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                   for t in indices if t is not None)
    if name == "aten::repeat_interleave":
        return "output_size" not in kwargs or kwargs["output_size"] is None
    if name in ("aten::_to_copy", "aten::copy_", "aten::to"):
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        target = kwargs.get("device")
        if target is not None:
            devices.add(torch.device(target).type)
        return len(devices) > 1  # host <-> device
    return False


#: In-place ops that write their first argument without reading it.
_WRITE_ONLY = frozenset({"aten::fill_", "aten::zero_", "aten::masked_fill_", "aten::copy_",
                         "aten::index_fill_", "aten::index_copy_"})
#: In-place ops that write K entries per row of their first argument (no pass over it).
_SPARSE_WRITES = frozenset({"aten::scatter_", "aten::index_put_", "aten::_index_put_impl_",
                            "aten::scatter_add_", "aten::scatter_reduce_", "aten::put_"})
#: Ops that read K entries per row of their first argument (no pass over it).
_SPARSE_READS = frozenset({"aten::gather", "aten::take"})


def _written(name: str, args: tuple, out: Any) -> list[torch.Tensor]:
    """The tensors an op writes: its outputs, and its first argument when it is in place."""
    if name.endswith("_") and args and isinstance(args[0], torch.Tensor):
        if name in _SPARSE_WRITES:
            return []
        if name == "aten::index_copy_":  # the rows of the source
            return [args[3]] if len(args) > 3 else []
        if name == "aten::index_fill_":  # the rows named by the index
            return [args[0].select(args[1], 0).expand(args[2].numel(), -1)] \
                if args[0].dim() == 2 else [args[0]]
        return [args[0]]
    return list(_tensors(out))


def _read(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op reads in full (first arguments of sparse or write-only ops excluded)."""
    tensors = list(_tensors(list(args) + list(kwargs.values())))
    if args and isinstance(args[0], torch.Tensor) and (
            name in _SPARSE_READS or name in _SPARSE_WRITES or name in _WRITE_ONLY):
        tensors = [t for t in tensors if t is not args[0]]
    if name == "aten::index_select" and len(args) > 2:  # the rows it gathers
        return [args[0].narrow(args[1], 0, min(args[2].numel(), args[0].shape[args[1]]))]
    return tensors


class DispatchCounter(TorchDispatchMode):
    """Counts host syncs, launched (non-view) ops and (with ``full``) passes over the batch of
    everything run inside it."""

    def __init__(self, full: int | None = None) -> None:
        super().__init__()
        self.full = full
        self.sync_ops: collections.Counter[str] = collections.Counter()
        self.launch_ops: collections.Counter[str] = collections.Counter()
        self.pass_ops: collections.Counter[str] = collections.Counter()
        self.elements = 0
        self.full_tensors = 0

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    @property
    def launches(self) -> int:
        return sum(self.launch_ops.values())

    @property
    def passes(self) -> int:
        return sum(self.pass_ops.values())

    def _is_full(self, tensor: torch.Tensor) -> bool:
        return self.full is not None and tensor.numel() >= self.full

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _qualified(func)
        if _is_sync(name, args, kwargs):
            self.sync_ops[name] += 1
        launch = not func.is_view and name not in _NOT_LAUNCHES
        if launch:
            self.launch_ops[name] += 1
        out = func(*args, **kwargs)
        if launch:
            self.elements += max((t.numel() for t in _tensors([*args, *kwargs.values(), out])),
                                 default=0)
        if launch and self.full is not None:
            storages = {id(t.untyped_storage()) for t in _read(name, args, kwargs)
                        if self._is_full(t)}
            self.pass_ops[name + " (read)"] += len(storages)
            written = [t for t in _written(name, args, out) if self._is_full(t)]
            self.pass_ops[name + " (write)"] += len(written)
            if not name.endswith("_"):
                self.full_tensors += len(written)
        elif not func.is_view and self.full is not None and name in ("aten::empty",
                                                                      "aten::empty_strided"):
            self.full_tensors += sum(1 for t in _tensors(out) if self._is_full(t))
        return out


class MemoryTracker(TorchDispatchMode):
    """Peak bytes held at once by tensors created inside it (outputs of ops, counted once per
    storage, released when the storage is freed). Inputs that existed before are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = {t.untyped_storage().data_ptr() for t in (*args, *kwargs.values())
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            if tensor.untyped_storage().data_ptr() not in before:
                self._track(tensor)
        return out


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
