"""Property tests (hypothesis) and robustness of the public core API.

Random shapes and parameters: every output is a valid distribution supported on a top-k set,
order-preserving, NaN-free; heterogeneous per-row parameters equal row-by-row calls; float32 is
within 1e-5 of float64; the logits entry point matches the probability one; edge cases (zeros,
ties, one-hot rows, V = 1, subnormals, -inf / NaN logits, extreme parameters) never produce NaN;
bad parameters raise `BregmanParamError` naming the field and the allowed range.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bregman_vllm import (
    AlphaGenerator,
    BregmanParamError,
    bregman_decode,
    bregman_decode_logits,
    renormalize,
)
from bregman_vllm.core.candidates import candidates

F64 = torch.float64
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def decoding_problems(draw):
    rows = draw(st.integers(1, 4))
    vocab = draw(st.sampled_from([1, 2, 3, 7, 64, 65, 200, 1000, 4099]))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 8.0, 30.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=F64) * scale
    if draw(st.booleans()) and vocab > 3:  # masked vocabulary (structured output)
        logits[:, torch.randperm(vocab, generator=g)[: vocab // 2]] = -math.inf
    if draw(st.booleans()) and vocab > 2:  # ties
        logits[:, 1] = logits[:, 0]
    mode = draw(st.sampled_from(["primal", "dual"]))
    fixed = draw(st.booleans())
    if mode == "primal":
        choices = [-math.inf, -3.0, -0.5, 0.3, 1.0, 1.5, 2.0, 4.0, 60.0, math.inf] if fixed \
            else [0.05, 0.3, 1.0, 1.0 + 1e-9, 1.5, 2.0, 3.7, 60.0]
    else:
        choices = [1.0, 1.2, 1.5, 2.0, 3.0, 60.0, math.inf] if fixed \
            else [1.0 + 1e-6, 1.2, 1.5, 2.0, 3.0, 9.0, 60.0]
    alpha = torch.tensor(draw(st.lists(st.sampled_from(choices), min_size=rows, max_size=rows)),
                         dtype=F64)
    lam = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1e-9, 1e-4, 1e-2, 0.3, 10.0]),
                                     min_size=rows, max_size=rows)), dtype=F64)
    top_k = draw(st.integers(1, 50)) if fixed else None
    k_max = draw(st.one_of(st.none(), st.integers(1, 80)))
    return logits, mode, alpha, lam, top_k, k_max


def check_valid(p: torch.Tensor, out) -> None:
    q, k = out.probs, out.k
    assert torch.isfinite(q).all()
    assert (q >= 0).all()
    assert torch.allclose(q.sum(-1), torch.ones_like(q[..., 0]), atol=1e-6)
    assert torch.equal((q > 0).sum(-1), k)
    for row in range(p.shape[0]):
        kept, dropped = p[row][q[row] > 0], p[row][q[row] == 0]
        assert (kept > 0).all()  # never revives a zero-probability (masked) token
        if dropped.numel():
            assert kept.min() >= dropped.max()  # a top-k set (greedy property)
        order = torch.argsort(p[row][q[row] > 0], descending=True)
        values = q[row][q[row] > 0][order]
        assert (values[:-1] >= values[1:] - 1e-12).all()  # monotone renormalization


@SETTINGS
@given(decoding_problems())
def test_random_problems_give_valid_top_k_distributions(problem):
    logits, mode, alpha, lam, top_k, k_max = problem
    p = torch.softmax(logits, -1)
    out = bregman_decode(p, alpha=alpha, lam=lam, mode=mode, top_k=top_k, k_max=k_max)
    check_valid(p, out)
    positive = (p > 0).sum(-1)
    limit = positive if k_max is None else positive.clamp_max(k_max)
    if top_k is not None:
        assert torch.equal(out.k, limit.clamp_max(top_k))
    else:
        assert (out.k >= 1).all() and (out.k <= limit).all()
        zero = lam == 0
        assert torch.equal(out.k[zero], limit[zero])


@SETTINGS
@given(decoding_problems())
def test_heterogeneous_batch_equals_row_by_row(problem):
    logits, mode, alpha, lam, top_k, k_max = problem
    p = torch.softmax(logits, -1)
    batch = bregman_decode(p, alpha=alpha, lam=lam, mode=mode, top_k=top_k, k_max=k_max)
    for row in range(p.shape[0]):
        single = bregman_decode(p[row], alpha=float(alpha[row]), lam=float(lam[row]), mode=mode,
                                top_k=top_k, k_max=k_max)
        assert torch.equal(single.k, batch.k[row])
        assert torch.allclose(single.probs, batch.probs[row], atol=1e-12, rtol=0)


@SETTINGS
@given(decoding_problems())
def test_float32_is_within_1e5_of_float64(problem):
    logits, mode, alpha, lam, top_k, k_max = problem
    p32 = torch.softmax(logits.float(), -1)
    out32 = bregman_decode(p32, alpha=alpha, lam=lam, mode=mode, top_k=top_k, k_max=k_max)
    out64 = bregman_decode(p32.double(), alpha=alpha, lam=lam, mode=mode, top_k=top_k,
                           k_max=k_max)
    assert out32.probs.dtype == torch.float32
    assert torch.equal(out32.k, out64.k)
    assert (out32.probs.double() - out64.probs).abs().max() <= 1e-5


@SETTINGS
@given(decoding_problems())
def test_logits_entry_point_matches_probabilities(problem):
    logits, mode, alpha, lam, top_k, k_max = problem
    decoded, k = bregman_decode_logits(logits, alpha=alpha, lam=lam, mode=mode, top_k=top_k,
                                       k_max=k_max, return_k=True)
    out = bregman_decode(torch.softmax(logits, -1), alpha=alpha, lam=lam, mode=mode,
                         top_k=top_k, k_max=k_max)
    assert torch.equal(k, out.k)
    assert not torch.isnan(decoded).any()
    assert torch.equal(torch.isneginf(decoded), out.probs == 0)
    assert torch.allclose(torch.exp(decoded), out.probs, atol=1e-12)


def test_generator_protocol_matches_the_alpha_family_and_accepts_user_generators():
    g = torch.Generator().manual_seed(9)
    p = torch.softmax(torch.randn(4, 300, generator=g, dtype=F64) * 2, -1)
    for alpha, mode in ((1.0, "primal"), (1.7, "primal"), (0.6, "primal"), (2.5, "dual")):
        fast = bregman_decode(p, alpha=alpha, lam=1e-3, mode=mode)
        generic = bregman_decode(p, generator=AlphaGenerator(alpha), lam=1e-3, mode=mode)
        assert torch.equal(fast.k, generic.k)
        assert torch.allclose(fast.probs, generic.probs, atol=1e-12)

    class ShiftedEntropy:  # phi(x) = (x + 0.1) log(x + 0.1): primal valid, not an alpha member
        def phi(self, x):
            return (x + 0.1) * torch.log(x + 0.1)

        def dphi(self, x):
            return torch.log(x + 0.1) + 1

        def d2phi(self, x):
            return 1 / (x + 0.1)

        def inv_dphi(self, y):
            return (torch.exp(y - 1) - 0.1).clamp(0.0, 1.0)

    out = bregman_decode(p, generator=ShiftedEntropy(), lam=1e-3)
    check_valid(p, out)
    with pytest.raises(BregmanParamError, match="generator"):
        bregman_decode(p, generator=object(), lam=0.1)


def test_block_candidates_equal_a_full_sort():
    """The candidates from block maxima and block masses (two reads, no probability tensor
    for logits) are the top entries of a full sort, with the mass left outside them."""
    g = torch.Generator().manual_seed(10)
    for vocab in (1000, 4096, 4097, 50257):
        logits = torch.randn(3, vocab, generator=g) * 4
        p = torch.softmax(logits, -1)
        top = torch.topk(p, 16)
        p64 = torch.softmax(logits.double(), -1)
        expected = 1.0 - torch.gather(p64, 1, top.indices).sum(-1)
        for scores, as_logits in ((p, False), (logits, True)):
            cand = candidates(scores, 16, logits=as_logits)
            assert torch.equal(cand.index, top.indices)
            assert cand.valid.all()
            want = torch.gather(p64 if as_logits else p.double() / p.double().sum(-1,
                                keepdim=True), 1, top.indices)
            torch.testing.assert_close(cand.x, want, rtol=1e-6, atol=0)
            torch.testing.assert_close(cand.deficit[:, -1], expected, rtol=1e-5, atol=0)
            torch.testing.assert_close(cand.x.sum(-1) + cand.deficit[:, -1],
                                       torch.ones(3, dtype=F64), rtol=0, atol=4e-15)


@pytest.mark.parametrize("mode", ["primal", "dual"])
def test_edge_cases_never_produce_nan(mode):
    alpha = 1.5
    cases = {
        "one-hot": torch.tensor([0.0, 1.0, 0.0]),
        "V=1": torch.tensor([1.0]),
        "ties": torch.tensor([0.25, 0.25, 0.25, 0.25]),
        "zeros": torch.tensor([0.5, 0.0, 0.5, 0.0]),
        "subnormal": torch.tensor([1.0 - 2e-45, 1e-45, 1e-45]),
        "subnormal64": torch.tensor([1.0, 5e-324, 1e-310], dtype=F64),
        "tiny-second": torch.tensor([1.0 - 1e-12, 1e-12], dtype=F64),
    }
    for name, p in cases.items():
        for lam in (0.0, 1e-12, 0.01, 10.0):
            out = bregman_decode(p, alpha=alpha, lam=lam, mode=mode)
            assert torch.isfinite(out.probs).all(), name
            assert abs(out.probs.sum().item() - 1) < 1e-6, name
            assert 1 <= out.k.item() <= (p > 0).sum().item(), name


def test_logits_edge_cases():
    logits = torch.tensor([
        [0.0, -math.inf, -math.inf, -math.inf],  # all -inf but one
        [-math.inf] * 4,  # nothing allowed: returned unchanged
        [math.nan, 0.0, 1.0, 2.0],  # NaN from a broken model: returned unchanged
        [1e30, -1e30, 0.0, 3e4],  # extreme but finite
        [-1e4, -1e4 + 1.0, -1e4 + 2.0, -1e4 + 3.0],  # shifted far down
    ])
    out, k = bregman_decode_logits(logits, alpha=1.5, lam=0.01, return_k=True)
    assert out[0, 0] == 0 and torch.isneginf(out[0, 1:]).all() and k[0] == 1
    assert torch.equal(torch.isneginf(out[1]), torch.ones(4, dtype=torch.bool)) and k[1] == 0
    assert torch.isnan(out[2, 0]) and k[2] == 0
    assert out[3, 0] == 0 and k[3] == 1
    assert not torch.isnan(out[3:]).any()
    shifted = bregman_decode_logits(logits[4] + 1e4, alpha=1.5, lam=0.01)
    assert torch.allclose(out[4], shifted, atol=1e-4)


@pytest.mark.parametrize("mode", ["primal", "dual"])
@pytest.mark.parametrize("extra", [
    {"alpha": 1000.0, "lam": 0.0}, {"alpha": 1000.0, "lam": 0.01}, {"alpha": 1.5, "lam": 0.0},
    {"alpha": 1.5, "lam": 10.0}, {"alpha": 1.5, "lam": 0.01, "top_k": 1},
    {"alpha": 1.5, "lam": 0.01, "k_max": 1}, {"alpha": 1.5, "lam": 0.0, "k_max": 3},
])
def test_extreme_valid_parameters(mode, extra):
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(6, 2000, generator=g) * 3, -1)
    out = bregman_decode(p, mode=mode, **extra)
    check_valid(p, out)
    if extra.get("top_k") == 1 or extra.get("k_max") == 1 or extra["lam"] == 10.0:
        assert (out.k == 1).all()


def test_renormalize_api():
    x = torch.tensor([[0.4, 0.2, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    primal = renormalize(x, alpha=2.0)
    assert torch.allclose(primal[0], torch.tensor([0.4 + 0.4 / 3, 0.2 + 0.4 / 3, 0.4 / 3],
                                                  dtype=F64))
    assert torch.allclose(primal[1], torch.full((3,), 1 / 3, dtype=F64))
    assert renormalize(x, alpha=0.5)[0, 2] == 0  # alpha <= 1 keeps zeros at zero
    assert renormalize(x, alpha=3.0, mode="dual")[0, 2] > 0
    with pytest.raises(BregmanParamError, match="at most 1"):
        renormalize(torch.tensor([0.7, 0.6]), alpha=2.0)


@pytest.mark.parametrize(("kwargs", "field", "text"), [
    ({"alpha": 0.0, "lam": 0.1}, "alpha", "(0, 1e8]"),
    ({"alpha": -1.0, "lam": 0.1}, "alpha", "(0, 1e8]"),
    ({"alpha": math.inf, "lam": 0.1}, "alpha", "(0, 1e8]"),
    ({"alpha": math.nan, "lam": 0.1}, "alpha", "(0, 1e8]"),
    ({"alpha": 1.0, "lam": 0.1, "mode": "dual"}, "alpha", "(1, 1e8]"),
    ({"alpha": 0.9, "lam": 0.1, "mode": "dual", "top_k": 3}, "alpha", "[1, 1e8], or inf"),
    ({"alpha": 0.0, "lam": 0.1, "top_k": 3}, "alpha", "excluding 0"),
    ({"alpha": 1.5, "lam": -0.1}, "lam", "[0, inf)"),
    ({"alpha": 1.5, "lam": math.inf}, "lam", "[0, inf)"),
    ({"alpha": 1.5, "lam": 0.1, "top_k": 0}, "top_k", ">= 1"),
    ({"alpha": 1.5, "lam": 0.1, "k_max": -2}, "k_max", ">= 1"),
    ({"alpha": 1.5, "lam": 0.1, "mode": "both"}, "mode", '"primal" | "dual"'),
    ({"alpha": torch.tensor([1.5, 0.0]), "lam": 0.1}, "alpha", "(0, 1e8]"),
    ({"alpha": torch.ones(3), "lam": 0.1}, "alpha", "broadcast"),
    ({"lam": 0.1}, "alpha", "required"),
])
def test_bad_parameters_name_the_field_and_range(kwargs, field, text):
    p = torch.softmax(torch.randn(2, 10), -1)
    with pytest.raises(BregmanParamError) as error:
        bregman_decode(p, **kwargs)
    assert error.value.field == field
    assert text in str(error.value)
    assert isinstance(error.value, ValueError)
