"""Prometheus metrics of the verifier (served as text at GET /metrics)."""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from server.verifier.hang_up import HangUpWatch
from server.verifier.paths import route_path


class VerifierMetrics:
    def __init__(self, max_sessions: int = 8, max_draft: int = 16) -> None:
        # One registry per app, so several apps (tests) never share counters.
        r = self.registry = CollectorRegistry()
        count = partial(Counter, registry=r)  # a counter with no labels
        self.requests = Counter(
            "verifier_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.requests_in_progress = Gauge(
            "verifier_requests_in_progress",
            "HTTP requests received and not yet answered",
            registry=r,
        )
        self.active_sessions = Gauge(
            "verifier_active_sessions", "sessions holding a KV sequence", registry=r
        )
        self.evicted_sessions = count(
            "verifier_evicted_sessions",
            "sessions evicted (least recently used) to make room for a new one",
        )
        self.moved_sequences = count(
            "verifier_moved_sequences",
            "KV sequences copied to another id so that sessions sit side by side and share "
            "forward passes (VERIFIER_PACK_SESSIONS)",
        )
        self.prompt_tokens_evaluated = count(
            "verifier_prompt_tokens_evaluated",
            "prompt tokens evaluated by /prefill (the last one of each prompt is evaluated "
            "with the session's first round)",
        )
        self.prompt_tokens_reused = count(
            "verifier_prompt_tokens_reused",
            "prompt tokens taken from a cached prefix instead of being evaluated",
        )
        self.copied_tokens = count(
            "verifier_copied_tokens",
            "tokens copied from a session's own text as its chunks' drafts (copy_draft.py)",
        )
        self.copied_tokens_accepted = count("verifier_copied_tokens_accepted", "copies accepted")
        self.prompt_tokens_retiled = count(
            "verifier_prompt_tokens_retiled",
            "cached prefixes' tokens evaluated again while idle, as a next prompt would "
            "evaluate them (docs/numerics.md)",
        )
        self.replayed_rounds = count(
            "verifier_replayed_rounds",
            "/verify requests that repeated the session's last round (a retry, a duplicate) "
            "and got its recorded answer",
        )
        self.expired_sessions = count("verifier_expired_sessions", "sessions ended by the idle TTL")
        self.rejected_full = count(
            "verifier_rejected_full",
            "requests refused with 503 because the queue was full",
        )
        self.queue_depth = Gauge(
            "verifier_queue_depth", "requests waiting for or in the current batch", registry=r
        )
        self.drafted_tokens = count("verifier_drafted_tokens", "draft tokens received by /verify")
        self.accepted_tokens = count("verifier_accepted_tokens", "draft tokens accepted by /verify")
        lookups = "draft tokens of a client's lookups (draft_kind), "  # of those, copies
        self.lookup_drafted_tokens = count("verifier_lookup_drafted_tokens", lookups + "received")
        self.lookup_accepted_tokens = count("verifier_lookup_accepted_tokens", lookups + "accepted")
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
        self.decoded_tokens = count(
            "verifier_decoded_tokens",
            "rows of jobs evaluated by llama_decode (prompt tokens, rounds' tokens)",
        )
        # The names llama.cpp's server and vLLM use (`llamacpp:` and `vllm:` there), so
        # dashboards made for them read these; positions from 0, as theirs.
        self.spec_drafts = count("verifier:spec_decode_num_drafts", "rounds that carried a draft")
        self.spec_draft_tokens = count("verifier:spec_decode_num_draft_tokens", "draft tokens")
        self.spec_accepted_tokens = Counter(
            "verifier:spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "verifier:spec_decode_num_accepted_tokens_per_pos",
            "draft tokens accepted at each position of a draft",
            ["position"],
            registry=r,
        )
        self.decodes = Counter(
            "verifier_decodes",
            "llama_decode calls, by what they carried (rounds, or a prompt chunk)",
            ["kind"],
            registry=r,
        )
        self.forward_passes = Counter(
            "verifier_forward_passes",
            "forward passes of the model (llama.cpp's micro-batches): each reads every "
            "weight once; passes / decodes above 1 means a decode was split",
            ["kind"],
            registry=r,
        )
        self.pass_sessions = Histogram(
            "verifier_pass_sessions",
            "sessions with rows in one llama_decode of rounds",
            buckets=[float(n) for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)],
            registry=r,
        )
        self.cycle_rounds = Histogram(
            "verifier_cycle_rounds",
            "rounds decoded in one engine step (one or more llama_decode calls: sessions "
            "far apart in the KV cache take passes of their own)",
            buckets=[float(n) for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)],
            registry=r,
        )
        self.advised_draft = Histogram(
            "verifier_advised_draft",
            "the draft length each round's answer advised (0: drafting cannot pay now)",
            buckets=[float(n) for n in (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)],
            registry=r,
        )
        self.pass_fixed_rows = Gauge(
            "verifier_pass_fixed_rows",
            "what a pass of the current size costs beyond its rows, in rows (the part its "
            "sessions share), as learned from the passes of rounds",
            registry=r,
        )
        self.rounds_without_draft = count(
            "verifier_rounds_without_draft",
            "rounds that carried no draft: /generate's steps and each token of a chunk",
        )
        self.pass_rows = Histogram(
            "verifier_pass_rows",
            "rows in one llama_decode, padding and filler rows included",
            ["kind"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.shaping_rows = Counter(
            "verifier_shaping_rows",
            "rows decoded only to give a pass its shape (padding after a round or a short "
            "prompt stretch, filler rows of sequences in between), removed after the pass",
            ["kind"],
            registry=r,
        )
        self.decode_seconds = Histogram(
            "verifier_decode_seconds",
            "wall time of one llama_decode, by what it carried (rounds, or a prompt chunk)",
            ["kind"],
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
            registry=r,
        )
        self.busy_seconds = count(
            "verifier_busy_seconds",
            "wall time with at least one model request in flight (the denominator of "
            "efficiency = decode seconds / busy seconds)",
        )
        self.gather_holds = count(
            "verifier_gather_holds",
            "times queued rounds were held for sessions the last pass answered, to share "
            "a pass with them",
        )
        self.gather_hold_seconds = count(
            "verifier_gather_hold_seconds",
            "time queued rounds were held for sessions the last pass answered",
        )
        # Children resolved once: labels() per position per round costs a lock and a
        # lookup each, on the way to the round's answer.
        positions = range(1, max_draft + 1)
        self._drafted_at = [self.drafted_by_position.labels(str(p)) for p in positions]
        self._accepted_at = [self.accepted_by_position.labels(str(p)) for p in positions]
        self._spec_accepted_at = [self.spec_accepted_per_pos.labels(str(p - 1)) for p in positions]
        self._inflight = 0
        self._busy_since = 0.0
        self._lock = threading.Lock()

    def observe_pass(self, record) -> None:
        """One llama_decode (server.verifier.decoding.decoder.PassRecord)."""
        self.decodes.labels(record.kind).inc()
        self.forward_passes.labels(record.kind).inc(record.forward_passes)
        if record.kind == "rounds":
            self.pass_sessions.observe(record.sessions)
        self.pass_rows.labels(record.kind).observe(record.rows)
        self.shaping_rows.labels(record.kind).inc(record.rows - record.real_rows)
        self.decode_seconds.labels(record.kind).observe(record.seconds)
        self.decoded_tokens.inc(record.real_rows)

    def observe_step(self, step) -> None:
        """What one engine step did (server.verifier.scheduling.cycle.Step)."""
        for record in step.passes:
            self.observe_pass(record)
        if step.rounds_decoded:
            self.cycle_rounds.observe(step.rounds_decoded)
        for drafted, accepted in step.rounds:
            self.observe_round(drafted, accepted)
        for drafted, accepted in step.copies:
            self.copied_tokens.inc(drafted)
            self.copied_tokens_accepted.inc(accepted)
        for drafted, accepted in step.lookups:
            self.lookup_drafted_tokens.inc(drafted)
            self.lookup_accepted_tokens.inc(accepted)
        for advised in step.advised:
            self.advised_draft.observe(advised)
        if step.passes:
            self.pass_fixed_rows.set(step.fixed_rows)
        self.replayed_rounds.inc(step.replayed)
        self.evicted_sessions.inc(step.evicted)
        self.moved_sequences.inc(step.moved)
        self.prompt_tokens_reused.inc(step.prompt_tokens_reused)
        self.prompt_tokens_evaluated.inc(step.prompt_tokens_evaluated)

    def observe_round(self, drafted: int, accepted: int) -> None:
        if not drafted:
            self.rounds_without_draft.inc()
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        for counter in self._drafted_at[:drafted]:
            counter.inc()
        for counter in self._accepted_at[:accepted]:
            counter.inc()
        if drafted:
            self.spec_drafts.inc()
            self.spec_draft_tokens.inc(drafted)
            self.spec_accepted_tokens.inc(accepted)
            for counter in self._spec_accepted_at[:accepted]:
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
HUNG_UP = 499  # nginx's status for a client that closed the connection first
access_log = logging.getLogger("uvicorn.access")


class RequestMetricsMiddleware:
    """Pure ASGI: counts requests by route and status, and keeps the busy clock running
    while model work is in flight. (Starlette's BaseHTTPMiddleware would add a task
    group and a memory stream to every request, on the path of every round.)

    A request whose client hung up before its answer started is counted, and logged
    where uvicorn logs requests, as 499: uvicorn drops that answer and logs nothing."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        state = getattr(scope.get("app"), "state", None)
        metrics: VerifierMetrics | None = getattr(getattr(state, "verifier", None), "metrics", None)
        if scope["type"] != "http" or metrics is None:
            return await self.app(scope, receive, send)
        path = route_path(scope)
        model_work = path in MODEL_PATHS or path.startswith("/sessions/")
        status = HUNG_UP  # nothing answered: the client went away first
        watch = HangUpWatch(receive)

        async def send_and_record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = HUNG_UP if watch.gone else message["status"]
            await send(message)

        if model_work:
            metrics.request_started()
        metrics.requests_in_progress.inc()
        try:
            await self.app(scope, watch.receive, send_and_record)
        except Exception:
            if status == HUNG_UP:
                status = 500  # the app's handler for the unexpected answers it
            raise
        finally:
            watch.close()
            metrics.requests_in_progress.dec()
            if model_work:
                metrics.request_ended()
            # The router records the matched route in the scope: label by the path
            # template, so session ids never become label values.
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            metrics.requests.labels(route, str(status)).inc()
            if status == HUNG_UP:
                log_hang_up(scope)


def log_hang_up(scope) -> None:
    """The access log's line for a request whose client hung up, as uvicorn writes its
    others (its formatter, its switch: `--no-access-log` silences this one too)."""
    access_log.info(
        '%s - "%s %s HTTP/%s" %d',
        get_client_addr(scope),
        scope["method"],
        get_path_with_query_string(scope),
        scope["http_version"],
        HUNG_UP,
    )
