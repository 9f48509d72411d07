"""SmolLM2-135M-Instruct (the model `make run` serves) in a real vLLM CPU engine with the
processor: its first tests in any engine (tests/test_models.py checks only its files).

One engine (``processed_logprobs``, ``max_logprobs=-1``: each step's returned logprobs are the
whole distribution that was sampled), a vocabulary of 49,152:

* its chat answer to the check question of scripts/prepare_models.py, greedily and with
  ``bregman_top_k=1`` at temperature 1 (top-1 decoding is the argmax: the same answer, "Paris");
* several families decoded at every step as the independent float64 reference
  (tests/reference_search.py) decodes the plain distribution of the same step.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from . import reference_search as rs
from .test_models import load_script
from .test_processor import dense, sampling
from .test_reference_search import compare

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm():
    if not (MODEL / "config.json").exists():
        pytest.fail(f"{MODEL} is missing: run `python scripts/prepare_models.py` (make test does)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    engine = LLM(str(MODEL), logprobs_mode="processed_logprobs", max_logprobs=-1, seed=0,
                 enforce_eager=True, max_num_seqs=8, max_model_len=512)
    yield engine
    del engine


def test_the_chat_answer_is_the_greedy_one_with_top_1(llm) -> None:
    prepare = load_script()
    messages = [{"role": "user", "content": prepare.SMOL_CHECK_PROMPT}]
    greedy = llm.chat(messages, sampling(temperature=0.0, max_tokens=24), use_tqdm=False)
    top1 = llm.chat(messages, sampling(temperature=1.0, max_tokens=24, seed=1,
                                       extra_args={"bregman_top_k": 1, "bregman_alpha": 1.5}),
                    use_tqdm=False)
    answer = greedy[0].outputs[0].text
    assert prepare.SMOL_CHECK_WORD in answer, answer
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


#: k* in the window and past it, primal and dual, a cap, a fixed k with water-filling.
REQUESTS = [
    ({"bregman_alpha": 1.5, "bregman_lambda": 1e-4}, 1.0),
    ({"bregman_alpha": 1.0, "bregman_lambda": 1e-5}, 0.8),
    ({"bregman_mode": "dual", "bregman_alpha": 3.0, "bregman_lambda": 1e-6,
      "bregman_k_max": 200}, 1.0),
    ({"bregman_alpha": "inf", "bregman_top_k": 40}, 1.2),
]


def test_every_step_is_the_independent_references_decoding(llm) -> None:
    vocab = llm.llm_engine.model_config.get_vocab_size()
    assert vocab == 49152
    prompts = ["The capital of France is", "Once upon a time,", "def fibonacci(n):",
               "Water boils at"]
    outputs = llm.generate(prompts, [sampling(temperature=t, max_tokens=3, logprobs=-1,
                                              seed=i, extra_args=e)
                                     for i, (e, t) in enumerate(REQUESTS)], use_tqdm=False)
    prefixes, steps = [], []
    for out, (extra, temperature) in zip(outputs, REQUESTS, strict=True):
        tokens = list(out.outputs[0].token_ids)
        for t in range(len(tokens)):
            prefixes.append(({"prompt_token_ids": list(out.prompt_token_ids) + tokens[:t]},
                             temperature))
            steps.append((out.outputs[0].logprobs[t], extra))
    plain = llm.generate([prefix for prefix, _ in prefixes],
                         [sampling(temperature=t, max_tokens=1, logprobs=-1)
                          for _, t in prefixes], use_tqdm=False)
    sizes = []
    for (processed, extra), reference in zip(steps, plain, strict=True):
        alpha = extra["bregman_alpha"]
        alpha = math.inf if alpha == "inf" else float(alpha)
        lam = extra.get("bregman_lambda", 0.0)
        log_p = dense(reference.outputs[0].logprobs[0], vocab).numpy()[None]
        want = rs.decode(log_p, alpha, lam, extra.get("bregman_mode", "primal"),
                         top_k=extra.get("bregman_top_k"), k_max=extra.get("bregman_k_max"))
        got = dense(processed, vocab).numpy()
        kept = got > -9000.0  # (processed logprobs report tokens off the support at -9999)
        q = np.where(kept, np.exp(got), 0.0)
        compare(q[None], np.array([int(kept.sum())]), want, lam, rtol=1e-4, tie=1e-4,
                label=str(extra), log_p=log_p)
        sizes.append(int(want.k[0]))
    assert min(sizes) < 64 < max(sizes), sizes
