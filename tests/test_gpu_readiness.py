"""GPU readiness of the torch step (`core.step`: the CPU path, the reference of the CUDA kernels
and the CUDA step with ``BREGMAN_BACKEND=torch``), measured on the CPU (issue 10's targets). The
Triton kernels' own launches and syncs are counted in `tests/test_kernels.py`.

A TorchDispatchMode (`bregman_vllm.diagnostics.DispatchCounter`) sees every ATen op a call
dispatches: the host syncs it forces and the ops it launches (each non-view op is at least one
kernel on a GPU). These are regression guards on counts, not timings:

* one `bregman_decode_logits` call at [64, 32000] for the configurations of the issue: at most
  one sync and at most 150 launched ops; no sync at all when every row's k_max fits the window
  and the family has closed-form gaps, or for a fixed top-k;
* the processor's `apply()` in steady state (no batch change), V1 and V2 interfaces, on a batch
  mixing those configurations: at most one sync, no re-planning, no host-to-device copy;
* the extra memory of a step stays under `step_memory_bound` for any parameters (the
  `MemoryTracker` counts the bytes of the tensors the call creates);
* rows the fixed-shape step cannot certify go through the exact path and agree with it.
"""

from __future__ import annotations

import gc
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

from bregman_vllm import bregman_decode, bregman_decode_logits
from bregman_vllm.adapter import BregmanLogitsProcessor, telemetry
from bregman_vllm.adapter import processor as processor_module
from bregman_vllm.core import step as step_module
from bregman_vllm.core.plan import exact_plan
from bregman_vllm.core.step import decode_exact, step_memory_bound
from bregman_vllm.diagnostics import MIXED_FAMILIES, DispatchCounter, MemoryTracker

from .v2_state import v2_request_state

BATCH, VOCAB = 64, 32000


def realistic_logits(batch: int = BATCH, vocab: int = VOCAB, seed: int = 0,
                     scale: tuple[float, float] = (3.0, 7.0)) -> torch.Tensor:
    """Gaussian logits with a per-row scale: peaked rows like a language model's (the median
    row keeps a few dozen tokens at 90% of the mass)."""
    g = torch.Generator().manual_seed(seed)
    low, high = scale
    return torch.randn(batch, vocab, generator=g) * (low + (high - low) * torch.rand(
        batch, 1, generator=g))


CONFIGS = {
    **{f"primal a={a} lam={lam}{' k_max=50' if cap else ''}": dict(
        alpha=a, lam=lam, **({"k_max": 50} if cap else {}))
       for a in (1.0, 1.5, 2.0, 3.0) for lam in (1e-3, 1e-2) for cap in (False, True)},
    "dual a=1.5 lam=1e-2": dict(alpha=1.5, lam=1e-2, mode="dual"),
    "dual a=1.5 lam=1e-3": dict(alpha=1.5, lam=1e-3, mode="dual"),
    "dual a=1.5 lam=1e-2 k_max=50": dict(alpha=1.5, lam=1e-2, mode="dual", k_max=50),
    "top_k=50 a=1.5": dict(alpha=1.5, lam=0.0, top_k=50),
}


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    return realistic_logits()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_call_at_most_one_sync_and_150_launches(logits, name, gpu_ops):
    kwargs = CONFIGS[name]
    bregman_decode_logits(logits, **kwargs)  # warm the constant caches
    with DispatchCounter() as counter:
        bregman_decode_logits(logits, **kwargs)
    assert counter.syncs <= 1, dict(counter.sync_ops)
    assert counter.launches <= 150, counter.launch_ops.most_common(8)
    if "top_k" in kwargs or "k_max" in kwargs:  # every support fits the window: no sync
        assert counter.syncs == 0, dict(counter.sync_ops)


def test_first_true_is_the_first_flagged_position_or_the_fill():
    from bregman_vllm.core.numerics import first_true

    g = torch.Generator().manual_seed(3)
    flags = torch.rand(64, 300, generator=g) < 0.02
    flags[:4] = False  # rows with no flag get the fill
    positions = torch.arange(1, 301, dtype=torch.float32)
    got = first_true(flags, positions, 301)
    want = torch.tensor([next((j + 1 for j in range(300) if row[j]), 301)
                         for row in flags.tolist()])
    assert got.dtype == torch.long and torch.equal(got, want)


@pytest.fixture
def gpu_ops(monkeypatch):
    """The ops the torch step runs on a GPU (`candidates.SOFTMAX_NORMALIZER`,
    `candidates.PLAIN_TOP_K_FRACTION`, `write.READ_WRITE_FILL` name the CPU's faster choices),
    counted here on the CPU."""
    from bregman_vllm.core import candidates, write

    monkeypatch.setattr(candidates, "SOFTMAX_NORMALIZER", {})
    monkeypatch.setattr(candidates, "PLAIN_TOP_K_FRACTION", {})
    monkeypatch.setattr(write, "READ_WRITE_FILL", {})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_step_is_three_passes_over_the_batch_and_no_intermediate(logits, name, gpu_ops):
    """Passes over the [64, 32000] batch (`DispatchCounter(full=...)`: ops that read a whole
    [n, V] tensor or write one; gathers and scatters of K entries per row not counted): the
    step in place, as the processor runs it, reads the logits twice (block maxima;
    block log-sum-exps, which give the log-normalizer without a probability tensor) and writes
    them once, and makes no [n, V] tensor. The public, out-of-place call makes its output, from
    one more read of the logits (rows that are not distributions keep their values). (One op,
    aten::logsumexp's eager kernel still makes exp(x - max) inside; the Triton kernels' read
    is one fused reduction.)"""
    from bregman_vllm.core.plan import make_plan

    kwargs = CONFIGS[name]
    plan = make_plan(kwargs.get("mode", "primal"), kwargs["alpha"], kwargs["lam"],
                     kwargs.get("top_k"), kwargs.get("k_max"), batch_shape=BATCH, vocab=VOCAB,
                     device="cpu")
    step_module.decode_step(logits.clone(), plan, logits=True, inplace=True)  # constants
    scores = logits.clone()
    with DispatchCounter(full=BATCH * VOCAB) as counter:
        step_module.decode_step(scores, plan, logits=True, inplace=True)
    assert counter.passes == 3, dict(counter.pass_ops)
    assert {op for op, n in counter.pass_ops.items() if n} == {
        "aten::amax (read)", "aten::logsumexp (read)", "aten::masked_fill_ (write)"}
    assert counter.full_tensors == 0
    with DispatchCounter(full=BATCH * VOCAB) as counter:
        out = bregman_decode_logits(logits, **kwargs)
    assert counter.passes == 4 and counter.full_tensors == 1, dict(counter.pass_ops)
    assert torch.equal(out, scores)


@pytest.mark.parametrize("name", ["primal a=1.5 lam=0.01", "primal a=3.0 lam=0.001",
                                  "dual a=1.5 lam=1e-2", "top_k=50 a=1.5"])
def test_the_cpu_ops_decode_the_same_with_more_passes(logits, name, monkeypatch):
    """On a CPU the eager step normalizes with one softmax and fills with a vectorized clamp
    (faster there, `candidates.SOFTMAX_NORMALIZER`, `write.READ_WRITE_FILL`): six passes and
    one [n, V] temporary (the probabilities), and the same decoded batch as the CUDA ops."""
    from bregman_vllm.core import candidates, write
    from bregman_vllm.core.plan import make_plan

    kwargs = CONFIGS[name]
    plan = make_plan(kwargs.get("mode", "primal"), kwargs["alpha"], kwargs["lam"],
                     kwargs.get("top_k"), kwargs.get("k_max"), batch_shape=BATCH, vocab=VOCAB,
                     device="cpu")
    step_module.decode_step(logits.clone(), plan, logits=True, inplace=True)
    cpu = logits.clone()
    with DispatchCounter(full=BATCH * VOCAB) as counter:
        step_module.decode_step(cpu, plan, logits=True, inplace=True)
    assert counter.passes == 6 and counter.full_tensors == 1, dict(counter.pass_ops)
    monkeypatch.setattr(candidates, "SOFTMAX_NORMALIZER", {})
    monkeypatch.setattr(write, "READ_WRITE_FILL", {})
    gpu = logits.clone()
    step_module.decode_step(gpu, plan, logits=True, inplace=True)
    assert torch.equal(torch.isinf(cpu), torch.isinf(gpu))
    torch.testing.assert_close(cpu.exp(), gpu.exp(), rtol=0, atol=1e-6)


def _extreme_rows(vocab: int) -> dict[str, torch.Tensor]:
    """Rows that stress the fixed Newton iterations and the gap decisions."""
    g = torch.Generator().manual_seed(5)

    def normal(scale: float) -> torch.Tensor:
        return torch.randn(16, vocab, generator=g) * scale

    masked = normal(5.0)
    masked[:, ::3] = -math.inf  # a grammar or bad-words mask
    ties = torch.zeros(16, vocab)
    ties[:, :7] = 3.0
    near = normal(5.0)
    near[:, :40] = 20.0 + torch.randn(16, 40, generator=g) * 1e-6
    peaked = torch.full((16, vocab), -1e4)
    peaked[:, 0] = 0.0
    return {"scale 100": normal(100.0), "scale 0.01": normal(0.01), "masked": masked,
            "ties": ties, "near ties": near, "one-hot": peaked,
            "half precision": normal(8.0).half().float()}


@pytest.mark.parametrize("vocab", [300, 4096])
def test_fixed_iterations_are_certified_wherever_the_step_trusts_them(monkeypatch, vocab):
    """The step skips the exact path's numerical certificates (Newton converged, gap decisions
    clear of rounding) for iterative groups whose every support fits the window, so it never
    syncs there. This holds because those certificates never fail there: checked with the
    certificate still computed, over extreme rows, the POWER range's ends and both dual
    quadratic families, adaptive (k_max) and fixed (top_k)."""
    from bregman_vllm.core import window
    from bregman_vllm.core.families import POWER_RANGE
    from bregman_vllm.core.plan import make_plan

    seen = {"rows": 0, "uncertified": 0}
    for name in ("iterative_search", "iterative_fixed"):
        original = getattr(window, name)

        def counted(*args, _original=original, **kwargs):
            kwargs["certify"] = True  # the certificate the step leaves out there
            decoded = _original(*args, **kwargs)
            seen["rows"] += decoded.k.numel()
            seen["uncertified"] += int(decoded.uncertain.sum())
            return decoded

        monkeypatch.setattr(step_module, name, counted)
    low, high = POWER_RANGE
    families = [("primal", a) for a in (low, 1.25, 3.0, high)] + [("dual", 1.5), ("dual", 3.0)]
    for kind, rows in _extreme_rows(vocab).items():
        for (mode, alpha), lam, sizes in itertools.product(
                families, (1e-1, 1e-4), ({"k_max": 50}, {"k_max": 5}, {"top_k": 50})):
            lam = 0.0 if "top_k" in sizes else lam
            plan = make_plan(mode, alpha, lam, batch_shape=16, vocab=vocab, device="cpu",
                             **sizes)
            assert all(group.bounded for group in plan.groups)
            before = seen["uncertified"]
            out = step_module.decode_step(rows.clone(), plan, logits=True).out
            assert seen["uncertified"] == before, (kind, mode, alpha, lam, sizes)
            assert not torch.isnan(out).any(), (kind, mode, alpha, lam, sizes)
    assert seen["rows"] >= 2 * 7 * 6 * 3 * 16 - 7 * 6 * 16  # every iterative group ran


def test_exact_path_for_rows_past_the_window_agrees_with_it():
    """Flat rows with a tiny lambda (k* in the hundreds) are not certified by the window: they
    take the exact path after the step's one sync, and the result is the exact path's."""
    g = torch.Generator().manual_seed(4)
    flat = torch.randn(6, 3000, generator=g) * 0.3
    for mode, alpha, lam in (("primal", 1.5, 1e-7), ("primal", 3.0, 1e-9), ("dual", 1.5, 1e-7)):
        out, k = bregman_decode_logits(flat, alpha=alpha, lam=lam, mode=mode, return_k=True)
        assert (k > 64).all()
        p = torch.softmax(flat, -1)  # the exact path on the probabilities, the step on logits
        want = torch.zeros_like(flat)
        k_want = torch.zeros(6, dtype=torch.long)
        rows = torch.full((6,), 0, dtype=torch.long)
        plan = exact_plan(mode, torch.full((6,), alpha, dtype=torch.float64),
                          torch.full((6,), lam, dtype=torch.float64), rows, rows)
        decode_exact(want, k_want, p, plan, logits=False)
        assert torch.equal(k, k_want)
        torch.testing.assert_close(out.exp(), want, rtol=0, atol=1e-7)


def test_fixed_shape_step_agrees_with_the_exact_path_on_realistic_rows(logits):
    """The window's answers (Newton with a fixed iteration count, gaps from H(k)) equal the
    exact path's (tolerance-stopped Newton, Pythagorean gaps) on every row."""
    rows = logits[:16].double()
    for mode, alpha, lam in (("primal", 3.0, 1e-3), ("primal", 1.25, 1e-3),
                             ("primal", 5.0, 1e-4), ("dual", 1.5, 1e-3), ("dual", 3.0, 1e-3)):
        out, k = bregman_decode(torch.softmax(rows, -1), alpha=alpha, lam=lam, mode=mode)
        p = torch.softmax(rows, -1)
        want = torch.zeros_like(p)
        k_want = torch.zeros(16, dtype=torch.long)
        none = torch.zeros(16, dtype=torch.long)
        plan = exact_plan(mode, torch.full((16,), alpha, dtype=torch.float64),
                          torch.full((16,), lam, dtype=torch.float64), none, none)
        decode_exact(want, k_want, p, plan, logits=False)
        assert torch.equal(k, k_want), (mode, alpha)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- the processor

#: Six families and a plain request (`bregman_vllm.diagnostics.MIXED_FAMILIES`).
MIXED = MIXED_FAMILIES


def _request(kwargs: dict) -> dict:
    names = {"alpha": "bregman_alpha", "lam": "bregman_lambda", "mode": "bregman_mode",
             "k_max": "bregman_k_max", "top_k": "bregman_top_k"}
    return {names[key]: value for key, value in kwargs.items()}


#: Every configuration of `CONFIGS` in one batch, and a plain request (issue 10, part 2).
MIXED_ALL = [_request(kwargs) for kwargs in CONFIGS.values()] + [{}]


class EngineConfig:
    """Stands in for VllmConfig: the processor uses it only as an identity for de-duplication
    (and reads the vocabulary size and max_num_seqs from it when they are there)."""


def v1_processor(configs: list[dict]) -> BregmanLogitsProcessor:
    proc = BregmanLogitsProcessor(EngineConfig(), torch.device("cpu"), False)
    added = [(i, SamplingParams(temperature=1.0, extra_args=configs[i % len(configs)] or None),
              None, []) for i in range(BATCH)]
    proc.update_state(BatchUpdate(BATCH, [], added, []))
    return proc


def v2_processor(configs: list[dict], temperature: float = 0.8
                 ) -> tuple[BregmanLogitsProcessor, LogitsContext]:
    """The V2 interface with vLLM's own LogitsContext and request state (built on the CPU:
    `tests/v2_state.py`)."""
    proc = BregmanLogitsProcessor(EngineConfig(), v2_request_state(BATCH, VOCAB))
    for slot in range(BATCH):
        config = configs[slot % len(configs)]
        proc.add_request(slot, SamplingParams(temperature=temperature,
                                              extra_args=config or None))
    order = list(reversed(range(BATCH)))
    mapping = torch.tensor(order, dtype=torch.int32)
    ctx = LogitsContext(
        expanded_idx_mapping=mapping, idx_mapping=mapping, idx_mapping_np=np.array(order),
        expanded_local_pos=torch.zeros(BATCH, dtype=torch.int32),
        input_ids=torch.zeros(BATCH, dtype=torch.int32), pos=torch.zeros(BATCH, dtype=torch.int32),
        seq_lens_upper_bound_np=np.ones(BATCH, dtype=np.int64))
    return proc, ctx


@pytest.mark.parametrize("interface", ["v1", "v2"])
@pytest.mark.parametrize("configs", [MIXED[:1], MIXED[3:4], MIXED[4:5], MIXED_ALL],
                         ids=["kl", "alpha3", "dual", "mixed"])
def test_steady_state_apply_plans_once_and_syncs_at_most_once(logits, interface, configs,
                                                              gpu_ops):
    if interface == "v1":
        proc = v1_processor(configs)
        call = lambda: proc.apply(logits.clone())  # noqa: E731
    else:
        proc, ctx = v2_processor(configs)
        call = lambda: proc.apply(logits.clone(), ctx)  # noqa: E731
    call()
    plan = proc.plan
    with DispatchCounter() as counter:
        call()
    assert proc.plan is plan  # planned once per batch change, not per step
    assert counter.syncs <= 1, dict(counter.sync_ops)
    if len(configs) == 1:
        # One family: the same budget as one call of the core (plus the V2 temperature and
        # row gather around it).
        assert counter.launches <= 150 + (6 if interface == "v2" else 0), \
            counter.launch_ops.most_common(8)
    else:
        # Six families in one batch: one joint pass (one softmax, one candidate set, one
        # write), each family's formulas on its own rows. The Triton kernels are the way below
        # 150 launches (four); this guards the torch step against regressions (470 today).
        assert counter.launches <= 500, counter.launch_ops.most_common(8)


@pytest.mark.parametrize("interface", ["v1", "v2", "v2 at T = 1"])
@pytest.mark.parametrize("configs", [MIXED[:1], MIXED[3:4], MIXED[4:5], MIXED[5:6]],
                         ids=["kl", "alpha3", "dual", "top_k"])
def test_steady_state_apply_is_three_passes_in_place(logits, interface, configs, gpu_ops):
    """One steady-state `apply()` with every row Bregman-decoded writes into vLLM's logits in
    place: three passes, no [n, V] tensor, on V1 and on Model Runner V2 (no gather, no
    rescaling of the logits: the temperature enters the log-normalizer only). In eager mode a
    temperature other than 1 costs the scaled logits inside that log-sum-exp: one more [n, V]
    temporary, written and read (5 passes); in the kernels the scaling is part of the read."""
    if interface == "v1":
        proc = v1_processor(configs)
        call = lambda scores: proc.apply(scores)  # noqa: E731
    else:
        proc, ctx = v2_processor(configs, temperature=1.0 if "T = 1" in interface else 0.8)
        call = lambda scores: proc.apply(scores, ctx)  # noqa: E731
    call(logits.clone())
    scores = logits.clone()
    with DispatchCounter(full=BATCH * VOCAB) as counter:
        out = call(scores)
    assert out is scores
    if interface == "v2":
        assert counter.passes == 5 and counter.full_tensors == 1, dict(counter.pass_ops)
        assert counter.pass_ops["aten::mul (write)"] == 1
    else:
        assert counter.passes == 3 and counter.full_tensors == 0, dict(counter.pass_ops)


def test_a_partial_batch_adds_only_the_gather_of_its_rows(logits, gpu_ops):
    """Half the rows Bregman-decoded (V1): the plain rows are never read; the decoded rows
    are gathered (one read, one write of those rows), decoded with the same three passes over
    the copy, and copied back (one read, one write)."""
    proc = v1_processor([MIXED[1], {}])
    proc.apply(logits.clone())
    scores = logits.clone()
    half = (BATCH // 2) * VOCAB
    with DispatchCounter(full=half) as counter:
        proc.apply(scores)
    assert counter.passes == 3 + 4, dict(counter.pass_ops)
    assert counter.pass_ops["aten::index_select (read)"] == 1
    assert counter.pass_ops["aten::index_copy_ (write)"] == 1
    assert torch.equal(scores[1::2], logits[1::2])  # plain rows untouched


@pytest.mark.parametrize("as_logits", [True, False], ids=["logits", "probabilities"])
def test_joint_pass_equals_each_family_decoded_alone(logits, as_logits):
    """A batch mixing every configuration (and plain rows, and rows that are not
    distributions) decoded in one joint pass gives each row what its family's group gives
    alone: the same k*, the same distribution (the shared candidate set is wider than some
    groups' own, which changes nothing but rounding)."""
    from bregman_vllm.adapter.processor import request_params
    from bregman_vllm.core.plan import Plan, plan_requests

    scores = logits.clone()
    scores[5] = math.nan  # not a distribution: returned as given
    scores[11] = -math.inf
    flat = [0, 4]  # primal alpha 1 and 1.5, lambda 1e-3, no cap: k* past the window
    scores[flat] *= 0.02
    if not as_logits:
        scores = torch.softmax(scores, -1)
    requests = [(row, request_params(MIXED_ALL[row % len(MIXED_ALL)]))
                for row in range(BATCH) if MIXED_ALL[row % len(MIXED_ALL)]]
    plan = plan_requests(requests, batch=BATCH, vocab=VOCAB, device="cpu")
    # Five window groups of width 64 share a pass; KL at lambda 1e-3 has a window of 256.
    assert [len(joint.groups) for joint in plan.passes()[1]] == [5]
    together, k_together, _ = step_module.decode_step(scores.clone(), plan, logits=as_logits)
    alone = scores.clone()
    k_alone = torch.zeros(BATCH, dtype=torch.long)
    for group in plan.groups:
        single = Plan((group,), plan.batch, plan.vocab)
        assert not single.passes()[1]
        out, k, _ = step_module.decode_step(scores.clone(), single, logits=as_logits)
        rows = group.rows_or_all(scores.device)
        alone[rows], k_alone[rows] = out[rows], k[rows]
    assert torch.equal(k_together, k_alone)
    assert (k_together[flat] > 64).all()  # the exact path ran inside the joint pass
    q_together = together.exp() if as_logits else together
    q_alone = alone.exp() if as_logits else alone
    assert torch.equal(torch.isnan(q_together), torch.isnan(q_alone))
    assert torch.isnan(q_together[5]).all()
    torch.testing.assert_close(q_together, q_alone, rtol=0, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("mode", ["primal", "dual"])
def test_joint_pass_sends_rows_past_the_window_to_the_exact_path(mode):
    """Rows of several families in one joint pass, flat enough for k* in the hundreds (the
    iterative families included): each row gets what it gets decoded alone."""
    g = torch.Generator().manual_seed(6)
    flat = torch.randn(6, 3000, generator=g) * 0.3
    alphas = [1.5, 3.0, 2.0, 3.0, 1.5, 2.0] if mode == "dual" else [1.0, 3.0, 1.5, 3.0, 2.0, 1.25]
    lams = [1e-7, 1e-9, 1e-7, 1e-9, 1e-2, 1e-7]
    out, k = bregman_decode_logits(flat, alpha=torch.tensor(alphas), lam=torch.tensor(lams),
                                   mode=mode, return_k=True)
    assert (k[[0, 1, 2, 3]] > 64).all()
    for row in range(6):
        want, k_want = bregman_decode_logits(flat[row:row + 1], alpha=alphas[row],
                                             lam=lams[row], mode=mode, return_k=True)
        assert int(k[row]) == int(k_want[0]), row
        torch.testing.assert_close(out[row].exp(), want[0].exp(), rtol=0, atol=1e-7)


def test_v2_replans_only_when_the_row_order_changes(logits):
    proc, ctx = v2_processor(MIXED[1:2])
    proc.apply(logits.clone(), ctx)
    plan = proc.plan
    proc.apply(logits.clone(), ctx)
    assert proc.plan is plan
    order = list(range(BATCH))
    mapping = torch.tensor(order, dtype=torch.int32)
    reordered = LogitsContext(
        expanded_idx_mapping=mapping, idx_mapping=mapping, idx_mapping_np=np.array(order),
        expanded_local_pos=ctx.expanded_local_pos, input_ids=ctx.input_ids, pos=ctx.pos,
        seq_lens_upper_bound_np=ctx.seq_lens_upper_bound_np)
    proc.apply(logits.clone(), reordered)
    assert proc.plan is not plan


def break_the_kl_window(monkeypatch) -> None:
    """A bug in one family's decoder: the KL rows' closed-form window search raises (and the
    failure warning is due at once)."""
    real = step_module.closed_search

    def broken(family, *args, **kwargs):
        if family.value == "kl":
            raise RuntimeError("simulated bug in the KL window")
        return real(family, *args, **kwargs)

    monkeypatch.setattr(step_module, "closed_search", broken)
    monkeypatch.setattr(telemetry, "_last_warning", -math.inf)


def test_one_bad_row_never_disables_the_others(monkeypatch):
    """A request that slipped past validation with a top_k beyond int64, next to eight
    `bregman_top_k=1` requests: those eight are decoded to their top token at every step. A
    decoder failure in one group leaves only that group's rows as they were, and is counted."""
    proc = BregmanLogitsProcessor(EngineConfig(), torch.device("cpu"), False)
    rows = [(i, SamplingParams(temperature=1.0, extra_args={"bregman_top_k": 1}), None, [])
            for i in range(8)]
    rows.append((8, SamplingParams(temperature=1.0,
                                   extra_args={"bregman_top_k": 9223372036854775808}), None, []))
    before = telemetry.failures_total()
    proc.update_state(BatchUpdate(9, [], rows, []))
    assert telemetry.failures_total() == before + 1  # refused, and counted
    assert set(proc.requests) == set(range(8))
    for seed in range(3):
        logits = realistic_logits(9, 500, seed)
        out = proc.apply(logits.clone())
        assert torch.isfinite(out[:8]).sum(-1).eq(1).all()
        assert torch.equal(out[:8].argmax(-1), logits[:8].argmax(-1))

    # A bug in one family's decoder: the other families' rows are still decoded.
    proc = v1_processor(MIXED[:2])
    break_the_kl_window(monkeypatch)
    before = telemetry.failures_total()
    logits = realistic_logits(seed=9)
    out = proc.apply(logits.clone())
    kl_rows, other_rows = slice(0, None, 2), slice(1, None, 2)
    assert torch.equal(out[kl_rows], logits[kl_rows])
    assert torch.isinf(out[other_rows]).any(-1).all()  # decoded: tokens cut off
    assert telemetry.failures_total() == before + BATCH // 2
    assert processor_module.telemetry is telemetry


def test_a_failing_family_under_model_runner_v2_keeps_the_temperature(logits, monkeypatch):
    """V2, temperature 0.8: when one family's decoder fails, the processor decodes the other
    families group by group, each with its rows' temperature (T log q, as the whole step
    writes it), and the failing rows keep their logits."""
    proc, ctx = v2_processor(MIXED[:2])
    want = proc.apply(logits.clone(), ctx)
    break_the_kl_window(monkeypatch)
    out = proc.apply(logits.clone(), ctx)
    order = list(reversed(range(BATCH)))  # the context's row -> slot order
    kl = [row for row, slot in enumerate(order) if slot % 2 == 0]
    other = [row for row, slot in enumerate(order) if slot % 2 == 1]
    assert torch.equal(out[kl], logits[kl])
    torch.testing.assert_close(out[other], want[other], rtol=0, atol=1e-6)


def test_a_failing_exact_path_never_decodes_the_batch_twice(monkeypatch):
    """The fixed step writes a whole-batch group in place before the exact path redoes the
    uncertified rows. If the exact path fails, the batch already holds decoded rows: the
    processor must keep them (decoding log q again would shrink supports further) and count the
    uncertified rows."""
    proc = v1_processor([{"bregman_alpha": 1.5, "bregman_lambda": 1e-7}])
    flat = realistic_logits(seed=3, scale=(0.3, 0.3))  # k* far past the window: every row

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure of the exact path")

    monkeypatch.setattr(step_module, "decode_exact", broken)
    monkeypatch.setattr(telemetry, "_last_warning", -math.inf)
    before = telemetry.failures_total()
    out = proc.apply(flat.clone())
    assert telemetry.failures_total() == before + BATCH
    # The fixed step's answer, once: a distribution on the window of each row.
    window = proc.plan.groups[0].width
    assert torch.isfinite(out).sum(-1).eq(window).all()
    torch.testing.assert_close(torch.logsumexp(out, -1), torch.zeros(BATCH), rtol=0, atol=1e-5)
    kept = torch.topk(flat, window, -1).indices
    assert torch.isfinite(torch.gather(out, 1, kept)).all()


def test_failures_reach_the_prometheus_counter(monkeypatch):
    from prometheus_client import REGISTRY

    proc = v1_processor(MIXED[3:4])
    monkeypatch.setattr(processor_module, "decode_step", lambda *a, **k: 1 / 0)
    before = REGISTRY.get_sample_value("bregman_processor_failures_total",
                                       {"interface": "v1"}) or 0.0
    proc.apply(realistic_logits())
    after = REGISTRY.get_sample_value("bregman_processor_failures_total", {"interface": "v1"})
    assert after == before + BATCH


# ----------------------------------------------------------------------------- memory


#: Launched ops and host syncs of the search's worst cases at [4, 8192] (one call, eager), at
#: most: the GPU's launches and syncs counted on the CPU, a regression guard. Measured
#: 2026-11-28 (launches, syncs): the attack 4678, 143; dual a=20 5205, 153; primal a=3 2644, 65
#: (`core.search`: probes on the multiplier, the dual's first ones steering with one inner
#: Newton step, each step one read; the last sizes by their series from 4096 sizes on).
EXACT_PATH_COUNTS = {
    "attack: realistic dual a=10 lam=1e-100": ((3.0, 7.0), dict(alpha=10.0, lam=1e-100,
                                                                mode="dual"), 5150, 160),
    "realistic dual a=20 lam=1e-240": ((3.0, 7.0), dict(alpha=20.0, lam=1e-240, mode="dual"),
                                       5750, 170),
    "flat primal a=3 lam=1e-12": ((0.3, 0.3), dict(alpha=3.0, lam=1e-12), 2900, 75),
}


@pytest.mark.parametrize("name", list(EXACT_PATH_COUNTS))
def test_the_exact_paths_launches_and_syncs_stay_within_their_counts(name):
    scale, kwargs, launches, syncs = EXACT_PATH_COUNTS[name]
    logits = realistic_logits(4, 8192, seed=0, scale=scale)
    bregman_decode_logits(logits, **kwargs)  # (cached constants, as in a serving engine)
    with DispatchCounter() as counter:
        out, k = bregman_decode_logits(logits, **kwargs, return_k=True)
    assert (k > step_module.WINDOW).all(), k  # every row went through the exact path
    assert torch.isfinite(torch.logsumexp(out.double(), -1)).all()
    assert counter.launches <= launches, counter.launch_ops.most_common(8)
    assert counter.syncs <= syncs, counter.sync_ops.most_common(8)


@pytest.mark.parametrize(("kind", "kwargs"), [
    ("peaked", dict(alpha=3.0, lam=1e-2)),
    ("flat", dict(alpha=1.5, lam=1e-9)),  # k* = V: the exact path over whole rows
    ("flat", dict(alpha=1.5, lam=1e-9, mode="dual")),
    ("flat", dict(alpha=0.5, lam=1e-9)),
    ("flat", dict(alpha=1.5, lam=0.0)),  # lambda = 0: the whole support
    ("flat", dict(alpha=1.5, lam=0.0, top_k=20000, mode="dual")),
    # Four families in one joint pass, every row past the window (the exact path in place).
    ("flat", dict(alpha=torch.tensor([1.0, 1.5, 2.0, 3.0] * (BATCH // 4)), lam=1e-9)),
])
def test_extra_memory_of_a_step_is_bounded(kind, kwargs):
    assert _extra_memory(kind, kwargs) <= step_memory_bound(BATCH, VOCAB)


def _extra_memory(kind: str, kwargs: dict) -> int:
    """Peak bytes a public call holds beyond its output (which `step_memory_bound` leaves
    out: the processor writes in place), on [BATCH, VOCAB] logits."""
    scale = (3.0, 7.0) if kind == "peaked" else (0.3, 0.3)
    logits = realistic_logits(BATCH, VOCAB, seed=2, scale=scale)
    gc.collect()
    with MemoryTracker() as memory:
        out = bregman_decode_logits(logits, **kwargs)
    return memory.peak - out.numel() * out.element_size()


def test_the_memory_bound_is_within_ten_times_the_widest_step():
    """A fixed top-k as wide as the vocabulary (every row through the chunked exact path)
    holds at most the bound and at least a tenth of it: the bound is not loose by orders of
    magnitude (measured: 0.7 of it, 2026-11-28)."""
    bound = step_memory_bound(BATCH, VOCAB)
    extra = _extra_memory("flat", dict(alpha=3.0, lam=0.0, top_k=VOCAB))
    assert bound / 10 <= extra <= bound, (extra, bound)


def test_processor_reserves_the_bound_until_its_first_step():
    """On an accelerator the processor holds `step_memory_bound(max_num_seqs, V)` bytes from
    construction (before vLLM profiles memory) to its first apply(). Exercised on the 'meta'
    device, which allocates nothing: the reservation's size and its release are what count."""
    config = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: 1000),
                             scheduler_config=SimpleNamespace(max_num_seqs=32))
    proc = BregmanLogitsProcessor(config, torch.device("meta"), False)
    assert proc._reserve is not None
    assert proc._reserve.numel() == step_memory_bound(32, 1000)
    proc.update_state(BatchUpdate(1, [], [(0, SamplingParams(extra_args={"bregman_alpha": 2}),
                                           None, [])], []))
    proc.apply(torch.empty(1, 1000, device="meta"))  # (meta tensors hold no values to decode)
    assert proc._reserve is None
    cpu = BregmanLogitsProcessor(SimpleNamespace(**vars(config)), torch.device("cpu"), False)
    assert cpu._reserve is None  # the CPU runner does not profile memory this way
