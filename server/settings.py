"""Server configuration: one `ServerSettings` object built from environment and CLI flags.

Every field can be set from the environment with the ``BREGMAN_`` prefix (``BREGMAN_PORT=9000``,
``BREGMAN_API_KEY=...``, ``BREGMAN_DEFAULT_MODE=primal``); CLI flags (`server.cli`) win over the
environment because they are passed as init arguments, which pydantic-settings ranks first.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from bregman_vllm.params import (
    DEFAULT_ALPHA,
    DEFAULT_LAMBDA,
    BregmanParamError,
    BregmanParams,
    parse_alpha,
)

MiB = 1024 * 1024


class ServerSettings(BaseSettings):
    """All settings of `bregman-serve` (env prefix ``BREGMAN_``)."""

    model_config = SettingsConfigDict(env_prefix="BREGMAN_", extra="ignore",
                                      validate_default=True)

    # --- where we listen -------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Interface to listen on (0.0.0.0 in containers).")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level of the server (vLLM has its own: VLLM_LOGGING_LEVEL).")
    access_log: bool = Field(False, description="Uvicorn access log (one line per request).")

    # --- what we forward to ------------------------------------------------------------------
    # NoDecode: "http://a:8000,http://b:8000" or whitespace-separated, not JSON, in the env.
    upstream: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Upstream vLLM server URLs (upstream mode; in the environment separated by "
        "commas or spaces). Empty: embedded mode.")
    upstream_api_key: SecretStr | None = Field(
        None, description="Bearer key sent to the upstream vLLM servers (their --api-key).")
    model: str | None = Field(None, description="Model for the embedded vLLM child.")

    # --- security ----------------------------------------------------------------------------
    api_key: SecretStr | None = Field(
        None, description="If set, /v1/* requests need 'Authorization: Bearer <api_key>'.")
    max_body_bytes: int = Field(16 * MiB, ge=1, description="Largest accepted request body.")

    # --- upstream client ---------------------------------------------------------------------
    connect_timeout: float = Field(5.0, gt=0, description="Upstream connect timeout, seconds.")
    read_timeout: float = Field(
        600.0, gt=0,
        description="Upstream read timeout (longest silence between two bytes), seconds.")
    max_connections: int = Field(1024, ge=1, description="Pooled connections per upstream.")
    health_interval: float = Field(2.0, gt=0, description="Seconds between upstream checks.")
    health_timeout: float = Field(5.0, gt=0, description="Timeout of one health check.")
    graceful_timeout: float = Field(
        10.0, ge=0, description="On shutdown, seconds to let open requests finish.")

    # --- server-wide Bregman defaults ----------------------------------------------------------
    default_mode: Literal["primal", "dual", "off"] = Field(
        "off", description='Bregman mode of requests that do not say; "off" leaves them alone.')
    default_alpha: float | str = Field(DEFAULT_ALPHA, description="Default bregman_alpha.")
    default_lambda: float = Field(DEFAULT_LAMBDA, ge=0, description="Default bregman_lambda.")
    default_top_k: int | None = Field(None, ge=1, description="Default bregman_top_k.")
    default_k_max: int | None = Field(None, ge=1, description="Default bregman_k_max.")

    # --- embedded vLLM child -------------------------------------------------------------------
    vllm_host: str = Field("127.0.0.1", description="Loopback interface of the vLLM child.")
    vllm_port: int = Field(0, ge=0, le=65535, description="vLLM child port (0: a free port).")
    vllm_start_timeout: float = Field(
        900.0, gt=0, description="Seconds to wait for the vLLM child to become healthy.")
    vllm_stop_timeout: float = Field(
        20.0, gt=0, description="Seconds between SIGTERM and SIGKILL when stopping the child.")
    child_exit_grace: float = Field(
        5.0, ge=0,
        description="After the vLLM child dies: seconds /health reports 503 before we exit(3).")
    cpu_kvcache_space_gib: int = Field(
        4, ge=1, description="VLLM_CPU_KVCACHE_SPACE given to a CPU child when it is unset.")

    @field_validator("upstream", mode="before")
    @classmethod
    def _split_upstreams(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            value = [part for part in re.split(r"[\s,]+", value) if part]
        return value

    @field_validator("upstream")
    @classmethod
    def _check_upstreams(cls, value: list[str]) -> list[str]:
        cleaned = []
        for url in value:
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(f"upstream URL must start with http:// or https://, got {url!r}")
            cleaned.append(url.rstrip("/").removesuffix("/v1"))
        return cleaned

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
            self.bregman_defaults().validated()
        except BregmanParamError as error:
            raise ValueError(f"invalid server default {error}") from None
        return self

    def upstream_api_key_value(self) -> str | None:
        """The upstream key in clear (or None), for the Authorization header we send."""
        if self.upstream_api_key is None:
            return None
        return self.upstream_api_key.get_secret_value() or None

    @property
    def embedded(self) -> bool:
        """Embedded mode: no upstream given, we start vLLM ourselves."""
        return not self.upstream

    def bregman_defaults(self) -> BregmanParams:
        """The server-wide defaults as the parameter model (mode "off" leaves requests alone)."""
        return BregmanParams(
            mode=self.default_mode,
            alpha=float(self.default_alpha),
            lam=self.default_lambda,
            top_k=self.default_top_k,
            k_max=self.default_k_max,
        ).validated()

    def default_request_values(self) -> dict[str, Any]:
        """The defaults as JSON values, for the OpenAPI schema ("inf" for infinite alpha)."""
        alpha = float(self.default_alpha)
        return {
            "bregman_mode": self.default_mode,
            "bregman_alpha": alpha if math.isfinite(alpha) else ("inf" if alpha > 0 else "-inf"),
            "bregman_lambda": self.default_lambda,
            "bregman_top_k": self.default_top_k,
            "bregman_k_max": self.default_k_max,
        }
