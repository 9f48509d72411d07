"""Citations of the paper (arXiv 2505.19371) in the code use the numbers printed in its PDF.

A reader holding the PDF cannot resolve a LaTeX label key ("eq. ren-dual", "Theorem convex_cost",
"Algorithm alg:binary-search"), so every ``.py`` file under ``bregman_vllm/``, ``server/`` and
``benchmarks/`` must cite equations, theorems, algorithms, sections and tables by their printed
numbers ("eq. (5)", "Theorem 3.3", "Algorithm 2", "Appendix G.3", "Table 1"). This test reads
only files of this repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("bregman_vllm", "server", "benchmarks")

#: Every non-numeric \label key of the paper's LaTeX source (figures and tables included), so that
#: a key written after a citation word ("Definition gentopk", "eq. (ren)") is recognized.
PAPER_LABELS = frozenset(word for line in (
    "intro fig:breg reg-dec topksec topk gentopk reg-sp-breg sp-br fig:landscape",
    "eq:primal_and_dual_Bregman_decoding alg sec:renorm ren ass:convex_in_second ren-dual",
    "fig:renorm greedy thm:greedy_optimal thm:greedy-dual assump:dual-greedy-1",
    "assump:dual-greedy-2 disc-cvx eq:regularised-cost thm:convex_cost ex alpha-ren-def",
    "prop:alpha-special-cases lem:dual-alpha sec:experiments fig:text_generation",
    "tab:gsm8k_lambda_compare rel app:dual_uniqueness d-ren eq:implicit app:proof_greedy_primal",
    "sec:proof-primal-greedy eq:loss-primal-form lem:simplified-cost-primal eq:solution-primal",
    "lem:loss-diff-primal eq:loss-diff-primal app:proof_greedy_property_dual lem:dual_breg",
    "app:A1_dual_greedy eq:duality-loss app:A2_dual_greedy not+ psi lem:sensitivity_dual",
    "partial-xi lem:d_nu lem:d_x app:proof_discrete_convexity_primal L-eq W nu-eq delta-L",
    "phi-ineq app:proof_discrete_convexity_dual d2lb lem:dual_helper_psi alg-det",
    "alg:dual-renormalization alg-pseudo alg:binary-search alg:sparse-bregman-binary",
    "alg:sparse-dual-bregman subsec:proof-alpha-special-cases illus-pd",
    "fig:primal_dual_comparison_peaked app:dual_nonconvexity fig:dual_bregman_nonconvex",
    "ill:disc-cvx fig:primal_dual_discrete_convex fig:temp_comp app:supp_experiments comp-exp",
    "tab:gsm8k_lambda10_01_compare fig:mauve_scores fig:ppl&rep_phi&qwen",
    "tab:gsm8k_lambda1_01_compare_qwen tab:gsm8k_lambda001_0001_compare_qwen",
    "tab:gsm8k_mu1e1_1e2_compare_phi tab:gsm8k_mu1e3_1e4_compare_phi",
    "tab:triviaqa_lambda01_001_llama tab:triviaqa_lambda0001_llama tab:gsm8k_lambda01_001_phi",
    "tab:gsm8k_lambda0001_phi sec:adaptivity tab:averaged_k*_llama_gsm8k",
    "tab:averaged_k_entropy_llama_gsm8k tab:averaged_k_star_qwen_gsm8k",
    "tab:averaged_k_entropy_qwen_gsm8k tab:averaged_k_star_phi_gsm8k",
    "tab:averaged_k_entropy_phi_gsm8k tab:averaged_k_star_llama_triviaqa",
    "tab:averaged_k_entropy_llama_triviaqa tab:averaged_k_star_phi_triviaqa",
    "tab:averaged_k_entropy_phi_triviaqa",
) for word in line.split())

#: The keys as they may appear in prose: whole, and without their "prefix:".
_KEYS = sorted({key for label in PAPER_LABELS for key in (label, label.split(":", 1)[-1])},
               key=len, reverse=True)

_CITE_WORD = (r"(?:eqs?\.|equations?|problems?|theorems?|lemmas?|propositions?|definitions?|"
              r"assumptions?|algorithms?|sections?|appendix|appendices|tables?|figures?)")

#: Patterns that only a label key (never a printed number) produces in a citation.
FORBIDDEN = [
    ("eq. + word", re.compile(r"\beqs?\. [a-z]")),
    ("eq. + (word)", re.compile(r"\beqs?\. \([a-zA-Z]")),
    ("prefixed label key", re.compile(r"\b(?:alg|sec|thm|eq|prop|def|lem|app|ass|assump|tab|fig)"
                                      r":[A-Za-z]")),
    ("convex_cost", re.compile(r"convex_cost")),
    ("\\ref", re.compile(r"\\ref\b")),
    ("\\eqref", re.compile(r"\\eqref\b")),
    ("\\cref", re.compile(r"\\[cC]ref\b")),
    ("citation word + hyphenated or snake_case key",
     re.compile(r"\b(?:Theorem|Lemma|Proposition|Definition|Assumption|Algorithm)s? "
                r"[a-z][a-z0-9]*[-_][\w-]*")),
    ("citation word + paper label key",
     re.compile(_CITE_WORD + r"\s+\(?(?:"
                + "|".join(re.escape(key) for key in _KEYS) + r")(?![\w-])",
                re.IGNORECASE)),
]

#: Known citations left on purpose, as (path, text); none today.
ALLOWED: set[tuple[str, str]] = set()


def _python_files() -> list[Path]:
    files: list[Path] = []
    for top in SCANNED:
        files.extend(sorted((ROOT / top).rglob("*.py")))
    return files


def _violations(path: Path) -> list[str]:
    relative = path.relative_to(ROOT).as_posix()
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for name, pattern in FORBIDDEN:
            for match in pattern.finditer(line):
                if any(relative == where and text in line for where, text in ALLOWED):
                    continue
                found.append(f"{relative}:{number}: {name}: {match.group(0)!r} in {line.strip()!r}")
    return found


def test_scanned_directories_exist() -> None:
    assert (ROOT / "bregman_vllm").is_dir()
    assert len(_python_files()) > 10


@pytest.mark.parametrize(
    "text",
    ["eq. ren", "eqs. L-eq and W", "eq. (ren-dual)", "Algorithm alg:binary-search",
     "Theorem convex_cost", "Definition gentopk", "Lemma dual-alpha",
     "Proposition alpha-special-cases", "Theorem d-ren", "Section ex", "Appendix illus-pd",
     "Table gsm8k_lambda_compare", "Section reg-sp-breg", "see \\eqref{ren}"],
)
def test_label_keys_are_caught(text: str) -> None:
    assert any(pattern.search(text) for _, pattern in FORBIDDEN), text


@pytest.mark.parametrize(
    "text",
    ["eq. (4)", "eqs. (15) and (16) of Appendix D", "Theorem 3.3", "Theorems 3.1 and 3.2",
     "Algorithm 1", "Definition 2.2", "Lemma 4.2", "Proposition 4.1", "Section 3.1",
     "Appendix G.3", "Table 1", "Tables 11-20", "Figure 6 (Appendix G.5)", "Sections 2-4",
     "the section below", "the renormalization figure"],
)
def test_printed_numbers_pass(text: str) -> None:
    assert not any(pattern.search(text) for _, pattern in FORBIDDEN), text


def test_no_label_keys_in_citations() -> None:
    found = [hit for path in _python_files() for hit in _violations(path)]
    assert not found, ("cite arXiv 2505.19371 by its printed numbers, not LaTeX label keys:\n"
                       + "\n".join(found))
