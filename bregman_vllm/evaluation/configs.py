"""Decoding configurations: what one row of a results table was sampled with.

A configuration is (mode, alpha, lambda | top_k, temperature), or a plain top-k baseline, written
on the command line as a small spec string (`parse_config`)::

    primal:1.5:0.01            adaptive primal alpha-decoding, lambda = 0.01 (k* <= k_max)
    dual:1.5:0.01:T=0.7        adaptive dual decoding at temperature 0.7
    primal:2:k=10              generalized top-k: fixed k = 10, primal alpha = 2 renormalization
    primal:1.5:0.01:kmax=none  no cap on k*
    topk:10                    plain top-k sampling (vLLM's own top_k; = primal alpha = 1, k = 10)
    sample                     plain sampling from softmax(logits / T)
    ...@open / ...@gsm8k       restrict the configuration to some tasks ("@open+gsm8k")

The paper's (arXiv 2505.19371, Section 5.1) "full" evaluation is the adaptive form (with
k_max = 50); its "partial" evaluation is the fixed-k form on a grid of k; its matched top-k
baseline is ``topk:round(mean k*)`` of an adaptive configuration (`matched_baseline`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..params import BregmanParamError, BregmanParams, parse_alpha

#: The paper's cap on k* in its full (adaptive) evaluation.
DEFAULT_K_MAX = 50
TASKS: tuple[str, ...] = ("open", "gsm8k")


@dataclass(frozen=True)
class DecodingConfig:
    """One decoding configuration.

    kind: "bregman" (our processor), "topk" (vLLM's top_k) or "sample" (no truncation).
    For "bregman": ``top_k`` set means fixed-k generalized top-k, otherwise adaptive k* with
    price ``lam`` and cap ``k_max``. ``matched_to`` marks a top-k configuration that was added
    as a matched baseline (it names the adaptive configuration that first asked for it; a
    result's per-task ``matched`` mapping lists every pairing).
    """

    kind: str
    temperature: float = 1.0
    mode: str | None = None
    alpha: float | None = None
    lam: float | None = None
    top_k: int | None = None
    k_max: int | None = None
    tasks: tuple[str, ...] | None = None
    matched_to: str | None = None

    @property
    def adaptive(self) -> bool:
        return self.kind == "bregman" and self.top_k is None

    @property
    def label(self) -> str:
        """A short unique name, also a valid spec (``parse_config(c.label) == c`` up to tasks)."""
        t = f"T={_num(self.temperature)}"
        if self.kind == "sample":
            return f"sample:{t}"
        if self.kind == "topk":
            return f"topk:{self.top_k}:{t}"
        head = f"{self.mode}:{_alpha(self.alpha)}"
        if self.top_k is not None:
            return f"{head}:k={self.top_k}:{t}"
        cap = "none" if self.k_max is None else str(self.k_max)
        return f"{head}:{_num(self.lam)}:kmax={cap}:{t}"

    def runs_on(self, task: str) -> bool:
        return self.tasks is None or task in self.tasks

    def request_fields(self) -> dict[str, Any]:
        """The request fields besides prompt / temperature / seed (``bregman_*`` keys are placed
        by the client: top level for our server, ``vllm_xargs`` otherwise)."""
        if self.kind == "sample":
            return {}
        if self.kind == "topk":
            return {"top_k": self.top_k}
        params = BregmanParams(mode=self.mode or "primal", alpha=float(self.alpha),
                               lam=float(self.lam or 0.0), top_k=self.top_k, k_max=self.k_max)
        return params.to_request()

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["label"] = self.label
        out["adaptive"] = self.adaptive
        if self.alpha is not None and math.isinf(self.alpha):
            out["alpha"] = "inf" if self.alpha > 0 else "-inf"
        out["tasks"] = list(self.tasks) if self.tasks is not None else None
        return out


def _num(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"


def _alpha(value: float | None) -> str:
    if value is not None and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return _num(value)


def parse_config(spec: str, *, default_temperature: float = 1.0,
                 default_k_max: int | None = DEFAULT_K_MAX) -> DecodingConfig:
    """Parse a configuration spec (see the module docstring). Raises ValueError."""
    text = spec.strip()
    tasks: tuple[str, ...] | None = None
    if "@" in text:
        text, _, where = text.partition("@")
        tasks = tuple(t.strip() for t in where.split("+") if t.strip())
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            raise ValueError(f"{spec!r}: unknown task(s) {unknown}; use {'+'.join(TASKS)}")
    parts = [p.strip() for p in text.split(":") if p.strip()]
    if not parts:
        raise ValueError("empty configuration spec")
    kind = parts[0].lower()
    options: dict[str, str] = {}
    positional: list[str] = []
    for part in parts[1:]:
        if "=" in part:
            key, _, value = part.partition("=")
            options[key.strip().lower().replace("_", "")] = value.strip()
        else:
            positional.append(part)
    temperature = float(options.pop("t", default_temperature))
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"{spec!r}: temperature must be a positive number")
    if kind == "sample":
        config = DecodingConfig("sample", temperature, tasks=tasks)
    elif kind == "topk":
        k = int(options.pop("k", positional.pop(0) if positional else "0"))
        if k < 1:
            raise ValueError(f"{spec!r}: topk needs k >= 1, e.g. topk:10")
        config = DecodingConfig("topk", temperature, top_k=k, tasks=tasks)
    elif kind in ("primal", "dual"):
        if not positional:
            raise ValueError(f"{spec!r}: give alpha, e.g. {kind}:1.5:0.01 or {kind}:2:k=10")
        alpha = parse_alpha(positional.pop(0), "alpha")
        top_k = int(options.pop("k")) if "k" in options else None
        lam: float | None = None
        if positional:
            lam = float(positional.pop(0))
        if top_k is None and lam is None:
            raise ValueError(f"{spec!r}: give lambda (adaptive) or k=N (fixed k)")
        cap_text = options.pop("kmax", None)
        if cap_text is None:
            k_max = default_k_max if top_k is None else None
        else:
            k_max = None if cap_text.lower() in ("none", "0", "") else int(cap_text)
        config = DecodingConfig("bregman", temperature, mode=kind, alpha=alpha,
                                lam=0.0 if top_k is not None else lam, top_k=top_k,
                                k_max=k_max, tasks=tasks)
        try:
            config.request_fields()  # the shared parameter model's range checks
        except BregmanParamError as exc:
            raise ValueError(f"{spec!r}: {exc}") from None
    else:
        raise ValueError(f"{spec!r}: unknown kind {kind!r} (primal, dual, topk, sample)")
    if positional or options:
        raise ValueError(f"{spec!r}: unexpected {positional + list(options)}")
    return config


def grid_configs(ks: list[int], alphas: list[float], temperature: float = 1.0,
                 tasks: tuple[str, ...] | None = ("open",)) -> list[DecodingConfig]:
    """The paper's partial evaluation: for each k, top-k and primal alpha-renormalized top-k
    (generalized top-k, Definition 2.2 of arXiv 2505.19371) for each alpha (alpha = 1 is top-k
    itself)."""
    configs: list[DecodingConfig] = []
    for k in ks:
        configs.append(DecodingConfig("topk", temperature, top_k=k, tasks=tasks))
        for alpha in alphas:
            if alpha == 1.0:
                continue
            configs.append(DecodingConfig("bregman", temperature, mode="primal", alpha=alpha,
                                          lam=0.0, top_k=k, tasks=tasks))
    return configs


def matched_baseline(config: DecodingConfig, k: int, task: str) -> DecodingConfig:
    """Top-k with k = round(mean k*) of ``config`` on ``task``, at the same temperature."""
    return replace(DecodingConfig("topk", config.temperature, top_k=k, tasks=(task,)),
                   matched_to=config.label)
