"""Lossless speculative sampling on the real models over HTTP.

Over 2,000 seeded runs, the first two generated tokens must follow the verifier's exact
joint distribution (computed from its logits), for rejection sampling and for
sample-and-match; a seed must reproduce its output; the lossy strategy must say so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import httpx
import numpy as np
import pytest
from scipy.stats import chisquare
from typer.testing import CliRunner

from drafter.cli import app
from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel, DraftPolicy
from drafter.speculative.loop import SpeculativeLoop
from server.shared.batching import Piece, decode_pieces
from server.shared.constraint import Grammars
from server.shared.penalties import adjusted_rows
from server.shared.protocol import Grammar, PrefillRequest, SamplingParams, VerifyRequest
from server.shared.runtime import LlamaRuntime
from server.shared.sampling import probabilities
from tests.conftest import TEST_N_CTX, TEST_THREADS, start_verifier
from tests.fixtures.scripted_length import ScriptedLength

pytestmark = pytest.mark.integration

PROMPT = "My favourite fruit is the"
RUNS = 2000
TOP_K = 8


def sampling_for(seed: int | None, **adjusted) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, **adjusted)


@pytest.fixture(scope="module")
def prompt_ids(live_verifier) -> list[int]:
    with VerifierClient(live_verifier.url) as client:
        opened = client.prefill(PrefillRequest(prompt=PROMPT))
        client.delete_session(opened.session_id)
    return opened.prompt_ids


def last_logits(runtime: LlamaRuntime, tokens: list[int], start: int) -> np.ndarray:
    """One decode of `tokens` into sequence 0 from `start`; the last row's logits."""
    (rows,) = decode_pieces(runtime, [Piece(0, start, tokens, (len(tokens) - 1,))])
    return rows[0]


@pytest.fixture(scope="module")
def exact_joint(verifier_model, prompt_ids) -> dict[tuple[int, int], float]:
    """P(t1, t2) from the verifier model's own logits, in the engine's configuration."""
    runtime = LlamaRuntime(verifier_model, n_ctx_per_seq=256, n_threads=TEST_THREADS)
    try:
        sampling = sampling_for(None)
        first = probabilities(last_logits(runtime, prompt_ids, 0), sampling)
        joint = {}
        for t1 in np.flatnonzero(first):
            assert not runtime.is_eog(int(t1)), "pick a prompt whose first token is never EOS"
            runtime.remove(0, len(prompt_ids))
            logits = last_logits(runtime, [int(t1)], len(prompt_ids))
            second = probabilities(logits, sampling)
            for t2 in np.flatnonzero(second):
                joint[(int(t1), int(t2))] = float(first[t1] * second[t2])
        return joint
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def draft_model(drafter_model):
    model = DraftModel(drafter_model, n_ctx=TEST_N_CTX + 256, n_threads=TEST_THREADS)
    yield model
    model.close()


# The RUNS seeded runs go on this many threads at once. On two cores one verifier is the
# bottleneck: its decode (one thread) is busy ~90% of a run alone, a prompt's pass is
# never shared and passes of prompts and of rounds take turns, so more sessions on it
# barely batch (measured: no faster). A second verifier on the other core halves the
# time; a draft model costs a run ~5 ms, one each beside its own verifier.
WORKERS = 2


@pytest.fixture(scope="module")
def second_verifier(verifier_model):
    """A verifier as the session's live one (the same settings, so the same numbers):
    the other core's, for half the seeded runs."""
    verifier = start_verifier(verifier_model)
    yield verifier
    verifier.stop()


@pytest.fixture(scope="module")
def workers(live_verifier, second_verifier, draft_model, drafter_model):
    """WORKERS (draft model, verifier URL) pairs: a draft model is one llama context,
    used from one thread at a time, so each worker has its own, loaded once."""
    urls = [live_verifier.url, second_verifier.url]
    models = [draft_model] + [
        DraftModel(drafter_model, n_ctx=TEST_N_CTX + 256, n_threads=TEST_THREADS)
        for _ in range(WORKERS - 1)
    ]
    yield [(model, urls[i % len(urls)]) for i, model in enumerate(models)]
    for model in models[1:]:
        model.close()


R = TypeVar("R")


def over_seeds(
    workers, seeds: Sequence[int], run: Callable[[VerifierClient, DraftModel, int], R]
) -> list[R]:
    """`run(client, model, seed)` for every seed, in seed order: the seeds dealt out
    among the workers, each going through its own in turn on a thread of its own (with
    its own client). A seed's run is the same whichever worker has it (`first_tokens`
    starts each from the same state; both verifiers give the same numbers, batched or
    not: /info's batch_invariant), so what the runs add up to never depends on how they
    were dealt or scheduled. Pipelined runs excepted: how far drafting ahead gets before
    an answer depends on timing, one worker or several, and so do their draws."""

    def work(worker: tuple[DraftModel, str], mine: Sequence[int]) -> dict[int, R]:
        model, url = worker
        with VerifierClient(url) as client:
            return {seed: run(client, model, seed) for seed in mine}

    shares = [seeds[i :: len(workers)] for i in range(len(workers))]
    by_seed: dict[int, R] = {}
    with ThreadPoolExecutor(len(workers), thread_name_prefix="seeds") as pool:
        for done in pool.map(work, workers, shares):
            by_seed.update(done)
    return [by_seed[seed] for seed in seeds]


def first_tokens(
    client,
    model,
    prompt_ids,
    strategy: str,
    seed: int,
    n: int = 2,
    pipeline: bool = False,
    draft_n=1,
    adjusted: dict | None = None,
    grammar: Grammar | None = None,
):
    """One seeded generation of `n` tokens in a session of its own (a fresh prefill):
    its tokens and stats. The draft model's cache is cut back to the prompt first, whose
    cells and logits are those of its first cold evaluation on that model: what an
    earlier run left behind (cells evaluated in passes of other shapes, which Q4_K
    kernels may give other last bits) never reaches this run."""
    sampling = sampling_for(seed, **(adjusted or {}))
    model.configure(DraftPolicy(sampling, sample_drafts=strategy == "rejection", seed=seed + 1))
    model.catch_up(prompt_ids)
    assert model.cached_tokens == list(prompt_ids)
    loop = SpeculativeLoop(model, client, draft_n=draft_n, n_ctx=TEST_N_CTX, pipeline=pipeline)
    request = PrefillRequest(
        prompt_tokens=prompt_ids,
        add_bos=False,
        sampling=sampling,
        strategy=strategy,
        grammar=grammar,
    )
    for _ in loop.run(request, n):
        pass
    return tuple(loop.result.tokens), loop.result.stats


def sampled_pairs(
    workers, prompt_ids, strategy: str = "rejection", **options
) -> dict[tuple[int, int], int]:
    """How often each pair of first tokens came, over RUNS seeded generations."""

    def pair(client, model, seed: int) -> tuple[int, int]:
        return first_tokens(client, model, prompt_ids, strategy, seed, **options)[0]

    counts: dict[tuple[int, int], int] = {}
    for pair_ in over_seeds(workers, range(RUNS), pair):
        counts[pair_] = counts.get(pair_, 0) + 1
    return counts


def chi_square_pvalue(counts: dict, exact: dict, runs: int) -> float:
    """Chi-square over the outcomes expected at least 5 times; the rest pooled."""
    big = [key for key, p in exact.items() if p * runs >= 5]
    observed = [counts.get(key, 0) for key in big]
    expected = [exact[key] * runs for key in big]
    rest_observed = runs - sum(observed)
    rest_expected = runs - sum(expected)
    if rest_expected >= 5:
        observed.append(rest_observed)
        expected.append(rest_expected)
    else:
        expected[-1] += rest_expected
        observed[-1] += rest_observed
    return chisquare(observed, np.array(expected) * sum(observed) / sum(expected)).pvalue


@pytest.mark.parametrize("strategy", ["rejection", "match"])
def test_first_two_tokens_follow_the_verifier_distribution(
    workers, prompt_ids, exact_joint, strategy
):
    counts = sampled_pairs(workers, prompt_ids, strategy)
    assert set(counts) <= set(exact_joint), "a pair the verifier gives no probability"
    pvalue = chi_square_pvalue(counts, exact_joint, RUNS)
    assert pvalue > 1e-3, (strategy, pvalue, counts)


@pytest.fixture(scope="module")
def exact_third(verifier_model, prompt_ids, exact_joint) -> dict[int, float]:
    """P(t3), summed over the verifier's (t1, t2)."""
    runtime = LlamaRuntime(verifier_model, n_ctx_per_seq=256, n_threads=TEST_THREADS)
    try:
        last_logits(runtime, prompt_ids, 0)
        third: dict[int, float] = {}
        for (t1, t2), p12 in exact_joint.items():
            runtime.remove(0, len(prompt_ids))
            logits = last_logits(runtime, [t1, t2], len(prompt_ids))
            p3 = probabilities(logits, sampling_for(None))
            for t3 in np.flatnonzero(p3):
                third[int(t3)] = third.get(int(t3), 0.0) + p12 * float(p3[t3])
        return third
    finally:
        runtime.close()


def test_pipelined_drafts_keep_sampling_exact(workers, prompt_ids, exact_joint, exact_third):
    """Pipelined, the third token's draft was drawn while the first round was out, after
    the drafter's guess of the second token: when the guess came true that draft is
    sent. The first two tokens and the third must still follow the verifier."""

    def run(client, model, seed: int):
        return first_tokens(client, model, prompt_ids, "rejection", seed, n=4, pipeline=True)

    pairs: dict[tuple[int, int], int] = {}
    thirds: dict[int, int] = {}
    reused = 0
    for tokens, stats in over_seeds(workers, range(RUNS), run):
        pairs[tokens[:2]] = pairs.get(tokens[:2], 0) + 1
        thirds[tokens[2]] = thirds.get(tokens[2], 0) + 1
        reused += stats.reused_drafts
    assert reused > RUNS // 10, "the pipelined path was hardly taken"
    assert set(thirds) <= set(exact_third)
    for counts, exact in ((pairs, exact_joint), (thirds, exact_third)):
        pvalue = chi_square_pvalue(counts, exact, RUNS)
        assert pvalue > 1e-3, (pvalue, counts)


def test_a_chunk_then_a_draft_keeps_sampling_exact(workers, prompt_ids, exact_joint, exact_third):
    """A round without a draft that asks for two of the verifier's own tokens, then a
    round with a draft (what `auto` switches between): the first two tokens, sampled by
    the verifier in the chunk, and the third, judged against a draft, follow the verifier."""
    runs = RUNS // 2  # each run is three rounds: half the draws keep the suite's time

    def run(client, model, seed: int):
        script = ScriptedLength([(0, 2), (1, 1)])
        return first_tokens(client, model, prompt_ids, "rejection", seed, n=4, draft_n=script)

    pairs: dict[tuple[int, int], int] = {}
    thirds: dict[int, int] = {}
    for tokens, stats in over_seeds(workers, range(runs), run):
        assert stats.tokens_without_draft >= 2  # the chunk, and maybe a last round
        pairs[tokens[:2]] = pairs.get(tokens[:2], 0) + 1
        thirds[tokens[2]] = thirds.get(tokens[2], 0) + 1
    assert set(pairs) <= set(exact_joint) and set(thirds) <= set(exact_third)
    for counts, exact in ((pairs, exact_joint), (thirds, exact_third)):
        pvalue = chi_square_pvalue(counts, exact, runs)
        assert pvalue > 1e-3, (pvalue, counts)


PRESENCE_PENALTY = 1.5


@pytest.fixture(scope="module")
def penalised_joint(verifier_model, prompt_ids) -> tuple[dict, dict[tuple[int, int], float]]:
    """A bias against the likeliest first token, a presence penalty; and P(t1, t2) under
    them, computed here from the verifier model's logits (t2's row penalised for t1)."""
    runtime = LlamaRuntime(verifier_model, n_ctx_per_seq=256, n_threads=TEST_THREADS)
    try:
        row = last_logits(runtime, prompt_ids, 0)
        adjusted = {
            "presence_penalty": PRESENCE_PENALTY,
            "logit_bias": {int(np.argmax(row)): -2.0},
        }
        sampling = sampling_for(None, **adjusted)
        first = probabilities(adjusted_rows(row[None], sampling, [], [])[0], sampling)
        joint = {}
        for t1 in np.flatnonzero(first):
            runtime.remove(0, len(prompt_ids))
            logits = last_logits(runtime, [int(t1)], len(prompt_ids))
            second_row = adjusted_rows(logits[None], sampling, [int(t1)], [])[0]
            second = probabilities(second_row, sampling)
            for t2 in np.flatnonzero(second):
                joint[(int(t1), int(t2))] = float(first[t1] * second[t2])
        return adjusted, joint
    finally:
        runtime.close()


def test_penalties_and_biases_keep_sampling_exact(workers, prompt_ids, penalised_joint):
    """Drafts drawn from the draft model's own distribution, judged by rejection sampling
    against the verifier's penalised one (the second token's row penalised for the first,
    drafted or not): the first two tokens follow the penalised distribution."""
    adjusted, exact = penalised_joint
    counts = sampled_pairs(workers, prompt_ids, adjusted=adjusted)
    assert set(counts) <= set(exact), "a pair the penalised distribution rules out"
    pvalue = chi_square_pvalue(counts, exact, RUNS)
    assert pvalue > 1e-3, (pvalue, counts)


# Lowercase words after a space: the verifier's likeliest first tokens, cut to some of them.
WORDS = Grammar(kind="regex", source=r" [a-m][a-z]*( [a-z]+)*")


@pytest.fixture(scope="module")
def grammar_joint(verifier_model, prompt_ids) -> dict[tuple[int, int], float]:
    """P(t1, t2) under WORDS, from the verifier model's logits: each row masked by the
    grammar's state after the tokens before it."""
    runtime = LlamaRuntime(verifier_model, n_ctx_per_seq=256, n_threads=TEST_THREADS)
    try:
        grammars = Grammars(runtime.grammar_tokenizer, runtime.n_vocab)
        constraint = grammars.constraint(WORDS.kind, WORDS.source)
        sampling = sampling_for(None)
        row = last_logits(runtime, prompt_ids, 0)
        first = probabilities(constraint.mask_rows(row[None], [])[0], sampling)
        joint = {}
        for t1 in np.flatnonzero(first):
            runtime.remove(0, len(prompt_ids))
            logits = last_logits(runtime, [int(t1)], len(prompt_ids))
            second = probabilities(_after(constraint, int(t1), logits), sampling)
            for t2 in np.flatnonzero(second):
                joint[(int(t1), int(t2))] = float(first[t1] * second[t2])
        return joint
    finally:
        runtime.close()


def _after(constraint, token: int, logits: np.ndarray) -> np.ndarray:
    """`logits` masked by the grammar's state after `token`, the state put back after."""
    undo = constraint.commit([token])
    try:
        return constraint.mask_rows(logits[None], [])[0]
    finally:
        undo()


def test_a_grammar_keeps_sampling_exact(workers, prompt_ids, grammar_joint):
    """Drafts judged by rejection sampling against the verifier's rows masked by the
    grammar (the second row by its state after the first token, drafted or not): the
    first two tokens follow the masked distribution."""
    counts = sampled_pairs(workers, prompt_ids, grammar=WORDS)
    assert set(counts) <= set(grammar_joint), "a pair the grammar rules out"
    pvalue = chi_square_pvalue(counts, grammar_joint, RUNS)
    assert pvalue > 1e-3, (pvalue, counts)


def run_cli(url: str, *args: str) -> dict:
    result = CliRunner().invoke(
        app, ["--server", url, "--output", "json", "--threads", str(TEST_THREADS), *args]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("strategy", ["rejection", "match", "threshold"])
def test_same_seed_same_output(live_verifier, strategy):
    args = [
        "--prompt",
        "Tell me about owls.",
        "--chat",
        "--max-tokens",
        "32",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--strategy",
        strategy,
        "--threshold",
        "0.3",
    ]
    first = run_cli(live_verifier.url, *args, "--seed", "11")
    again = run_cli(live_verifier.url, *args, "--seed", "11")
    other = run_cli(live_verifier.url, *args, "--seed", "12")
    assert first["tokens"] == again["tokens"]
    assert first["tokens"] != other["tokens"]
    assert first["strategy"] == strategy
    assert first["lossless"] is (strategy != "threshold")
    assert first["stats"]["bytes_sent_per_round"] > 0


def test_a_seeded_session_opened_again_draws_on_where_the_first_stood(live_verifier, prompt_ids):
    """A session opened again from its prompt and the tokens generated so far (as a
    drafter does after a restart) goes on with the draws of the positions it is at: the
    rest is what the verifier alone gives with the same seed, in one go."""
    sampling = {"temperature": 1.0, "seed": 5}
    whole = httpx.post(
        f"{live_verifier.url}/generate",
        json={"prompt_tokens": prompt_ids, "max_tokens": 24, "sampling": sampling},
        timeout=120,
    ).json()["tokens"]
    cut = 7
    reopened = PrefillRequest(
        prompt_tokens=prompt_ids + whole[:cut],
        add_bos=False,
        generated_tokens=cut,
        sampling=SamplingParams(**sampling),
    )
    rest: list[int] = []
    with VerifierClient(live_verifier.url) as client:
        session = client.prefill(reopened)
        total = session.total_tokens
        while len(rest) < len(whole) - cut:
            answer = client.verify(VerifyRequest(session_id=session.session_id, n_past=total))
            rest += answer.tokens
            total = answer.total_tokens
            if answer.eos:
                break
        client.delete_session(session.session_id)
    assert rest == whole[cut:]


def test_lossy_strategy_is_flagged_everywhere(live_verifier):
    with VerifierClient(live_verifier.url) as client:
        assert client.info().strategies == {
            "greedy": True,
            "rejection": True,
            "match": True,
            "threshold": False,
        }
        opened = client.prefill(
            PrefillRequest(
                prompt="Hi", sampling=sampling_for(1), strategy="threshold", threshold=0.2
            )
        )
        assert opened.lossless is False
        round_ = client.verify(
            VerifyRequest(
                session_id=opened.session_id, n_past=opened.total_tokens, draft_tokens=[42]
            )
        )
        assert round_.strategy == "threshold" and round_.lossless is False
        client.delete_session(opened.session_id)


def test_rejection_needs_valid_draft_probs(live_verifier):
    with VerifierClient(live_verifier.url) as client:
        opened = client.prefill(PrefillRequest(prompt="Hi", sampling=sampling_for(1)))
    base = {"session_id": opened.session_id, "n_past": opened.total_tokens, "draft_tokens": [42]}
    for extra, error_type in [
        ({}, "invalid_draft_probs"),
        ({"draft_probs": [[[42, 0.5]]]}, "invalid_draft_probs"),
        ({"draft_probs": [[[7, 1.0]]]}, "invalid_draft_probs"),
        ({"draft_probs": [[[42, 1.0]], [[1, 1.0]]]}, "invalid_draft_probs"),
        ({"draft_probs": [[[49152, 1.0]]]}, "invalid_token"),
    ]:
        response = httpx.post(f"{live_verifier.url}/verify", json={**base, **extra})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == error_type
    ok = httpx.post(
        f"{live_verifier.url}/verify", json={**base, "draft_probs": [[[42, 0.25], [43, 0.75]]]}
    )
    assert ok.status_code == 200, ok.text
    httpx.delete(f"{live_verifier.url}/sessions/{opened.session_id}")


def test_a_confidence_cut_never_shortens_a_sampled_draft(draft_model, prompt_ids):
    """A sampled draft stopped by its own value would not be drawn from the q it sends,
    and rejection sampling would follow another law: p_min applies to argmax drafts only."""
    k = 6
    for seed in range(20):
        draft_model.configure(
            DraftPolicy(sampling_for(seed), sample_drafts=True, seed=seed, p_min=0.999)
        )
        draft = draft_model.get_candidates(prompt_ids, k)
        ended = draft.tokens and draft_model.runtime.is_eog(draft.tokens[-1])
        assert len(draft.tokens) == k or ended, (seed, draft.tokens)
    draft_model.configure(DraftPolicy(sampling_for(None), sample_drafts=False, p_min=0.999))
    assert len(draft_model.get_candidates(prompt_ids, k).tokens) < k  # the cut is on
    draft_model.configure(DraftPolicy(sampling_for(None), sample_drafts=False))
