"""Unit tests of the evaluation harness on hand-made inputs: metrics, configurations, the report
and the theory figures' computations (no server)."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
import torch

from bregman_vllm.evaluation import figures, report
from bregman_vllm.evaluation.client import _prompt_logprobs, finite_count
from bregman_vllm.evaluation.configs import grid_configs, matched_baseline, parse_config
from bregman_vllm.evaluation.kstar import agreement
from bregman_vllm.evaluation.metrics import (
    bootstrap,
    bootstrap_mean,
    bootstrap_mean_diff,
    entropy_bits,
    exact_match,
    extract_answer,
    gsm8k_target,
    has_repetition,
    kstar_stats,
    matched_top_k,
    normalize_number,
    perplexity,
)
from bregman_vllm.evaluation.tasks import corpus_documents, fewshot_prompt, request_seed

# ----------------------------------------------------------------------------- rep(Y)


@pytest.mark.parametrize("tokens", [
    [1, 2, 1, 2],                  # the shortest case: a span of 2 repeated
    [9, 1, 2, 3, 1, 2, 3, 8],      # span of 3 in the middle
    [5, 6, 7, 8, 5, 6, 7, 8],      # span of 4 covering everything
    [0, 0, 0, 0],                  # "0 0" then "0 0"
    [4, 1, 2, 1, 2, 1, 2, 7],
])
def test_repetition_positive(tokens: list[int]) -> None:
    assert has_repetition(tokens)


@pytest.mark.parametrize("tokens", [
    [],
    [1],
    [1, 1],                        # a length-1 repeat does not count
    [1, 1, 2, 2, 3, 3],            # only length-1 repeats
    [1, 2, 3, 1, 2],               # repeated span, but not contiguous with itself
    [1, 2, 9, 1, 2],               # separated by a token
    [0, 0, 0],                     # needs 4 tokens for "0 0 | 0 0"
    list(range(50)),
])
def test_repetition_negative(tokens: list[int]) -> None:
    assert not has_repetition(tokens)


def test_repetition_min_span_parameter() -> None:
    assert has_repetition([1, 1, 2], min_span=1)
    assert not has_repetition([1, 2, 1, 2], min_span=3)
    assert has_repetition([1, 2, 3, 1, 2, 3], min_span=3)
    with pytest.raises(ValueError):
        has_repetition([1, 2], min_span=0)


def test_repetition_matches_brute_force() -> None:
    rng = np.random.default_rng(0)

    def brute(seq: list[int]) -> bool:
        return any(seq[i:i + n] == seq[i + n:i + 2 * n]
                   for n in range(2, len(seq)) for i in range(len(seq)) if i + 2 * n <= len(seq))

    for _ in range(300):
        seq = rng.integers(0, 3, size=int(rng.integers(0, 12))).tolist()
        assert has_repetition(seq) == brute(seq), seq


# ----------------------------------------------------------------------------- perplexity


def test_perplexity_from_logprobs() -> None:
    # p(Y|X) = 0.5 * 0.125 = 1/16 over 2 tokens: ppl = 16 ** (1/2) = 4.
    assert perplexity([math.log(0.5), math.log(0.125)]) == pytest.approx(4.0)
    assert perplexity([0.0, 0.0, 0.0]) == pytest.approx(1.0)
    assert perplexity([math.log(0.25)] * 7) == pytest.approx(4.0)
    # Geometric, not arithmetic, mean of the inverse probabilities.
    assert perplexity([math.log(0.9), math.log(0.1)]) == pytest.approx(1 / math.sqrt(0.09))


def test_perplexity_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        perplexity([])
    with pytest.raises(ValueError):
        perplexity([float("nan")])


def test_prompt_logprobs_both_answer_forms() -> None:
    ids = [1, 7, 8]
    echo = {"logprobs": {"token_logprobs": [None, -1.5, -0.25, -3.0]}}  # + one generated
    assert _prompt_logprobs(echo, ids) == [None, -1.5, -0.25]
    vllm = {"prompt_logprobs": [None, {"7": {"logprob": -1.5}, "3": {"logprob": -0.1}},
                                {"8": {"logprob": -0.25}}]}
    assert _prompt_logprobs(vllm, ids) == [None, -1.5, -0.25]


def test_finite_count_of_processed_logprobs() -> None:
    assert finite_count({"a": -0.1, "b": -2.0, "c": -9999.0, "d": float("-inf")}) == 2
    assert finite_count({}) == 0
    assert finite_count(None) == 0


# ----------------------------------------------------------------------------- bootstrap


def test_bootstrap_is_deterministic_with_a_seed() -> None:
    values = np.random.default_rng(1).normal(size=40)
    a = bootstrap_mean(values, seed=3)
    b = bootstrap_mean(values, seed=3)
    c = bootstrap_mean(values, seed=4)
    assert a == b
    assert a.std != c.std
    assert a.value == pytest.approx(values.mean())
    assert a.n == 40


def test_bootstrap_std_close_to_analytic() -> None:
    # Bernoulli(0.3) with n = 400: the standard error of the mean is sqrt(p (1 - p) / n).
    rng = np.random.default_rng(0)
    values = (rng.random(400) < 0.3).astype(float)
    p = values.mean()
    analytic = math.sqrt(p * (1 - p) / len(values))
    estimate = bootstrap_mean(values, resamples=4000, seed=0)
    assert estimate.std == pytest.approx(analytic, rel=0.08)


def test_bootstrap_of_a_constant_has_zero_std() -> None:
    assert bootstrap_mean([2.0] * 10).std == 0.0


def test_paired_bootstrap_difference() -> None:
    rng = np.random.default_rng(2)
    base = rng.normal(10.0, 3.0, size=200)
    shifted = base - 1.0 + rng.normal(0, 0.1, size=200)
    paired = bootstrap_mean_diff(base, shifted, seed=0)
    assert paired.value == pytest.approx(1.0, abs=0.05)
    # Pairing removes the shared per-example variation: far below the unpaired spread.
    unpaired_std = math.sqrt(base.var() / 200 + shifted.var() / 200)
    assert paired.std < unpaired_std / 5
    with pytest.raises(ValueError):
        bootstrap_mean_diff([1.0, 2.0], [1.0])


def test_bootstrap_generic_statistic_and_empty() -> None:
    est = bootstrap([[1.0, 2.0, 3.0, 10.0]], lambda a: float(np.median(a)), seed=0)
    assert est.value == 2.5
    assert est.std > 0
    empty = bootstrap_mean([])
    assert empty.n == 0 and math.isnan(empty.value)


# ----------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(("text", "value"), [
    ("1,234", Decimal(1234)), ("-5", Decimal(-5)), ("3.50", Decimal("3.5")),
    ("$18", Decimal(18)), ("7.", Decimal(7)), (".5", Decimal("0.5")), ("abc", None), ("", None),
])
def test_normalize_number(text: str, value: Decimal | None) -> None:
    assert normalize_number(text) == value


def test_gsm8k_target() -> None:
    assert gsm8k_target("Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72") == 72
    assert gsm8k_target("...\n#### 1,234") == 1234
    assert gsm8k_target("#### -3.5") == Decimal("-3.5")
    with pytest.raises(ValueError):
        gsm8k_target("no marker 12")


@pytest.mark.parametrize(("completion", "expected"), [
    (" She had 5 + 7 = <<5+7=12>>12 apples.\n#### 12", Decimal(12)),
    (" It costs 1,000 + 234 dollars.\n#### 1,234", Decimal(1234)),
    (" The temperature fell to\n#### -4", Decimal(-4)),
    (" 3 / 2 = 1.5 so\n#### 1.50", Decimal("1.5")),
    (" 2 + 2 = 4. The answer is 4.", Decimal(4)),
    (" First 3, then 8, so she has 11 left", Decimal(11)),       # last number
    (" #### 7 and later 9", Decimal(7)),                         # the marker wins
    (" no numbers at all", None),
])
def test_extract_answer(completion: str, expected: Decimal | None) -> None:
    assert extract_answer(completion) == expected


def test_exact_match() -> None:
    assert exact_match("so\n#### 1,234", Decimal(1234))
    assert exact_match("so\n#### $18.00", "18")
    assert not exact_match("so\n#### 17", Decimal(18))
    assert not exact_match("no answer", Decimal(18))
    assert exact_match("#### -2", "-2") and not exact_match("#### 2", "-2")


def test_fewshot_prompt_format() -> None:
    shots = [{"question": "Q1?", "answer": "A1\n#### 1"}, {"question": "Q2?", "answer": "#### 2"}]
    prompt = fewshot_prompt(shots, "Q3?")
    assert prompt == ("Question: Q1?\nAnswer: A1\n#### 1\n\nQuestion: Q2?\nAnswer: #### 2\n\n"
                      "Question: Q3?\nAnswer:")


# ----------------------------------------------------------------------------- adaptivity


def test_kstar_stats_hand_made() -> None:
    stats = kstar_stats([1, 1, 1, 2])
    assert stats.mean == pytest.approx(1.25)
    assert stats.std == pytest.approx(math.sqrt(0.1875))  # population std
    # H(3/4, 1/4) in bits
    assert stats.entropy_bits == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    assert stats.rounded == 1
    assert stats.histogram == {1: 3, 2: 1}
    assert (stats.minimum, stats.maximum, stats.n) == (1, 2, 4)
    assert kstar_stats([4, 4, 4]).entropy_bits == 0.0
    assert entropy_bits([1, 2, 3, 4]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        kstar_stats([])
    with pytest.raises(ValueError):
        kstar_stats([0, 1])


def test_entropy_in_bits_reproduces_the_paper_table() -> None:
    # Paper appendix: mean 1.2231, std 0.46, entropy 0.82 (LLaMA, lambda 0.1, alpha 1.5, T 0.3);
    # a k* distribution of 80% ones, 18% twos and 2% threes has exactly those moments.
    ks = [1] * 80 + [2] * 18 + [3] * 2
    stats = kstar_stats(ks)
    assert stats.mean == pytest.approx(1.22)
    assert stats.std == pytest.approx(0.46, abs=0.005)
    assert stats.entropy_bits == pytest.approx(0.82, abs=0.005)


@pytest.mark.parametrize(("mean", "k"), [
    (1.2231, 1), (1.6201, 2), (2.5, 3), (1.5048, 2), (14.2539, 14), (0.3, 1), (4.4999, 4)])
def test_matched_top_k_rounding(mean: float, k: int) -> None:
    assert matched_top_k(mean) == k


def test_matched_top_k_rejects_nan() -> None:
    with pytest.raises(ValueError):
        matched_top_k(float("nan"))


def test_kstar_agreement() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    assert agreement([1, 2], [1, 2, 3]) == 1.0
    assert math.isnan(agreement([], [1]))


# ----------------------------------------------------------------------------- configurations


def test_parse_config_adaptive_and_fixed() -> None:
    adaptive = parse_config("primal:1.5:0.01")
    assert adaptive.adaptive and adaptive.k_max == 50 and adaptive.temperature == 1.0
    assert adaptive.request_fields() == {"bregman_mode": "primal", "bregman_alpha": 1.5,
                                         "bregman_lambda": 0.01, "bregman_k_max": 50}
    dual = parse_config("dual:2:0.001:T=0.7:kmax=none@gsm8k")
    assert (dual.mode, dual.alpha, dual.lam, dual.k_max, dual.temperature, dual.tasks) == \
        ("dual", 2.0, 0.001, None, 0.7, ("gsm8k",))
    assert dual.runs_on("gsm8k") and not dual.runs_on("open")
    fixed = parse_config("primal:inf:k=10")
    assert not fixed.adaptive
    assert fixed.request_fields()["bregman_alpha"] == "inf"
    assert fixed.request_fields()["bregman_top_k"] == 10
    topk = parse_config("topk:7:T=0.3")
    assert topk.request_fields() == {"top_k": 7} and topk.temperature == 0.3
    assert parse_config("sample").request_fields() == {}


def test_config_labels_round_trip() -> None:
    for spec in ("primal:1.5:0.01", "dual:2:0.001:T=0.7:kmax=none", "primal:2:k=10",
                 "topk:5:T=1.5", "sample:T=0.5", "primal:-inf:k=3"):
        config = parse_config(spec)
        assert parse_config(config.label) == config


@pytest.mark.parametrize("spec", [
    "primal", "primal:1.5", "dual:1:0.01",  # adaptive dual needs alpha > 1
    "primal:0:k=5", "topk:0", "topk", "greedy", "primal:1.5:0.01@nope", "sample:T=0",
    "primal:1.5:0.01:extra",
])
def test_parse_config_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_config(spec)


def test_grid_and_matched_configs() -> None:
    grid = grid_configs([5, 10], [1.0, 1.5, 2.0])
    labels = [c.label for c in grid]
    assert labels == ["topk:5:T=1", "primal:1.5:k=5:T=1", "primal:2:k=5:T=1",
                      "topk:10:T=1", "primal:1.5:k=10:T=1", "primal:2:k=10:T=1"]
    assert all(c.tasks == ("open",) for c in grid)
    base = parse_config("primal:2:0.01:T=0.7")
    matched = matched_baseline(base, matched_top_k(2.5), "gsm8k")
    assert matched.label == "topk:3:T=0.7" and matched.matched_to == base.label
    assert matched.tasks == ("gsm8k",)


def test_request_seeds_are_shared_across_configurations_and_distinct_across_examples() -> None:
    seeds = {request_seed(0, "open", i) for i in range(100)}
    assert len(seeds) == 100
    assert request_seed(0, "open", 3) != request_seed(0, "gsm8k", 3)
    assert request_seed(1, "open", 3) != request_seed(0, "open", 3)


def test_corpus_documents(tmp_path: Path) -> None:
    text = tmp_path / "c.txt"
    text.write_text("A:\nhello there\n\nB:\nhi\n\n\nC:\nbye now friend\n")
    docs = corpus_documents(text, min_chars=20)
    assert docs == ["A:\nhello there\n\nB:\nhi", ]  # the short tail is dropped
    lines = tmp_path / "c.jsonl"
    lines.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"body": "x"}) + "\n")
    assert corpus_documents(lines) == ["one"]


# ----------------------------------------------------------------------------- figures' math


def test_cost_curve_is_discretely_convex_and_its_minimizer_is_kstar() -> None:
    p = figures.zipf(80, exponent=1.0)
    for mode, alphas in (("primal", (1.0, 1.5, 2.0, 3.0)), ("dual", (1.5, 2.0, 3.0))):
        for alpha in alphas:
            costs = figures.cost_curve(p, alpha, 1 / 80, mode)
            assert np.diff(costs, 2).min() > -1e-9, (mode, alpha)
            k_star = int(figures.bregman_decode(torch.tensor(p.copy()), alpha=alpha,
                                                lam=1 / 80, mode=mode).k)
            assert int(np.argmin(costs)) + 1 == k_star, (mode, alpha)
            assert costs[-1] == pytest.approx(1.0, abs=1e-9)  # Div = 0 at k = V, lambda V = 1


def test_bregman_divergence_special_cases() -> None:
    x, y = np.array([0.2, 0.5]), np.array([0.4, 0.1])
    # alpha = 2: d(x, y) = (x - y)^2 / 2
    assert figures.bregman_d(x, y, 2.0) == pytest.approx((x - y) ** 2 / 2)
    # alpha = 1: generalized KL, x log(x/y) - x + y
    assert figures.bregman_d(x, y, 1.0) == pytest.approx(x * np.log(x / y) - x + y)
    assert figures.bregman_d(x, x, 1.5) == pytest.approx([0.0, 0.0])


def test_primal_and_dual_maps_coincide_at_alpha_1_2_inf_on_the_peaked_vector() -> None:
    v = [0.1, 0.001, 0.001, 0.001, 0.001]
    for alpha in (1.0, 2.0, math.inf):
        assert figures.renorm(v, alpha, "primal") == pytest.approx(
            figures.renorm(v, alpha, "dual"), abs=1e-9)
    assert figures.renorm(v, 2.0, "primal")[0] == pytest.approx(0.1 + 0.896 / 5)
    assert figures.renorm(v, math.inf, "primal") == pytest.approx([0.2] * 5)
    assert figures.renorm(v, 1.5, "primal")[0] != pytest.approx(figures.renorm(v, 1.5, "dual")[0])


def test_theory_figures_are_written(tmp_path: Path) -> None:
    paths = figures.theory_figures(tmp_path)
    assert [p.name for p in paths] == ["alpha_reshape.png", "renorm_maps.png",
                                       "primal_vs_dual_peaked.png", "cost_convexity.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


# ----------------------------------------------------------------------------- report


def _fake_result() -> dict:
    est = {"value": 1.0, "std": 0.5, "n": 4}
    configs = [parse_config(s) for s in ("primal:1.5:0.01", "primal:2:0.01", "topk:5",
                                         "primal:2:k=5", "topk:10")]
    matched = matched_baseline(configs[0], 2, "gsm8k")
    rows_open = [{"config": c.label, "ppl": est, "ppl_gap": {"value": 0.25 * i, "std": 0.1},
                  "rep": est, "rep_gap": est, "mean_length": 10.0, "kstar": None}
                 for i, c in enumerate(configs)]
    ks = kstar_stats([1, 2, 2, 3]).as_dict()
    rows_gsm = [{"config": configs[0].label, "accuracy": {"value": 12.5, "std": 2.0},
                 "mean_length": 5.0, "kstar": ks},
                {"config": matched.label, "accuracy": {"value": 25.0, "std": 3.0},
                 "mean_length": 5.0, "kstar": None}]
    return {
        "meta": {"model": "m", "endpoint": "e", "open": {"prompt_tokens": 35, "max_tokens": 8,
                                                        "corpus": "c"},
                 "gsm8k": {"max_tokens": 16}, "kstar": {"local": True, "model_dir": "d"}},
        "configs": [c.as_dict() for c in [*configs, matched]],
        "open": {"passages": 4, "results": rows_open,
                 "human": {"ppl": est, "rep": est, "mean_length": 8.0}},
        "gsm8k": {"problems": 4, "results": rows_gsm,
                  "matched": {configs[0].label: matched.label}},
    }


def test_markdown_report_layout() -> None:
    text = report.markdown_report(_fake_result())
    assert "| k | top-k (α=1) | primal α=2 |" in text
    assert "| 5 | 0.50 ± 0.10 | 0.75 ± 0.10 |" in text  # ppl gap by k: top-k, then alpha 2
    assert "| 10 | 1.00 ± 0.10 | — |" in text
    assert "| T | λ=0.01 α=1.5 | top-k (λ=0.01, matched α=1.5) |" in text
    assert "| 1 | 12.50 ± 2.00 | 25.00 ± 3.00 (k=2) |" in text
    assert "| 1 | 2.0000 (2) |" in text  # adaptivity: mean (rounded)
    assert "| 1 | 0.71 (1.50) |" in text  # std (entropy in bits)


def test_write_outputs_json_is_strict(tmp_path: Path) -> None:
    result = _fake_result()
    paths = report.write_outputs(result, [{"task": "open", "text": "x"}], tmp_path)
    assert json.loads(paths["json"].read_text()) == result
    assert paths["markdown"].read_text().startswith("# Bregman decoding evaluation")
    assert paths["samples"].read_text().count("\n") == 1
    result["open"]["human"]["ppl"]["value"] = float("nan")
    with pytest.raises(ValueError):
        report.write_outputs(result, [], tmp_path)


def test_result_figures_from_a_result(tmp_path: Path) -> None:
    made = figures.result_figures(_fake_result(), tmp_path)
    assert [p.name for p in made] == ["gaps_vs_k.png", "kstar_hist.png"]
    assert figures.result_figures({"configs": []}, tmp_path / "none") == []


def test_decoding_fields_placement() -> None:
    from bregman_vllm.evaluation.client import EndpointClient

    fields = parse_config("dual:2:0.01").request_fields()
    generic = EndpointClient("http://h:1").decoding_fields({**fields, "top_k": 3})
    assert generic == {"top_k": 3, "vllm_xargs": fields}
    ours = EndpointClient("http://h:1/v1/", ours=True).decoding_fields(fields)
    assert ours == fields
    assert EndpointClient("http://h:1").decoding_fields({"top_k": 3}) == {"top_k": 3}
    client = EndpointClient("http://h:1/")
    assert (client.base_url, client.root_url) == ("http://h:1/v1", "http://h:1")
