"""The draft-length schedules."""

import itertools

import pytest

from drafter.length.chunk_pace import CHUNK_S_FIRST, CHUNK_S_LAST
from drafter.length.draft_length import LinkAwareLength
from drafter.length.length_memory import LengthMemory, RememberingLength
from drafter.length.plain_lengths import DoublingLength, FixedLength
from drafter.settings import parse_draft_n
from drafter.speculative.candidates import RoundTiming


def test_fixed_length_never_moves():
    length = FixedLength(4)
    length.update(4, 4)
    length.update(4, 0)
    assert length.next() == 4


def test_a_round_with_no_draft_teaches_nothing():
    length = DoublingLength(maximum=16, start=4)
    length.update(0, 0)
    assert length.next() == 4


def timing(
    rows: int, verifier_s: float, link_s: float, draft_s: float, ahead: bool = False, tokens=1
):
    return RoundTiming(
        rows=rows,
        verifier_s=verifier_s,
        round_trip_s=verifier_s + link_s,
        draft_s=draft_s,
        drafted_ahead=ahead,
        tokens=tokens,
    )


def run_rounds(length: LinkAwareLength, link_s: float, accept: float, rounds: int = 40):
    """Rounds of a CPU-like verifier (10 ms + 5 ms a row), 15 ms a drafted token, a link of
    `link_s`, acceptance `accept`: each draft accepted up to round(k * accept)."""
    for _ in range(rounds):
        k = length.next()
        accepted = min(k, round(k * accept))
        length.update(k, accepted)
        length.observe(
            timing(k + 1, 0.010 + 0.005 * (k + 1), link_s, 0.015 * k, tokens=accepted + 1)
        )
    return length.next()


def test_link_aware_drafts_longer_over_a_slow_link():
    near = run_rounds(LinkAwareLength(maximum=16), link_s=0.0005, accept=0.8)
    far = run_rounds(LinkAwareLength(maximum=16), link_s=0.100, accept=0.8)
    assert 1 <= near < far <= 16


def test_link_aware_drafts_less_when_little_is_accepted():
    good = run_rounds(LinkAwareLength(maximum=16), link_s=0.05, accept=0.9)
    poor = run_rounds(LinkAwareLength(maximum=16), link_s=0.05, accept=0.2)
    assert poor < good


def test_link_aware_expectation_is_the_geometric_model():
    length = LinkAwareLength(maximum=8)
    length.observe(timing(5, 0.05, 0.02, 0.06))
    a = length.acceptance
    expected_tokens = (1 - a**4) / (1 - a)
    seconds = 0.02 + length.verifier_s(4)
    assert length.expected_tokens_per_s(3, ahead=True) == pytest.approx(expected_tokens / seconds)
    seconds += 3 * length._draft_s  # drafted after the answer: its tokens wait
    assert length.expected_tokens_per_s(3) == pytest.approx(expected_tokens / seconds)
    assert length.next(ahead=True) >= length.next()


def test_a_draft_made_ahead_comes_no_faster_than_its_drafting():
    length = LinkAwareLength(maximum=8)
    length.observe(timing(5, 0.05, 0.02, 0.4))  # 0.1 s a drafted token: slower than rounds
    a = length.acceptance
    expected_tokens = (1 - a**4) / (1 - a)
    assert length.expected_tokens_per_s(3, ahead=True) == pytest.approx(expected_tokens / 0.3)


def first_generation(
    draft_s_prior: float | None, step_s: float, link_s: float, advised: int = 1
) -> int:
    """A `serve` slot's first generation, alone on a verifier that advises `advised`: its
    first round goes without a draft (the draft model still warming the prompt), one
    token; the next round's length."""
    length = LinkAwareLength(maximum=16, max_chunk=64, watched=False, draft_s_prior=draft_s_prior)
    length.advise(advised, pass_sessions=1.0)
    assert length.next() == advised  # nothing measured: the advice
    length.update(0, 0)
    length.advise(advised, pass_sessions=1.0)
    length.observe(RoundTiming(1, step_s, step_s + link_s, 0.0, False))
    return length.next()


def test_a_draft_model_as_slow_as_the_verifier_steps_aside_before_drafting():
    # A CPU pair: the draft model's decode of an answer's tokens (35 ms) longer than the
    # verifier's step (25 ms): the verifier's own tokens come sooner than drafted ones.
    assert first_generation(0.035, step_s=0.025, link_s=0.003) == 0
    # Unknown, drafting looks free until a drafted round has measured it.
    assert first_generation(None, step_s=0.025, link_s=0.003) == 1
    # A Mac's draft model beside a GPU verifier that advises 4: drafting pays.
    assert first_generation(0.004, step_s=0.010, link_s=0.003, advised=4) >= 1


def test_a_first_draft_found_ready_does_not_erase_the_timed_prior():
    # The prompt warmed while the verifier prefilled: the first draft's logits were ready.
    timed = LinkAwareLength(maximum=8, draft_s_prior=0.02)
    timed.observe(timing(2, 0.04, 0.003, 0.0))
    assert timed._draft_s == pytest.approx(0.9 * 0.02)
    untimed = LinkAwareLength(maximum=8)
    untimed.observe(timing(2, 0.04, 0.003, 0.0))
    assert untimed._draft_s == 0.0


def test_alone_a_chunk_step_before_chunks_is_the_line_at_one_row():
    """Rows cost as on a CPU (20 ms + 10 ms a row) and the draft model 30 ms a token: alone,
    chunks are expected at the line's one row (30 ms), faster than drafted rounds; where
    others share the passes, a chunk's step waits for their pass (priced as a round)."""

    def after_two_drafted_rounds(pass_sessions: float) -> bool:
        length = LinkAwareLength(maximum=8, max_chunk=64, watched=False)
        for rows in (2, 4):
            length.advise(3, pass_sessions)
            length.observe(timing(rows, 0.020 + 0.010 * rows, 0.003, 0.030 * (rows - 1)))
        return length.chunking

    assert after_two_drafted_rounds(1.0)
    assert not after_two_drafted_rounds(3.0)


def test_alone_a_line_that_reads_no_time_at_one_row_prices_a_step_as_a_round():
    """Two drafted rounds whose line of rows runs below zero before one row (noise, or a
    steep cost a row): a step is not free, it is priced at the round's pass, and a cheap
    draft model keeps drafting."""
    length = LinkAwareLength(maximum=8, max_chunk=64, watched=False)
    for rows, seconds in ((2, 0.010), (4, 0.070)):
        length.advise(3, 1.0)
        length.observe(timing(rows, seconds, 0.003, 0.001 * (rows - 1)))
    assert length.verifier_s(1) == 0.0
    assert not length.chunking


def test_doubling_jumps_up_on_whole_drafts_and_down_to_what_was_accepted():
    length = DoublingLength(maximum=16, start=4)
    seen = []
    for drafted, accepted in ((4, 4), (8, 8), (16, 16), (16, 9), (10, 0), (1, 1), (0, 0), (2, 2)):
        assert length.next() >= drafted
        length.update(drafted, accepted)
        seen.append(length.next())
    assert seen == [8, 16, 16, 10, 1, 2, 2, 4]


def test_doubling_bounds():
    length = DoublingLength(maximum=6, start=10, minimum=2)
    assert length.next() == 6
    length.update(6, 0)
    assert length.next() == 2
    with pytest.raises(ValueError):
        DoublingLength(maximum=4, minimum=0)


def test_where_a_lookup_misses_chunks_start_at_one_token_grow_while_it_keeps_missing():
    """Prompt lookup or the suffix drafter found nothing: chunks of the verifier's own
    tokens, paced (one token, then 0.1 s of the verifier's doubling to 0.4 s) whether or
    not anyone watches, and from the shortest again after a drafted round."""
    length = DoublingLength(maximum=16, max_chunk=64)
    sizes = []
    for _ in range(5):
        m = length.chunk()
        sizes.append(m)
        length.update(0, 0)
        length.observe(RoundTiming(1, m * 0.01, m * 0.01, 0.0, False, steps=m, tokens=m))
    assert sizes == [1, 10, 20, 40, 40]
    assert length.next() == 4  # a miss teaches the draft length nothing
    length.update(4, 4)
    assert length.next() == 8 and length.chunk() == 10
    assert DoublingLength(maximum=16).chunk() == 1  # a verifier without chunks


def test_auto_means_the_schedule_that_suits_the_drafter():
    from drafter.runner import draft_length
    from drafter.settings import DrafterSettings
    from server.shared.info import InfoResponse

    info = InfoResponse.model_construct(max_draft=16)

    def length(**options):
        settings = DrafterSettings(**options)
        return draft_length(settings, settings.request_options(), info)

    assert isinstance(length(draft_n="auto"), LinkAwareLength)
    assert isinstance(length(draft_n="auto", drafter="model+ngram"), LinkAwareLength)
    assert isinstance(length(draft_n="auto", drafter="ngram"), DoublingLength)
    assert length(draft_n="auto", drafter="ngram").maximum == 16
    assert length(draft_n=3) == FixedLength(3)
    # `serve`'s warm-up timing reaches auto, and its slot's memory (drafter/length/length_memory.py)
    auto = DrafterSettings(draft_n="auto")
    timed = draft_length(auto, auto.request_options(), info, draft_s_prior=0.03)
    assert timed.draft_s_prior == 0.03
    remembered = draft_length(
        auto, auto.request_options(), info, memory=LengthMemory(), draft_s_prior=0.03
    )
    assert isinstance(remembered, RememberingLength) and remembered.draft_s_prior == 0.03


def test_parse_draft_n():
    assert parse_draft_n("auto") == "auto"
    assert parse_draft_n(" AUTO ") == "auto"
    assert parse_draft_n("7") == 7
    for bad in ("-1", "many", "1.5", "257"):
        with pytest.raises(ValueError):
            parse_draft_n(bad)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, LinkAwareLength),
        ({"drafter": "ngram"}, DoublingLength),
        ({"drafter": "ngram", "seed": 3}, DoublingLength),  # acceptance only, no chunks
        ({"seed": 3, "temperature": 0.7}, FixedLength),  # timings vary: a seed must repeat
        ({"draft_n": "6"}, FixedLength),
    ],
)
def test_what_auto_means_for_each_drafter(options, expected):
    from drafter.runner import SEEDED_DRAFT_N, draft_length
    from drafter.settings import DrafterSettings

    info = type("Info", (), {"max_draft": 16, "max_chunk_tokens": 64})()
    settings = DrafterSettings(**options)
    length = draft_length(settings, settings.request_options(), info)
    assert isinstance(length, expected)
    if "seed" in options and expected is FixedLength:
        assert length.next() == SEEDED_DRAFT_N
    if "seed" in options:  # no chunk paced by measured times: the run repeats
        assert length.chunk() == 1


def drive(
    length: LinkAwareLength,
    rounds: int,
    per_row_s: float,
    fixed_s: float,
    advised,
    draft_token_s: float = 0.005,
    pass_sessions: float | None = None,
    chunks: list[int] | None = None,
):
    """Rounds as `auto` asks for them against a verifier whose pass costs fixed + per row,
    a 2 ms link and `draft_token_s` a drafted token; the advice the verifier gives each
    time, and the sessions its passes hold. The draft lengths sent, 0 for a round without
    a draft (whose sizes go to `chunks`)."""
    sent = []
    for _ in range(rounds):
        k = length.next()
        sent.append(k)
        if k == 0:
            m = length.chunk()
            if chunks is not None:
                chunks.append(m)
            verifier_s = m * (fixed_s + per_row_s)
            length.update(0, 0)
            length.advise(advised, pass_sessions)
            length.observe(
                RoundTiming(1, verifier_s, verifier_s + 0.002, 0.0, False, steps=m, tokens=m)
            )
        else:
            verifier_s = fixed_s + per_row_s * (k + 1)
            accepted = round(0.8 * k)
            length.update(k, accepted)
            length.advise(advised, pass_sessions)
            length.observe(timing(k + 1, verifier_s, 0.002, draft_token_s * k, tokens=accepted + 1))
    return sent


def probes_of_chunks(sent: list[int]) -> list[int]:
    """Where the rounds without a draft came among drafted ones: the drafted rounds before
    each."""
    return [sum(1 for k in sent[:i] if k) for i, k in enumerate(sent) if k == 0]


def test_advised_0_auto_sends_chunks_from_the_first_round_and_drafts_only_to_probe_late():
    length = LinkAwareLength(maximum=16, max_chunk=64)
    length.advise(0)  # the prefill's answer: before the first round
    sent = drive(length, 60, per_row_s=0.009, fixed_s=0.0, advised=0)
    assert sent[:16] == [0] * 16
    assert [k for k in sent if k] == [1, 1]  # after 16 chunks, then 32; the shortest draft
    assert 8 <= length.chunk() <= 64  # a few tenths of a second of the verifier's


def test_chunks_grow_to_a_bound_and_never_past_the_verifiers_limit():
    length = LinkAwareLength(maximum=16, max_chunk=24)
    length.advise(0)
    chunks = []
    for _ in range(6):
        chunks.append(length.chunk())
        drive(length, 1, per_row_s=0.005, fixed_s=0.0, advised=0)
    assert chunks == sorted(chunks) and chunks[-1] == 24 and chunks[0] < 24


def test_where_drafting_pays_auto_drafts_within_the_advice():
    """A pass costs its fixed part, rows next to nothing (a GPU): drafts pay, as long as
    the advice allows them. The session has the passes to itself."""
    length = LinkAwareLength(maximum=16, max_chunk=64)
    chunks: list[int] = []
    sent = drive(
        length, 40, per_row_s=0.0002, fixed_s=0.02, advised=6, pass_sessions=1.0, chunks=chunks
    )
    assert max(sent) <= 6
    # Only short chunks that measure what chunks give, after 4, 8 then 16 drafted rounds.
    assert probes_of_chunks(sent) == [4, 12, 28]
    assert all(m <= round(CHUNK_S_FIRST / 0.02) for m in chunks)


@pytest.mark.parametrize("pass_sessions", [1.0, 4.0])
def test_where_this_drafter_drafts_too_slowly_for_the_advice_alone_auto_sends_chunks(
    pass_sessions,
):
    """A CPU verifier advises a draft of 1 (its 2-row pass costs less than two steps), but
    each draft token costs this drafter most of a step: chunks come 1.3x faster. Alone
    (the verifier's passes hold this session's rounds only) the probe of chunks shows it
    and chunks are sent from then on, a drafted round now and then; where other sessions
    share the passes, a chunk's step waits for their pass, as a chunk is priced already:
    no chunk is sent to measure it, and drafting goes on."""
    length = LinkAwareLength(maximum=16, max_chunk=64, watched=False)
    length.advise(1, pass_sessions)  # the prefill's
    sent = drive(
        length, 40, per_row_s=0.009, fixed_s=0.002, advised=1, draft_token_s=0.007,
        pass_sessions=pass_sessions,
    )  # fmt: skip
    assert sent[:4] == [1] * 4
    if pass_sessions == 1.0:
        assert sent[4] == 0 and sent[-20:].count(0) >= 15  # chunks, a drafted round now and then
    else:
        assert 0 not in sent


def test_where_the_verifier_cannot_chunk_auto_drafts_as_before():
    length = LinkAwareLength(maximum=16, max_chunk=1)
    length.advise(0)
    assert 0 not in drive(length, 20, per_row_s=0.009, fixed_s=0.0, advised=0)


def test_advice_that_allows_drafts_still_chunks_where_the_drafter_costs_more_and_probes():
    """The verifier advises 1 (a draft pays it), but each draft token costs this drafter
    80 ms, four passes. One drafted round shows the drafting time; with drafts made
    ahead as often as not (nothing has shown otherwise), a round whose draft waits for the
    drafter costs more than chunks win: chunks from then on, and a drafted round
    measures again after 4, 8, then 16 chunks."""
    length = LinkAwareLength(maximum=16, max_chunk=64, start=1)
    sent = drive(length, 40, per_row_s=0.0002, fixed_s=0.02, advised=1, draft_token_s=0.08)
    drafted = [i for i, k in enumerate(sent) if k > 0]
    assert drafted[0] == 0 and sent[1] == 0
    assert sent.count(0) > 30
    gaps = [b - a - 1 for a, b in itertools.pairwise(drafted)]
    assert gaps[:3] == [4, 8, 16]


def test_drafts_made_ahead_count_as_often_as_they_were_ready():
    """The expected rate of drafted rounds mixes rounds whose draft was made while the
    round before was out (no drafting on the user's path) with rounds drafted after the
    answer, by the share measured: where no draft is ever ready in time, the rate is the
    after-the-answer one; where every one is, the ahead one."""
    never, always = LinkAwareLength(maximum=8), LinkAwareLength(maximum=8)
    for length, ahead in ((never, False), (always, True)):
        for _ in range(60):
            length.observe(timing(4, 0.04, 0.01, 0.0 if ahead else 0.06, ahead=ahead))
    never._draft_s = always._draft_s = 0.02  # the same drafter
    for length, ahead in ((never, False), (always, True)):
        rate = length.expected_tokens_per_s(length.next(ahead), ahead)
        assert length.expected_drafting_per_s() == pytest.approx(rate, rel=0.01)
    assert always.expected_drafting_per_s() > never.expected_drafting_per_s()


def test_under_load_advice_above_0_makes_auto_draft_where_its_own_rows_model_would_chunk():
    """Loaded: a pass holds many sessions, and a draft's rows add little to it. The chunks
    measured before (one row a pass) tell nothing of that; once the verifier advises a
    draft, auto drafts, measures, and keeps drafting while drafted rounds come faster."""
    length = LinkAwareLength(maximum=16, max_chunk=64)
    length.advise(0)  # idle when the session opened
    loaded = drive(length, 8, per_row_s=0.003, fixed_s=0.047, advised=0)
    assert loaded == [0] * 8
    then = drive(length, 30, per_row_s=0.003, fixed_s=0.047, advised=2)
    assert then[0] == 0  # asked before the answer that advised 2
    assert then[1] == 0  # one more while the draft model catches up (drafts_soon)
    assert 0 not in then[2:] and set(then[2:]) <= {1, 2}


def test_advice_above_0_still_chunks_where_measured_drafted_rounds_come_slower():
    """A slow link: each drafted round pays it for a couple of tokens, a chunk once for
    dozens. Measured, the chunks win, whatever the advice."""
    length = LinkAwareLength(maximum=16, max_chunk=64)
    for _ in range(40):
        k = length.next()
        length.advise(3)
        if k == 0:
            m = length.chunk()
            length.update(0, 0)
            length.observe(RoundTiming(1, m * 0.01, m * 0.01 + 0.2, 0.0, False, steps=m, tokens=m))
        else:
            length.update(k, k // 2)
            length.observe(timing(k + 1, 0.012, 0.2, 0.0, ahead=True, tokens=k // 2 + 1))
    assert length.chunking and length.next() == 0


def test_auto_drafts_again_once_the_link_that_made_chunks_faster_is_gone():
    """A slow link made chunks faster; then the link turns fast. The drafted rounds
    measured on the slow link age while chunks are sent, and auto drafts again."""
    length = LinkAwareLength(maximum=16, max_chunk=64)

    def rounds(n: int, link_s: float) -> list[int]:
        sent = []
        for _ in range(n):
            k = length.next()
            sent.append(k)
            length.advise(3)
            if k == 0:
                m = length.chunk()
                length.update(0, 0)
                length.observe(
                    RoundTiming(1, m * 0.02, m * 0.02 + link_s, 0.0, False, steps=m, tokens=m)
                )
            else:
                length.update(k, k)
                length.observe(timing(k + 1, 0.021, link_s, 0.0, ahead=True, tokens=k + 1))
        return sent

    assert rounds(60, link_s=0.5)[-10:].count(0) >= 8  # chunks, the odd probe
    assert rounds(60, link_s=0.001)[-20:].count(0) == 0


def test_under_load_a_chunk_is_priced_at_a_pass_not_at_the_line_of_rows_run_down_to_one():
    """Loaded, a round's time is the pass the other sessions fill. Advised 1 and 2 in
    turn, the rounds of 3 rows landed in fuller passes than those of 2, so the line of
    time against rows falls steeply towards one row; but a chunk's tokens wait a pass
    each all the same. Where the verifier advises drafts, auto keeps drafting."""
    length = LinkAwareLength(maximum=16, max_chunk=64)
    sent = []
    for i in range(40):
        k = length.next()
        sent.append(k)
        length.advise(1 + i % 2)
        if k == 0:
            m = length.chunk()
            length.update(0, 0)
            chunk = RoundTiming(1, m * 0.075, m * 0.075 + 0.002, 0.0, False, steps=m, tokens=m)
            length.observe(chunk)
        else:
            pass_s = 0.02 + 0.04 * k  # 2 rows: 60 ms; 3 rows: 100 ms
            length.update(k, k - 1)
            length.observe(timing(k + 1, pass_s, 0.002, 0.005 * k, tokens=k))
    assert 0 not in sent


def chunk_sizes(length, rounds: int, step_s: float = 0.01) -> list[int]:
    """The chunks asked for by `rounds` rounds without a draft, against a verifier that
    takes `step_s` a token, next to it (no link)."""
    sizes = []
    for _ in range(rounds):
        assert length.next() == 0
        m = length.chunk()
        sizes.append(m)
        length.update(0, 0)
        length.observe(RoundTiming(1, m * step_s, m * step_s, 0.0, False, steps=m, tokens=m))
    return sizes


def test_asking_for_no_drafts_unwatched_asks_for_all_the_verifier_takes_each_round():
    """`--draft-n 0` with nobody reading the tokens as they come: the fewest rounds (the
    loop caps a chunk by the tokens still wanted)."""
    assert chunk_sizes(FixedLength(0, max_chunk=64, watched=False), 4) == [64] * 4
    assert FixedLength(0).chunk() == 1  # a verifier without chunks: a token a round
    assert FixedLength(0, max_chunk=64) == FixedLength(0)  # the same length, paced alike


def test_watched_chunks_start_with_one_token_then_grow_to_a_few_updates_a_second():
    """A stream: the first token as soon as the verifier alone would give it, then chunks
    of more and more of the verifier's time, up to the bound."""
    auto = LinkAwareLength(maximum=16, max_chunk=64)
    auto.advise(0)
    for length in (FixedLength(0, max_chunk=64), auto):
        sizes = chunk_sizes(length, 6, step_s=0.01)
        assert sizes[0] == 1
        assert sizes[1] == round(CHUNK_S_FIRST / 0.01)
        assert sizes == sorted(sizes) and sizes[-1] == round(CHUNK_S_LAST / 0.01)


@pytest.mark.parametrize("watched", [False, True])
def test_advised_0_at_the_prefill_the_first_chunk_is_large_unless_watched(watched):
    length = LinkAwareLength(maximum=16, max_chunk=64, watched=watched)
    length.advise(0)  # the prefill's answer
    assert length.next() == 0 and not length.drafts_soon()
    assert length.chunk() == (1 if watched else 64)


def test_chunks_after_drafted_rounds_start_at_the_shortest_pace_not_at_one_token():
    """The stream is flowing already: no round of one token, and no waiting either."""
    length = LinkAwareLength(maximum=16, max_chunk=64, start=2)
    length.advise(2)
    length.update(2, 2)
    length.observe(timing(3, 0.03, 0.0, 0.0, tokens=3))
    length.advise(0)
    assert length.next() == 0
    assert length.chunk() == round(CHUNK_S_FIRST / length.verifier_s(1))


def test_the_round_before_auto_leaves_chunks_for_drafts_is_a_chunk_that_says_so():
    """The draft model does nothing while chunks are sent; the last chunk before a drafted
    round tells the loop to catch it up meanwhile (drafts_soon), so that the drafted
    round does not wait for it."""
    length = LinkAwareLength(maximum=16, max_chunk=64, watched=False)
    length.advise(0)
    sent = []
    for advised in (0, 2, 2, 2):
        k = length.next()
        sent.append((k, length.drafts_soon()))
        if k == 0:
            length.update(0, 0)
            length.advise(advised)
            length.observe(RoundTiming(1, 0.64, 0.64, 0.0, False, steps=64, tokens=64))
        else:
            length.update(k, k)
            length.advise(advised)
            length.observe(timing(k + 1, 0.03, 0.0, 0.01 * k, tokens=k + 1))
    assert sent[:3] == [(0, False), (0, False), (0, True)]
    assert 1 <= sent[3][0] <= 2  # a drafted round, within the advice


def test_the_drafted_round_before_a_probe_of_chunks_says_so_nothing_is_drafted_ahead():
    """While the 4th drafted round under advice is out, the loop drafts nothing ahead for
    the next round: it is the short chunk that measures chunks, whatever the answer."""
    length = LinkAwareLength(maximum=16, max_chunk=64, watched=False)
    length.advise(2, 1.0)
    soon = []
    for _ in range(4):
        k = length.next()
        assert k > 0
        soon.append(length.chunk_soon())  # asked while the round is out
        length.update(k, k)
        length.advise(2, 1.0)
        length.observe(timing(k + 1, 0.02, 0.001, 0.001 * k, tokens=k + 1))
    assert soon == [False, False, False, True]
    assert length.next() == 0 and length.next(ahead=True) == 0
    assert not FixedLength(4).chunk_soon()
