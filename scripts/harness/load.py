"""Concurrent drafters against a verifier, for the load test (scripts/loadtest.py) and the
failover script: each runs the real speculative loop (drafter/speculative/loop.py) with the real
HTTP client on a thread of its own.

Two kinds of drafter. `model`: the draft model, one context with a sequence per drafter
(as `serve --parallel` has); on one machine the drafters then compete with the verifier
for its cores. `replay`: drafts replayed from the verifier's own continuation of each
prompt (fetched with /generate before the clock starts), with one token in `REPLAY_MISS`
wrong so that rounds are cut as a real drafter's are: every fourth (`periodic`: a round
of 3 drafts that starts after a wrong one is always taken whole), or each with
probability 1/4 at positions drawn once (`random`: the acceptance a real drafter's rounds
see, the same for every k); it costs nothing to draft unless given a time per token, so
it stands for many drafters on machines of their own and measures the verifier.
Either way every drafter's output is checked against the verifier alone.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from drafter.length.draft_length import LinkAwareLength
from drafter.length.plain_lengths import FixedLength
from drafter.speculative.candidates import Draft, Drafter
from drafter.speculative.loop import SpeculativeLoop
from scripts.harness.metrics import Metrics
from server.shared.defaults import DEFAULT_DRAFTER_MODEL
from server.shared.protocol import GenerateRequest, PrefillRequest, VerifyRequest, VerifyResponse

PROMPTS = [
    "The history of the bicycle begins",
    "def merge_sort(items):\n",
    "Shopping list:\n1.",
    "Dear Sir or Madam,",
    "SELECT name, email FROM",
    "The recipe for bread needs",
    "In 1969, the first humans",
    "Once upon a time, in a village",
]
REPLAY_MISS = 4  # one replayed token in 4 is wrong
MISSES = ("periodic", "random")


class TimedClient(VerifierClient):
    """The drafter's client, timing each round."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[float, float]] = []  # (sent at, seconds) of each round

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        began = time.perf_counter()
        response = super().verify(request)
        self.rounds.append((began, time.perf_counter() - began))
        return response


class ReplayDrafter(Drafter):
    """Drafts the verifier's own continuation, one token in REPLAY_MISS made wrong
    (`misses`: which), spending `token_s` a draft token (asleep: a drafter on a machine of
    its own)."""

    def __init__(
        self,
        prompt_len: int,
        continuation: Sequence[int],
        n_vocab: int,
        token_s: float = 0.0,
        misses: str = "periodic",
    ):
        self.prompt_len = prompt_len
        self.continuation = list(continuation)
        self.n_vocab = n_vocab
        self.token_s = token_s
        drawn = random.Random(prompt_len)  # the same positions for every k and every run
        self.wrong = [
            i % REPLAY_MISS == REPLAY_MISS - 1
            if misses == "periodic"
            else drawn.random() < 1 / REPLAY_MISS
            for i in range(len(self.continuation))
        ]

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft:
        at = len(committed) - self.prompt_len
        draft = self.continuation[at : at + k]
        for i in range(len(draft)):
            if self.wrong[at + i]:
                draft[i] = (draft[i] + 1) % self.n_vocab
        if self.token_s and draft:
            time.sleep(self.token_s * len(draft))
        return Draft(draft, None)


@dataclass
class LevelResult:
    drafters: int
    tokens: int
    wall_s: float
    rounds: list[list[tuple[float, float]]]  # per drafter: (sent at, seconds) of each round
    errors: list[str]
    mismatches: int  # drafters whose output was not the verifier's own
    before: list[Metrics] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # each drafter's tokens
    after: list[Metrics] = field(default_factory=list)

    def delta(self, name: str, **labels: str) -> float:
        return sum(
            a.value(name, **labels) - b.value(name, **labels)
            for a, b in zip(self.after, self.before, strict=True)
        )

    @property
    def round_s(self) -> list[float]:
        return [seconds for drafter in self.rounds for _, seconds in drafter]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def latency_ms(self, q: float) -> float:
        if not self.round_s:
            return 0.0
        ordered = sorted(self.round_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.round_s) * 1000.0 if self.round_s else 0.0


def references(url: str, prompts: Sequence[str], tokens: int, api_key: str | None = None):
    """Each prompt's ids and the verifier's own continuation (its /generate)."""
    out = {}
    with VerifierClient(url, timeout=600, api_key=api_key) as client:
        n_vocab = client.info().n_vocab
        for prompt in set(prompts):
            answer = client.generate(GenerateRequest(prompt=prompt, max_tokens=tokens))
            out[prompt] = (len(answer.prompt_ids), answer.tokens)
    return out, n_vocab


def run_drafters(
    url: str,
    metrics_urls: Sequence[str],
    prompts: Sequence[str],
    *,
    rounds: int,
    draft_n: int | str,
    drafter: str = "replay",
    threads: int = 1,
    n_ctx: int = 1024,
    api_keys: Sequence[str | None] = (None,),
    metrics_key: str | None = None,
    reference: dict | None = None,
    n_vocab: int = 0,
    during: Callable[[], None] | None = None,
    draft_token_s: float = 0.0,
    misses: str = "periodic",
) -> LevelResult:
    """One drafter per prompt, all started at once, `rounds` rounds each (or to the end of
    the reference); `during` runs on a thread of its own while they do."""
    n = len(prompts)
    k = draft_n if isinstance(draft_n, int) else 16
    # A replayed round commits REPLAY_MISS tokens or so at most (periodic: exactly).
    budget = rounds * (min(k, REPLAY_MISS - 1) + 1 if drafter == "replay" else k + 1)
    if reference is None:
        reference, n_vocab = references(url, prompts, budget, api_keys[0])
    owner = None
    if drafter == "model":
        owner = DraftModel(DEFAULT_DRAFTER_MODEL, n_ctx=n_ctx + 256, n_seq=n, n_threads=threads)
        drafters = [owner, *(DraftModel.on(owner.context, i) for i in range(1, n))]
    else:
        drafters = [ReplayDrafter(*reference[p], n_vocab, draft_token_s, misses) for p in prompts]
    clients = [TimedClient(url, timeout=600, api_key=api_keys[i % len(api_keys)]) for i in range(n)]
    max_chunk = clients[0].info().max_chunk_tokens  # 1 where the verifier has no chunks
    outputs: list[list[int]] = [[] for _ in range(n)]
    errors: list[str] = []
    barrier = threading.Barrier(n + 1 + (during is not None))

    def run(i: int) -> None:
        length = (
            LinkAwareLength(maximum=16, max_chunk=max_chunk)
            if draft_n == "auto"
            else FixedLength(int(draft_n))
        )
        loop = SpeculativeLoop(drafters[i], clients[i], draft_n=length, n_ctx=n_ctx)
        barrier.wait()
        try:
            generation = loop.run(PrefillRequest(prompt=prompts[i]), budget)
            for done, event in enumerate(generation, start=1):
                outputs[i] += event.tokens
                if done == rounds or event.eos:
                    generation.close()
                    break
        except Exception as exc:  # counted, reported: a load test keeps going
            errors.append(f"{type(exc).__name__}: {exc}")

    def side() -> None:
        barrier.wait()
        during()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    if during is not None:
        workers.append(threading.Thread(target=side))
    for worker in workers:
        worker.start()
    before = [Metrics.scrape(u, metrics_key) for u in metrics_urls]
    barrier.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - began
    after = [Metrics.scrape(u, metrics_key) for u in metrics_urls]
    if owner is not None:
        owner.close()
    for client in clients:
        client.close()
    mismatches = sum(
        out != reference[p][1][: len(out)] for out, p in zip(outputs, prompts, strict=True)
    )
    return LevelResult(
        drafters=n,
        tokens=sum(len(out) for out in outputs),
        wall_s=wall,
        rounds=[c.rounds for c in clients],
        errors=errors,
        mismatches=mismatches,
        before=before,
        after=after,
        outputs=outputs,
    )
