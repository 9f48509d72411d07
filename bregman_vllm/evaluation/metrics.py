"""The evaluation metrics of the paper's Section 5 and Appendix H, as pure functions.

Definitions (Noarov et al., "Foundations of Top-k Decoding for Language Models",
arXiv 2505.19371, Section 5.1):

* perplexity of a continuation Y of a prompt X under the base model:
  ``ppl(Y) = p_base(Y | X) ** (-1 / |Y|) = exp(-mean_t log p_base(y_t | X, y_<t))``;
* perplexity gap: ``E[ppl(human Y)] - E[ppl(generated Y)]`` over prompts (lower magnitude is
  better; the paper plots it signed);
* rep(Y): Y contains two contiguous identical token spans of length >= 2, i.e. some span
  ``Y[i:i+L] == Y[i+L:i+2L]`` with ``L >= 2``; repetition gap:
  ``P(rep(generated Y)) - P(rep(human Y))``;
* GSM8K: exact match of the final number;
* standard deviations: bootstrap over examples, 1000 resamples;
* adaptivity (Appendix H.5, Tables 11-20): mean, standard deviation and entropy of the k*
  chosen at every decoding step, and the matched top-k baseline k = round(mean k*).

Only numpy and the standard library are used, so the metrics are cheap to import and test.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

#: Bootstrap resamples used by the paper for every standard deviation.
BOOTSTRAP_RESAMPLES = 1000

# ----------------------------------------------------------------------------- repetition


def has_repetition(tokens: Sequence[int], min_span: int = 2) -> bool:
    """rep(Y): True when ``tokens`` holds a span of length >= ``min_span`` immediately repeated
    (``Y[i:i+L] == Y[i+L:i+2L]`` for some i and L >= min_span; paper Section 5.1, metric (2)).

    Repeats of single tokens ("a a") do not count with the paper's ``min_span = 2``.

    >>> has_repetition([1, 2, 1, 2]), has_repetition([1, 1, 2, 3]), has_repetition([5, 6, 7, 5, 6])
    (True, False, False)
    """
    if min_span < 1:
        raise ValueError("min_span must be >= 1")
    seq = list(tokens)
    n = len(seq)
    for length in range(min_span, n // 2 + 1):
        for start in range(n - 2 * length + 1):
            # Cheap first-token check before comparing whole slices.
            if seq[start] == seq[start + length] and \
                    seq[start:start + length] == seq[start + length:start + 2 * length]:
                return True
    return False


# ----------------------------------------------------------------------------- perplexity


def perplexity(logprobs: Sequence[float]) -> float:
    """``p(Y | X) ** (-1/|Y|)`` from the per-token log-probabilities (natural log) of Y.

    >>> round(perplexity([math.log(0.5), math.log(0.125)]), 6)
    4.0
    """
    values = [float(v) for v in logprobs]
    if not values:
        raise ValueError("perplexity of an empty continuation is undefined")
    if any(math.isnan(v) for v in values):
        raise ValueError("log-probabilities must not be NaN")
    return math.exp(-sum(values) / len(values))


# ----------------------------------------------------------------------------- bootstrap


@dataclass(frozen=True)
class Estimate:
    """A statistic on the full sample and its bootstrap standard deviation."""

    value: float
    std: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def bootstrap(
    columns: Sequence[Sequence[float]],
    statistic: Callable[..., float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Estimate:
    """Bootstrap standard deviation of ``statistic(*columns)``.

    The columns are paired (one row per example, e.g. the human and the generated perplexity of
    the same prompt): each resample draws example indices with replacement and applies the same
    indices to every column. The standard deviation is that of the resampled statistics (ddof=1);
    the RNG is seeded, so the result is deterministic.
    """
    arrays = [np.asarray(column, dtype=np.float64) for column in columns]
    if not arrays:
        raise ValueError("bootstrap needs at least one column")
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError("bootstrap columns must have the same length")
    if n == 0:
        return Estimate(math.nan, math.nan, 0)
    value = float(statistic(*arrays))
    if resamples < 2:
        return Estimate(value, math.nan, n)
    rng = np.random.default_rng(seed)
    index = rng.integers(0, n, size=(resamples, n))
    stats = np.array([statistic(*(a[row] for a in arrays)) for row in index], dtype=np.float64)
    return Estimate(value, float(stats.std(ddof=1)), n)


def _mean(a: np.ndarray) -> float:
    return float(a.mean())


def _mean_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(a.mean() - b.mean())


def bootstrap_mean(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                   seed: int = 0) -> Estimate:
    """Mean and its bootstrap standard deviation (about ``std(values) / sqrt(n)``)."""
    return bootstrap([values], _mean, resamples=resamples, seed=seed)


def bootstrap_mean_diff(a: Sequence[float], b: Sequence[float], *,
                        resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Estimate:
    """``mean(a) - mean(b)`` for paired samples (same examples), with a paired bootstrap."""
    return bootstrap([a, b], _mean_diff, resamples=resamples, seed=seed)


# ----------------------------------------------------------------------------- GSM8K

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\$?\s?\.\d+"
_FINAL_MARK = re.compile(r"####\s*(" + _NUMBER + ")")
_ANSWER_IS = re.compile(r"answer is\s*:?\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


def normalize_number(text: str) -> Decimal | None:
    """A number written as in GSM8K answers (``1,234``, ``-5``, ``$3.50``, ``7.``) as a Decimal;
    None when ``text`` is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if not cleaned or cleaned in {"-", "."}:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def gsm8k_target(answer: str) -> Decimal:
    """The reference number of a GSM8K ``answer`` field (the text after ``####``)."""
    match = _FINAL_MARK.search(answer)
    if match is None:
        raise ValueError(f"GSM8K answer without '#### <number>': {answer[-80:]!r}")
    value = normalize_number(match.group(1))
    if value is None:
        raise ValueError(f"GSM8K answer with an unreadable number: {match.group(1)!r}")
    return value


def extract_answer(text: str) -> Decimal | None:
    """The final number of a chain-of-thought completion.

    In order of preference: the number after the first ``####`` (the format the 8-shot prompt
    teaches), the number after the last "the answer is", else the last number in the text.
    """
    match = _FINAL_MARK.search(text)
    if match is None:
        matches = list(_ANSWER_IS.finditer(text))
        match = matches[-1] if matches else None
    if match is not None:
        return normalize_number(match.group(1))
    numbers = _ANY_NUMBER.findall(text)
    for candidate in reversed(numbers):
        value = normalize_number(candidate)
        if value is not None:
            return value
    return None


def exact_match(text: str, target: Decimal | str) -> bool:
    """Exact match of the completion's final number with the reference (numerically equal, so
    ``18``, ``18.00`` and ``$18`` all match ``18``)."""
    reference = target if isinstance(target, Decimal) else normalize_number(str(target))
    predicted = extract_answer(text)
    return predicted is not None and reference is not None and predicted == reference


# ----------------------------------------------------------------------------- adaptivity


@dataclass(frozen=True)
class KStarStats:
    """Adaptivity of k* over every decoding step (paper, Appendix H.5, Tables 11-20).

    ``entropy_bits`` is the Shannon entropy (base 2) of the empirical distribution of k*; base 2
    reproduces the paper's numbers (e.g. mean 1.22 / std 0.46 / entropy 0.82 for LLaMA at
    lambda = 0.1, alpha = 1.5, T = 0.3: Tables 11 and 12). ``std`` is the population standard
    deviation (ddof = 0).
    """

    mean: float
    std: float
    entropy_bits: float
    rounded: int
    n: int
    minimum: int
    maximum: int
    histogram: dict[int, int]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["histogram"] = {str(k): v for k, v in sorted(self.histogram.items())}
        return out


def entropy_bits(values: Sequence[int]) -> float:
    """Shannon entropy in bits of the empirical distribution of ``values``."""
    counts = np.array(list(Counter(int(v) for v in values).values()), dtype=np.float64)
    if counts.size == 0:
        return math.nan
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum() + 0.0)


def matched_top_k(mean_k: float) -> int:
    """The paper's matched top-k baseline: round(mean k*) to the nearest integer, halves up
    (Python's ``round`` would send 2.5 to 2), and at least 1."""
    if not math.isfinite(mean_k):
        raise ValueError(f"mean k* must be finite, got {mean_k}")
    return max(1, math.floor(mean_k + 0.5))


def kstar_stats(values: Sequence[int]) -> KStarStats:
    """Mean, standard deviation, entropy (bits) and histogram of the k* of every step."""
    ks = np.asarray([int(v) for v in values], dtype=np.int64)
    if ks.size == 0:
        raise ValueError("no k* values")
    if (ks < 1).any():
        raise ValueError("k* values must be >= 1")
    mean = float(ks.mean())
    return KStarStats(
        mean=mean,
        std=float(ks.std()),
        entropy_bits=entropy_bits(ks.tolist()),
        rounded=matched_top_k(mean),
        n=int(ks.size),
        minimum=int(ks.min()),
        maximum=int(ks.max()),
        histogram=dict(Counter(ks.tolist())),
    )
