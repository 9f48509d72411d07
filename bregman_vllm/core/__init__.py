"""The math core of Bregman decoding (arXiv 2505.19371). Imports only torch.

Modules, in pipeline order:
    plan        per-row parameters validated and grouped by formula family (on the host, once
                per batch change)
    families    which formulas decode a row: the one place where special alphas are recognized
    candidates  the top entries of each row and the deficits R_k from the scores themselves
                (block maxima, block masses: no sort, no probability tensor)
    window      the fixed-shape k* search over a window of support sizes, with a certificate
    rows        per-row parameters as device columns indexed by slot (the kernels' input)
    step        the decoding step (the hot path): three passes over the batch, fixed ops on
                fixed shapes, at most one sync; on CUDA the Triton kernels of
                `bregman_vllm.kernels` (``BREGMAN_BACKEND``)
    exact       value-dependent rounds for the rows the window cannot certify
    write       the one writer of decoded rows
    decode      the public functions
The formulas they use:
    primal      T_alpha on a fixed support (eq. (4), Definition 4.1, Proposition 4.1)
    dual        T*_alpha on a fixed support (eq. (5), Theorem A.1, Algorithm 1)
    gaps        cost gaps G(k) of cost(k) (eq. (6)) that decide k* (Theorem 3.3)
    roots       the safeguarded Newton iteration of the exact path
    numerics    log-space kernels
    generators  the generator protocol (phi, phi', phi'', (phi')^-1) and generic reference maps
"""

from .decode import BregmanOutput, bregman_decode, bregman_decode_logits, renormalize

__all__ = ["BregmanOutput", "bregman_decode", "bregman_decode_logits", "renormalize"]
