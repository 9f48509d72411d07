"""The search for k* (`bregman_vllm.core.search`): its premise, its answers, its work.

References that share no code with the search: `tests/reference.py` (the brute-force float64
costs, small rows) for the weak-duality bounds every probe rests on, and
`tests/reference_search.py` (the paper's binary search over k on its own maps) for k* and the
maps at real sizes. The checks are on behaviour: k* and q against the references, and the
work of a call (launched ops and host syncs, counted: load-independent) against bounds.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from bregman_vllm import bregman_decode, bregman_decode_logits
from bregman_vllm.core import dual, families, roots
from bregman_vllm.core import step as torch_step
from bregman_vllm.core.candidates import candidates
from bregman_vllm.core.gaps import log_entry_term, series_gap
from bregman_vllm.core.generators import AlphaGenerator
from bregman_vllm.core.maps import log_deficit, solved
from bregman_vllm.core.plan import exact_plan
from bregman_vllm.core.primal import normalized, primal_values, support_mask, top_values
from bregman_vllm.diagnostics import DispatchCounter

from . import reference as ref
from . import reference_search as rs

F64 = torch.float64


def _rows(kind: str, n: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits: realistic (Gaussian, a per-row scale of 3 to 7) or flat (scale 0.3) rows."""
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(n, vocab, generator=g) * 0.3
    return torch.randn(n, vocab, generator=g) * (3.0 + 4.0 * torch.rand(n, 1, generator=g))


def _sorted_row(rng: random.Random, size: int, scale: float) -> list[float]:
    logits = sorted((rng.gauss(0.0, scale) for _ in range(size)), reverse=True)
    weights = [math.exp(v - logits[0]) for v in logits]
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize(("mode", "alpha"), [("primal", 0.5), ("primal", 1.5), ("primal", 3.0),
                                             ("primal", 12.0), ("dual", 1.3), ("dual", 2.5),
                                             ("dual", 6.0)])
def test_one_multiplier_brackets_the_cost_gap(mode, alpha):
    """The premise of every probe (weak duality, `gaps.log_entry_term`): with s_k the scalar of
    the map of size k, w(p_(k+1), s_(k+1)) <= G(k) <= w(p_(k+1), s_k), G(k) = cost(k) -
    cost(k + 1) at lambda = 0 from the brute-force reference's costs."""
    rng = random.Random(11)
    a = torch.tensor(alpha, dtype=F64)
    for scale in (0.5, 1.5, 3.0):
        p = _sorted_row(rng, 7, scale)
        costs = ref.top_k_costs(p, alpha, 0.0, mode)
        cand = candidates(torch.tensor([p], dtype=F64), 7)
        maps = [None] + [solved(None, mode, cand.log_x, torch.tensor([k]),
                                torch.tensor([alpha], dtype=F64),
                                log_deficit(cand, torch.tensor([k]))) for k in range(1, 8)]
        for k in range(1, 7):
            gap = costs[k - 1] - costs[k]
            p_next = cand.log_x[0, k]
            lower = math.exp(log_entry_term(mode, p_next, maps[k + 1].log_q[0, k], a))
            upper = math.exp(log_entry_term(mode, p_next, maps[k].log_q[0, k], a))
            slack = 1e-9 * abs(gap) + 1e-13
            assert lower <= gap + slack <= upper + 2 * slack, (k, lower, gap, upper)


@pytest.mark.parametrize("alpha", [1.001, 1.3, 2.5, 7.0, 20.0, 1e4])
def test_the_dual_map_matches_the_reference_from_every_start(alpha, monkeypatch):
    """The dual map (eq. (5)) by its joint Newton, cold, warm-started from the neighbouring
    size's multiplier and inner unknowns (what the search's maps get), and by the nested
    root finding of Algorithm 1 alone (no joint iterations): the reference's map each time,
    on rows with zeros past the support."""
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(8, 300, generator=g, dtype=F64)
                      * torch.tensor([0.3, 2.0, 6.0, 1.0] * 2, dtype=F64).unsqueeze(-1), -1)
    p[::4, -3:] = 0.0
    p = torch.sort(p / p.sum(-1, keepdim=True), -1, descending=True).values
    log_p = torch.log(p)
    k = torch.tensor([1, 2, 5, 30, 100, 200, 250, 150])
    mask = support_mask(k, 300)
    log_r = torch.log1p(-torch.where(mask, p, 0.0).sum(-1))
    want = rs.renormalize_sorted(log_p.numpy(), k.numpy(), log_r.numpy(), alpha, "dual")
    a = torch.full((8,), alpha, dtype=F64)

    def close(found) -> None:
        got = normalized(found.log_q, mask).exp().numpy()
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, np.exp(want), rtol=1e-10, atol=1e-14)

    cold = dual.dual_multiplier(log_p, mask, a, log_r, k)
    close(cold)
    bigger = torch.minimum(k + 1, torch.full_like(k, 299))
    neighbour = dual.dual_multiplier(log_p, support_mask(bigger, 300), a,
                                     torch.log(torch.gather(1 - p.cumsum(-1), 1,
                                                            (bigger - 1).unsqueeze(-1))
                                               .squeeze(-1).clamp_min(1e-300)), bigger)
    close(dual.dual_multiplier(log_p, mask, a, log_r, k, start=neighbour.s,
                               state=neighbour.state))
    monkeypatch.setattr(dual, "JOINT_ITERATIONS", 0)
    close(dual.dual_multiplier(log_p, mask, a, log_r, k))


@pytest.mark.parametrize(("mode", "alpha"), [("dual", 1.2), ("dual", 1.5), ("dual", 2.5),
                                             ("dual", 3.0), ("dual", 10.0), ("dual", 20.0),
                                             ("primal", 0.3), ("primal", 0.7),
                                             ("primal", 1.05), ("primal", 1.5), ("primal", 3.0),
                                             ("primal", 7.5), ("primal", 20.0)])
def test_the_gaps_by_their_series_match_the_references(mode, alpha):
    """`gaps.series_gap`, what the search decides its last few sizes with (`search._series`):
    log G of sizes m and m + 1 and the maps T_m to T_(m+2) from the values at one scalar near
    theirs (no map solved), against the reference's gaps and maps, at sizes 300 to 8000 of
    realistic and flat rows of 8192 entries (the quadratic duals 3/2 and 3 by their formulas):
    log G within 1e-9 (`search.SERIES_TOLERANCE` is 1e-8) and q within 1e-9 wherever the
    expansion says it holds, which it does on flat rows at every size in the thousands."""
    closed = families.family_of(mode, alpha, False)
    closed = closed if closed in families.QUADRATIC_DUAL_FAMILIES else None
    a = torch.full((4,), alpha, dtype=F64)
    beta = a.unsqueeze(-1) - 1.0
    held = 0
    for kind in ("realistic", "flat"):
        p = torch.softmax(_rows(kind, 4, 8192, 5).double(), -1).sort(-1, descending=True).values
        log_p, tail = torch.log(p), p.flip(-1).cumsum(-1).flip(-1)
        finite = torch.isfinite(log_p)
        lp = torch.where(finite, log_p, 0.0)
        for size in (300, 2000, 8000):
            m = torch.full((4,), size)
            log_r = torch.log(tail[:, size: size + 3])  # R_m, R_(m+1), R_(m+2)
            ends = [solved(closed, mode, log_p, m + j, a, log_r[:, j]) for j in (0, 1)]
            for share in (0.0, 0.5, 1.0, -2.0):  # (where s lies between the two scalars)
                s = ends[1].s + share * (ends[0].s - ends[1].s)
                if mode == "dual":
                    values, exact = dual.dual_values(lp, finite, beta, s, ends[1].state, closed,
                                                     dual.INNER_STEPS)
                    assert bool(exact.all())
                else:  # (the scalar as the maps' solvers take it: tau, or delta below 1)
                    values = (primal_values(lp, finite, beta, s, True) if alpha > 1.0
                              else top_values(lp, finite, beta, s))
                log_gap, holds, map_of = series_gap(
                    mode, log_p, values, beta, m.unsqueeze(-1) + torch.arange(3), log_r)
                pair, holds = holds[:, 0], holds.all(-1)
                want = np.stack([rs.log_gap(log_p.numpy(), (m + j).numpy(), alpha, mode)
                                 for j in (0, 1)], -1)
                rows = holds.nonzero().squeeze(-1)
                held += rows.numel()
                if kind == "flat" and size == 2000 and abs(share) <= 1.0:
                    assert bool(pair.all()), (kind, size, share, pair)
                np.testing.assert_allclose(log_gap[rows].numpy(), want[rows.numpy()],
                                           rtol=0, atol=1e-9)
                for j in (0, 1, 2):
                    maps = rs.renormalize_sorted(log_p.numpy(), (m + j).numpy(),
                                                 log_r[:, j].numpy(), alpha, mode)
                    got = normalized(map_of(torch.full((4,), j)), support_mask(m + j, 8192))
                    np.testing.assert_allclose(got.exp().numpy()[rows.numpy()],
                                               np.exp(maps)[rows.numpy()], rtol=1e-9,
                                               atol=1e-300)
    assert held >= 4, held


@pytest.mark.parametrize("alpha", [2.5, 4.0])
def test_a_support_far_below_k_star_solves_the_dual_map_in_a_few_steps(alpha, monkeypatch):
    """A support holding little of the mass (flat rows capped at k_max = 256 where k* is in
    the thousands, what a server's `--max-support` makes common): the map's start lies at its
    bracket's end at once (3 Newton steps at most, not a bisection), and it is the reference's
    map."""
    g = torch.Generator().manual_seed(8)
    p = torch.sort(torch.softmax(torch.randn(4, 4096, generator=g, dtype=F64) * 0.3, -1), -1,
                   descending=True).values
    log_p, k = torch.log(p), torch.full((4,), 256)
    mask = support_mask(k, 4096)
    log_r = torch.log1p(-torch.where(mask, p, 0.0).sum(-1))
    assert bool((log_r > math.log(0.8)).all())  # more than 80% of the mass outside
    steps: list[int] = []
    solve = roots.safeguarded_newton

    def counted(evaluate, x, low, high, moved=None):
        calls = [0]

        def each(value):
            calls[0] += 1
            return evaluate(value)

        try:
            return solve(each, x, low, high, moved)
        finally:
            steps.append(calls[0])

    monkeypatch.setattr(dual, "safeguarded_newton", counted)
    found = dual.dual_multiplier(log_p, mask, torch.full((4,), alpha, dtype=F64), log_r, k)
    assert steps and max(steps) <= 3, steps
    want = rs.renormalize_sorted(log_p.numpy(), k.numpy(), log_r.numpy(), alpha, "dual")
    np.testing.assert_allclose(normalized(found.log_q, mask)[:, :256].exp().numpy(),
                               np.exp(want[:, :256]), rtol=1e-10)


#: Random parameter sets of the property test: (mode, alpha) pairs across the families the
#: search decodes, lambdas spread so that k* falls anywhere from the first window to the row.
_MODES_ALPHAS = [("primal", 0.3), ("primal", 0.7), ("primal", 1.02), ("primal", 1.3),
                 ("primal", 3.0), ("primal", 10.0), ("primal", 40.0), ("dual", 1.05),
                 ("dual", 1.5), ("dual", 2.5), ("dual", 3.0), ("dual", 7.0)]


@pytest.mark.parametrize("seed", range(6))
def test_the_search_finds_the_references_k_star_on_random_rows(seed):
    """Property test: random rows (peaked, flat, with ties and zero entries) and random
    parameters (every kind of multiplier, lambda from the first window's sizes to the whole
    row, a k_max now and then), at 2048 entries: k* and q as the independent reference's,
    q within 2e-5 relative where it is not tiny."""
    rng = random.Random(seed)
    kinds = ["realistic", "flat"]
    for case in range(4):
        logits = _rows(kinds[case % 2], 2, 2048, seed * 10 + case)
        if case == 2:  # ties at every size and zero entries (-inf logits)
            logits[:, 100:400] = logits[:, 100:101]
            logits[:, -200:] = -math.inf
        mode, alpha = rng.choice(_MODES_ALPHAS)
        lam = 10.0 ** rng.uniform(-40.0 if alpha > 2 else -12.0, -2.0)
        k_max = rng.choice([None, None, 300, 1500])
        out, k = bregman_decode_logits(logits, alpha=alpha, lam=lam, mode=mode, k_max=k_max,
                                       return_k=True)
        want = rs.decode_logits(logits.double().numpy(), alpha, lam, mode, k_max=k_max)
        label = (mode, alpha, lam, k_max, k.tolist(), want.k.tolist())
        assert k.tolist() == want.k.tolist(), label
        q, want_q = torch.softmax(out.double(), -1).numpy(), want.q
        if case == 2:  # (which of tied entries a support keeps is either's choice)
            q, want_q = np.sort(q, -1), np.sort(want_q, -1)
        big = want_q > 1e-30
        np.testing.assert_allclose(q[big], want_q[big], rtol=2e-5, err_msg=str(label))
        assert (q[~big] < 1e-29).all(), label


@pytest.mark.parametrize("mode", ["primal", "dual"])
def test_a_capped_row_beside_an_uncapped_one_stops_at_its_cap(mode):
    """Rows of one family, one held to k_max = 100 where its k* is in the hundreds, one not
    (a server's batch): the probes bound k* without the cap, and the capped row's k* is
    min(k*, k_max) (Theorem 3.3), as the reference's (it once came out at 102)."""
    logits = _rows("flat", 3, 4096, 0) * (1.0 / 0.3)
    caps = torch.tensor([0, 100, 30])
    out, k = bregman_decode_logits(logits, alpha=3.0, lam=1e-9, mode=mode, k_max=caps,
                                   return_k=True)
    for row, cap in enumerate(caps.tolist()):
        want = rs.decode_logits(logits[row:row + 1].double().numpy(), 3.0, 1e-9, mode,
                                k_max=cap or None)
        assert int(k[row]) == int(want.k[0]), (row, k.tolist(), want.k)
        np.testing.assert_allclose(torch.softmax(out[row].double(), -1).numpy(), want.q[0],
                                   rtol=2e-5, atol=1e-12)
    assert k.tolist()[1:] == [100, 30] and int(k[0]) > 100


def test_a_user_generator_takes_the_exact_gaps_past_the_first_round():
    """A user generator has no multiplier: Algorithm 2's binary search on exact gaps of its
    generic maps, round after round (k* past the first 64 candidates): the same k* and maps
    as the alpha family's own search, for the same phi."""
    p = torch.softmax(_rows("realistic", 2, 512, 3).double() * 0.2, -1)
    for mode, alpha, lam in (("primal", 2.5, 1e-7), ("dual", 2.5, 1e-7)):
        want = bregman_decode(p, alpha=alpha, lam=lam, mode=mode)
        got = bregman_decode(p, generator=AlphaGenerator(alpha), lam=lam, mode=mode)
        assert bool((want.k > 64).all()), want.k
        assert torch.equal(got.k, want.k)
        torch.testing.assert_close(got.probs, want.probs, rtol=1e-9, atol=1e-15)


#: Launched ops and host syncs of one call at [4, 8192] for the costliest kinds of rows (k* in
#: the hundreds to the whole row, the weak-duality bounds tight or loose, the level where every
#: entry's term sits at once), at most; counted 2026-11-28 at about two thirds of these. A
#: search whose probes stop converging (bisection to the end) takes several times more.
_WORK = [
    ("realistic", dict(alpha=3.0, lam=1e-12), 6000, 160),
    ("realistic", dict(alpha=0.5, lam=1e-6), 2000, 75),
    ("realistic", dict(alpha=10.0, lam=1e-100, mode="dual"), 6000, 170),
    ("flat", dict(alpha=4.0, lam=1e-20, mode="dual"), 750, 60),
    ("flat", dict(alpha=1.2, lam=1e-3, mode="dual"), 8000, 210),
    ("flat", dict(alpha=10.0, lam=1e-3), 1900, 65),
    ("realistic", dict(alpha=1.001, lam=1e-2, mode="dual"), 3600, 120),
    ("flat", dict(alpha=2.5, lam=1e-12, mode="dual", k_max=1024), 1800, 80),
]


@pytest.mark.parametrize(("kind", "kwargs", "launches", "syncs"), _WORK,
                         ids=[f"{kind}-{kw}" for kind, kw, _, _ in _WORK])
def test_the_search_takes_a_bounded_number_of_ops(kind, kwargs, launches, syncs):
    """The work of one call (`diagnostics.DispatchCounter`, load-independent: each probe and
    each map is a fixed handful of ops per row) within its bound, and the answer the
    reference's."""
    logits = _rows(kind, 4, 8192, 0)
    with DispatchCounter() as counter:
        _, k = bregman_decode_logits(logits, return_k=True, **kwargs)
    assert counter.launches <= launches and counter.syncs <= syncs, \
        (counter.launches, counter.syncs)
    params = dict(kwargs)
    want = rs.decode_logits(logits.double().numpy(), params.pop("alpha"), params.pop("lam"),
                            params.pop("mode", "primal"), **params)
    assert k.tolist() == want.k.tolist()


def test_a_row_whose_probes_point_past_a_rounds_candidates_goes_on_in_a_wider_one():
    """A row whose k* lies just past a round's candidates (here 4908, past 4096): once an exact
    probe's scalar is below every candidate size's, the probes cannot settle it there (its
    residual is not known past them) and it goes on in the next round. Without that, its
    probes cycled between two scalars until the probe limit, then settled the rest of the round
    by exact gaps: 28,920 launched ops for the row (measured), 5,350 with it."""
    g = torch.Generator().manual_seed(0)
    scale = 3.0 + 4.0 * torch.rand(8, 1, generator=g)
    row = (torch.randn(8, 49152, generator=g) * scale)[6:7]  # (the sweep's peaked rows)
    with DispatchCounter() as counter:
        _, k = bregman_decode_logits(row, return_k=True, alpha=20.0, lam=1e-140, mode="dual")
    want = rs.decode_logits(row.double().numpy(), 20.0, 1e-140, "dual")
    assert k.tolist() == want.k.tolist() and 4096 < int(k[0]) < 32768, k
    assert counter.launches <= 8000, counter.launches


def test_a_probe_at_the_end_of_a_round_pointing_back_inside_settles_there(monkeypatch):
    """Rows whose k* is inside a round (flat primal alpha 0.3 at lambda 0.251: k* 274 to 414)
    whose first probe lands at the end of its 512 candidates with D < 0 there (the root at a
    larger scalar, a smaller size): they settle in that round, as the reference's k*. They
    once went on to rounds of 4096 and the whole row (4.9x the previous core's time)."""
    widths: list[int] = []

    def recorded(scores, width, **kwargs):
        widths.append(width)
        return candidates(scores, width, **kwargs)

    monkeypatch.setattr(torch_step, "candidates", recorded)
    logits = _rows("flat", 4, 49152, 0)[[0, 1, 3]]
    _, k = bregman_decode_logits(logits, alpha=0.3, lam=0.251, return_k=True)
    want = rs.decode_logits(logits.double().numpy(), 0.3, 0.251, "primal")
    assert k.tolist() == want.k.tolist() and int(k.max()) < 512, (k, want.k)
    assert widths == [64, 512], widths


def test_a_wider_round_starts_where_the_narrower_ones_probes_pointed():
    """Flat dual alpha 2.5 rows at lambda 1e-10 (k* about 7,560: rounds of 64, 512, 4096, then
    the whole row of 49152): each round's probes start at the scalar the last one's Newton step
    aimed at past its candidates, so the whole row takes one steering probe over all its
    columns (two when each round started again from its lower bound's scalar). Counted
    elements (`diagnostics.DispatchCounter`, load-independent): 37.1 M, 50.2 M before; and k*
    is the reference's."""
    logits = _rows("flat", 8, 49152, 0)[:2]
    with DispatchCounter() as counter:
        _, k = bregman_decode_logits(logits, alpha=2.5, lam=1e-10, mode="dual", return_k=True)
    want = rs.decode_logits(logits.double().numpy(), 2.5, 1e-10, "dual")
    assert k.tolist() == want.k.tolist() and bool((k > 4096).all()), (k, want.k)
    assert counter.elements <= 43_000_000, counter.elements


def test_a_round_is_no_wider_than_its_rows_sizes_need(monkeypatch):
    """Rows held to k_max = 1024 (a server's default bound) take one round of 1024 candidates
    after the first, neither a wider one nor one between (512 would only delay them: each round
    is a top-k over the rows); rows without a bound grow by 8 to the whole row."""
    widths: list[int] = []

    def recorded(scores, width, **kwargs):
        widths.append(width)
        return candidates(scores, width, **kwargs)

    monkeypatch.setattr(torch_step, "candidates", recorded)
    logits = _rows("flat", 2, 49152, 5)
    _, k = bregman_decode_logits(logits, alpha=2.5, lam=1e-12, mode="dual", k_max=1024,
                                 return_k=True)
    assert k.tolist() == [1024, 1024] and widths == [64, 1024], widths
    widths.clear()
    bregman_decode_logits(logits, alpha=2.5, lam=1e-12, mode="dual")
    assert widths == [64, 512, 4096, 49152], widths


def test_rows_handed_over_with_a_lower_bound_start_past_it():
    """`step.decode_exact` on some rows only, with a certified lower bound on their k*
    (what the window hands over): those rows get the same k* and maps as a call from scratch,
    the others are left as they are."""
    logits = _rows("realistic", 4, 4096, 9).double()
    alpha = torch.full((4,), 3.0, dtype=F64)
    lam = torch.full((4,), 1e-20, dtype=F64)
    plan = exact_plan("primal", alpha, lam, torch.zeros(4, dtype=torch.long),
                      torch.zeros(4, dtype=torch.long))
    want, k_want = logits.clone(), torch.zeros(4, dtype=torch.long)
    torch_step.decode_exact(want, k_want, logits, plan, logits=True)
    assert bool((k_want > 64).all())
    got, k_got = logits.clone(), torch.zeros(4, dtype=torch.long)
    rows = torch.tensor([1, 3])
    torch_step.decode_exact(got, k_got, logits, plan, logits=True, rows=rows,
                            low=torch.full((4,), 64))
    assert torch.equal(k_got[rows], k_want[rows]) and k_got[[0, 2]].tolist() == [0, 0]
    torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=1e-12)
    assert torch.equal(got[[0, 2]], logits[[0, 2]])


@pytest.mark.parametrize("width", [100, 192, 512, 700])
def test_a_wide_round_takes_one_top_k_on_a_cpu_with_the_same_candidates(width, monkeypatch):
    """On a CPU a round that would gather a quarter of the row or more again takes one plain
    top-k instead (`candidates.PLAIN_TOP_K_FRACTION`): the same candidates and deficits, to the
    rounding of the mass left outside (summed in another order), as the two-stage selection's
    (still what other devices run), on logits and on probabilities with ties."""
    from bregman_vllm.core import candidates as module

    g = torch.Generator().manual_seed(width)
    logits = torch.randn(3, 49152, generator=g) * torch.tensor([[0.3], [3.0], [8.0]])
    probs = torch.softmax(logits, -1)
    probs[0, :300] = probs[0, 0]  # ties across the selection's edge
    for scores, is_logits in ((logits, True), (probs, False)):
        plain = module.candidates(scores, width, logits=is_logits)
        monkeypatch.setattr(module, "PLAIN_TOP_K_FRACTION", {})
        blocks = module.candidates(scores, width, logits=is_logits)
        monkeypatch.undo()
        # (x is normalized by the mass inside plus the mass outside, summed in another order)
        torch.testing.assert_close(plain.x, blocks.x, rtol=1e-6, atol=0)
        torch.testing.assert_close(plain.deficit, blocks.deficit, rtol=1e-6, atol=0)
        for row in (1, 2):  # no ties: the same entries (a tie may be broken either way)
            assert torch.equal(plain.index[row].sort().values, blocks.index[row].sort().values)
        assert torch.equal(plain.valid, blocks.valid) and torch.equal(plain.known, blocks.known)
