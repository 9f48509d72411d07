"""The Triton kernels of the CUDA step (`bregman_vllm.kernels`) against the torch step, their
reference, in float64.

On a machine without a GPU they run on CPU tensors under Triton's interpreter
(`tests/conftest.py` sets ``TRITON_INTERPRET=1`` before Triton is imported), on a GPU on the
device. The interpreter runs a program at a time and is slow, so the shapes are small ([n, 4096]
or less) and each call decodes a batch mixing many families. Checked: the same k* and q (within
1e-5) as the float64 torch step for every family, both window sizes, temperatures other than 1,
logits and probabilities; ties at the support's boundary; grammar-masked (-inf) entries; rows
that are not distributions left as they are; rows past the window; the launches and
syncs of one step (at most 6 and none for supports that fit the window, counted as the kernel
launches plus the torch ops around them); Model Runner V2's slot mapping with reordered rows and
draft rows.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _disable_current_modes
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

from bregman_vllm import bregman_decode, bregman_decode_logits, kernels
from bregman_vllm import engine_metrics as em
from bregman_vllm.adapter import telemetry
from bregman_vllm.adapter.processor import BregmanLogitsProcessor, request_params
from bregman_vllm.backend import decode as decode_step
from bregman_vllm.core.plan import plan_requests
from bregman_vllm.diagnostics import DispatchCounter
from bregman_vllm.kernels import step as kernel_step
from bregman_vllm.kernels.formulas import order_key, rank_top

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 4096

#: One request per family the kernels decode, and a plain one (``None``). Window 64.
NARROW = {
    "kl": {"bregman_alpha": 1.0, "bregman_lambda": 1e-2},
    "three halves": {"bregman_alpha": 1.5, "bregman_lambda": 1e-2},
    "square": {"bregman_alpha": 2.0, "bregman_lambda": 1e-2},
    "power 3": {"bregman_alpha": 3.0, "bregman_lambda": 1e-3},
    "power 1.25": {"bregman_alpha": 1.25, "bregman_lambda": 1e-3},
    "dual 3/2": {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 1e-2},
    "dual 3 k_max": {"bregman_mode": "dual", "bregman_alpha": 3.0, "bregman_lambda": 1e-3,
                     "bregman_k_max": 40},
    "power k_max": {"bregman_alpha": 3.0, "bregman_lambda": 1e-3, "bregman_k_max": 50},
    "kl k_max": {"bregman_alpha": 1.0, "bregman_lambda": 1e-3, "bregman_k_max": 30},
    "top_k kl": {"bregman_alpha": 1.0, "bregman_top_k": 20},
    "top_k 3/2": {"bregman_alpha": 1.5, "bregman_top_k": 50},
    "top_k square": {"bregman_alpha": 2.0, "bregman_top_k": 30},
    "top_k water": {"bregman_alpha": "inf", "bregman_top_k": 20},
    "top_k argmax": {"bregman_alpha": "-inf", "bregman_top_k": 20},
    "top_k power": {"bregman_alpha": 3.0, "bregman_top_k": 20},
    "top_k dual 3/2": {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_top_k": 20},
    "top_k dual 3": {"bregman_mode": "dual", "bregman_alpha": 3.0, "bregman_top_k": 10},
    "keep all": {"bregman_alpha": 1.5, "bregman_lambda": 0.0},
    "plain": None,
}
#: Families of the wide window (256 candidates): closed forms at small lambda, fixed sizes
#: above 64 (the iterative one certified: it may take the exact path).
WIDE = {
    "kl 1e-3": {"bregman_alpha": 1.0, "bregman_lambda": 1e-3},
    "three halves 1e-4": {"bregman_alpha": 1.5, "bregman_lambda": 1e-4},
    "square 5e-5": {"bregman_alpha": 2.0, "bregman_lambda": 5e-5},
    "top_k 3/2 100": {"bregman_alpha": 1.5, "bregman_top_k": 100},
    "top_k power 100": {"bregman_alpha": 3.0, "bregman_top_k": 100},
    "power 3": NARROW["power 3"],
    "plain": None,
}

def model_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Gaussian logits with a per-row scale from 2 to 7 (peaked rows like a language model's)."""
    g = torch.Generator().manual_seed(seed)
    scale = 2.0 + 5.0 * torch.rand(rows, 1, generator=g)
    return (torch.randn(rows, vocab, generator=g) * scale).to(DEVICE)


def plan_of(configs: list[dict | None], vocab: int, temperatures: list[float] | None = None):
    requests = [(row, request_params(config)) for row, config in enumerate(configs)
                if config is not None]
    return plan_requests(requests, batch=len(configs), vocab=vocab, device=DEVICE,
                         temperatures=temperatures)


def probabilities(out: torch.Tensor, logits: bool, temperatures=None) -> torch.Tensor:
    q = out.double()
    if not logits:
        return q
    if temperatures is not None:  # the step writes T log q
        q = q / torch.tensor(temperatures, dtype=torch.float64, device=q.device).unsqueeze(-1)
    return q.exp()


def check_against_float64(scores: torch.Tensor, configs: list[dict | None], *,
                          logits: bool = True, temperatures: list[float] | None = None
                          ) -> kernel_step.KernelStep:
    """One kernel step over ``scores`` against the torch step on the same scores in float64:
    the same k* per row, q within 1e-5, rows of plain requests untouched."""
    vocab = scores.shape[-1]
    plan = plan_of(configs, vocab, temperatures)
    got = decode_step(scores.clone(), plan, logits=logits, backend="triton")
    want = decode_step(scores.double(), plan_of(configs, vocab, temperatures), logits=logits,
                       backend="torch")
    q, q_want = (probabilities(t, logits, temperatures) for t in (got.out, want.out))
    decoded = torch.tensor([config is not None for config in configs], device=scores.device)
    names = [str(config) for config in configs]
    assert torch.equal(got.k, want.k), [(n, a, b) for n, a, b in
                                        zip(names, got.k.tolist(), want.k.tolist(), strict=True)
                                        if a != b]
    torch.testing.assert_close(q, q_want, rtol=0, atol=1e-5, equal_nan=True)
    assert torch.equal(q > 0, q_want > 0)  # the same supports
    plain = ~decoded
    assert torch.equal(got.out[plain], scores[plain])
    # (the kernels' search pass decodes on the device what the torch step hands its exact
    # path: their ``exact_rows`` counts the rows left to the host, at most the torch step's)
    assert got.exact_rows <= want.exact_rows, (got.exact_rows, want.exact_rows)
    return got


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("width", ["narrow", "wide"])
def test_every_family_matches_the_float64_step(width):
    """Every family the kernels decode, one row each with a plain request among them, in one
    batch: the kernels' k* and q are the float64 torch step's (window 64, and 256 for the
    closed forms at small lambda and fixed sizes above 64)."""
    configs = list((NARROW if width == "narrow" else WIDE).values())
    scores = model_logits(len(configs), seed=1 if width == "narrow" else 2)
    check_against_float64(scores, configs)


def test_temperatures_other_than_one_and_probabilities():
    """Model Runner V2's temperatures (the step decodes softmax(logits / T) and writes
    T log q), and probabilities in (`bregman_decode`: q written, zeros off the support)."""
    configs = [NARROW[name] for name in ("three halves", "power k_max", "dual 3/2", "top_k 3/2",
                                         "keep all", "plain")]
    temperatures = [0.7, 1.3, 0.5, 2.0, 0.8, 1.0]
    scores = model_logits(len(configs), seed=3)
    check_against_float64(scores, configs, temperatures=temperatures)
    configs = [NARROW[name] for name in ("kl", "power 3", "dual 3 k_max", "top_k water",
                                         "keep all")]
    probs = torch.softmax(model_logits(len(configs), seed=4), -1)
    probs[1, :7] = 0.0  # zero entries
    check_against_float64(probs, configs, logits=False)


def test_ties_at_the_support_boundary():
    """Seven tied tokens across the boundary of a fixed size 5, and k* deciding inside a tie:
    the same k* and the same multiset of kept probabilities (which of the tied tokens is kept
    is a tie-break: the kernels keep the smallest indices, torch.topk any), every kept token
    at or above the boundary's logit."""
    scores = torch.full((4, 1024), -5.0, device=DEVICE)
    scores[:, 100:107] = 2.0
    scores[:, 3] = 4.0
    configs = [{"bregman_alpha": 1.5, "bregman_top_k": 5},
               {"bregman_alpha": 3.0, "bregman_top_k": 5},
               {"bregman_alpha": 1.0, "bregman_lambda": 1e-2},
               {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 1e-2}]
    plan = plan_of(configs, 1024)
    got = decode_step(scores.clone(), plan, logits=True, backend="triton")
    want = decode_step(scores.double(), plan_of(configs, 1024), logits=True, backend="torch")
    assert torch.equal(got.k, want.k) and got.k.tolist()[:2] == [5, 5]
    q = got.out.double().exp().sort(-1, descending=True).values
    q_want = want.out.exp().sort(-1, descending=True).values
    torch.testing.assert_close(q, q_want, rtol=0, atol=1e-5)
    kept = torch.isfinite(got.out)
    assert (scores[kept] >= 2.0).all()
    assert torch.equal(kept[:, :100], torch.isfinite(want.out)[:, :100])  # the token at 3


def test_masked_entries_and_rows_that_are_not_distributions():
    """Grammar-masked tokens (-inf) stay off every support; a NaN row, a row with +inf and an
    all -inf row are left as they are (k = 0), as the torch step leaves them."""
    configs = [NARROW[name] for name in ("power 3", "top_k 3/2", "kl", "keep all", "dual 3/2",
                                         "square")]
    scores = model_logits(len(configs), seed=5)
    scores[:, ::3] = -math.inf
    scores[0, 1::3] = -math.inf  # row 0: a third of its tokens allowed
    scores[3, 7] = math.nan
    scores[4, 11] = math.inf
    scores[5] = -math.inf
    got = decode_step(scores.clone(), plan_of(configs, VOCAB), logits=True, backend="triton")
    want = decode_step(scores.double(), plan_of(configs, VOCAB), logits=True, backend="torch")
    assert torch.equal(got.k, want.k) and got.k[3:].tolist() == [0, 0, 0]
    torch.testing.assert_close(got.out[3:], scores[3:], rtol=0, atol=0, equal_nan=True)
    assert not torch.isfinite(got.out[:3, ::3]).any()
    torch.testing.assert_close(got.out[:3].double().exp(), want.out[:3].exp(), rtol=0,
                               atol=1e-5)


def test_rows_past_the_window_decode_on_the_device():
    """Flat rows at a tiny lambda (k* in the hundreds), an alpha without a fixed-shape formula
    (the EXACT family) and a fixed size wider than the widest window: the window flags them,
    the search pass (or the wide pass, past its candidates) decodes them, none goes to the
    host's exact path, and each row ends as the float64 step decodes it."""
    configs = [{"bregman_alpha": 1.5, "bregman_lambda": 1e-7},
               {"bregman_alpha": 3.0, "bregman_lambda": 1e-9},
               {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 1e-7},
               {"bregman_alpha": 1.0, "bregman_lambda": 1e-5},
               {"bregman_alpha": 0.5, "bregman_lambda": 1e-3},
               {"bregman_alpha": 1.5, "bregman_top_k": 300},
               NARROW["power k_max"], None]
    g = torch.Generator().manual_seed(6)
    scores = (torch.randn(len(configs), 2048, generator=g) * 0.3).to(DEVICE)
    got = check_against_float64(scores, configs)
    assert (got.k[:4] > 64).all() and got.exact_rows == 0


def test_a_nan_from_the_wide_pass_is_never_written(monkeypatch):
    """Should the wide pass's map come out NaN, the row is not written with it: a window
    family's row keeps the window's uncertified answer (a distribution on the window), an
    exact-family row stays as it came (k = 0), and the other rows are decoded."""
    from bregman_vllm.kernels import wide

    monkeypatch.setattr(wide, "solve", lambda *args: tl.full((), float("nan"), tl.float64))
    configs = [{"bregman_alpha": 3.0, "bregman_lambda": 1e-9},
               {"bregman_alpha": 10.0, "bregman_lambda": 1e-32}, NARROW["kl"]]
    g = torch.Generator().manual_seed(7)
    scores = (torch.randn(3, 2048, generator=g) * torch.tensor([[0.3], [0.3], [5.0]])).to(DEVICE)
    out = scores.clone()
    got = decode_step(out, plan_of(configs, 2048), logits=True, inplace=True, backend="triton")
    assert 0 < int(got.k[0]) <= kernel_step.WIDE_WINDOW and int(got.k[1]) == 0
    assert torch.isfinite(out[0]).sum() == got.k[0] and int(got.k[2]) > 0
    assert torch.equal(out[1], scores[1])
    torch.testing.assert_close(torch.logsumexp(out[::2].double(), -1),
                               torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- launches, syncs


@pytest.fixture
def counted(monkeypatch):
    """Kernel launches counted by `kernels.step._launch`, run outside the dispatch counter
    (under the interpreter a launch is torch ops on CPU tensors, which a GPU does not run)."""
    launches = []
    real = kernel_step._launch

    def launch(kernel, grid, *args, **meta):
        launches.append(kernel)
        with _disable_current_modes():
            real(kernel, grid, *args, **meta)

    monkeypatch.setattr(kernel_step, "_launch", launch)
    monkeypatch.setenv("BREGMAN_BACKEND", "triton")
    return launches


def _values_of(keys: torch.Tensor) -> torch.Tensor:
    """The float32 values of order keys, decoded on the host (as `formulas.key_value`)."""
    high = (keys >> 32).to(torch.int32)
    return torch.where(high < 0, high ^ 0x7FFFFFFF, high).view(torch.float32)


BOUNDED = {name: NARROW[name] for name in ("kl k_max", "power k_max", "dual 3 k_max",
                                           "top_k 3/2", "top_k water", "top_k argmax",
                                           "top_k power", "top_k dual 3/2", "keep all")}


def _v2(configs: list[dict | None], vocab: int, temperature: float = 1.0):
    proc = BregmanLogitsProcessor(SimpleNamespace(), SimpleNamespace(
        device=torch.device(DEVICE), vocab_size=vocab, max_num_reqs=32))
    for slot, config in enumerate(configs):
        proc.add_request(slot, SamplingParams(temperature=temperature, extra_args=config))
    proc.apply_staged_writes()
    return proc


def _context(order: list[int], rows_of: list[int] | None = None) -> LogitsContext:
    """vLLM's LogitsContext for requests in slots ``order``; ``rows_of``: the row -> slot
    mapping when requests have several rows (speculative decoding)."""
    expanded = order if rows_of is None else rows_of
    n = len(expanded)
    return LogitsContext(  # (int64 mappings, as Model Runner V2 makes them)
        expanded_idx_mapping=torch.tensor(expanded, dtype=torch.int64, device=DEVICE),
        idx_mapping=torch.tensor(order, dtype=torch.int64, device=DEVICE),
        idx_mapping_np=np.array(order), expanded_local_pos=torch.zeros(n, dtype=torch.int32),
        input_ids=torch.zeros(n, dtype=torch.int32), pos=torch.zeros(n, dtype=torch.int32),
        seq_lens_upper_bound_np=np.ones(len(order), dtype=np.int64))


@pytest.mark.parametrize("name", [*BOUNDED, "mixed", "unbounded"])
def test_one_step_is_at_most_six_launches_and_no_sync(counted, name):
    """Model Runner V2's `apply()` with the kernels, each bounded family alone and all of them
    with a plain request in one batch: four kernel launches, no torch op, no host sync; the
    same for the public call (out of place) and the V1 interface. A batch whose supports may
    pass the window (every family without a cap, each bounded within the search's candidates)
    adds the search pass: six launches, still no sync."""
    configs = [*BOUNDED.values(), None] if name == "mixed" else \
        list(NARROW.values()) if name == "unbounded" else [BOUNDED[name]] * 2
    vocab = 512
    logits = model_logits(len(configs), vocab, seed=8)
    proc = _v2(configs, vocab, temperature=0.8)
    ctx = _context(list(reversed(range(len(configs)))))
    proc.apply(logits.clone(), ctx)
    scores = logits.clone()
    counted.clear()
    with DispatchCounter() as counter:
        proc.apply(scores, ctx)
    assert counter.syncs == 0, dict(counter.sync_ops)
    if name == "unbounded":  # (the search pass: every row bounded within its candidates)
        assert len(counted) == 6 and counter.launches == 0, counter.launch_ops
        return
    assert len(counted) == 4 and counter.launches == 0, counter.launch_ops
    if name == "mixed":
        return
    kwargs = {"alpha": proc.requests[0].alpha, "lam": proc.requests[0].lam,
              "mode": proc.requests[0].mode, "top_k": proc.requests[0].top_k,
              "k_max": proc.requests[0].k_max}
    bregman_decode_logits(logits, **kwargs)  # (the plan's table, once)
    counted.clear()
    with DispatchCounter() as counter:
        bregman_decode_logits(logits, **kwargs)
    assert counter.syncs == 0 and len(counted) + counter.launches <= 6, counter.launch_ops


def test_the_v1_interface_runs_the_same_kernels(counted):
    """V1 keeps its plan (built once per batch change) and runs the same four kernels."""
    configs = list(BOUNDED.values())
    logits = model_logits(len(configs), 512, seed=9)
    proc = BregmanLogitsProcessor(SimpleNamespace(), torch.device(DEVICE), False)
    proc.update_state(BatchUpdate(len(configs), [], [
        (i, SamplingParams(temperature=1.0, extra_args=config), None, [])
        for i, config in enumerate(configs)], []))
    want = decode_step(logits.double(), plan_of(configs, 512), logits=True, backend="torch")
    out = proc.apply(logits.clone())
    again = logits.clone()
    counted.clear()
    with DispatchCounter() as counter:
        proc.apply(again)
    assert counter.syncs == 0 and len(counted) == 4 and counter.launches == 0, counter.launch_ops
    assert torch.equal(out, again)
    torch.testing.assert_close(out.double().exp(), want.out.exp(), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- Model Runner V2


def test_v2_slots_with_reordered_rows_and_draft_rows(counted):
    """Requests in slots 0-5 (one per family and temperature, slot 4 plain), scheduled in a
    shuffled order, two of them with three rows each (speculative decoding's draft rows): each
    row is decoded as its slot's request alone would be, by the mapping on the device, and
    the host never reads the mapping."""
    configs = [NARROW["three halves"], NARROW["dual 3 k_max"], NARROW["top_k power"],
               NARROW["kl"], None, NARROW["keep all"]]
    temperatures = [0.7, 1.0, 1.5, 0.9, 1.0, 1.2]
    proc = BregmanLogitsProcessor(SimpleNamespace(), SimpleNamespace(
        device=torch.device(DEVICE), vocab_size=1024, max_num_reqs=8))
    for slot, (config, temperature) in enumerate(zip(configs, temperatures, strict=True)):
        proc.add_request(slot, SamplingParams(temperature=temperature, extra_args=config))
    proc.apply_staged_writes()
    order = [3, 0, 5, 1, 4, 2]
    rows_of = [3, 0, 0, 0, 5, 1, 1, 1, 4, 2]  # slots 0 and 1 score three positions each
    logits = model_logits(len(rows_of), 1024, seed=10)
    engine = telemetry._engine()
    sums = {mode: engine.values.get(em.support_sum(mode), 0.0) for mode in em.MODES}
    out = proc.apply(logits.clone(), _context(order, rows_of))
    # k* reaches the metrics per row and mode (by the device mapping: several rows a request).
    k = proc.last_step.k
    dual = torch.tensor([slot == 1 for slot in rows_of])
    assert engine.values[em.support_sum("dual")] - sums["dual"] == float(k[dual].sum())
    assert engine.values[em.support_sum("primal")] - sums["primal"] == float(k[~dual].sum())
    for row, slot in enumerate(rows_of):
        if configs[slot] is None:
            assert torch.equal(out[row], logits[row])
            continue
        alone = decode_step(logits[row:row + 1].double(),
                            plan_of([configs[slot]], 1024, [temperatures[slot]]),
                            logits=True, backend="torch")
        assert int(proc.last_step.k[row]) == int(alone.k[0]), (row, slot)
        q = (out[row].double() / temperatures[slot]).exp()
        q_want = (alone.out[0] / temperatures[slot]).exp()
        torch.testing.assert_close(q, q_want, rtol=0, atol=1e-5)
    # A slot reused by another request, and a request leaving: the columns follow.
    proc.add_request(0, SamplingParams(temperature=1.0))  # now a plain request
    proc.add_request(4, SamplingParams(temperature=1.0, extra_args=NARROW["square"]))
    proc.apply_staged_writes()
    out = proc.apply(logits.clone(), _context(order, rows_of))
    assert torch.equal(out[1:4], logits[1:4]) and not torch.equal(out[8], logits[8])


# ----------------------------------------------------------------------------- pieces


@triton.jit
def _select(values_ptr, out_ptr, ranked_ptr, N: tl.constexpr, K: tl.constexpr):
    positions = tl.arange(0, N)
    keys = order_key(tl.load(values_ptr + positions), positions)
    tl.store(out_ptr + tl.arange(0, K), tl.topk(keys, K))
    tl.store(ranked_ptr + tl.arange(0, K), rank_top(keys, K))


def test_tl_topk_and_the_interpreters_rank_selection_agree():
    """`formulas.top_keys` is `tl.topk` on a GPU and `formulas.rank_top` under the
    interpreter: both give the K largest keys, sorted, with their positions."""
    g = torch.Generator().manual_seed(11)
    values = torch.randn(64, generator=g).to(DEVICE)
    values[[5, 9, 40]] = 3.0  # ties: the smaller index first
    values[[7, 8]] = -math.inf
    out = torch.empty(16, dtype=torch.long, device=DEVICE)
    ranked = torch.empty_like(out)
    _select[(1,)](values, out, ranked, N=64, K=16)
    assert torch.equal(out, ranked)
    want = torch.sort(values, descending=True, stable=True)
    assert torch.equal(4294967295 - (out & 4294967295), want.indices[:16])  # (`key_index`)
    assert torch.equal(_values_of(out), want.values[:16])  # (`key_value`)


def test_warm_up_runs_every_variant():
    """The processor's warm-up (every kernel variant a step runs, on dummy rows; under the
    interpreter the processor skips it, as nothing compiles there)."""
    before = kernel_step.LAUNCHES[0]
    kernels.warm_up(DEVICE, 512)
    # (both windows: four kernels; the search pass's select and search kernels at each of its
    # widths; the wide pass's kernel)
    widths = {kernel_step.search_width(reach, 512)[0] for reach in kernel_step.SEARCH_WIDTHS}
    assert kernel_step.LAUNCHES[0] - before == 2 * 4 + 2 * len(widths) + 1 == 15


def _signatures(monkeypatch) -> set:
    """Records what a launch compiles a variant for: the kernel, its tensor arguments' dtypes
    and its compile-time constants (Triton specializes on each)."""
    seen: set = set()
    real = kernel_step._launch

    def launch(kernel, grid, *args, **meta):
        dtypes = tuple(arg.dtype for arg in args if isinstance(arg, torch.Tensor))
        seen.add((kernel.fn.__name__, dtypes, tuple(sorted(meta.items()))))
        with _disable_current_modes():
            real(kernel, grid, *args, **meta)

    monkeypatch.setattr(kernel_step, "_launch", launch)
    return seen


def test_the_processors_steps_run_only_variants_the_warm_up_compiled(monkeypatch):
    """Model Runner V2's int64 ``expanded_idx_mapping``, V1's plan, a slot mapping of another
    dtype (converted), batch sizes from 1 to 9: every launch is a variant the warm-up ran, so
    no step compiles (the warm-up once ran an int32 mapping, and V2's first steps compiled
    the read, select and decode kernels again)."""
    monkeypatch.setenv("BREGMAN_BACKEND", "triton")
    seen = _signatures(monkeypatch)
    kernels.warm_up(DEVICE, 512)
    warmed = set(seen)
    seen.clear()
    configs = [NARROW["kl"], NARROW["dual 3 k_max"], NARROW["keep all"], None]
    proc = _v2(configs, 512)
    for n in range(1, 10):
        order = [row % len(configs) for row in range(n)]
        proc.apply(model_logits(n, 512, seed=n), _context(order))
    ctx = _context([0, 1])
    ctx = dataclasses.replace(ctx, expanded_idx_mapping=ctx.expanded_idx_mapping.int())
    proc.apply(model_logits(2, 512, seed=11), ctx)
    v1 = BregmanLogitsProcessor(SimpleNamespace(), torch.device(DEVICE), False)
    v1.update_state(BatchUpdate(2, [], [(0, SamplingParams(temperature=1.0, extra_args=
                                                           NARROW["kl"]), None, [])], []))
    v1.apply(model_logits(2, 512, seed=12))
    assert seen and seen <= warmed, seen - warmed


def test_the_step_allocates_no_scratch_when_the_batch_size_changes():
    """One set of scratch buffers per vocabulary, window and dtype, grown to the largest batch
    (by doubling), and its first n rows as cached views: the same batch sizes again allocate
    nothing, and a smaller batch reuses the buffers of a larger one."""
    args = (8, kernel_step.WINDOW, torch.float32, torch.device(DEVICE))
    first = kernel_step._workspace(5, *args)
    assert first.x.shape[0] == 5 and first.x.is_contiguous()
    assert kernel_step._workspace(5, *args) is first
    smaller = kernel_step._workspace(3, *args)
    assert smaller.x.data_ptr() == first.x.data_ptr() and smaller.x.shape[0] == 3
    larger = kernel_step._workspace(9, *args)  # grows to 16 rows
    assert larger.x.shape[0] == 9 and kernel_step._workspace(16, *args).x.data_ptr() == \
        larger.x.data_ptr()


def test_a_steps_layout_is_read_once_per_batch_change(monkeypatch):
    """`RowTable.layout` (what a V2 step with the kernels is specialized on, read every step):
    the same slots and no write since give the last answer without reading the host columns
    again; a write or other slots read them again."""
    from bregman_vllm.params import BregmanParams
    from bregman_vllm.rows import Row, RowTable

    table = RowTable(8, "cpu")
    # (lambda 1e-6: k* may pass the window, `families.support_bound`, so that slot may flag)
    for slot, params in enumerate([BregmanParams(alpha=1.5, lam=1e-6),
                                   BregmanParams(mode="dual", alpha=3.0), BregmanParams(top_k=5)]):
        table.write(slot, Row.of_request(params, 512))
    slots = np.array([2, 0, 1], dtype=np.int32)
    first = table.layout(slots)
    assert first is not None and table.layout(slots.copy()) is first
    reads = [0]
    host = table.host

    class Counted(dict):
        def __getitem__(self, name):
            reads[0] += 1
            return dict.__getitem__(self, name)

    monkeypatch.setattr(table, "host", Counted(host))
    for _ in range(3):
        assert table.layout(slots) is first
    assert reads[0] == 0
    alone = table.layout(np.array([2], dtype=np.int32))  # other slots: read again
    assert reads[0] > 0 and alone is not None and not alone.sync and first.sync
    reads[0] = 0
    table.write(1, Row.of_request(BregmanParams(alpha=1.5), 512), temperature=0.7)
    again = table.layout(slots)
    assert reads[0] > 0 and again is not first and again.scaled and not first.scaled
    assert table.layout(np.array([3, 4], dtype=np.int32)) is None  # (slots not decoded)


def test_v2_rows_held_at_their_k_max_are_counted_at_every_step_in_any_order(counted):
    """``bregman_support_held_total{mode}`` under Model Runner V2 with the kernels: at every
    step, one per adaptive row whose k* was held at its k_max (flat rows at a tiny lambda),
    whatever order the slots come in; rows under their cap, fixed sizes and plain rows are not
    counted. A slot that changes request changes the count at the next step."""
    configs = [{"bregman_lambda": 1e-9, "bregman_k_max": 16},                  # held
               None,                                                         # plain
               {"bregman_mode": "dual", "bregman_alpha": 2, "bregman_lambda": 1e-9,
                "bregman_k_max": 8},                                         # held (dual)
               {"bregman_lambda": 0.5, "bregman_k_max": 16},                   # k* 1: under
               {"bregman_top_k": 16, "bregman_k_max": 16}]                     # fixed k
    proc = _v2(configs, 512)
    assert proc.table is not None  # (the kernels' slot columns, no plan)

    def held_in_one_step(order: list[int]) -> dict[str, float]:
        before = telemetry.totals()  # (the pending steps counted first)
        proc.apply(torch.randn(len(order), 512) * 1e-3, _context(order))
        after = telemetry.totals()
        return {mode: after.get(em.held(mode), 0.0) - before.get(em.held(mode), 0.0)
                for mode in em.MODES}

    for order in ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0]):
        assert held_in_one_step(order) == {"primal": 1, "dual": 1}, order
    assert held_in_one_step([3, 1, 4]) == {"primal": 0, "dual": 0}
    proc.add_request(0, SamplingParams(temperature=1.0))  # slot 0 now a plain request
    proc.apply_staged_writes()
    assert held_in_one_step([4, 3, 2, 1, 0]) == {"primal": 0, "dual": 1}


def test_a_slot_past_the_processors_slots_falls_back_to_the_plan(monkeypatch, caplog):
    """A request slot past the max_num_reqs the processor was built for: decoded (by a plan,
    as V2 without the slot columns) rather than an error out of vLLM's add_request."""
    monkeypatch.setenv("BREGMAN_BACKEND", "triton")
    proc = _v2([NARROW["kl"]], 512)
    assert proc.table is not None
    with caplog.at_level("WARNING", logger="bregman_vllm.adapter"):
        assert proc.add_request(40, SamplingParams(temperature=1.0,
                                                   extra_args=NARROW["top_k 3/2"]))
    assert proc.table is None
    assert any("past the 32 slots" in record.getMessage() for record in caplog.records)
    logits = model_logits(2, 512, seed=13)
    out = proc.apply(logits.clone(), _context([40, 0]))
    want = decode_step(logits[:1].double(), plan_of([NARROW["top_k 3/2"]], 512), logits=True,
                       backend="torch")
    assert int((out[0] > -math.inf).sum()) == int(want.k[0])


def test_bregman_decode_takes_the_kernels(monkeypatch):
    """`bregman_decode` (probabilities) and `bregman_decode_logits` with
    ``BREGMAN_BACKEND=triton``: the kernels' answers, the torch step's k*."""
    monkeypatch.setenv("BREGMAN_BACKEND", "triton")
    before = kernel_step.LAUNCHES[0]
    probs = torch.softmax(model_logits(2, 512, seed=12), -1)
    out = bregman_decode(probs, alpha=2.0, lam=0.01)
    # (k* <= 8 by `families.support_bound`: the window decides; at lambda 1e-7, past the
    # 256-wide window, it may not)
    assert kernel_step.LAUNCHES[0] - before == 4
    wide = bregman_decode(probs, alpha=2.0, lam=1e-7)
    assert kernel_step.LAUNCHES[0] - before == 4 + 6
    monkeypatch.setenv("BREGMAN_BACKEND", "torch")
    for got, lam in ((out, 0.01), (wide, 1e-7)):
        want = bregman_decode(probs.double(), alpha=2.0, lam=lam)
        assert torch.equal(got.k, want.k)
        torch.testing.assert_close(got.probs.double(), want.probs, rtol=0, atol=1e-5)
    monkeypatch.setenv("BREGMAN_BACKEND", "cuda")
    with pytest.raises(ValueError, match="BREGMAN_BACKEND must be one of auto, triton, torch"):
        bregman_decode(probs, alpha=2.0, lam=0.01)


def test_a_compile_failure_at_start_leaves_the_torch_step(monkeypatch, caplog):
    """If the kernels cannot be compiled when the processor is built (an unknown GPU, a broken
    Triton), the engine still starts: one warning, and the processor decodes with the torch
    step (V2 by a plan), never compiling inside a step."""
    def broken(*args, **kwargs):
        raise RuntimeError("simulated compilation failure")

    monkeypatch.setenv("BREGMAN_BACKEND", "triton")
    monkeypatch.setattr(kernels, "INTERPRETED", False)  # (as on a GPU: warm up)
    monkeypatch.setattr(kernels, "warm_up", broken)
    launches = kernel_step.LAUNCHES[0]
    with caplog.at_level("WARNING", logger="bregman_vllm.adapter"):
        proc = _v2([NARROW["power 3"], None], 512, temperature=0.8)
    assert proc.backend == "torch" and proc.table is None
    assert any("failed to compile" in record.getMessage() for record in caplog.records)
    logits = model_logits(2, 512, seed=13)
    out = proc.apply(logits.clone(), _context([0, 1]))
    want = decode_step(logits.double(), plan_of([NARROW["power 3"], None], 512, [0.8, 1.0]),
                       logits=True, backend="torch")
    torch.testing.assert_close(out.double(), want.out, rtol=0, atol=1e-5)
    assert kernel_step.LAUNCHES[0] == launches
