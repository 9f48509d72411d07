"""The math core of Bregman decoding. Imports only torch.

Modules, in pipeline order:
    numerics  log-space kernels (the Bregman alpha kernel K_alpha, stable softplus/log1mexp)
    primal    T_alpha on a fixed support (eq. ren, Proposition alpha-special-cases)
    dual      T*_alpha on a fixed support (eq. ren-dual, Algorithm alg:dual-renormalization)
    gaps      cost gaps G(k) that decide k* (Theorem convex_cost)
    decode    candidates, the k* search and the public functions
    generators  the generator protocol (phi, phi', phi'', (phi')^-1) and generic reference maps
"""

from .decode import BregmanOutput, bregman_decode, bregman_decode_logits, renormalize

__all__ = ["BregmanOutput", "bregman_decode", "bregman_decode_logits", "renormalize"]
