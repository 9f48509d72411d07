"""The logits processor's batch bookkeeping, driven with vLLM's own BatchUpdate objects.

These tests construct the processor directly (no engine) and replay batch changes the way
vLLM's persistent batch reports them: removed, then added, then moved (unidirectional or swap).
After each update, `apply()` must decode exactly the rows that carry Bregman parameters, each
with its own parameters, and leave every other row bit for bit.
"""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from bregman_vllm import BregmanParamError, bregman_decode_logits
from bregman_vllm.adapter import BregmanLogitsProcessor, telemetry
from bregman_vllm.adapter import processor as processor_module

VOCAB = 300


class EngineConfig:
    """Stands in for VllmConfig: the processor only uses it as an identity for de-duplication."""


def make_processor() -> BregmanLogitsProcessor:
    return BregmanLogitsProcessor(EngineConfig(), torch.device("cpu"), False)


def params(**bregman) -> SamplingParams:
    return SamplingParams(temperature=1.0, extra_args=bregman or None)


def expected(logits: torch.Tensor, table: dict[int, dict]) -> torch.Tensor:
    out = logits.clone()
    for row, args in table.items():
        mode = args.get("bregman_mode", "primal")
        if mode == "off":
            continue
        out[row] = bregman_decode_logits(
            logits[row], alpha=float(args.get("bregman_alpha", 1.5)),
            lam=float(args.get("bregman_lambda", 0.01)), mode=mode,
            top_k=args.get("bregman_top_k"), k_max=args.get("bregman_k_max"))
    return out


def check(proc: BregmanLogitsProcessor, table: dict[int, dict], batch: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, VOCAB, generator=g) * 3
    want = expected(logits, table)
    got = proc.apply(logits.clone())
    for row in range(batch):
        if row in table and table[row].get("bregman_mode", "primal") != "off":
            assert torch.allclose(got[row], want[row], atol=1e-6), row
            assert torch.equal(torch.isinf(got[row]), torch.isinf(want[row])), row
        else:
            assert torch.equal(got[row], logits[row]), f"row {row} was touched"


PARAM_CHOICES = [
    {},  # plain request: untouched
    {"bregman_mode": "primal", "bregman_alpha": 1.5, "bregman_lambda": 0.01},
    {"bregman_mode": "dual", "bregman_alpha": 3.0, "bregman_lambda": 0.001},
    {"bregman_alpha": 2.0},  # mode defaults to primal
    {"bregman_mode": "off", "bregman_alpha": 2.0},
    {"bregman_mode": "primal", "bregman_alpha": "inf", "bregman_top_k": 5},
    {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 0.0, "bregman_k_max": 3},
    {"bregman_alpha": 0.5, "bregman_lambda": 0.05, "unrelated_key": "ignored"},
]


def test_random_batch_updates_with_moves_and_swaps():
    rng = random.Random(0)
    proc = make_processor()
    table: dict[int, dict] = {}
    batch = 0
    for step in range(40):
        removed = sorted(rng.sample(range(batch), rng.randint(0, min(2, batch))), reverse=True)
        for index in removed:
            table.pop(index, None)
        # vLLM fills removed slots first, then appends.
        free = sorted(removed)
        added = []
        for _ in range(rng.randint(0, 3)):
            index = free.pop(0) if free else batch
            batch = max(batch, index + 1)
            choice = rng.choice(PARAM_CHOICES)
            added.append((index, params(**choice), None, []))
            table[index] = choice
        moved = []
        if batch >= 2 and rng.random() < 0.7:
            a, b = rng.sample(range(batch), 2)
            direction = rng.choice([MoveDirectionality.SWAP, MoveDirectionality.UNIDIRECTIONAL])
            moved.append((a, b, direction))
            ta, tb = table.pop(a, None), table.pop(b, None)
            if ta is not None:
                table[b] = ta
            if tb is not None and direction == MoveDirectionality.SWAP:
                table[a] = tb
        # Condense: holes at the end shrink the batch.
        while batch and batch - 1 not in table and all(i < batch - 1 for i in table):
            batch -= 1
        batch = max(batch, max(table, default=-1) + 1)
        proc.update_state(BatchUpdate(batch, removed, added, moved))
        check(proc, {i: t for i, t in table.items() if t}, batch, step)
        proc.update_state(None)  # no change: the same rows stay decoded
        check(proc, {i: t for i, t in table.items() if t}, batch, step + 1000)


def test_plain_requests_are_untouched_bit_for_bit():
    proc = make_processor()
    added = [(0, params(), None, []), (1, params(bregman_alpha=1.5), None, []),
             (2, SamplingParams(extra_args={"other_plugin": 1}), None, [])]
    proc.update_state(BatchUpdate(3, [], added, []))
    logits = torch.randn(3, VOCAB) * 4
    out = proc.apply(logits.clone())
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])
    # A batch of only plain requests returns the very same tensor.
    proc.update_state(BatchUpdate(3, [1], [], []))
    same = torch.randn(3, VOCAB)
    assert proc.apply(same) is same


@pytest.mark.parametrize(("extra", "field"), [
    ({"bregman_alpha": 0}, "bregman_alpha"),
    ({"bregman_mode": "dual", "bregman_alpha": 1.0}, "bregman_alpha"),
    ({"bregman_lambda": -1}, "bregman_lambda"),
    ({"bregman_top_k": 0}, "bregman_top_k"),
    ({"bregman_k_max": 2.5}, "bregman_k_max"),
    ({"bregman_mode": "sideways"}, "bregman_mode"),
    ({"bregman_alpha": "banana"}, "bregman_alpha"),
    # A key meant as a Bregman field is refused, never ignored (issue 27): what reaches
    # extra_args unread by the server, e.g. a form's vllm_xargs JSON string, is checked here.
    ({"BREGMAN_TOP_K": 2}, "BREGMAN_TOP_K"),
    ({"bregman-top-k": 2, "kv_transfer_params": {}}, "bregman-top-k"),
    ({"bregman_topk": 2}, "bregman_topk"),
])
def test_validate_params_rejects_bad_values(extra, field):
    with pytest.raises(BregmanParamError) as error:
        BregmanLogitsProcessor.validate_params(SamplingParams(extra_args=extra))
    assert error.value.field == field
    BregmanLogitsProcessor.validate_params(SamplingParams(extra_args={"bregman_alpha": 2.0}))
    BregmanLogitsProcessor.validate_params(SamplingParams())


def test_apply_never_raises(monkeypatch, caplog):
    proc = make_processor()
    proc.update_state(BatchUpdate(2, [], [(0, params(bregman_alpha=1.5), None, []),
                                          (1, params(bregman_alpha=2.5), None, [])], []))
    hostile = torch.tensor([[math.nan] * VOCAB, [-math.inf] * VOCAB])
    out = proc.apply(hostile.clone())
    assert torch.isnan(out[0]).all() and torch.isneginf(out[1]).all()

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug in the decoder")

    # Simulate a bug inside the math core: the step must go on with the logits unchanged.
    monkeypatch.setattr(processor_module, "decode_step", broken)
    monkeypatch.setattr(telemetry, "_last_warning", -math.inf)
    before = telemetry.failures_total()
    logits = torch.randn(2, VOCAB)
    with caplog.at_level(logging.WARNING):
        out = proc.apply(logits.clone())
    assert torch.equal(out, logits)
    assert telemetry.failures_total() == before + 2
    assert "left unchanged" in caplog.text


def test_second_instance_for_the_same_engine_is_inactive():
    config = EngineConfig()
    first = BregmanLogitsProcessor(config, torch.device("cpu"), False)
    second = BregmanLogitsProcessor(config, torch.device("cpu"), False)
    update = BatchUpdate(1, [], [(0, params(bregman_alpha=1.5), None, [])], [])
    first.update_state(update)
    second.update_state(update)
    logits = torch.randn(1, VOCAB) * 3
    once = first.apply(logits.clone())
    assert torch.equal(second.apply(once.clone()), once)
    assert first.is_argmax_invariant()


def test_model_runner_v2_interface():
    """vLLM's Model Runner V2 loads processors through its own interface: both loaders must
    accept the class, and under V2 the processor sees unscaled logits in reordered rows. The
    request state and `LogitsContext` are vLLM's own (`tests/v2_state.py`; the whole runner
    runs in `tests/test_processor_v2.py`)."""
    import numpy as np
    from vllm.v1.sample.logits_processor import _load_logitsprocs_plugins
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_plugins

    assert BregmanLogitsProcessor in _load_logitsprocs_plugins()
    assert BregmanLogitsProcessor in _load_v2_logitsprocs_plugins()

    from .v2_state import v2_request_state

    proc = BregmanLogitsProcessor(EngineConfig(), v2_request_state(8, VOCAB))
    requests = {
        5: SamplingParams(temperature=0.7, extra_args={"bregman_alpha": 1.5,
                                                       "bregman_lambda": 0.01}),
        2: SamplingParams(temperature=1.3, extra_args={"bregman_mode": "dual",
                                                       "bregman_alpha": 3.0,
                                                       "bregman_top_k": 4}),
        0: SamplingParams(temperature=1.0),  # plain
        7: SamplingParams(temperature=0.0, extra_args={"bregman_alpha": 2.0}),  # greedy
    }
    flags = {slot: proc.add_request(slot, sp) for slot, sp in requests.items()}
    assert flags == {5: True, 2: True, 0: False, 7: False}
    order = [2, 7, 0, 5]  # this step's row -> slot mapping
    logits = torch.randn(4, VOCAB) * 3
    ctx = LogitsContext(
        expanded_idx_mapping=torch.tensor(order, dtype=torch.int32),
        idx_mapping=torch.tensor(order, dtype=torch.int32),
        idx_mapping_np=np.array(order), expanded_local_pos=torch.zeros(4, dtype=torch.int32),
        input_ids=torch.zeros(4, dtype=torch.int32), pos=torch.zeros(4, dtype=torch.int32),
        seq_lens_upper_bound_np=np.ones(4, dtype=np.int64))
    out = proc.apply(logits.clone(), ctx)
    for row, slot in enumerate(order):
        sp = requests[slot]
        if not flags[slot]:
            assert torch.equal(out[row], logits[row])
            continue
        args = sp.extra_args
        # What the runner does next: divide by the temperature; that must give log q.
        got = torch.softmax(out[row] / sp.temperature, -1)
        want = torch.softmax(bregman_decode_logits(
            logits[row] / sp.temperature, alpha=float(args["bregman_alpha"]),
            lam=float(args.get("bregman_lambda", 0.01)), mode=args.get("bregman_mode", "primal"),
            top_k=args.get("bregman_top_k")), -1)
        assert torch.allclose(got, want, atol=1e-6)
    # A slot that is recycled for a plain request is no longer decoded.
    assert proc.add_request(5, SamplingParams(temperature=1.0)) is False
    assert torch.equal(proc.apply(logits.clone(), ctx)[3], logits[3])
