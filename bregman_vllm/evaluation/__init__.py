"""Evaluation harness and figures for Bregman decoding (arXiv 2505.19371, Section 5, App. H).

    bregman-eval run --endpoint http://127.0.0.1:8000/v1 ...   (see `bregman_vllm.evaluation.cli`)
    bregman-eval plot --result out/eval/results.json

Modules: `metrics` (pure metric functions), `configs` (decoding configurations), `client`
(async OpenAI-compatible client), `tasks` (open-ended generation, GSM8K), `kstar` (k* per
step), `runner` (a run), `report` (JSON and markdown), `figures` (PNG), `cli`.
"""
