"""The benchmark's parts that decide its numbers: the delay proxy and the expectation."""

import socket
import threading
import time

import pytest

from scripts.bench import (
    Baseline,
    Totals,
    acceptance_estimate,
    batched_drafter_tokens_per_s,
    expected_tokens_per_round,
    projection_lines,
    run_expectation,
    summarize,
    within,
)
from scripts.harness.delay_proxy import DelayProxy


def test_expected_tokens_per_round_matches_the_closed_form():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # As a sum over positions: sum_{i=0..k} alpha^i.
    for alpha in (0.3, 0.72, 0.95):
        for k in (1, 2, 4, 8):
            assert expected_tokens_per_round(alpha, k) == pytest.approx(
                sum(alpha**i for i in range(k + 1))
            )
    assert expected_tokens_per_round(0.7, 0) == 1.0


def test_acceptance_estimate_is_the_geometric_mle():
    # 10 rounds of k=4: 6 accepted everything (24 tokens), 4 stopped after 1 (4 tokens).
    assert acceptance_estimate(24 + 4, 4) == pytest.approx(28 / 32)
    assert acceptance_estimate(0, 0) == 0.0
    assert acceptance_estimate(0, 5) == 0.0


def test_run_expectation_adds_up_each_round_and_the_parts():
    stats = {
        "accepted": 28,
        "rejected_rounds": 4,  # alpha = 28 / 32
        "rounds_by_draft_len": {"4": 10, "0": 2},
        "prefill_time_s": 0.1,
        "draft_time_s": 0.4,
        "round_trip_s": 0.5,
    }
    tokens, seconds = run_expectation(stats)
    alpha = 28 / 32
    assert tokens == pytest.approx(10 * sum(alpha**i for i in range(5)) + 2 * 1.0)
    assert seconds == pytest.approx(1.0)
    # Mixed draft lengths are not averaged first: f is concave in k (Jensen).
    mixed = {**stats, "rounds_by_draft_len": {"8": 6, "0": 6}}
    assert run_expectation(mixed)[0] < 12 * expected_tokens_per_round(alpha, 4)


def test_speedups_end_to_end_and_after_the_prompt():
    stats = {
        "generated_tokens": 60,
        "rounds": 20,
        "drafted": 40,
        "accepted": 30,
        "rejected_rounds": 8,
        "total_time_s": 2.0,  # 30 tok/s end to end
        "prefill_time_s": 0.5,  # 40 tok/s after the prompt
        "draft_time_s": 0.5,
        "round_trip_s": 1.0,
        "verifier_time_s": 0.9,
        "bytes_sent": 6000,
        "bytes_received": 4000,
        "rounds_by_draft_len": {"2": 20},
    }
    totals = Totals()
    totals.add(stats)
    row = summarize(totals, Baseline(tokens_per_s=20.0, decode_tokens_per_s=25.0))
    assert row["tokens_per_s"] == pytest.approx(30.0)
    assert row["speedup"] == pytest.approx(1.5)
    assert row["decode_speedup"] == pytest.approx(40.0 / 25.0)
    assert row["overhead_ms"] == pytest.approx(5.0)
    assert row["bytes_per_round"] == pytest.approx(500.0)


@pytest.fixture
def echo_server():
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()
    listener.close()


def round_trip_ms(port: int, payload: bytes) -> tuple[float, bytes]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        began = time.perf_counter()
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += sock.recv(65536)
        return (time.perf_counter() - began) * 1000.0, got


def test_the_proxy_adds_its_delay_to_every_round_trip(echo_server):
    # Only the lower bound is asserted: a loaded machine can make a round trip longer,
    # never shorter. (The bench prints the measured RTT through the proxy for each row.)
    with DelayProxy(echo_server, delay_ms=30) as proxy:
        times = [round_trip_ms(proxy.port, b"ping")[0] for _ in range(5)]
    assert min(times) >= 30.0


def test_the_proxy_passes_bytes_intact_and_in_order(echo_server):
    payload = bytes(range(256)) * 4096  # 1 MiB, many chunks
    with DelayProxy(echo_server, delay_ms=4) as proxy:
        _, got = round_trip_ms(proxy.port, payload)
    assert got == payload


def test_no_delay_is_a_plain_forwarder_and_negative_is_refused(echo_server):
    with DelayProxy(echo_server, delay_ms=0) as proxy:
        _, got = round_trip_ms(proxy.port, b"x" * 100)
    assert got == b"x" * 100
    with pytest.raises(ValueError):
        DelayProxy(echo_server, delay_ms=-1)


SEQUENTIAL = {"draft_ms_per_token": 20.0, "round_trip_ms": 100.0}


def test_a_batched_drafter_saves_the_draft_of_every_round_it_hit():
    speculative = {"k_mean": 4.0, "tokens_per_round": 3.0}
    # A miss: 100 ms for the answer, then 80 ms for the draft; a hit: the answer only.
    assert batched_drafter_tokens_per_s(speculative, SEQUENTIAL, 0.0) == pytest.approx(
        3000.0 / 180.0
    )
    assert batched_drafter_tokens_per_s(speculative, SEQUENTIAL, 1.0) == pytest.approx(30.0)
    assert batched_drafter_tokens_per_s(speculative, SEQUENTIAL, 0.5) == pytest.approx(
        3000.0 / 140.0
    )
    # A draft longer than the wait: a hit still waits for its draft.
    slow = {**SEQUENTIAL, "draft_ms_per_token": 40.0}
    assert batched_drafter_tokens_per_s(speculative, slow, 1.0) == pytest.approx(3000.0 / 160.0)


def test_the_paper_table_has_a_row_per_speculative_row_with_its_own_baselines():
    def row(drafter: str, branches: int, **extra) -> dict:
        return {
            "drafter": drafter,
            "k": "4",
            "branches": branches,
            "k_mean": 4.0,
            "tokens_per_round": 3.0,
            "round_trip_ms": 110.0,
            "decode_tokens_per_s": 20.0,
            "hit_rate_within": {"1": 0.5, "2": 0.7, "4": 0.8},
            **extra,
        }

    rows = {
        "model sequential k=4": row("model sequential", 0, **SEQUENTIAL),
        "model pipelined k=4": row("model pipelined", 1),
        "model speculative (4) k=4": row("model speculative (4)", 4),
        # No sequential row with this p_min: no paper row.
        "model speculative (4) p_min 0.5 k=4": row("model speculative (4) p_min 0.5", 4),
    }
    results = {"delays": {"20.0": {"rows": rows, "baseline_decode_tokens_per_s": 50.0}}}
    table = [line for line in projection_lines(results) if line.startswith("| 20 ")]
    expected = [3000.0 / (100.0 + (1 - h) * 80.0) for h in (0.5, 0.7, 0.8)]
    assert table == [
        "| 20 | model speculative (4) | 4 | "
        + " | ".join(f"{v:.1f}" for v in expected)
        + " | 20.0 | 20.0 | 50.0 |"
    ]


def test_hit_rates_are_shown_only_for_the_answers_a_drafter_ranks():
    rates = {"hit_rate_within": {"1": 0.5, "2": 0.7, "4": 0.8}}
    assert within({**rates, "branches": 4}) == "0.50/0.70/0.80"
    assert within({**rates, "branches": 1}) == "0.50/-/-"
    assert within({**rates, "branches": 0}) == "-/-/-"


def test_humaneval_sessions_carry_each_problem_and_the_first_answer_back():
    """The task benchmark's sessions where text repeats (scripts/bench_tasks.py)."""
    from scripts.bench_tasks import REPEATS, humaneval_questions, load_questions, turn_text

    for family in REPEATS:
        questions = humaneval_questions(family)
        assert len(questions) == 164 and len({q.id for q in questions}) == 164
        assert all(len(q.turns) == 2 and "```python\n" in q.turns[0] for q in questions)
    first = humaneval_questions("agent_edit")[0]
    assert "def has_close_elements(" in first.turns[0]
    assert "Rename `has_close_elements` to `solve`" in first.turns[1]
    history = [
        {"role": "user", "content": first.turns[0]},
        {"role": "assistant", "content": "def has_close_elements(): ..."},
    ]
    sent = turn_text(first.turns[1], history)
    assert "{previous}" not in sent and "def has_close_elements(): ..." in sent
    fix = humaneval_questions("code_fix")[0]
    assert turn_text(fix.turns[1], history) == fix.turns[1]  # nothing to carry back
    mixed = load_questions(["qa", "code_fix"], 2)
    assert [q.family for q in mixed] == ["qa", "code_fix", "qa", "code_fix"]


def test_speed_on_the_same_work_counts_only_answers_every_system_wrote_alike():
    """Where llama-server's greedy answer differs from ours, its tokens/s is other work."""
    from scripts.bench_tasks import SYSTEMS, alike, summarize

    systems = [SYSTEMS["verifier"], SYSTEMS["default"], SYSTEMS["llama"]]

    def row(system, qid, text, tokens, seconds):
        return {"system": system, "question_id": qid, "turn": 1, "family": "qa", "text": text,
                "tokens": tokens, "seconds": seconds, "accepted": None}  # fmt: skip

    rows = [
        row("verifier", 1, "same", 10, 1.0), row("default", 1, "same", 10, 0.5),
        row("llama", 1, "same", 10, 1.0),
        # llama-server wrote more here: left out of the same-work rates.
        row("verifier", 2, "short", 5, 1.0), row("default", 2, "short", 5, 1.0),
        row("llama", 2, "longer", 50, 1.0),
        row("verifier", 3, "x", 5, 1.0), row("llama", 3, "x", 5, 1.0),  # one system missing
    ]  # fmt: skip
    assert alike(rows, systems) == {(1, 1)}
    all_ = summarize(rows, ["qa"], systems)["all"]
    assert all_["default"]["alike_answers"] == 1
    assert all_["default"]["alike_tokens_per_s"] == 20.0
    assert all_["llama"]["alike_tokens_per_s"] == 10.0
    assert all_["llama"]["tokens_per_s"] == 65 / 3  # every answer: other work counted


def test_a_variant_is_serves_default_on_a_verifier_with_other_settings():
    """scripts/bench_tasks.py --variant: an A/B of a verifier setting in one run."""
    import argparse

    from scripts.bench_tasks import variant

    system = variant("copy6:VERIFIER_CHUNK_COPY_NGRAM=6, VERIFIER_CHUNK_COPY_RESYNC=0")
    assert (system.name, system.kind, system.args) == ("copy6", "serve", ())
    assert system.verifier_env == (
        ("VERIFIER_CHUNK_COPY_NGRAM", "6"),
        ("VERIFIER_CHUNK_COPY_RESYNC", "0"),
    )
    assert "VERIFIER_CHUNK_COPY_NGRAM=6" in system.label
    unsized = variant("unsized@model+suffix:VERIFIER_LOOKUP_SIZING=false")
    assert unsized.args == ("--drafter", "model+suffix") and unsized.kind == "serve"
    assert unsized.verifier_env == (("VERIFIER_LOOKUP_SIZING", "false"),)
    for bad in (
        "copy6@verifier:VERIFIER_X=1",  # the verifier alone runs no serve
        "copy6@nosuch:VERIFIER_X=1",
        "copy6",
        "copy6:",
        ":VERIFIER_X=1",
        "copy6:CHUNK=1",
        "copy6:VERIFIER_X",
        "default:VERIFIER_X=1",
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            variant(bad)
