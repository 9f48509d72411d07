"""`bregman_vllm.hf.BregmanLogitsProcessor` in real ``model.generate`` calls on the tiny model.

The tiny Llama of scripts/prepare_models.py runs with transformers on the CPU (float32). Each
generation returns the raw logits and the processed scores of every step
(``output_logits`` / ``output_scores``), so every step is checked against `bregman_decode` of
the model's own distribution, in float64. About 10 s in all.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessorList,
    TemperatureLogitsWarper,
)

from bregman_vllm import BregmanParamError, bregman_decode
from bregman_vllm.hf import BregmanLogitsProcessor, paper_order

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"
PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further,",
           "KING RICHARD III:\nNow is the winter of", "To be, or not"]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    if not (TINY / "config.json").exists():
        pytest.fail(f"{TINY} is missing: run `python scripts/prepare_models.py --only tiny` "
                    "(make test does)", pytrace=False)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    return model, tokenizer


def generate(tiny: tuple[Any, Any], processors: LogitsProcessorList, *, seed: int = 0,
             max_new_tokens: int = 12, prompts: list[str] = PROMPTS, **kwargs: Any) -> Any:
    model, tokenizer = tiny
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    return model.generate(**inputs, do_sample=True, max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, top_k=0, logits_processor=processors,
                          output_scores=True, output_logits=True, return_dict_in_generate=True,
                          pad_token_id=tokenizer.pad_token_id, **kwargs)


def check_every_step(out: Any, temperature: float, **bregman: Any) -> list[torch.Tensor]:
    """Each step's processed scores equal log bregman_decode(softmax(logits / T)); the sampled
    token is in the support. Returns k* per step."""
    ks = []
    prompt_len = out.sequences.shape[1] - len(out.scores)
    for step, (logits, scores) in enumerate(zip(out.logits, out.scores, strict=True)):
        reference = bregman_decode(torch.softmax(logits.double() / temperature, dim=-1),
                                   **bregman)
        support = torch.isfinite(scores)
        assert torch.equal(support, reference.probs > 0), f"support differs at step {step}"
        assert torch.equal(support.sum(-1), reference.k)
        torch.testing.assert_close(torch.softmax(scores.double(), dim=-1), reference.probs,
                                   rtol=1e-5, atol=1e-6)
        sampled = out.sequences[:, prompt_len + step]
        assert bool(support.gather(1, sampled[:, None]).all()), "sampled outside the support"
        ks.append(reference.k)
    return ks


@pytest.mark.parametrize(("temperature", "bregman"), [
    (1.0, {"alpha": 1.5, "lam": 0.01, "k_max": 50}),
    (0.7, {"alpha": 2.0, "lam": 1e-3}),
    (1.5, {"alpha": 3.0, "lam": 1e-3, "mode": "dual"}),
    (1.0, {"alpha": "inf", "lam": 0.0, "top_k": 5}),
])
def test_generate_matches_bregman_decode_at_every_step(tiny: tuple[Any, Any],
                                                       temperature: float,
                                                       bregman: dict[str, Any]) -> None:
    out = generate(tiny, paper_order(temperature, **bregman))
    ks = torch.stack(check_every_step(out, temperature, **bregman))
    assert ks.shape == (12, len(PROMPTS))  # the whole batch, every step
    if "top_k" in bregman:
        assert bool((ks == bregman["top_k"]).all())
    else:  # adaptive: k* moves from step to step and row to row
        assert ks.min() >= 1 and ks.max() > ks.min()
        assert ks.max() <= bregman.get("k_max", ks.max())


def test_batch_rows_are_independent(tiny: tuple[Any, Any]) -> None:
    """One row decoded alone gets the same scores as inside a padded batch of four."""
    bregman = {"alpha": 1.5, "lam": 0.01}
    processor = BregmanLogitsProcessor(**bregman)
    model, tokenizer = tiny
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1, :]
    batch = processor(inputs["input_ids"], logits.clone())
    for row in range(len(PROMPTS)):
        alone = processor(inputs["input_ids"][row:row + 1], logits[row:row + 1].clone())
        torch.testing.assert_close(batch[row:row + 1], alone)
    assert batch.dtype == logits.dtype and batch.shape == logits.shape


def test_hf_temperature_is_applied_after_the_processor(tiny: tuple[Any, Any]) -> None:
    """The documented order: generate's own temperature warper runs after our processor, so
    its scores are log q / T with q decoded from softmax(logits) at T = 1."""
    bregman = {"alpha": 1.5, "lam": 0.01}
    out = generate(tiny, LogitsProcessorList([BregmanLogitsProcessor(**bregman)]),
                   temperature=0.5, max_new_tokens=4)
    for logits, scores in zip(out.logits, out.scores, strict=True):
        log_q = torch.log(bregman_decode(torch.softmax(logits.double(), dim=-1), **bregman).probs)
        expected = (log_q / 0.5).float()
        assert torch.equal(torch.isfinite(scores), torch.isfinite(expected))
        finite = torch.isfinite(expected)
        torch.testing.assert_close(scores[finite], expected[finite], rtol=1e-4, atol=1e-4)


def test_paper_order_list() -> None:
    processors = paper_order(0.7, alpha=1.5, lam=0.01)
    assert [type(p) for p in processors] == [TemperatureLogitsWarper, BregmanLogitsProcessor]
    assert [type(p) for p in paper_order(alpha=2, lam=0.1)] == [BregmanLogitsProcessor]


def test_half_precision_scores_and_masked_rows() -> None:
    processor = BregmanLogitsProcessor(alpha=2.0, lam=0.01)
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    scores[1] = -math.inf  # a row another processor masked entirely stays as it is
    out = processor(None, scores.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert torch.isneginf(out[1]).all()
    torch.testing.assert_close(out[0].float().softmax(-1),
                               torch.tensor([0.5167, 0.3167, 0.1667, 0.0]), atol=5e-3, rtol=0)


@pytest.mark.parametrize(("kwargs", "field", "message"), [
    ({"alpha": 0.5, "lam": 0.01, "mode": "dual"}, "alpha",
     "must be in (1, 1e8] for adaptive dual decoding, got 0.5"),
    ({"alpha": "inf", "lam": 0.01}, "alpha",
     "must be in (0, 1e8] for adaptive primal decoding, got inf"),
    ({"alpha": 0.0, "lam": 0.0, "top_k": 3}, "alpha", "excluding 0"),
    ({"alpha": 1.5, "lam": -1.0}, "lam", "must be a finite number in [0, inf)"),
    ({"alpha": 1.5, "lam": math.inf}, "lam", "must be a finite number in [0, inf)"),
    ({"alpha": 1.5, "lam": 0.01, "top_k": 0}, "top_k", "must be an integer >= 1"),
    ({"alpha": 1.5, "lam": 0.01, "k_max": 2.5}, "k_max", "integer"),
    ({"alpha": 1.5, "lam": 0.01, "mode": "off"}, "mode", 'must be one of "primal" | "dual"'),
    ({"alpha": True, "lam": 0.01}, "alpha", "must be a number"),
    ({"alpha": torch.tensor([1.5, 2.0]), "lam": 0.01}, "alpha", "single number"),
    # Per-row lists, which the math core takes, are refused: generate's rows (padding, beams,
    # num_return_sequences) would not line up with them.
    ({"alpha": [1.5, 2.0], "lam": 0.01}, "alpha", "single number for the whole batch, got a list"),
    ({"alpha": 1.5, "lam": (0.01, 0.02)}, "lam", "single number for the whole batch, got a tuple"),
    ({"alpha": 1.5, "lam": 0.0, "top_k": [3, 4]}, "top_k", "got a list"),
    ({"alpha": 1.5, "lam": 0.01, "k_max": [50, 60]}, "k_max", "got a list"),
])
def test_invalid_values_raise_at_construction(kwargs: dict[str, Any], field: str,
                                              message: str) -> None:
    with pytest.raises(BregmanParamError) as error:
        BregmanLogitsProcessor(**kwargs)
    assert error.value.field == field
    assert message in str(error.value)
    # The same message as the math core's own entry point (which takes per-row values).
    if not any(isinstance(value, (torch.Tensor, list, tuple)) for value in kwargs.values()):
        with pytest.raises(BregmanParamError) as core_error:
            bregman_decode(torch.tensor([0.6, 0.4]), **kwargs)
        assert str(core_error.value) == str(error.value)


def test_keyword_arguments_are_those_of_bregman_decode() -> None:
    import inspect

    ours = inspect.signature(BregmanLogitsProcessor.__init__).parameters
    core = inspect.signature(bregman_decode).parameters
    assert set(ours) - {"self"} == {"alpha", "lam", "mode", "top_k", "k_max"}
    assert set(ours) - {"self"} <= set(core)
    assert ours["mode"].default == core["mode"].default == "primal"
