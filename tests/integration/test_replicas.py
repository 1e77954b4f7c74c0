"""Three verifiers behind a real nginx on 127.0.0.1 (deploy/nginx): sessions routed by
X-Session-Id, spread over the replicas, and a replica's kill -9 costing only a re-prefill.
Every output must equal the verifier decoding alone."""

from __future__ import annotations

import random
import signal
import threading
import time
import types
import uuid
from collections.abc import Iterator

import httpx
import pytest

import drafter.speculative.loop
from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from drafter.speculative.loop import SpeculativeLoop
from scripts.harness.local import LocalVerifier
from scripts.harness.metrics import Metrics
from scripts.harness.replicas import LocalReplicas, NginxMissing, find_nginx
from server.shared.protocol import SESSION_ID_HEADER, PrefillRequest
from server.verifier.settings import VerifierSettings
from tests.conftest import TEST_N_CTX, TEST_THREADS, verifier_env
from tests.integration.test_many_clients import PROMPTS  # eight, one a chat turn

pytestmark = pytest.mark.integration

NEW_TOKENS = 32
HOLD_AT_ROUND = 2  # rounds done before the replica dies
JOIN_GUARD_S = 900


@pytest.fixture(scope="module")
def nginx() -> str:
    try:
        return find_nginx()
    except NginxMissing as exc:
        pytest.fail(str(exc))  # never a silent skip: the balancer is what is under test


def start_replicas(verifier_model) -> LocalReplicas:
    env = verifier_env(verifier_model, max_sessions=len(PROMPTS))
    return LocalReplicas(3, env, VerifierSettings().max_body_bytes)


@pytest.fixture(scope="module")
def solo(live_verifier) -> dict[str, list[int]]:
    """Each prompt decoded by one verifier alone (`/generate`)."""
    outputs = {}
    for prompt in PROMPTS:
        response = httpx.post(
            f"{live_verifier.url}/generate",
            json={"prompt": prompt, "max_tokens": NEW_TOKENS},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        outputs[prompt] = response.json()["tokens"]
    return outputs


def ids_spread_over(replicas: LocalReplicas, n: int) -> list[str]:
    """n session ids that nginx's ring sends to the replicas in turn, found by asking
    nginx itself (a /health request under each candidate id): the spread is then the
    same on every run, whatever ports the replicas got."""
    rng = random.Random(15)
    buckets: dict[str, list[str]] = {address: [] for address in replica_addresses(replicas)}
    per_replica = -(-n // len(buckets))
    while min(len(ids) for ids in buckets.values()) < per_replica:
        candidate = uuid.UUID(int=rng.getrandbits(128), version=4).hex
        response = httpx.get(f"{replicas.url}/health", headers={SESSION_ID_HEADER: candidate})
        assert response.status_code == 200, response.text
        buckets[response.headers["x-replica"]].append(candidate)
    in_turn = [ids[k] for k in range(per_replica) for ids in buckets.values()]
    return in_turn[:n]


def use_session_ids(monkeypatch, ids: list[str]) -> None:
    """The loop's random session ids, handed out from `ids` instead."""
    left = iter(ids)
    lock = threading.Lock()

    def uuid4() -> uuid.UUID:
        with lock:
            return uuid.UUID(hex=next(left))

    monkeypatch.setattr(drafter.speculative.loop, "uuid", types.SimpleNamespace(uuid4=uuid4))


@pytest.fixture(scope="module")
def draft_models(drafter_model) -> Iterator[list[DraftModel]]:
    """One draft context, a sequence for each drafter (as `serve --parallel 8` has)."""
    owner = DraftModel(
        drafter_model, n_ctx=TEST_N_CTX + 256, n_seq=len(PROMPTS), n_threads=TEST_THREADS
    )
    models = [owner] + [DraftModel.on(owner.context, i) for i in range(1, len(PROMPTS))]
    yield models
    owner.close()


class Drafters:
    """All prompts at once through `url`, a thread each. `after_round(i, event)` runs in
    drafter i's thread after each of its rounds, and once more with None when it is done."""

    def __init__(self, url: str, models: list[DraftModel], after_round=None):
        self.url = url
        self.models = models
        self.after_round = after_round or (lambda i, event: None)
        n = len(PROMPTS)
        self.tokens: list[list[int] | None] = [None] * n
        self.stats: list = [None] * n
        self.session_ids: list[str | None] = [None] * n
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]

    def start(self) -> Drafters:
        for thread in self.threads:
            thread.start()
        return self

    def join(self) -> Drafters:
        """Waits for every drafter, then checks none failed or hung."""
        self.wait()
        assert not any(t.is_alive() for t in self.threads), "a drafter never finished"
        assert not self.errors, self.errors
        return self

    def wait(self) -> None:
        # A guard, not a measure: one deadline for all, so that a request left hanging
        # fails the test well inside CI's time.
        deadline = time.monotonic() + JOIN_GUARD_S
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(self, i: int) -> None:
        self.models[i].reset()
        try:
            with VerifierClient(self.url, timeout=120) as client:
                loop = SpeculativeLoop(self.models[i], client, draft_n=4, n_ctx=TEST_N_CTX)
                for event in loop.run(PrefillRequest(prompt=PROMPTS[i]), NEW_TOKENS):
                    self.session_ids[i] = loop.session_id
                    self.after_round(i, event)
                self.tokens[i], self.stats[i] = loop.result.tokens, loop.result.stats
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            self.after_round(i, None)


def opened_sessions(url: str) -> float:
    return Metrics.scrape(url).value("verifier_requests_total", endpoint="/prefill", status="200")


def active_sessions(url: str) -> float:
    return Metrics.scrape(url).value("verifier_active_sessions")


def replica_addresses(replicas: LocalReplicas) -> list[str]:
    return [f"127.0.0.1:{v.port}" for v in replicas.verifiers]


def test_eight_drafters_through_nginx_get_their_solo_output_spread_over_replicas(
    nginx, verifier_model, draft_models, solo, monkeypatch
):
    with start_replicas(verifier_model) as replicas:
        use_session_ids(monkeypatch, ids_spread_over(replicas, len(PROMPTS)))
        drafters = Drafters(replicas.url, draft_models).start().join()
        replicas.balancer.wait_logged(drafters.session_ids)
        assert drafters.tokens == [solo[p] for p in PROMPTS]
        # Every request of a session reached one replica; the replicas' own metrics
        # count the sessions each opened.
        routes = replicas.balancer.replica_of_sessions()
        assert all(len(routes[s]) == 1 for s in drafters.session_ids), routes
        opened = [opened_sessions(v.url) for v in replicas.verifiers]
        assert sum(opened) == len(PROMPTS)
        assert opened == [
            sum(routes[s] == {address} for s in drafters.session_ids)
            for address in replica_addresses(replicas)
        ]
        assert min(opened) >= 2  # spread over all three
        assert [active_sessions(v.url) for v in replicas.verifiers] == [0, 0, 0]
        # Requests without the header (curl's) all go to one replica, not round-robin.
        headerless = {httpx.get(f"{replicas.url}/info").headers["x-replica"] for _ in range(6)}
        assert len(headerless) == 1


@pytest.mark.parametrize("restart", [False, True], ids=["gone", "restarted"])
def test_kill_9_of_a_replica_mid_generation_costs_only_a_reprefill(
    nginx, verifier_model, draft_models, solo, monkeypatch, restart
):
    """Every drafter still generating is held after its third round; the replica holding
    most of them is killed (and, restarted, comes back empty on its port before they go
    on); they all finish as if nothing had happened."""
    arrived = threading.Condition()
    held: dict[int, bool] = {}  # drafter -> held mid-generation (False: it had ended)
    released = threading.Event()
    rounds = [0] * len(PROMPTS)

    def hold(i: int, event) -> None:
        if event is not None:
            rounds[i] += 1
        if released.is_set() or i in held:
            return
        if event is None:  # done before the hold, its session deleted
            with arrived:
                held[i] = False
                arrived.notify_all()
        elif rounds[i] > HOLD_AT_ROUND and not event.eos:
            with arrived:
                held[i] = True
                arrived.notify_all()
            released.wait()

    with start_replicas(verifier_model) as replicas:
        use_session_ids(monkeypatch, ids_spread_over(replicas, len(PROMPTS)))
        drafters = Drafters(replicas.url, draft_models, hold).start()
        try:
            with arrived:
                assert arrived.wait_for(lambda: len(held) == len(PROMPTS), timeout=JOIN_GUARD_S)
            routes = replicas.balancer.replica_of_sessions()
            generating_on = {
                address: [
                    i for i in held if held[i] and routes[drafters.session_ids[i]] == {address}
                ]
                for address in replica_addresses(replicas)
            }
            victim_address, interrupted = max(generating_on.items(), key=lambda kv: len(kv[1]))
            assert interrupted, generating_on
            place = replica_addresses(replicas).index(victim_address)
            victim = replicas.verifiers[place]
            assert active_sessions(victim.url) == len(interrupted)
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait()
            if restart:  # the same settings, port and place in the ring; no sessions
                replicas.verifiers[place] = LocalVerifier(victim.env, port=victim.port)
                replicas.verifiers[place].wait_ready(timeout=300)
        finally:
            released.set()
            drafters.wait()
        drafters.join()
        replicas.balancer.wait_logged(drafters.session_ids)
        assert drafters.tokens == [solo[p] for p in PROMPTS]  # as if nothing had happened
        assert [s.recoveries for s in drafters.stats] == [
            int(i in interrupted) for i in range(len(PROMPTS))
        ]
        routes = replicas.balancer.replica_of_sessions()
        for i, session_id in enumerate(drafters.session_ids):
            if i not in interrupted:
                assert len(routes[session_id]) == 1  # the others never moved
            elif not restart:  # went on elsewhere, under the same id
                assert len(routes[session_id]) == 2 and victim_address in routes[session_id]
        # Nothing left open anywhere.
        live = replicas.verifiers if restart else [v for v in replicas.verifiers if v is not victim]
        assert all(active_sessions(v.url) == 0 for v in live)
