"""The math core of Bregman decoding (arXiv 2505.19371). Imports only torch (never the kernels:
`bregman_vllm.backend` chooses between them and the torch step here; the public calls are
`bregman_vllm.decode`).

Modules, in pipeline order:
    plan        per-row parameters validated and grouped by formula family (on the host, once
                per batch change)
    families    which formulas decode a row, what decodes it (the window or the search) and
                how wide its window is: the one place where special alphas are recognized
    candidates  the top entries of each row and the deficits R_k from the scores themselves
                (block maxima, block masses: no sort, no probability tensor)
    window      the fixed-shape k* search over a window of support sizes, with a certificate
    step        the torch decoding step (the hot path off CUDA): three passes over the batch,
                fixed ops on fixed shapes, at most one sync
    search      k* and the maps of the rows the window cannot certify: probes on the
                multiplier, exact gaps for the last sizes
    write       the one writer of decoded rows
    result      what a step returns, whichever backend ran it
The formulas they use:
    maps        the map of each family on a fixed support
    primal      T_alpha on a fixed support (eq. (4), Definition 4.1, Proposition 4.1)
    dual        T*_alpha on a fixed support (eq. (5), Theorem A.1, Algorithm 1)
    gaps        cost gaps G(k) of cost(k) (eq. (6)) that decide k* (Theorem 3.3)
    roots       the safeguarded Newton iteration of the maps
    numerics    log-space kernels
    generators  the generator protocol (phi, phi', phi'', (phi')^-1) and generic reference maps
"""
