"""A small demonstration of the math core: decode one Zipf-like distribution several ways.

    python -m bregman_vllm.demo
"""

from __future__ import annotations

import torch

from . import bregman_decode


def main() -> None:
    vocab = 20
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    p = ranks**-1.1 / (ranks**-1.1).sum()
    print("p (Zipf, exponent 1.1, V = 20):")
    print("  " + " ".join(f"{v:.3f}" for v in p[:10]) + " ...")
    print(f"\n{'decoder':<42} {'k*':>3}  decoded distribution (first 10 entries)")
    configs = [
        ("top-k: primal alpha=1, lambda=0.02", dict(alpha=1.0, lam=0.02)),
        ("primal alpha=1.5, lambda=0.02", dict(alpha=1.5, lam=0.02)),
        ("primal alpha=2, lambda=0.02", dict(alpha=2.0, lam=0.02)),
        ("primal alpha=3, lambda=0.02", dict(alpha=3.0, lam=0.02)),
        ("dual alpha=3, lambda=0.02", dict(alpha=3.0, lam=0.02, mode="dual")),
        ("primal alpha=1.5, lambda=0.002", dict(alpha=1.5, lam=0.002)),
        ("fixed top_k=5, alpha=0.25", dict(alpha=0.25, lam=0.0, top_k=5)),
        ("fixed top_k=5, alpha=inf (water-filling)", dict(alpha=float("inf"), lam=0.0, top_k=5)),
    ]
    for name, kwargs in configs:
        out = bregman_decode(p, **kwargs)
        values = " ".join(f"{v:.3f}" for v in out.probs[:10])
        print(f"{name:<42} {int(out.k):>3}  {values}")


if __name__ == "__main__":
    main()
