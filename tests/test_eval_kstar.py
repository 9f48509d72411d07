"""The offline k* recomputation (`LocalKStar`) on the tiny model, without a server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bregman_vllm import bregman_decode
from bregman_vllm.evaluation.configs import parse_config
from bregman_vllm.evaluation.kstar import LocalKStar, common_prefix_length

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-llama"


@pytest.fixture(scope="module")
def local() -> LocalKStar:
    if not (MODEL / "config.json").exists():
        pytest.fail(f"{MODEL} is missing: run `python scripts/prepare_models.py --only tiny`")
    return LocalKStar(str(MODEL), dtype="float32")


PROMPT = [1, 863, 30, 203, 466, 1256, 272, 311, 16, 203, 331, 404]
GENERATED = [347, 31, 293, 460, 509, 571, 203, 2]


def test_common_prefix_length() -> None:
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length([[5, 6], [5, 6]]) == 2
    assert common_prefix_length([[1], [2]]) == 0
    assert common_prefix_length([]) == 0


def test_distributions_are_the_next_token_distributions(local: LocalKStar) -> None:
    probs = local.distributions(PROMPT, GENERATED, temperature=1.0)
    assert probs.shape == (len(GENERATED), local.model.config.vocab_size)
    assert probs.dtype == torch.float64
    assert torch.allclose(probs.sum(-1), torch.ones(len(GENERATED), dtype=torch.float64))
    # Row t is p(. | prompt, generated[:t]): compare with a forward pass over that prefix.
    for t in (0, 3, len(GENERATED) - 1):
        with torch.no_grad():
            logits = local.model(input_ids=torch.tensor([PROMPT + GENERATED[:t]])).logits[0, -1]
        expected = torch.softmax(logits.double(), -1)
        assert torch.allclose(probs[t], expected, atol=1e-5), t


def test_temperature_scales_the_logits(local: LocalKStar) -> None:
    p1 = local.distributions(PROMPT, GENERATED, temperature=1.0)
    p05 = local.distributions(PROMPT, GENERATED, temperature=0.5)
    # softmax(l / 0.5) is proportional to softmax(l) ** 2.
    squared = p1 ** 2 / (p1 ** 2).sum(-1, keepdim=True)
    assert torch.allclose(p05, squared, atol=1e-6)


def test_prefix_cache_gives_the_same_distributions(local: LocalKStar) -> None:
    full = local.distributions(PROMPT, GENERATED, 1.0)
    for prefix in (4, len(PROMPT) - 1, len(PROMPT) + 3):  # the last one is clamped
        cached = local.distributions(PROMPT, GENERATED, 1.0, prefix_len=prefix)
        assert torch.allclose(full, cached, atol=1e-5), prefix
        again = local.distributions(PROMPT, GENERATED, 1.0, prefix_len=prefix)
        assert torch.allclose(cached, again)  # the cached prefix is not mutated by a call


def test_support_sizes_are_bregman_kstar(local: LocalKStar) -> None:
    for spec in ("primal:1.5:0.01", "dual:2:0.01:T=0.7", "primal:2:0.001:kmax=5"):
        config = parse_config(spec)
        ks = local.support_sizes(PROMPT, GENERATED, config)
        probs = local.distributions(PROMPT, GENERATED, config.temperature)
        expected = bregman_decode(probs, alpha=config.alpha, lam=config.lam, mode=config.mode,
                                  k_max=config.k_max).k.tolist()
        assert ks == expected
        assert len(ks) == len(GENERATED) and all(k >= 1 for k in ks)
        if config.k_max is not None:
            assert max(ks) <= config.k_max
    assert max(local.support_sizes(PROMPT, GENERATED, parse_config("primal:2:0.001:kmax=5"))) \
        == 5  # the cap binds on this flat tiny model
    assert local.support_sizes(PROMPT, [], parse_config("primal:1.5:0.01")) == []
    with pytest.raises(ValueError):
        local.support_sizes(PROMPT, GENERATED, parse_config("primal:2:k=5"))
