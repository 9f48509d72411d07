"""An asynchronous client for any OpenAI-compatible completions endpoint (vLLM's server, ours).

Everything the harness asks of an endpoint goes through `EndpointClient`:

* ``generate``: ``POST /v1/completions`` with the prompt as a list of token ids (so token
  boundaries are exact), the decoding configuration's fields, a per-request seed, and
  ``return_token_ids`` (vLLM) so that the generated token ids come back exactly;
* ``score``: the base model's log-probabilities of a continuation given a prompt, from one
  prefill-only request (``echo`` + ``logprobs`` + ``max_tokens = 0``, the legacy OpenAI way that
  vLLM implements; vLLM's ``prompt_logprobs`` answer is read as well);
* ``tokenize`` / ``detokenize``: vLLM's ``POST /tokenize`` and ``/detokenize`` (our server
  forwards them), or a local Hugging Face tokenizer (`LocalTokenizer`) for endpoints without them.

Requests run concurrently, so the server batches them: at most ``concurrency`` generation
requests, and besides them at most ``concurrency // 4`` (>= 1) short prefill-only scoring and
tokenizer requests on a semaphore of their own (behind one shared semaphore, a finished sample's
scoring request would queue behind every generation still waiting). Transient failures
(connection errors, timeouts, HTTP 408/429/5xx) are retried with exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

logger = logging.getLogger(__name__)

#: vLLM writes -inf log-probabilities (tokens outside the Bregman support, with
#: ``--logprobs-mode processed_logprobs``) as -9999 in JSON.
VLLM_NEG_INF = -9999.0
_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class EndpointError(RuntimeError):
    """The endpoint refused a request or answered something unusable."""


class Tokenizer(Protocol):
    """What the harness needs to turn text into token ids and back."""

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    async def detokenize(self, ids: Sequence[int]) -> str: ...


@dataclass
class Generation:
    """One sampled continuation."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    #: vLLM: the stop string or stop token id that ended the generation; None for EOS / length.
    stop_reason: str | int | None = None
    #: Per generated position, the number of finite entries of the returned top logprobs (the
    #: support size k* when the server runs with ``--logprobs-mode processed_logprobs``).
    support_sizes: list[int] | None = None


@dataclass
class EndpointClient:
    """OpenAI-compatible completions endpoint, e.g. ``http://127.0.0.1:8000/v1``.

    ``ours=True`` sends the Bregman fields at the top level of the body (our server's native
    form); otherwise they go inside ``vllm_xargs``, which both vLLM's server and ours accept.
    ``send_seeds=False`` leaves the per-request seeds out (for endpoints that refuse them);
    generations are then not reproducible.
    """

    base_url: str
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 8
    timeout: float = 600.0
    retries: int = 4
    ours: bool = False
    send_seeds: bool = True
    _client: httpx.AsyncClient | None = field(default=None, init=False, repr=False)
    _semaphore: asyncio.Semaphore | None = field(default=None, init=False, repr=False)
    _light: asyncio.Semaphore | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"

    @property
    def root_url(self) -> str:
        """The server root (``/tokenize`` lives there, not under ``/v1``)."""
        return self.base_url[: -len("/v1")]

    async def __aenter__(self) -> EndpointClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        light = max(1, self.concurrency // 4)
        limits = httpx.Limits(max_connections=self.concurrency + light + 2,
                              max_keepalive_connections=self.concurrency + light + 2)
        self._client = httpx.AsyncClient(headers=headers, timeout=self.timeout, limits=limits)
        self._semaphore = asyncio.Semaphore(self.concurrency)
        self._light = asyncio.Semaphore(light)
        if self.model is None:
            self.model = await self.first_model()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------------ transport

    async def _request(self, method: str, url: str, body: dict[str, Any] | None = None,
                       light: bool = False) -> dict[str, Any]:
        """One JSON request under the concurrency bound (``light``: the scoring / tokenizer
        one), retried on transient failures."""
        if self._client is None or self._semaphore is None or self._light is None:
            raise RuntimeError("use `async with EndpointClient(...)`")
        semaphore = self._light if light else self._semaphore
        delay = 0.5
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                async with semaphore:
                    response = await self._client.request(method, url, json=body)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                if last:
                    raise EndpointError(f"{method} {url} failed: {exc!r}") from exc
                logger.warning("%s %s failed (%r); retrying", method, url, exc)
            else:
                if response.status_code == 200:
                    return response.json()
                if response.status_code not in _RETRY_STATUS or last:
                    raise EndpointError(f"{method} {url} answered {response.status_code}: "
                                        f"{response.text[:500]}")
                logger.warning("%s %s answered %d; retrying", method, url,
                               response.status_code)
            # Jittered exponential backoff: concurrent retries do not arrive together.
            await asyncio.sleep(delay * (1 + random.random()))
            delay *= 2
        raise AssertionError("unreachable")

    async def first_model(self) -> str:
        """The first model the endpoint lists (used when no model name is given)."""
        data = await self._request("GET", f"{self.base_url}/models")
        models = data.get("data") or []
        if not models:
            raise EndpointError("the endpoint lists no model; pass --model")
        return str(models[0]["id"])

    async def completions(self, body: dict[str, Any], light: bool = False) -> dict[str, Any]:
        return await self._request("POST", f"{self.base_url}/completions",
                                   {"model": self.model, **body}, light=light)

    # ------------------------------------------------------------------ tokenizer

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        data = await self._request("POST", f"{self.root_url}/tokenize", {
            "model": self.model, "prompt": text, "add_special_tokens": add_special_tokens},
            light=True)
        return [int(t) for t in data["tokens"]]

    async def detokenize(self, ids: Sequence[int]) -> str:
        data = await self._request("POST", f"{self.root_url}/detokenize",
                                   {"model": self.model, "tokens": list(ids)}, light=True)
        return str(data["prompt"])

    # ------------------------------------------------------------------ generation and scoring

    def decoding_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Place a configuration's ``bregman_*`` fields where this endpoint reads them."""
        bregman = {k: v for k, v in fields.items() if k.startswith("bregman_")}
        other = {k: v for k, v in fields.items() if not k.startswith("bregman_")}
        if not bregman:
            return other
        if self.ours:
            return {**other, **bregman}
        return {**other, "vllm_xargs": bregman}

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        fields: dict[str, Any],
        stop: Sequence[str] | None = None,
        support_logprobs: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> Generation:
        """Sample one continuation of ``prompt_ids``.

        ``fields`` are the decoding configuration's request fields (`DecodingConfig`).
        ``support_logprobs = N`` also asks for the top-N logprobs per step and counts the finite
        ones (k* when the server runs with ``--logprobs-mode processed_logprobs`` and
        ``N >= k*``). The token ids come from ``return_token_ids``; an endpoint that ignores it
        has its text re-tokenized (``tokenizer``), which may shift token boundaries.
        """
        body: dict[str, Any] = {
            "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": temperature,
            "return_token_ids": True, **self.decoding_fields(fields)}
        if self.send_seeds:
            body["seed"] = seed
        if stop:
            body["stop"] = list(stop)
        if support_logprobs:
            # Token ids as keys: two tokens with the same text must not collide in the dict.
            body["logprobs"] = support_logprobs
            body["return_tokens_as_token_ids"] = True
        data = await self.completions(body)
        choice = data["choices"][0]
        text = choice.get("text") or ""
        ids = choice.get("token_ids")
        if ids is None:
            if tokenizer is None:
                raise EndpointError("the endpoint returned no token_ids; give a tokenizer")
            ids = await tokenizer.tokenize(text) if text else []
        sizes = None
        if support_logprobs:
            top = (choice.get("logprobs") or {}).get("top_logprobs") or []
            # The sampled token is added when it is not among the top N: cap the count at N.
            sizes = [min(finite_count(entry), support_logprobs) for entry in top][: len(ids)]
        return Generation([int(t) for t in ids], text, choice.get("finish_reason"),
                          choice.get("stop_reason"), sizes)

    async def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int],
                    ) -> list[float]:
        """log p_base(y_t | prompt, y_<t) for every continuation token (natural log).

        One prefill-only request over prompt + continuation, no decoding fields: the prompt
        log-probabilities come from the model's raw distribution (temperature 1, no truncation).
        """
        if not continuation_ids:
            return []
        ids = [*prompt_ids, *continuation_ids]
        data = await self.completions({
            "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 1.0},
            light=True)
        choice = data["choices"][0]
        values = _prompt_logprobs(choice, ids)
        tail = values[len(prompt_ids):]
        if len(tail) != len(continuation_ids) or any(v is None for v in tail):
            raise EndpointError(
                f"expected {len(continuation_ids)} continuation logprobs, got {len(tail)}")
        return [float(v) for v in tail]  # type: ignore[arg-type]


def finite_count(entry: Any) -> int:
    """Finite entries of one position's top logprobs (``{token: logprob}``)."""
    if not entry:
        return 0
    return sum(1 for v in entry.values()
               if v is not None and math.isfinite(v) and v > VLLM_NEG_INF / 2)


def _prompt_logprobs(choice: dict[str, Any], ids: Sequence[int]) -> list[float | None]:
    """Per prompt token, its log-probability (None for the first), from either answer form."""
    prompt_lp = choice.get("prompt_logprobs")
    if prompt_lp:  # vLLM: [None, {token_id: {"logprob": ...}}, ...]
        out: list[float | None] = []
        for position, entry in enumerate(prompt_lp[: len(ids)]):
            if entry is None:
                out.append(None)
                continue
            item = entry.get(str(ids[position]), entry.get(ids[position]))
            out.append(None if item is None else float(item["logprob"]))
        return out
    logprobs = choice.get("logprobs") or {}
    token_lp = logprobs.get("token_logprobs")
    if not token_lp:
        raise EndpointError("the endpoint returned no prompt logprobs (needs echo + logprobs)")
    # OpenAI echo: one entry per prompt token (the first is None) followed by generated ones.
    return [None if v is None else float(v) for v in token_lp[: len(ids)]]


class LocalTokenizer:
    """A Hugging Face tokenizer from a local model directory (for endpoints without
    ``/tokenize``); the same interface as `EndpointClient`'s tokenizer methods."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def detokenize(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))


async def gather_bounded(coroutines: Sequence[Any], progress: Any | None = None) -> list[Any]:
    """Await every coroutine (the client's semaphore bounds the concurrency), updating a tqdm
    bar as each finishes; results come back in the input order. On failure the others are
    cancelled."""
    async def run(index: int, coroutine: Any) -> tuple[int, Any]:
        result = await coroutine
        if progress is not None:
            progress.update(1)
        return index, result

    tasks = [asyncio.ensure_future(run(i, c)) for i, c in enumerate(coroutines)]
    results: list[Any] = [None] * len(tasks)
    try:
        for finished in asyncio.as_completed(tasks):
            index, value = await finished
            results[index] = value
    except BaseException:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        raise
    return results
