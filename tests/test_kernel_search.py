"""The search in Triton (`bregman_vllm.kernels.search`) and the step's search pass
(`bregman_vllm.kernels.step`: the select kernel again at the search's width for the rows the
window could not decode, then `_search_kernel`), against the torch functions each restates and
the float64 torch step.

Under Triton's interpreter (`tests/conftest.py`), CPU tensors, small shapes. Checked:

* the pieces, against the torch functions they restate (`core.primal`, `core.dual`,
  `core.gaps`, `core.numerics`, `core.maps`): the values every candidate gets at a scalar (the
  four kinds), the entry terms, K_alpha over its regions, the maps of fixed sizes, the exact
  gaps; and one row's search on its candidates against the independent reference
  (`tests/reference_search.py`);
* the step: every family including the general maps (primal alpha 10, 0.5, 1.05; dual alpha 4,
  10, 1.2), rows past the window (k* in the hundreds at [4, 8192]; the wide width's limit),
  rows held to k_max (300, the wide width), ties at the support's boundary, -inf entries, NaN
  and inf rows, temperatures other than 1, a mixed batch and Model Runner V2's slot mapping:
  the same k* as the float64 torch step and q within 2e-5; launches and host syncs counted
  (at most 10 launches and no sync where every row fits the search's candidates).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _disable_current_modes
from vllm import SamplingParams

from bregman_vllm.adapter.processor import BregmanLogitsProcessor
from bregman_vllm.backend import decode as decode_step
from bregman_vllm.core.candidates import candidates
from bregman_vllm.core.dual import dual_range, dual_values
from bregman_vllm.core.families import Family, support_bound
from bregman_vllm.core.gaps import dual_log_gap, log_entry_term, primal_log_gap
from bregman_vllm.core.maps import log_deficit, solved
from bregman_vllm.core.numerics import bregman_alpha_kernel
from bregman_vllm.core.primal import level_range, normalized, primal_values, support_mask, top_range
from bregman_vllm.diagnostics import DispatchCounter
from bregman_vllm.kernels import search as ks
from bregman_vllm.kernels import step as kernel_step
from bregman_vllm.kernels import wide
from bregman_vllm.kernels.formulas import at
from bregman_vllm.rows import FAMILY_CODES

from . import reference_search as rs
from .test_kernels import NARROW, WIDE, _context, model_logits, plan_of, probabilities

F64 = torch.float64
#: The general maps (every family the window has no formula for) and the quadratic duals.
GENERAL = [("primal", 10.0), ("primal", 0.5), ("primal", 1.05), ("dual", 4.0), ("dual", 10.0),
           ("dual", 1.2)]


def _candidates(rows: int, width: int, vocab: int, seed: int, flat: bool = False):
    """Sorted float64 candidates of softmax rows: peaked (scales 2 to 6) or flat (0.3)."""
    g = torch.Generator().manual_seed(seed)
    scale = 0.3 if flat else 2.0 + 4.0 * torch.rand(rows, 1, generator=g, dtype=F64)
    logits = torch.randn(rows, vocab, generator=g, dtype=F64) * scale
    return logits, candidates(torch.softmax(logits, -1), width)


def _family(mode: str, alpha: float) -> Family | None:
    """The family the torch maps take for a general alpha: a quadratic dual (closed inner
    roots) or None."""
    quadratic = {1.5: Family.DUAL_THREE_HALVES, 3.0: Family.DUAL_THREE}
    return quadratic.get(alpha) if mode == "dual" else None


def _closed(mode: str, alpha: float) -> int:
    """`_family`'s code in the kernels (0: none)."""
    family = _family(mode, alpha)
    return FAMILY_CODES[family] if family is not None else 0


def _kind(mode: str, alpha: float) -> int:
    return 0 if mode == "dual" else (1 if alpha > 1.0 else 2)


def _row_args(mode: str, alpha: float, n: int) -> dict:
    return {"alpha_ptr": torch.full((n,), alpha, dtype=F64),
            "kind_ptr": torch.full((n,), _kind(mode, alpha), dtype=torch.int32),
            "closed_ptr": torch.full((n,), _closed(mode, alpha), dtype=torch.int32)}


# ----------------------------------------------------------------------------- values


@triton.jit
def _values_kernel(log_x_ptr, alpha_ptr, kind_ptr, closed_ptr, s_ptr, log_q_ptr, rate_ptr,
                   lift_ptr, exact_ptr, steps, C: tl.constexpr):
    row = tl.program_id(0)
    positions = tl.arange(0, C)
    log_x = tl.load(log_x_ptr + row * C + positions)
    finite = ks.isfinite64(log_x)
    lp = tl.where(finite, log_x, 0.0)
    beta = tl.load(alpha_ptr + row) - 1.0
    kind = tl.load(kind_ptr + row)
    s = tl.load(s_ptr + row)
    if kind == 0:
        log_q, rate, lift, _z, exact = ks.dual_values(
            tl.load(closed_ptr + row), lp, finite, beta, s,
            tl.full([C], float("nan"), tl.float64), steps, positions < C)
    else:
        log_q, rate, lift = ks.primal_values(lp, finite, beta, s, kind == 1,
                                             at(lp, positions, 0))
        exact = steps >= 0
    tl.store(log_q_ptr + row * C + positions, log_q)
    tl.store(rate_ptr + row * C + positions, rate)
    tl.store(lift_ptr + row * C + positions, lift)
    tl.store(exact_ptr + row, exact)


@pytest.mark.parametrize(("mode", "alpha"), [*GENERAL, ("dual", 1.5), ("dual", 3.0)])
def test_values_at_a_scalar(mode, alpha):
    """Every candidate's value at a trial scalar (the four kinds: the water level, log delta,
    log nu with Newton steps on the inner roots, log nu with the quadratic formulas), its rate
    and log(q / p), as `primal.primal_values` / `dual.dual_values`; zero entries (-inf) too."""
    width, n = 64, 3
    _, cand = _candidates(n, width, 512, seed=1)
    log_x = cand.log_x.clone()
    log_x[0, -5:] = -math.inf
    finite = torch.isfinite(log_x)
    lp = torch.where(finite, log_x, 0.0)
    beta = torch.full((n, 1), alpha - 1.0, dtype=F64)
    size = torch.tensor([3, 10, 40])
    log_r = torch.log(cand.deficit.gather(1, (size - 1).unsqueeze(-1)).squeeze(-1))
    kind = _kind(mode, alpha)
    if kind == 1:
        s = level_range(lp[:, 0], beta[:, 0], log_r, size)[1]
    elif kind == 2:
        s = top_range(lp[:, 0], log_r)[1]
    else:
        s = dual_range(lp, finite, beta, log_r, size)[1]
    closed = _family(mode, alpha)
    if kind:
        want = primal_values(lp, finite, beta, s, kind == 1)
        exact_want = torch.ones(n, dtype=torch.bool)
    else:
        want, exact_want = dual_values(lp, finite, beta, s, None, closed, 30)
    out = [torch.empty(n, width, dtype=F64) for _ in range(3)]
    exact = torch.empty(n, dtype=torch.bool)
    _values_kernel[(n,)](log_x, s_ptr=s.contiguous(), log_q_ptr=out[0], rate_ptr=out[1],
                         lift_ptr=out[2], exact_ptr=exact, steps=30, C=width,
                         **_row_args(mode, alpha, n))
    for got, expected in zip(out, (want.log_q, want.rate, want.lift), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-13)
    assert torch.equal(exact, exact_want) and bool(exact.all())


# ----------------------------------------------------------------------------- entry terms, K


@triton.jit
def _terms_kernel(log_p_ptr, log_q_ptr, out_ptr, alpha_ptr, dual, N: tl.constexpr):
    where = tl.arange(0, N)
    out = ks.log_entry_term(dual, tl.load(log_p_ptr + where), tl.load(log_q_ptr + where),
                            tl.load(alpha_ptr))
    tl.store(out_ptr + where, out)


@pytest.mark.parametrize(("mode", "alpha"), GENERAL)
def test_entry_terms(mode, alpha):
    """log w(p, q), the term of an entry in the gaps and in their weak-duality bounds
    (`gaps.log_entry_term`), over q from p to 1e4 p, and zero entries."""
    g = torch.Generator().manual_seed(2)
    log_p = torch.log(torch.rand(256, generator=g, dtype=F64)) * 10.0
    log_p[:8] = -math.inf
    log_q = log_p.clamp_min(-30.0) + torch.rand(256, generator=g, dtype=F64) * 9.0
    log_q = torch.minimum(log_q, torch.zeros(()))
    out = torch.empty(256, dtype=F64)
    _terms_kernel[(1,)](log_p, log_q, out, torch.tensor([alpha], dtype=F64), int(mode == "dual"),
                        N=256)
    want = log_entry_term(mode, log_p, log_q, torch.tensor(alpha, dtype=F64))
    torch.testing.assert_close(out, want, rtol=1e-13, atol=1e-13)


@triton.jit
def _kernel_kernel(alpha_ptr, rho_ptr, out_ptr, N: tl.constexpr):
    where = tl.arange(0, N)
    tl.store(out_ptr + where, ks.alpha_kernel(tl.load(alpha_ptr + where),
                                              tl.load(rho_ptr + where)))


def test_the_alpha_kernel_over_its_regions():
    """log K_alpha(rho) (`numerics.bregman_alpha_kernel`): the series, the forms next to alpha
    = 1, the expm1 form and the shifted logarithm, rho = +-inf."""
    alphas = torch.tensor([0.5, 0.9, 1.0, 1.05, 1.2, 2.0, 3.0, 10.0, 1000.0, -2.0], dtype=F64)
    rhos = torch.tensor([1e-12, 1e-6, 1e-3, 0.1, 0.3, 2.0, 30.0, 45.0, 300.0, -0.2, -5.0,
                         -math.inf, math.inf], dtype=F64)
    a, r = (t.reshape(-1) for t in torch.meshgrid(alphas, rhos, indexing="ij"))
    size = triton.next_power_of_2(a.numel())
    a = torch.nn.functional.pad(a, (0, size - a.numel()), value=2.0)
    r = torch.nn.functional.pad(r, (0, size - r.numel()), value=1.0)
    out = torch.empty(size, dtype=F64)
    _kernel_kernel[(1,)](a, r, out, N=size)
    want = bregman_alpha_kernel(a, r)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-14, equal_nan=True)


# ----------------------------------------------------------------------------- maps, gaps


@triton.jit
def _map_kernel(log_x_ptr, deficit_ptr, alpha_ptr, kind_ptr, closed_ptr, k_ptr, s_ptr,
                log_q_ptr, lift_ptr, C: tl.constexpr):
    row = tl.program_id(0)
    positions = tl.arange(0, C)
    log_x = tl.load(log_x_ptr + row * C + positions)
    finite = ks.isfinite64(log_x)
    k = tl.load(k_ptr + row)
    nan = tl.full((), float("nan"), tl.float64)
    s, log_q, lift, _z = ks.solve_map(
        tl.load(kind_ptr + row), tl.load(closed_ptr + row), log_x, tl.where(finite, log_x, 0.0),
        finite, tl.load(alpha_ptr + row), tl.load(deficit_ptr + row * C + positions), k, nan,
        tl.full([C], float("nan"), tl.float64), positions, C)
    tl.store(s_ptr + row, s)
    tl.store(log_q_ptr + row * C + positions, ks.normalized(log_q, positions < k))
    tl.store(lift_ptr + row * C + positions, lift)


def _maps(mode, alpha, cand, k):
    n, width = cand.x.shape
    s = torch.empty(n, dtype=F64)
    log_q, lift = torch.empty(n, width, dtype=F64), torch.empty(n, width, dtype=F64)
    _map_kernel[(n,)](cand.log_x, cand.deficit, k_ptr=k, s_ptr=s, log_q_ptr=log_q,
                      lift_ptr=lift, C=width, **_row_args(mode, alpha, n))
    return s, log_q, lift


@pytest.mark.parametrize(("mode", "alpha"), [*GENERAL, ("dual", 1.5), ("dual", 3.0)])
def test_maps_of_fixed_sizes(mode, alpha):
    """The map of a fixed support by Newton on its scalar (`maps.solved`): its scalar, log q on
    the support (normalized) and log(q / p) of every candidate, for supports of 1 to 63
    entries, one holding all the mass (the identity)."""
    _, cand = _candidates(4, 64, 64, seed=3)
    k = torch.tensor([1, 7, 63, 64])
    family = _family(mode, alpha)
    s, log_q, lift = _maps(mode, alpha, cand, k)
    want = solved(family, mode, cand.log_x, k, torch.full((4,), alpha, dtype=F64),
                  log_deficit(cand, k))
    mask = support_mask(k, 64)
    torch.testing.assert_close(log_q, normalized(want.log_q, mask), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(s[:3], want.s[:3], rtol=1e-10, atol=1e-12)
    assert s[3] == -math.inf  # (no mass outside: the identity)
    near = torch.arange(64) <= k.unsqueeze(-1)  # (the support and the next entry)
    torch.testing.assert_close(lift[near], want.lift[near], rtol=1e-9, atol=1e-12)


@triton.jit
def _gap_kernel(log_x_ptr, deficit_ptr, alpha_ptr, kind_ptr, closed_ptr, m_ptr, out_ptr,
                decided_ptr, log_lam_ptr, dual, C: tl.constexpr):
    row = tl.program_id(0)
    positions = tl.arange(0, C)
    log_x = tl.load(log_x_ptr + row * C + positions)
    finite = ks.isfinite64(log_x)
    lp = tl.where(finite, log_x, 0.0)
    deficit = tl.load(deficit_ptr + row * C + positions)
    alpha = tl.load(alpha_ptr + row)
    kind = tl.load(kind_ptr + row)
    closed = tl.load(closed_ptr + row)
    m = tl.load(m_ptr + row)
    nan = tl.full((), float("nan"), tl.float64)
    none = tl.full([C], float("nan"), tl.float64)
    _s, log_q, lift, _z = ks.solve_map(kind, closed, log_x, lp, finite, alpha, deficit, m, nan,
                                       none, positions, C)
    _s, log_q1, lift1, _z = ks.solve_map(kind, closed, log_x, lp, finite, alpha, deficit, m + 1,
                                         nan, none, positions, C)
    lq = ks.normalized(log_q, positions < m)
    lq1 = ks.normalized(log_q1, positions < m + 1)
    if dual:
        value = ks.dual_log_gap(log_x, lq, lq1, m, alpha, lift - lift1, positions)
    else:
        value = ks.primal_log_gap(lq, lq1, m, alpha, lift - lift1, positions)
    tl.store(out_ptr + row, value)
    for j in range(3):  # (three lambdas)
        tl.store(decided_ptr + row * 3 + j, ks.decide_gap(
            dual, log_x, alpha, tl.load(log_lam_ptr + j), m, log_q, lift, log_q1, lift1,
            positions))


@pytest.mark.parametrize(("mode", "alpha"), [*GENERAL, ("dual", 1.5), ("dual", 3.0)])
def test_exact_gaps(mode, alpha):
    """log G(m) from the maps of sizes m and m + 1 (`gaps.primal_log_gap`,
    `gaps.dual_log_gap`, the ratios exact from the multipliers), and the decision of one gap
    against lambda by the maps' own bounds first (`gaps.consecutive_gaps`): the same side of
    log lambda."""
    _, cand = _candidates(4, 64, 4096, seed=4)
    m = torch.tensor([1, 5, 20, 62])
    n = 4
    a = torch.full((n,), alpha, dtype=F64)
    family = _family(mode, alpha)
    sizes = torch.stack([m, m + 1], -1)
    found = solved(family, mode, cand.log_x.repeat_interleave(2, 0), sizes.reshape(-1),
                   a.repeat_interleave(2), log_deficit(cand, sizes).reshape(-1))
    maps = normalized(found.log_q, support_mask(sizes.reshape(-1), 64)).reshape(n, 2, 64)
    lift = found.lift.reshape(n, 2, 64)
    rho = lift[:, 0] - lift[:, 1]
    if mode == "primal":
        want = primal_log_gap(maps[:, 0], maps[:, 1], m, a, rho)
    else:
        want = dual_log_gap(cand.log_x, maps[:, 0], maps[:, 1], m, a, rho)
    out, decided = torch.empty(n, dtype=F64), torch.empty(n, 3, dtype=F64)
    middle = float(want.sort().values[1:3].mean())  # (between two gaps)
    log_lam = torch.tensor([float(want.min()) - 1.0, middle, float(want.max()) + 1.0], dtype=F64)
    _gap_kernel[(n,)](cand.log_x, cand.deficit, m_ptr=m, out_ptr=out, decided_ptr=decided,
                      log_lam_ptr=log_lam, dual=int(mode == "dual"), C=64,
                      **_row_args(mode, alpha, n))
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-12)
    assert torch.equal(decided > log_lam, want.unsqueeze(-1) > log_lam)


# ----------------------------------------------------------------------------- one row


@triton.jit
def _row_kernel(x_ptr, log_x_ptr, deficit_ptr, alpha_ptr, kind_ptr, closed_ptr, lam_ptr, dual,
                limit_ptr, k_ptr, log_q_ptr, done_ptr, C: tl.constexpr):
    row = tl.program_id(0)
    positions = tl.arange(0, C)
    where = row * C + positions
    limit = tl.load(limit_ptr + row)
    k, log_q, done = ks.search_row(dual != 0, tl.load(closed_ptr + row), tl.load(alpha_ptr + row),
                                   tl.load(lam_ptr), tl.load(x_ptr + where),
                                   tl.load(log_x_ptr + where),
                                   tl.load(deficit_ptr + where), limit * 0 + 1, limit,
                                   positions, C)
    tl.store(k_ptr + row, k)
    tl.store(log_q_ptr + where, log_q)
    tl.store(done_ptr + row, done)


@pytest.mark.parametrize(("mode", "alpha", "lam"),
                         [("primal", 10.0, 1e-3), ("primal", 0.5, 1e-2), ("primal", 1.05, 1e-3),
                          ("dual", 4.0, 1e-3), ("dual", 10.0, 1e-3), ("dual", 1.2, 1e-3),
                          ("dual", 1.5, 1e-4), ("dual", 3.0, 1e-5), ("primal", 3.0, 1e-6),
                          ("primal", 0.3, 0.3)])
def test_one_rows_search_against_the_reference(mode, alpha, lam):
    """`search.search_row` on 256 candidates of [3, 4096] rows (flat and peaked): k* and log T_k*
    as the independent reference decodes the whole row (its own maps, Algorithm 2's binary
    search); a row whose k* passes the candidates says so, with a lower bound."""
    logits, cand = _candidates(3, 256, 4096, seed=5, flat=False)
    logits[0] *= 0.1  # (a flat row: k* past the candidates for the longest-tailed families)
    cand = candidates(torch.softmax(logits, -1), 256)
    n = 3
    k, done = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.bool)
    log_q = torch.empty(n, 256, dtype=F64)
    _row_kernel[(n,)](cand.x, cand.log_x, cand.deficit, lam_ptr=torch.tensor([lam], dtype=F64),
                      dual=int(mode == "dual"),
                      limit_ptr=cand.known, k_ptr=k, log_q_ptr=log_q, done_ptr=done, C=256,
                      **_row_args(mode, alpha, n))
    want = rs.decode(torch.log_softmax(logits, -1).numpy(), alpha, lam, mode)
    assert torch.equal(done, torch.from_numpy(want.k < 256)), (k, want.k)
    assert torch.equal(k[done], torch.from_numpy(want.k)[done])
    assert bool((k[~done] >= 255).all())
    for row in done.nonzero().flatten().tolist():
        size = int(k[row])
        q = log_q[row, :size].exp().numpy()
        expected = np.exp(want.log_q[row][cand.index[row, :size].numpy()])
        np.testing.assert_allclose(q, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["primal", "dual"])
def test_a_capped_row_stops_at_its_cap(mode):
    """Rows of one family, held to k_max = 100 and 30 where their k* is in the hundreds,
    beside one held to 400: the probes bound k* without the cap, and a capped row's k* is
    min(k*, k_max) (Theorem 3.3), as the reference's."""
    g = torch.Generator().manual_seed(28)
    logits = torch.randn(3, 4096, generator=g)
    configs = [{"bregman_mode": mode, "bregman_alpha": 3.0, "bregman_lambda": 1e-9,
                "bregman_k_max": cap} for cap in (400, 100, 30)]
    got, _ = _step(logits, configs)
    assert got.k.tolist()[1:] == [100, 30] and int(got.k[0]) > 100
    want = _reference(logits[1:2], configs[1])
    np.testing.assert_allclose(got.out[1].double().exp().numpy(), np.exp(want.log_q[0]),
                               rtol=0, atol=2e-5)


# ----------------------------------------------------------------------------- the step


@pytest.fixture
def counted(monkeypatch):
    """The step's kernel launches (`kernels.step._launch`, run outside the dispatch counter:
    under the interpreter a launch is torch ops on CPU tensors)."""
    seen = {"launches": 0}
    launch = kernel_step._launch

    def counted_launch(kernel, grid, *args, **meta):
        seen["launches"] += 1
        with _disable_current_modes():
            launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(kernel_step, "_launch", counted_launch)
    monkeypatch.setenv("BREGMAN_BACKEND", "triton")
    return seen


def _step(scores, configs, temperatures=None, logits=True, counted=None):
    """One step of the kernels and of the float64 torch step on the same scores: the same k*,
    q within 2e-5, the same supports, plain rows untouched; with ``counted``, the step's
    launches (the kernels' and the torch ops': at most 10; ``counted["total"]``) and no host
    sync."""
    vocab = scores.shape[-1]
    plan = plan_of(configs, vocab, temperatures)
    if counted is not None:
        # (its table, made once per plan, and the identity mapping, once per batch size)
        kernel_step._table_of(plan, scores.device)
        kernel_step._identity(scores.shape[0], scores.device)
        counted.update(launches=0)
    fresh = scores.clone()
    with DispatchCounter() as counter:
        got = decode_step(fresh, plan, logits=logits, backend="triton")
    want = decode_step(scores.double(), plan_of(configs, vocab, temperatures), logits=logits,
                       backend="torch")
    names = [str(config) for config in configs]
    assert torch.equal(got.k, want.k), [(n, a, b) for n, a, b in
                                        zip(names, got.k.tolist(), want.k.tolist(), strict=True)
                                        if a != b]
    q, q_want = (probabilities(t, logits, temperatures) for t in (got.out, want.out))
    torch.testing.assert_close(q, q_want, rtol=0, atol=2e-5, equal_nan=True)
    assert torch.equal(q > 0, q_want > 0)
    plain = torch.tensor([config is None for config in configs])
    assert torch.equal(got.out[plain], scores[plain])
    if counted is not None:
        counted["total"] = counted["launches"] + counter.launches
        counted["ops"] = dict(counter.launch_ops)
        assert counter.syncs == 0, dict(counter.sync_ops)
        assert counted["total"] <= 10, (counted, dict(counter.launch_ops))
    return got, want


def _reference(logits, config, temperature=1.0):
    """The independent reference's k* and q for one request's rows (`rs.decode_logits`)."""
    mode = config.get("bregman_mode", "primal")
    alpha = float(config["bregman_alpha"])
    return rs.decode_logits(logits.double().numpy(), alpha, config.get("bregman_lambda", 0.0),
                            mode, top_k=config.get("bregman_top_k"),
                            k_max=config.get("bregman_k_max"), temperature=temperature)


#: The general maps, adaptive with k* bounded by the parameters (`families.support_bound`) or a
#: cap within the window, and at fixed sizes (alpha < 0 too).
IN_WINDOW = [
    {"bregman_alpha": 10.0, "bregman_lambda": 1e-3},
    {"bregman_alpha": 0.5, "bregman_lambda": 1e-3, "bregman_k_max": 50},
    {"bregman_alpha": 1.05, "bregman_lambda": 1e-3, "bregman_k_max": 64},
    {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_lambda": 1e-3},
    {"bregman_mode": "dual", "bregman_alpha": 10.0, "bregman_lambda": 1e-4},
    {"bregman_mode": "dual", "bregman_alpha": 1.2, "bregman_lambda": 1e-3, "bregman_k_max": 60},
    {"bregman_alpha": 0.5, "bregman_top_k": 30},
    {"bregman_alpha": -2.0, "bregman_top_k": 10},
    {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_top_k": 40},
    None,
]


def test_the_general_maps_within_the_window_decode_on_the_device(counted):
    """The families the window has no formula for (primal alpha 10, 0.5, 1.05; dual alpha 4,
    10, 1.2; fixed sizes, alpha < 0 among them), each row's k* bounded by 64: the search pass
    at 64 candidates decodes them (six launches, no sync), as the float64 torch step and the
    independent reference do."""
    g = torch.Generator().manual_seed(21)
    scores = torch.randn(len(IN_WINDOW), 4096, generator=g) * \
        torch.linspace(1.0, 5.0, len(IN_WINDOW)).unsqueeze(-1)
    got, _ = _step(scores, IN_WINDOW, counted=counted)
    assert counted["launches"] == 6
    for row in (0, 3, 5, 7):
        want = _reference(scores[row:row + 1], IN_WINDOW[row])
        assert int(got.k[row]) == int(want.k[0])
        np.testing.assert_allclose(got.out[row].double().exp().numpy(), np.exp(want.log_q[0]),
                                   rtol=0, atol=2e-5)


#: Rows whose k* passes both windows (in the hundreds at [4, 8192]), capped within the search's
#: widest candidates: decoded on the device.
PAST = [
    {"bregman_mode": "dual", "bregman_alpha": 1.2, "bregman_lambda": 1e-4, "bregman_k_max": 500},
    {"bregman_alpha": 1.05, "bregman_lambda": 1e-4, "bregman_k_max": 500},
    {"bregman_alpha": 3.0, "bregman_lambda": 1e-8, "bregman_k_max": 500},
    {"bregman_alpha": 1.0, "bregman_lambda": 2e-4, "bregman_k_max": 300},
]


def test_rows_past_the_window_decode_on_the_device(counted):
    """Flat rows at small lambdas (k* in the hundreds at [4, 8192]: the general maps, a power
    family the window hands over, standard top-k past 256), capped within the search's widest
    candidates: the search pass decodes them on the device, no sync."""
    g = torch.Generator().manual_seed(22)
    scores = torch.randn(len(PAST), 8192, generator=g) * 0.8
    got, _ = _step(scores, PAST, counted=counted)
    assert bool((got.k > kernel_step.WIDE_WINDOW).all()), got.k
    want = _reference(scores[:1], PAST[0])
    assert int(got.k[0]) == int(want.k[0])


def test_the_widest_candidates_limit(counted):
    """Rows held to k_max 300 and to the search's widest width (k* = the cap), fixed sizes of
    300 and the widest width, decoded by the search pass; beside them a row whose k* passes the
    widest candidates and a fixed size past them: those two take the wide pass (one sort of the
    batch and its kernel: seven launches and the sort, no sync) and end as the float64 step
    decodes them."""
    wide = kernel_step.SEARCH_WIDTH
    configs = [
        {"bregman_mode": "dual", "bregman_alpha": 1.2, "bregman_lambda": 1e-6,
         "bregman_k_max": 300},
        {"bregman_alpha": 1.05, "bregman_lambda": 1e-6, "bregman_k_max": wide},
        {"bregman_alpha": 1.5, "bregman_top_k": 300},
        {"bregman_alpha": 10.0, "bregman_top_k": wide},
        {"bregman_alpha": 1.5, "bregman_lambda": 1e-8},
        {"bregman_alpha": 2.0, "bregman_top_k": wide + 100},
    ]
    g = torch.Generator().manual_seed(23)
    scores = torch.randn(len(configs), 8192, generator=g) * 0.3
    got, _ = _step(scores, configs, counted=counted)
    assert got.k[:4].tolist() == [300, wide, 300, wide] and int(got.k[4]) > wide
    assert counted["launches"] == 7 and counted["total"] == 8, counted


def test_ties_masked_entries_and_rows_that_are_not_distributions(counted):
    """The general maps on ties across the boundary of a fixed size and of k*, on rows with
    grammar-masked (-inf) entries, and rows that are NaN, hold +inf or are all -inf (left as
    they are, k = 0)."""
    configs = [{"bregman_alpha": 10.0, "bregman_top_k": 5},
               {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_top_k": 5},
               {"bregman_alpha": 0.5, "bregman_lambda": 1e-2, "bregman_k_max": 60},
               {"bregman_mode": "dual", "bregman_alpha": 1.2, "bregman_lambda": 1e-2,
                "bregman_k_max": 60},
               {"bregman_alpha": 10.0, "bregman_lambda": 1e-3},
               {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_lambda": 1e-3},
               {"bregman_alpha": 1.05, "bregman_lambda": 1e-3, "bregman_k_max": 60}]
    scores = torch.full((len(configs), 1024), -5.0)
    scores[:2, 100:107] = 2.0  # seven tied tokens across the boundary of 5
    scores[:2, 3] = 4.0
    g = torch.Generator().manual_seed(24)
    scores[2:4] = torch.randn(2, 1024, generator=g) * 3.0
    scores[2:4, ::3] = -math.inf  # grammar-masked
    scores[2, 1::3] = -math.inf
    scores[4, 7] = math.nan
    scores[5, 11] = math.inf
    scores[6] = -math.inf
    plan = plan_of(configs, 1024)
    got = decode_step(scores.clone(), plan, logits=True, backend="triton")
    want = decode_step(scores.double(), plan_of(configs, 1024), logits=True, backend="torch")
    assert torch.equal(got.k, want.k) and got.k[:2].tolist() == [5, 5]
    assert got.k[4:].tolist() == [0, 0, 0]
    torch.testing.assert_close(got.out[4:], scores[4:], rtol=0, atol=0, equal_nan=True)
    q = got.out[:4].double().exp().sort(-1, descending=True).values
    q_want = want.out[:4].exp().sort(-1, descending=True).values
    torch.testing.assert_close(q, q_want, rtol=0, atol=2e-5)
    kept = torch.isfinite(got.out[:2])
    assert bool((scores[:2][kept] >= 2.0).all())
    assert not torch.isfinite(got.out[2:4, ::3]).any()


def test_temperatures_other_than_one_and_probabilities(counted):
    """Model Runner V2's temperatures (softmax(logits / T) decoded, T log q written) on the
    general maps; and probabilities in (q written, zeros off the support), zero entries among
    them."""
    configs = IN_WINDOW[:6]
    temperatures = [0.7, 1.3, 0.5, 2.0, 0.8, 1.5]
    g = torch.Generator().manual_seed(25)
    scores = torch.randn(len(configs), 1024, generator=g) * 3.0
    _step(scores, configs, temperatures, counted=counted)
    probs = torch.softmax(scores, -1)
    probs[1, :7] = 0.0
    _step(probs, configs, logits=False, counted=counted)


def test_a_mixed_batch_in_slots(counted):
    """Model Runner V2: every family (the window's, the general maps, a row past the window,
    fixed sizes wide and narrow, a fixed size and a dual row past the search's candidates,
    keep-all, a plain request) in shuffled slots, with draft rows and temperatures: each row
    decoded as its slot's request alone by the float64 step, in seven launches and the wide
    pass's sort, no sync."""
    configs = [NARROW["kl"], NARROW["power 3"], NARROW["dual 3/2"], NARROW["top_k water"],
               IN_WINDOW[0], IN_WINDOW[3], IN_WINDOW[7], PAST[3], None, NARROW["keep all"],
               {"bregman_alpha": 1.5, "bregman_top_k": 300},
               {**WIDE["kl 1e-3"], "bregman_k_max": 400},
               {"bregman_alpha": 10.0, "bregman_top_k": 1000},
               {"bregman_mode": "dual", "bregman_alpha": 1.2, "bregman_lambda": 1e-9}]
    temperatures = [0.7, 1.0, 1.3, 0.9, 1.1, 1.0, 0.8, 1.0, 1.0, 1.2, 1.0, 0.6, 0.9, 1.4]
    proc = BregmanLogitsProcessor(SimpleNamespace(), SimpleNamespace(
        device=torch.device("cpu"), vocab_size=2048, max_num_reqs=16))
    for slot, (config, temperature) in enumerate(zip(configs, temperatures, strict=True)):
        proc.add_request(slot, SamplingParams(temperature=temperature, extra_args=config))
    proc.apply_staged_writes()
    order = [5, 11, 12, 0, 7, 3, 9, 1, 8, 13, 10, 2, 6, 4]
    rows_of = [5, 11, 12, 0, 0, 7, 3, 9, 1, 8, 13, 10, 2, 2, 6, 4]  # (slots 0, 2: two rows)
    logits = model_logits(len(rows_of), 2048, seed=26)
    ctx = _context(order, rows_of)
    proc.apply(logits.clone(), ctx)  # (its layout, once)
    scores = logits.clone()
    counted.update(launches=0)
    with DispatchCounter() as counter:
        out = proc.apply(scores, ctx)
    assert counter.syncs == 0, dict(counter.sync_ops)
    # (the processor's slot gather and the wide pass's sort beside the kernels)
    assert counted["launches"] == 7 and counter.launch_ops["aten::sort"] == 1
    assert counted["launches"] + counter.launches <= 10, dict(counter.launch_ops)
    for row, slot in enumerate(rows_of):
        if configs[slot] is None:
            assert torch.equal(out[row], logits[row])
            continue
        alone = decode_step(logits[row:row + 1].double(),
                            plan_of([configs[slot]], 2048, [temperatures[slot]]),
                            logits=True, backend="torch")
        assert int(proc.last_step.k[row]) == int(alone.k[0]), (row, slot)
        q = (out[row].double() / temperatures[slot]).exp()
        q_want = (alone.out[0] / temperatures[slot]).exp()
        torch.testing.assert_close(q, q_want, rtol=0, atol=2e-5)


#: Rows whose k* or fixed size passes the search's widest candidates (512 under the
#: interpreter; k* 600 to 2,900 on the rows of `test_rows_past_the_search_decode_on_the_device`):
#: the general maps, the quadratic duals, a power family, the closed-form gaps, fixed sizes of
#: every closed-form map and of the general ones.
BEYOND = [
    {"bregman_alpha": 10.0, "bregman_lambda": 1e-32},
    {"bregman_alpha": 0.5, "bregman_lambda": 3e-2},
    {"bregman_alpha": 1.05, "bregman_lambda": 2e-4},
    {"bregman_alpha": 3.0, "bregman_lambda": 1e-9},
    {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_lambda": 1e-14},
    {"bregman_mode": "dual", "bregman_alpha": 10.0, "bregman_lambda": 1e-30},
    {"bregman_mode": "dual", "bregman_alpha": 1.2, "bregman_lambda": 3e-4},
    {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 1e-5},
    {"bregman_mode": "dual", "bregman_alpha": 3.0, "bregman_lambda": 1e-9},
    {"bregman_alpha": 1.0, "bregman_lambda": 2e-4},
    {"bregman_alpha": 1.5, "bregman_lambda": 1e-5},
    {"bregman_alpha": 2.0, "bregman_lambda": 1e-6},
    {"bregman_alpha": 1.0, "bregman_top_k": 1500},
    {"bregman_alpha": 1.5, "bregman_top_k": 1500},
    {"bregman_alpha": 2.0, "bregman_top_k": 1500},
    {"bregman_alpha": math.inf, "bregman_top_k": 1500},
    {"bregman_alpha": -math.inf, "bregman_top_k": 1500},
    {"bregman_alpha": 10.0, "bregman_top_k": 1500},
    {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_top_k": 2000},
    None,
]


def test_rows_past_the_search_decode_on_the_device(counted):
    """Every family whose k* or fixed size passes the search's widest candidates (flat rows of
    4096, k* in the thousands): the wide pass decodes it on the whole sorted row (one sort and
    seven launches, no sync), as the float64 torch step does, and as the independent reference
    does."""
    g = torch.Generator().manual_seed(31)
    scores = torch.randn(len(BEYOND), 4096, generator=g) * 0.5
    got, _ = _step(scores, BEYOND, counted=counted)
    assert counted["launches"] == 7 and counted["total"] == 8, counted
    assert bool((got.k[:-1] > kernel_step.SEARCH_WIDTH).all()), got.k
    for row in range(len(BEYOND) - 1):
        want = _reference(scores[row:row + 1], BEYOND[row])
        assert int(got.k[row]) == int(want.k[0]), BEYOND[row]
        np.testing.assert_allclose(got.out[row].double().exp().numpy(), np.exp(want.log_q[0]),
                                   rtol=0, atol=2e-5)


def test_the_wide_pass_goes_on_to_the_whole_row_where_k_passes_its_first_round(counted):
    """Rows of 8192 whose k* (5,564 and 6,324) passes the wide pass's first round of entries
    (GROWTH times the search's candidates: 4096 under the interpreter): its probes point past
    the round, the next one (the whole row) settles k*, as the float64 torch step and the
    independent reference decide it."""
    configs = [{"bregman_alpha": 10.0, "bregman_lambda": 1e-40},
               {"bregman_mode": "dual", "bregman_alpha": 4.0, "bregman_lambda": 1e-16}]
    g = torch.Generator().manual_seed(33)
    scores = torch.randn(2, 8192, generator=g) * 0.5
    got, _ = _step(scores, configs, counted=counted)
    assert got.k.tolist() == [6324, 5564] and counted["launches"] == 7
    assert int(got.k.min()) > wide.FIRST
    for row, config in enumerate(configs):
        want = _reference(scores[row:row + 1], config)
        assert int(got.k[row]) == int(want.k[0])
        np.testing.assert_allclose(got.out[row].double().exp().numpy(), np.exp(want.log_q[0]),
                                   rtol=0, atol=2e-5)


def test_rows_held_past_the_search_take_their_top_entries_only(counted):
    """Rows held to k_max 3000 and 2500 and a top_k of 2500 at [n, 8192] (past the search's
    candidates, within half the row): the wide pass takes each row's top 4096 entries
    (`torch.topk`: a select and a sort of the candidates, not of the whole row) and the mass
    of the others from the row itself (100 of them tied with the last candidate), and decodes
    as the float64 torch step and the independent reference do."""
    configs = [{"bregman_alpha": 10.0, "bregman_lambda": 1e-40, "bregman_k_max": 3000},
               {"bregman_mode": "dual", "bregman_alpha": 3.0, "bregman_lambda": 1e-12,
                "bregman_k_max": 3000},
               {"bregman_alpha": 1.0, "bregman_lambda": 1e-5, "bregman_k_max": 2500},
               {"bregman_alpha": 1.5, "bregman_top_k": 2500}, None]
    g = torch.Generator().manual_seed(34)
    scores = torch.randn(len(configs), 8192, generator=g) * 0.5
    last = scores.sort(-1, descending=True).values[:, 4095:4096]
    scores[:, 8000:8100] = last  # (tied with each row's last candidate)
    got, _ = _step(scores, configs, counted=counted)
    assert got.k[[0, 2, 3, 4]].tolist() == [3000, 2500, 2500, 0]
    assert kernel_step.SEARCH_WIDTH < int(got.k[1]) <= 3000
    assert counted["ops"] == {"aten::topk": 1}, counted
    for row in (0, 1):
        want = _reference(scores[row:row + 1], configs[row])
        assert int(got.k[row]) == int(want.k[0])
        np.testing.assert_allclose(got.out[row].double().exp().numpy(), np.exp(want.log_q[0]),
                                   rtol=0, atol=2e-5)


def test_the_wide_pass_on_ties_masks_temperatures_and_probabilities(counted):
    """The wide pass on ties across the boundary of a fixed size (which of the tied tokens are
    kept is a tie-break: `torch.topk`'s here, the torch step's may differ, so the values are
    compared sorted), grammar-masked (-inf) entries, rows that are NaN or hold +inf (left as
    they are), temperatures other than 1, and probabilities in."""
    ties = [{"bregman_alpha": 10.0, "bregman_top_k": 1000},
            {"bregman_alpha": 1.0, "bregman_top_k": 1000}, None]
    g = torch.Generator().manual_seed(32)
    scores = torch.randn(3, 4096, generator=g) * 0.5
    scores[:, 500:1700] = 2.5  # 1,200 tied tokens across the boundary of 1000
    got = decode_step(scores.clone(), plan_of(ties, 4096), logits=True, backend="triton")
    want = decode_step(scores.double(), plan_of(ties, 4096), logits=True, backend="torch")
    assert got.k.tolist() == want.k.tolist() == [1000, 1000, 0]
    kept = torch.isfinite(got.out[:2])
    assert kept[:, 500:1700].sum(-1).tolist() == [1000, 1000] and int(kept.sum()) == 2000
    q = got.out[:2].double().exp().sort(-1, descending=True).values
    q_want = want.out[:2].exp().sort(-1, descending=True).values
    torch.testing.assert_close(q, q_want, rtol=0, atol=2e-5)
    configs = [{"bregman_mode": "dual", "bregman_alpha": 3.0, "bregman_lambda": 1e-9},
               {"bregman_alpha": 0.5, "bregman_lambda": 3e-2},
               {"bregman_alpha": 10.0, "bregman_lambda": 1e-32},
               {"bregman_alpha": 1.0, "bregman_lambda": 2e-4}]
    scores = torch.randn(len(configs), 4096, generator=g) * 0.5
    scores[:2, ::5] = -math.inf  # grammar-masked
    scores[2, 9] = math.nan
    scores[3, 17] = math.inf
    got, _ = _step(scores, configs, [1.3, 0.7, 1.0, 1.0], counted=counted)
    assert int(got.k[0]) > kernel_step.SEARCH_WIDTH and got.k[2:].tolist() == [0, 0]
    assert not torch.isfinite(got.out[:2, ::5]).any()
    torch.testing.assert_close(got.out[2:], scores[2:], rtol=0, atol=0, equal_nan=True)
    probs = torch.softmax(scores[:2] / 0.9, -1)
    probs[1, 3] = 0.0
    _step(probs, configs[:2], logits=False, counted=counted)


def test_a_row_the_search_cannot_decide_without_the_host_is_still_written(monkeypatch,
                                                                          counted):
    """Where the layout says no row can need the host (every row's reach within the search's
    candidates) and one still cannot be decided there (here: the search's width forced to 64
    for a row whose k* is in the hundreds), the row is written with the map of its certified
    lower bound, a distribution, rather than left as it came."""
    monkeypatch.setattr(kernel_step, "search_width", lambda reach, vocab: (64, False))
    configs = [PAST[3], PAST[1]]  # (standard top-k, and a general map)
    g = torch.Generator().manual_seed(27)
    scores = torch.randn(2, 4096, generator=g) * 0.8
    got = decode_step(scores.clone(), plan_of(configs, 4096), logits=True, backend="triton")
    assert bool((got.k >= 63).all()), got.k
    q = got.out.double().exp()
    assert torch.equal((q > 0).sum(-1), got.k)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, dtype=F64), rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["primal", "dual"])
def test_the_support_bound_holds(mode):
    """`families.support_bound` (whether a row can need the host: the search decides it on bound + 1
    candidates) against the independent reference's k* on rows from near-uniform to peaked:
    never below, and tight at large alpha (dual alpha > 2 needs its factor beta there)."""
    alphas = (0.5, 0.8, 1.05, 1.5, 3.0, 10.0) if mode == "primal" else (1.2, 1.5, 3.0, 4.0,
                                                                          10.0)
    g = torch.Generator().manual_seed(29)
    scale = torch.tensor([0.05, 0.3, 1.0, 3.0, 8.0], dtype=F64).unsqueeze(-1)
    logits = torch.randn(5, 4096, generator=g, dtype=F64) * scale
    tight = 0
    for alpha in alphas:
        for lam in (1e-1, 1e-2, 1e-3):
            bound = support_bound(mode, alpha, lam)
            if bound > 4096:
                continue
            k = rs.decode_logits(logits.numpy(), alpha, lam, mode).k
            assert int(k.max()) <= bound, (alpha, lam, k, bound)
            tight += int(k.max()) == bound
    assert tight >= 3


def test_a_nan_from_the_search_is_never_written(monkeypatch, counted):
    """Should the search's map come out NaN, the row is not written with it: without the
    wide pass an exact-family row stays as it came (k = 0) and the other rows are decoded;
    with it, the wide pass decodes the row on the whole sorted row."""
    def broken(dual, closed, alpha, lam, x, log_x, deficit, low, limit, positions, C):
        return low, tl.full([C], float("nan"), tl.float64), low >= 0

    monkeypatch.setattr(kernel_step, "search_row", broken)
    configs = [IN_WINDOW[0], NARROW["kl"]]
    g = torch.Generator().manual_seed(30)
    scores = torch.randn(2, 1024, generator=g) * 3.0
    got = decode_step(scores.clone(), plan_of(configs, 1024), logits=True, backend="triton")
    assert int(got.k[0]) == 0 and int(got.k[1]) > 0
    assert torch.equal(got.out[0], scores[0])
    configs = [{"bregman_alpha": 1.05, "bregman_lambda": 1e-6}]  # (its reach passes C: wide)
    _step(torch.randn(1, 1024, generator=g), configs, counted=counted)
    assert counted["launches"] == 7
