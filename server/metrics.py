"""Prometheus metrics of the server, in a registry of its own (served at GET /metrics).

Label values are bounded: ``endpoint`` is a route template (or "passthrough"), ``mode`` one of
primal / dual / off / invalid / none, ``upstream`` one of the configured upstream URLs.
vLLM's own engine metrics stay on the vLLM server (``vllm:*``); scrape both.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Proxy overhead is sub-millisecond and generations run for seconds: cover both.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)


class Metrics:
    """The server's counters, histograms and gauges."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "bregman_server_requests", "Requests answered, by endpoint, Bregman mode and status.",
            ["endpoint", "mode", "status"], registry=r)
        self.latency = Histogram(
            "bregman_server_request_duration_seconds",
            "Time from request to the last byte of the response (end of stream for SSE).",
            ["endpoint", "mode"], buckets=_LATENCY_BUCKETS, registry=r)
        self.first_byte = Histogram(
            "bregman_server_time_to_first_byte_seconds",
            "Time from request to the first response byte from the upstream.",
            ["endpoint", "mode"], buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge(
            "bregman_server_requests_in_flight", "Requests being proxied now.", ["endpoint"],
            registry=r)
        self.upstream_errors = Counter(
            "bregman_server_upstream_errors",
            "Upstream failures: connect, timeout, read (mid-stream), unavailable.",
            ["upstream", "kind"], registry=r)
        self.upstream_healthy = Gauge(
            "bregman_server_upstream_healthy", "1 if the upstream's /health answered 200.",
            ["upstream"], registry=r)
        self.client_disconnects = Counter(
            "bregman_server_client_disconnects",
            "Requests whose client went away before the response ended (upstream aborted), "
            "by response kind (stream / buffered).",
            ["kind"], registry=r)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
