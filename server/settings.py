"""Server configuration: one `ServerSettings` object built from environment and CLI flags.

Every field can be set from the environment with the ``BREGMAN_`` prefix (``BREGMAN_PORT=9000``,
``BREGMAN_API_KEY=...``, ``BREGMAN_DEFAULT_MODE=primal``); CLI flags (`bregman_server.cli`) win
over the environment because they are passed as init arguments, which pydantic-settings ranks
first. The middleware loaded by ``vllm serve --middleware ...`` reads the same variables.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bregman_vllm.params import (
    DEFAULT_ALPHA,
    DEFAULT_LAMBDA,
    MAX_SUPPORT_SIZE,
    BregmanParamError,
    BregmanParams,
    lifts_the_bound,
    parse_alpha,
)

KiB = 1024
MiB = 1024 * KiB
#: The largest support size a server admits unless told otherwise (``--max-support``): well
#: above the k* of the paper's grid (benchmarks/support_grid.py), and what TensorRT-LLM caps
#: its top-k at.
DEFAULT_MAX_SUPPORT = 1024


class ServerSettings(BaseSettings):
    """All settings of `bregman-serve` (env prefix ``BREGMAN_``)."""

    model_config = SettingsConfigDict(env_prefix="BREGMAN_", extra="ignore",
                                      validate_default=True)

    # --- where we listen -------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Interface to listen on (0.0.0.0 in containers).")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    log_level: Literal["critical", "error", "warning", "info", "debug", "notset"] = Field(
        "info", description="Log level of the server (notset: everything, as debug); as a "
        "flag also vLLM's (its --log-level; else vLLM's own: VLLM_LOGGING_LEVEL).")

    # --- what we serve ------------------------------------------------------------------------
    model: str | None = Field(None, description="Model that vLLM serves in this process.")

    # --- security and limits of client connections -----------------------------------------
    api_key: SecretStr | None = Field(
        None, description="If set, every route but /health needs 'Authorization: Bearer "
        "<api_key>' (the environment variable BREGMAN_API_KEY keeps it out of the process "
        "list).")
    max_body_bytes: int = Field(16 * MiB, ge=1, description="Largest request body (413 above).")
    max_header_bytes: int = Field(
        64 * KiB, ge=1024, description="Largest request head: request line and headers (431); "
        "vLLM's --h11-max-incomplete-event-size, when given, wins.")
    max_connections: int = Field(
        1024, ge=1, description="Open client connections (a soft cap). When all are open, a "
        "new one is let in and closes the connection that has waited longest for its client to "
        "send a request (one that has waited 0.1 s at least while there is headroom beyond "
        "the cap: half the cap, at least 16); with every other connection being served, it is "
        "answered 503 and closed.")
    header_timeout: float = Field(
        10.0, gt=0, description="Seconds a client may take to send a request head (408).")
    body_timeout: float = Field(
        30.0, gt=0, description="Longest silence while a client sends a request body (408).")
    body_deadline: float = Field(
        60.0, gt=0, description="Longest time a client may take to send a whole request body "
        "(408), however steadily it trickles.")
    send_timeout: float = Field(
        60.0, gt=0, description="Longest time a client may leave a response unread before the "
        "connection is closed (slow readers).")
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="Idle keep-alive connections are closed after this many seconds.")
    graceful_timeout: float = Field(
        10.0, ge=0, description="On SIGTERM, seconds to let open requests finish; then streams "
        "end with an error event and [DONE], other requests get 503.")

    # --- server-wide Bregman defaults ----------------------------------------------------------
    default_mode: Literal["primal", "dual", "off"] = Field(
        "off", description='Bregman mode of requests that do not say; "off" leaves them alone.')
    default_alpha: float | str = Field(DEFAULT_ALPHA, description="Default bregman_alpha.")
    default_lambda: float = Field(DEFAULT_LAMBDA, ge=0, description="Default bregman_lambda.")
    default_top_k: int | None = Field(None, ge=1, description="Default bregman_top_k.")
    default_k_max: int | None = Field(None, ge=1, description="Default bregman_k_max.")
    max_support: int | None = Field(
        DEFAULT_MAX_SUPPORT, ge=1, le=MAX_SUPPORT_SIZE, description="Largest support size a "
        "request may decode to: a bregman_top_k or bregman_k_max above it is refused (400), and "
        "a request without bregman_k_max decodes with k_max = this. Bounds what one request's "
        "rows cost every engine step (rows with k* past the fixed window take the exact path, "
        "whose cost grows with k*: docs/server.md); 'none' lifts the bound.")

    # --- the engine in this process -----------------------------------------------------------
    engine_exit_grace: float = Field(
        2.0, ge=0, description="If the vLLM engine dies: seconds of 503s before the process "
        "exits with status 3.")
    cpu_kvcache_space_gib: int = Field(
        4, ge=1, description="VLLM_CPU_KVCACHE_SPACE for CPU builds of vLLM when it is unset.")

    @field_validator("max_support", mode="before")
    @classmethod
    def _none_lifts_the_bound(cls, value: Any) -> Any:
        return None if lifts_the_bound(value) else value

    @field_validator("default_alpha")
    @classmethod
    def _alpha_number(cls, value: float | str) -> float:
        try:
            return parse_alpha(value)
        except BregmanParamError as error:
            raise ValueError(error.reason) from None

    @model_validator(mode="after")
    def _check_defaults(self) -> ServerSettings:
        # Same rules as a request: a deployment cannot start with defaults every request refuses.
        try:
            self.bregman_defaults().within(self.max_support)
        except BregmanParamError as error:
            raise ValueError(f"invalid server default {error}") from None
        return self

    def api_key_value(self) -> str | None:
        """Our API key in clear (None when unset or empty)."""
        return _secret(self.api_key)

    def bregman_defaults(self) -> BregmanParams:
        """The server-wide defaults as the parameter model (mode "off" leaves requests alone)."""
        return BregmanParams(
            mode=self.default_mode,
            alpha=float(self.default_alpha),
            lam=self.default_lambda,
            top_k=self.default_top_k,
            k_max=self.default_k_max,
        )

    def default_request_values(self) -> dict[str, Any]:
        """The defaults as JSON values, for the OpenAPI schema ("inf" for infinite alpha)."""
        alpha = float(self.default_alpha)
        held = self.bregman_defaults().within(self.max_support)  # (k_max: the limit, if unset)
        return {
            "bregman_mode": self.default_mode,
            "bregman_alpha": alpha if math.isfinite(alpha) else ("inf" if alpha > 0 else "-inf"),
            "bregman_lambda": self.default_lambda,
            "bregman_top_k": held.top_k,
            "bregman_k_max": held.k_max,
        }


def _secret(value: SecretStr | None) -> str | None:
    return (value.get_secret_value() or None) if value is not None else None
