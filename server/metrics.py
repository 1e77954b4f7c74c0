"""Prometheus metrics of the verifier (served as text at GET /metrics)."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server.paths import route_path


class VerifierMetrics:
    def __init__(self, max_sessions: int = 8, max_draft: int = 16) -> None:
        # One registry per app, so several apps (tests) never share counters.
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "verifier_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.active_sessions = Gauge(
            "verifier_active_sessions", "sessions holding a KV sequence", registry=r
        )
        self.evicted_sessions = Counter(
            "verifier_evicted_sessions",
            "sessions evicted (least recently used) to make room for a new one",
            registry=r,
        )
        self.prompt_tokens_evaluated = Counter(
            "verifier_prompt_tokens_evaluated",
            "prompt tokens evaluated by /prefill (the last one of each prompt is evaluated "
            "with the session's first round)",
            registry=r,
        )
        self.prompt_tokens_reused = Counter(
            "verifier_prompt_tokens_reused",
            "prompt tokens taken from a cached prefix instead of being evaluated",
            registry=r,
        )
        self.joined_rounds = Counter(
            "verifier_joined_rounds",
            "/verify requests that were a duplicate of the session's round in flight and "
            "got its answer",
            registry=r,
        )
        self.expired_sessions = Counter(
            "verifier_expired_sessions", "sessions ended by the idle TTL", registry=r
        )
        self.rejected_full = Counter(
            "verifier_rejected_full",
            "requests refused with 503 because the queue was full",
            registry=r,
        )
        self.queue_depth = Gauge(
            "verifier_queue_depth", "requests waiting for or in the current batch", registry=r
        )
        self.drafted_tokens = Counter(
            "verifier_drafted_tokens", "draft tokens received by /verify", registry=r
        )
        self.accepted_tokens = Counter(
            "verifier_accepted_tokens", "draft tokens accepted by /verify", registry=r
        )
        self.drafted_by_position = Counter(
            "verifier_drafted_by_position",
            "draft tokens received, by position in the draft",
            ["position"],
            registry=r,
        )
        self.accepted_by_position = Counter(
            "verifier_accepted_by_position",
            "draft tokens accepted, by position in the draft",
            ["position"],
            registry=r,
        )
        self.decoded_tokens = Counter(
            "verifier_decoded_tokens", "tokens evaluated by llama_decode", registry=r
        )
        self.batch_sessions = Histogram(
            "verifier_batch_sessions",
            "sessions sharing one llama_decode batch",
            buckets=[float(n) for n in range(1, max_sessions + 1)],
            registry=r,
        )
        self.batch_tokens = Histogram(
            "verifier_batch_tokens",
            "tokens in one llama_decode batch",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.decode_seconds = Histogram(
            "verifier_decode_seconds",
            "wall time of one llama_decode",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
            registry=r,
        )
        self.busy_seconds = Counter(
            "verifier_busy_seconds",
            "wall time with at least one model request in flight (the denominator of "
            "efficiency = decode seconds / busy seconds)",
            registry=r,
        )
        self.inline_rounds = Counter(
            "verifier_inline_rounds",
            "verify rounds decoded on the event loop because the engine was idle",
            registry=r,
        )
        # Children resolved once: labels() per position per round costs a lock and a
        # lookup each, on the way to the round's answer.
        positions = range(1, max_draft + 1)
        self._drafted_at = [self.drafted_by_position.labels(str(p)) for p in positions]
        self._accepted_at = [self.accepted_by_position.labels(str(p)) for p in positions]
        self._inflight = 0
        self._busy_since = 0.0
        self._lock = threading.Lock()

    def observe_batch(self, sessions: int, tokens: int, decode_s: float) -> None:
        self.batch_sessions.observe(sessions)
        self.batch_tokens.observe(tokens)
        self.decode_seconds.observe(decode_s)
        self.decoded_tokens.inc(tokens)

    def observe_round(self, drafted: int, accepted: int) -> None:
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        for counter in self._drafted_at[:drafted]:
            counter.inc()
        for counter in self._accepted_at[:accepted]:
            counter.inc()

    def request_started(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.perf_counter()
            self._inflight += 1

    def request_ended(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self.busy_seconds.inc(time.perf_counter() - self._busy_since)


MODEL_PATHS = frozenset({"/prefill", "/verify", "/generate"})


class RequestMetricsMiddleware:
    """Pure ASGI: counts requests by route and status, and keeps the busy clock running
    while model work is in flight. (Starlette's BaseHTTPMiddleware would add a task
    group and a memory stream to every request, on the path of every round.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        state = getattr(scope.get("app"), "state", None)
        metrics: VerifierMetrics | None = getattr(getattr(state, "verifier", None), "metrics", None)
        if scope["type"] != "http" or metrics is None:
            return await self.app(scope, receive, send)
        path = route_path(scope)
        model_work = path in MODEL_PATHS or path.startswith("/sessions/")
        status = 500  # what the client sees if the app fails before answering

        async def send_and_record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if model_work:
            metrics.request_started()
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            if model_work:
                metrics.request_ended()
            # The router records the matched route in the scope (the /verify lane its
            # path): label by the path template, so session ids never become label values.
            route = (
                getattr(scope.get("route"), "path", None)
                or scope.get("route_template")
                or "unmatched"
            )
            metrics.requests.labels(route, str(status)).inc()
