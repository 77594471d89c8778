"""The gateway's own Prometheus series (its /metrics); the server's series stay on Triton's metrics port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "openai_gateway_requests",
            "Requests answered by the gateway, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "openai_gateway_request_duration_seconds",
            "Arrival to the last byte, by endpoint",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "openai_gateway_time_to_first_token_seconds",
            "Arrival to the first generated text sent",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "openai_gateway_requests_in_flight", "Requests between arrival and their last byte", registry=self.registry
        )
        self.cancelled = Counter(
            "openai_gateway_client_disconnects",
            "Requests cancelled because the client went away",
            registry=self.registry,
        )

    def finished(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
