"""lm-evaluation-harness against `bregman-serve`: the recipe of docs/evaluation.md, run for real.

One server process (`tests/test_server_support.ServerProcess`, the same helper as every other
live-server test) serves the tiny model on loopback; the real ``lm_eval`` command line (pinned
in requirements/dev.txt) runs the local task ``data/lm_eval/gsm8k_local.yaml`` (the vendored
GSM8K lines, no hub download: the test sets HF_DATASETS_OFFLINE / HF_HUB_OFFLINE) on 3
problems with 32 new tokens:

Each Bregman run keeps one token per step (``bregman_k_max=1`` or ``bregman_top_k=1``) at
temperature 1 and must give exactly lm-eval's greedy (temperature 0) answers, which shows that
the fields reach the sampler and decode as asked (plain sampling at T = 1 from the tiny model,
whose top token has ~10 % of the mass, would not):

* ``local-completions`` with the Bregman fields in ``--gen_kwargs`` (finite alpha, adaptive);
* ``local-chat-completions`` with ``bregman_top_k=1``;
* ``bregman_alpha='inf'`` (quoted: lm-eval sends the string "inf") and ``bregman_alpha=inf``,
  which lm-eval turns into a float and sends as the JSON constant ``Infinity``, which the
  server accepts for ``bregman_alpha``.

About 2.5 minutes in all (server start ~30 s, each of the 6 lm_eval runs ~15-25 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_server_support import ROOT, ServerProcess, require_tiny_model, shut_down

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

MODEL = "models/tiny-llama"
TASK = "gsm8k_local"
# The tiny model on CPU: no torch.compile (minutes on a fresh machine), no chunked prefill
# (lm-eval sends a seed with every request, and vLLM 0.32 on CPU crashes when a seeded prompt is
# prefilled in chunks), a batch budget that holds a whole 8-shot prompt.
ENGINE_ARGS = ["--enforce-eager", "--max-model-len", "2048", "--no-enable-chunked-prefill",
               "--max-num-batched-tokens", "2048", "--max-num-seqs", "8"]
LM_EVAL = Path(sys.executable).with_name("lm_eval")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_tiny_model()
    live = ServerProcess(["--model", MODEL, *ENGINE_ARGS],
                         tmp_path_factory.mktemp("lm-eval-server") / "server.log")
    try:
        live.start().wait_healthy(timeout=300)
        yield live
    finally:
        shut_down(live)


def lm_eval(tmp_path: Path, model: str, model_args: dict[str, Any], gen_kwargs: str,
            *extra: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the ``lm_eval`` command line from the repository root; return its results JSON and
    its logged samples."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "lm-eval-out"
    command = [str(LM_EVAL), "--model", model,
               "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
               "--include_path", "data/lm_eval", "--tasks", TASK, "--limit", "3",
               "--gen_kwargs", gen_kwargs, "--output_path", str(out), "--log_samples", *extra]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, f"lm_eval failed:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-6000:]}"
    results = sorted(out.rglob("results_*.json"))
    samples = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    assert len(results) == 1 and len(samples) == 1, list(out.rglob("*"))
    rows = [json.loads(line) for line in samples[0].read_text().splitlines() if line.strip()]
    # One row per (problem, answer filter); the generations are those of the problems.
    rows = [row for row in rows if row["filter"] == "strict-match"]
    return json.loads(results[0].read_text()), rows


def completions_args(server: ServerProcess) -> dict[str, Any]:
    # tokenizer=: lm-eval asks the server for /tokenizer_info, which it does not serve.
    return {"model": MODEL, "base_url": f"{server.url}/v1/completions", "tokenizer": MODEL,
            "tokenized_requests": False, "num_concurrent": 3, "max_retries": 1}


def responses(rows: list[dict[str, Any]]) -> list[str]:
    ordered = sorted(rows, key=lambda row: row["doc_id"])
    return [row["resps"][0][0] for row in ordered]


@pytest.fixture(scope="module")
def greedy(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The oracle of the completions runs: lm-eval's greedy (temperature 0) answers. A run
    whose Bregman fields keep one token (a cap or a top-k of 1) at temperature 1 must give
    exactly these: the fields reached the sampler and decoded as asked (plain sampling at T = 1
    from the tiny model, whose top token has ~10 % of the mass, would not)."""
    _, rows = lm_eval(tmp_path_factory.mktemp("greedy"), "local-completions",
                      completions_args(server), "temperature=0.0,max_gen_toks=32")
    answers = responses(rows)
    assert len(answers) == 3 and any(answers)
    return answers


def test_local_completions_with_bregman_gen_kwargs(server: ServerProcess, tmp_path: Path,
                                                   greedy: list[str]) -> None:
    """Finite alpha, adaptive k* capped at 1 by bregman_k_max: the greedy answers."""
    results, rows = lm_eval(
        tmp_path, "local-completions", completions_args(server),
        "bregman_alpha=1.5,bregman_lambda=0.01,bregman_k_max=1,temperature=1.0,"
        "max_gen_toks=32")
    scores = results["results"][TASK]
    for name in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert 0.0 <= scores[name] <= 1.0
    assert results["n-samples"][TASK]["effective"] == 3
    generation = results["configs"][TASK]["generation_kwargs"]
    assert generation["bregman_alpha"] == 1.5 and generation["temperature"] == 1.0
    assert len(rows) == 3
    assert responses(rows) == greedy
    # The prompt is the 8-shot chain of thought built from the vendored exemplars.
    prompt = rows[0]["arguments"]["gen_args_0"]["arg_0"]
    assert prompt.count("Question:") == 9 and "#### 72" in prompt


def test_local_chat_completions_top1_equals_greedy(server: ServerProcess,
                                                   tmp_path: Path) -> None:
    args = {"model": MODEL, "base_url": f"{server.url}/v1/chat/completions",
            "num_concurrent": 1, "max_retries": 1}
    chat = ("--apply_chat_template",)
    _, top1 = lm_eval(tmp_path / "top1", "local-chat-completions", args,
                      "bregman_top_k=1,bregman_alpha=1.5,temperature=1.0,max_gen_toks=24",
                      *chat)
    _, greedy = lm_eval(tmp_path / "greedy", "local-chat-completions", args,
                        "temperature=0.0,max_gen_toks=24", *chat)
    assert len(top1) == len(greedy) == 3
    assert responses(top1) == responses(greedy)
    assert any(responses(greedy))


def test_local_completions_alpha_inf_as_a_quoted_string(server: ServerProcess, tmp_path: Path,
                                                        greedy: list[str]) -> None:
    """``bregman_alpha='inf'``: lm-eval keeps a quoted value as a string, which every server
    version accepts (water-filling over the top 1: the greedy answers)."""
    results, rows = lm_eval(
        tmp_path, "local-completions", completions_args(server),
        "bregman_alpha='inf',bregman_top_k=1,temperature=1.0,max_gen_toks=32")
    assert results["configs"][TASK]["generation_kwargs"]["bregman_alpha"] == "inf"
    assert len(rows) == 3 and responses(rows) == greedy


def _server_accepts_json_infinity(server: ServerProcess) -> bool:
    # json.dumps writes float("inf") as Infinity, as lm-eval's HTTP client does.
    body = json.dumps({"model": MODEL, "prompt": "To be", "max_tokens": 2, "temperature": 1.0,
                       "bregman_alpha": float("inf"), "bregman_top_k": 4})
    assert "Infinity" in body
    response = httpx.post(f"{server.url}/v1/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=60)
    return response.status_code == 200


def test_local_completions_alpha_inf(server: ServerProcess, tmp_path: Path,
                                     greedy: list[str]) -> None:
    """``bregman_alpha=inf`` (sent as JSON ``Infinity``) over the top 1: the greedy answers."""
    assert _server_accepts_json_infinity(server), "JSON Infinity refused by the server"
    results, rows = lm_eval(
        tmp_path, "local-completions", completions_args(server),
        "bregman_alpha=inf,bregman_top_k=1,temperature=1.0,max_gen_toks=32")
    assert results["configs"][TASK]["generation_kwargs"]["bregman_alpha"] == float("inf")
    assert len(rows) == 3 and responses(rows) == greedy
