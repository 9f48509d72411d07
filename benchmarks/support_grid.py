#!/usr/bin/env python
"""Does a largest support size bind on the paper's grid? k* over the evaluation corpus.

The server holds every request to a largest support size (``--max-support``, 1024 unless told
otherwise). This measures whether that bound changes the decoding of the paper's own settings
(arXiv 2505.19371, Section 5: primal decoding, alpha 1.5 and 2, lambda 0.1 to 1e-4, temperature
0.3 to 1.5). Rows: the next-token distribution at every position of the first ``--passages``
passages of the evaluation corpus (``data/wikitext2/passages.jsonl``; the first ``--tokens``
tokens of each), under SmolLM2-135M-Instruct (vocabulary 49152; transformers, float32, on the
CPU: the model the evaluation serves), teacher-forced on the human text: p = softmax(logits / T),
decoded without any cap (`bregman_decode`, adaptive k*). Printed per grid point: rows, mean k*,
99th percentile, largest k*, and the rows whose k* exceeds the bound (count and share).

Usage::

    python benchmarks/support_grid.py [--passages 64] [--tokens 128] [--bound 1024]
        [--model models/smollm2-135m-instruct] [--json FILE]

Exit status 1 if the bound binds (some row's k* exceeds it) at any grid point.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ALPHAS = (1.5, 2.0)
LAMBDAS = (0.1, 0.01, 1e-3, 1e-4)
TEMPERATURES = (0.3, 0.7, 1.0, 1.5)


def passages(count: int) -> list[str]:
    from bregman_vllm.evaluation.corpus import CORPORA

    lines = CORPORA["wikitext2"].read_text().splitlines()
    return [json.loads(line)["text"] for line in lines[:count]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--passages", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--bound", type=int, default=1024)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bregman_vllm import bregman_decode

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    grid = [(alpha, lam, t) for alpha in ALPHAS for lam in LAMBDAS for t in TEMPERATURES]
    sizes: dict[tuple[float, float, float], list[torch.Tensor]] = {point: [] for point in grid}
    started = time.perf_counter()
    rows = 0
    for text in passages(args.passages):
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :args.tokens]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()  # [L, V]
        rows += logits.shape[0]
        for alpha, lam, temperature in grid:
            probs = torch.softmax(logits / temperature, dim=-1)
            sizes[(alpha, lam, temperature)].append(
                bregman_decode(probs, alpha=alpha, lam=lam).k)
    seconds = time.perf_counter() - started

    print(f"primal Bregman decoding, k* without a cap: {rows} rows ({args.passages} WikiText-2 "
          f"passages, first {args.tokens} tokens each), SmolLM2-135M-Instruct (V = "
          f"{logits.shape[-1]}), {seconds:.0f} s")
    header = (f"{'alpha':>5} {'lambda':>7} {'T':>4} | {'rows':>6} {'mean k*':>8} {'p99 k*':>7} "
              f"{'max k*':>7} | {'> ' + str(args.bound):>7} {'share':>7}")
    print(header)
    print("-" * len(header))
    table = []
    binds = False
    for alpha, lam, temperature in grid:
        k = torch.cat(sizes[(alpha, lam, temperature)]).double()
        above = int((k > args.bound).sum())
        binds |= above > 0
        entry = {"alpha": alpha, "lambda": lam, "temperature": temperature, "rows": len(k),
                 "mean": float(k.mean()), "p99": float(torch.quantile(k, 0.99)),
                 "max": int(k.max()), "above": above, "share": above / len(k)}
        table.append(entry)
        print(f"{alpha:>5g} {lam:>7g} {temperature:>4g} | {entry['rows']:>6} "
              f"{entry['mean']:>8.1f} {entry['p99']:>7.0f} {entry['max']:>7} | {above:>7} "
              f"{100 * entry['share']:>6.2f}%")
    worst = max(table, key=lambda entry: entry["max"])
    print(f"largest k*: {worst['max']} (alpha {worst['alpha']:g}, lambda {worst['lambda']:g}, "
          f"T {worst['temperature']:g}); the bound {args.bound} "
          f"{'binds' if binds else 'never binds'} on this grid")
    if args.json:
        args.json.write_text(json.dumps({"bound": args.bound, "rows": rows, "grid": table},
                                        indent=1))
    return 1 if binds else 0


if __name__ == "__main__":
    sys.exit(main())
