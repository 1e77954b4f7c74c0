"""Prometheus metrics of the verifier (served as text at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class VerifierMetrics:
    def __init__(self) -> None:
        # One registry per app, so several apps (tests) never share counters.
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "verifier_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.active_sessions = Gauge(
            "verifier_active_sessions", "sessions holding a KV sequence", registry=self.registry
        )
        self.drafted_tokens = Counter(
            "verifier_drafted_tokens", "draft tokens received by /verify", registry=self.registry
        )
        self.accepted_tokens = Counter(
            "verifier_accepted_tokens", "draft tokens accepted by /verify", registry=self.registry
        )
        self.decoded_tokens = Counter(
            "verifier_decoded_tokens", "tokens evaluated by llama_decode", registry=self.registry
        )
        self.verify_decode_seconds = Histogram(
            "verifier_verify_decode_seconds",
            "llama_decode time of one verify round",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
            registry=self.registry,
        )
