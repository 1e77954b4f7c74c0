"""The cycle step on its own: plain jobs in, a `Step` out. No threads, no asyncio, no
futures: each test builds the queue it wants and reads what one step did."""

from __future__ import annotations

from server.shared.protocol import PrefillRequest, VerifyRequest, VerifyResponse
from server.verifier.decoding.checks import round_key
from server.verifier.decoding.jobs import Opened
from server.verifier.errors import EngineInterrupted, SessionNotFound
from server.verifier.scheduling.cycle import CycleStep, Job, PromptTurns
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import make_engine


def build(**settings) -> tuple[FakeRuntime, CycleStep]:
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    return runtime, CycleStep(make_engine(runtime, max_draft=4, **settings))


def prompt_job(text: str, owner: str = "a") -> Job:
    return Job(owner, None, request=PrefillRequest(prompt=text))


def round_job(opened: Opened, draft: list[int], owner: str = "a") -> Job:
    request = VerifyRequest(
        session_id=opened.response.session_id,
        n_past=len(opened.session.tokens),
        draft_tokens=draft,
    )
    return Job(owner, request.session_id, request=request, round_key=round_key(request))


def open_session(cycle: CycleStep, text: str, owner: str = "a", constraint=None) -> Opened:
    """A session of `text`'s prompt (under `constraint`, a grammar's state, if given)."""
    job = prompt_job(text, owner)
    job.constraint = constraint
    for _ in range(16):
        answers = dict(cycle.step([job]).answers)
        if job in answers:
            assert isinstance(answers[job], Opened), answers[job]
            return answers[job]
    raise AssertionError("the prompt never finished")


def test_a_round_is_decoded_and_answered_in_one_step_with_what_the_metrics_count():
    runtime, cycle = build()
    opened = open_session(cycle, "hello there")
    expected = runtime.reference_greedy(opened.response.prompt_ids, 4)
    job = round_job(opened, [expected[0], expected[1], 63])
    step = cycle.step([job])
    ((answered, response),) = step.answers
    assert answered is job and isinstance(response, VerifyResponse)
    assert response.tokens == expected[:3] and response.accepted_prefix_len == 2
    assert step.rounds == [(3, 2)] and step.rounds_decoded == 1
    assert step.answered_rounds == [("a", opened.response.session_id)]
    assert [p.kind for p in step.passes] == ["rounds"] and step.passes[0].real_rows == 4
    assert response.timings.decode_ms == round(step.passes[0].seconds * 1000.0, 3)
    check_engine(cycle.engine)


def test_a_prompt_counts_what_it_evaluated_and_opens_its_session():
    _runtime, cycle = build()
    job = prompt_job("one prompt")
    step = cycle.step([job])
    ((_, opened),) = step.answers
    assert isinstance(opened, Opened) and opened.session.session_id == job.session_id
    assert step.prompt_tokens_evaluated == opened.response.prompt_len - 1
    assert step.prompt_tokens_reused == 0 and step.rounds_decoded == 0
    assert [p.kind for p in step.passes] == ["prompt"]


def test_rounds_and_a_prompt_waiting_together_take_turns_step_by_step():
    _runtime, cycle = build(prompt_chunk=8)
    opened = open_session(cycle, "a session")
    long_prompt = prompt_job("x" * 40, owner="b")
    first_round = round_job(opened, [])
    step = cycle.step([first_round, long_prompt])
    assert [job for job, _ in step.answers] == [first_round]  # the round, not the chunk
    assert cycle.prompt_next and [p.kind for p in step.passes] == ["rounds"]
    step = cycle.step([long_prompt])
    assert step.answers == [] and [p.kind for p in step.passes] == ["prompt"]
    assert not cycle.prompt_next


def test_a_job_behind_unfinished_work_of_its_session_waits_for_a_later_step():
    _runtime, cycle = build()
    opened = open_session(cycle, "a session")
    first = round_job(opened, [])
    delete = Job("a", first.session_id, call=lambda: cycle.engine.sessions.delete(first.session_id))
    step = cycle.step([first, delete])
    assert [job for job, _ in step.answers] == [first]
    step = cycle.step([delete])
    assert step.answers == [(delete, None)] and step.ended == [("a", first.session_id)]
    check_engine(cycle.engine)


def test_a_replay_is_answered_from_its_record_without_a_decode():
    _runtime, cycle = build()
    opened = open_session(cycle, "a session")
    original, replay = round_job(opened, [5]), round_job(opened, [5])  # a client's retry
    ((_, first),) = cycle.step([original]).answers
    step = cycle.step([replay])
    assert step.answers == [(replay, first)] and step.replayed == 1 and step.passes == []


def test_an_error_is_the_jobs_answer_and_touches_no_other_job():
    _runtime, cycle = build()
    opened = open_session(cycle, "a session")
    lost = Job("a", "nobody", request=VerifyRequest(session_id="nobody", n_past=3))
    lost.round_key = round_key(lost.request)
    fine = round_job(opened, [])
    answers = dict(cycle.step([lost, fine]).answers)
    assert isinstance(answers[lost], SessionNotFound)
    assert isinstance(answers[fine], VerifyResponse)


def test_a_failing_cycle_undoes_and_fails_every_job_it_held(monkeypatch):
    runtime, cycle = build()
    opened = open_session(cycle, "a session")
    before = list(runtime.cells[opened.session.seq_id])
    jobs = [round_job(opened, [7, 8]), prompt_job("a newcomer", owner="b")]

    def broken(*args):
        raise RuntimeError("the pass broke")

    monkeypatch.setattr(cycle.engine, "run", broken)
    step = cycle.step(jobs)
    assert [job for job, _ in step.answers] == jobs
    assert all(isinstance(error, EngineInterrupted) for _, error in step.answers)
    assert opened.session.work is None and runtime.cells[opened.session.seq_id] == before
    check_engine(cycle.engine)


def test_a_job_already_finished_is_never_run_again():
    runtime, cycle = build()
    opened = open_session(cycle, "a session")
    job = round_job(opened, [])
    cycle.step([job])
    decodes = len(runtime.decodes)
    step = cycle.step([job])  # a caller that passes it again by mistake
    assert step.answers == [] and len(runtime.decodes) == decodes


def test_prompt_turns_go_round_the_keys_in_arrival_order():
    turns = PromptTurns()
    queued = [prompt_job("1", "m"), prompt_job("2", "m"), prompt_job("3", "a")]
    picked = [turns.next(queued)[0].owner for _ in range(4)]
    assert picked == ["m", "a", "m", "a"]
    assert turns.next(queued[2:]) == [queued[2]]  # only a's left: a's turn
    assert turns.next([]) == []


def test_a_prompts_turn_begins_no_round_so_none_is_left_begun_if_its_request_goes():
    """A round begun is decoded in the same step: on a prompt's turn the round waits
    unbegun, and if its request goes away meanwhile its session is not left busy."""
    _runtime, cycle = build(prompt_chunk=8)
    opened = open_session(cycle, "a session")
    cycle.step([round_job(opened, []), prompt_job("x" * 40, owner="b")])  # a round's step
    assert cycle.prompt_next
    gone = round_job(opened, [])
    long_prompt = prompt_job("y" * 40, owner="b")
    step = cycle.step([gone, long_prompt])  # the prompt's turn
    assert step.answers == [] and gone.work is None and opened.session.work is None
    # The request went away (never passed again): the session takes its next round.
    retry = round_job(opened, [])
    ((job, answer),) = cycle.step([retry]).answers
    assert job is retry and isinstance(answer, VerifyResponse)
    check_engine(cycle.engine)


def chunk_job(opened: Opened, n: int, owner: str = "a") -> Job:
    request = VerifyRequest(
        session_id=opened.response.session_id,
        n_past=len(opened.session.tokens),
        chunk_tokens=n,
    )
    return Job(owner, request.session_id, request=request, round_key=round_key(request))


def test_a_chunk_stays_queued_with_a_row_in_every_pass_until_it_has_its_tokens():
    """Continuous batching: the chunk's next token is in each pass of rounds, beside the
    other sessions' drafted rounds, and one answer carries them all."""
    runtime, cycle = build()
    chunked, drafted = open_session(cycle, "a chunk"), open_session(cycle, "drafts", owner="b")
    expected = runtime.reference_greedy(chunked.response.prompt_ids, 4)
    job = chunk_job(chunked, 4)
    for _ in range(3):
        step = cycle.step([job, round_job(drafted, [1, 2], owner="b")])
        assert job not in dict(step.answers) and step.rounds_decoded == 2
        assert step.answered_rounds == [("b", drafted.response.session_id)]
    step = cycle.step([job])
    ((answered, answer),) = step.answers
    assert answered is job and answer.tokens == expected and answer.preds == expected
    assert answer.accepted_prefix_len == 0 and answer.timings.decoded_tokens == 4
    assert answer.total_tokens == len(chunked.session.tokens)
    assert step.answered_rounds == [("a", chunked.response.session_id)]
    # Recorded: the same request again is a replay, not more tokens.
    again = chunk_job_like(job)
    assert cycle.step([again]).answers == [(again, answer)]
    check_engine(cycle.engine)


def chunk_job_like(job: Job) -> Job:
    return Job(job.owner, job.session_id, request=job.request, round_key=job.round_key)


def test_a_chunk_whose_step_fails_is_answered_with_the_steps_before_it(monkeypatch):
    runtime, cycle = build()
    opened = open_session(cycle, "steps then a failure")
    expected = runtime.reference_greedy(opened.response.prompt_ids, 2)
    job = chunk_job(opened, 6)
    cycle.step([job])
    cycle.step([job])

    def broken(*args):
        raise RuntimeError("the pass broke")

    with monkeypatch.context() as patch:
        patch.setattr(cycle.engine, "run", broken)
        ((answered, answer),) = cycle.step([job]).answers
    assert answered is job and isinstance(answer, VerifyResponse)
    assert answer.tokens == expected and answer.total_tokens == len(opened.session.tokens)
    assert opened.session.work is None
    again = chunk_job_like(job)
    assert cycle.step([again]).answers == [(again, answer)]  # a retry gets the same
    check_engine(cycle.engine)


def test_a_chunk_failing_at_its_first_step_is_answered_with_the_error(monkeypatch):
    _runtime, cycle = build()
    opened = open_session(cycle, "a failure first")
    before = list(opened.session.tokens)

    def broken(*args):
        raise RuntimeError("the pass broke")

    monkeypatch.setattr(cycle.engine, "run", broken)
    job = chunk_job(opened, 6)
    ((_, error),) = cycle.step([job]).answers
    assert isinstance(error, EngineInterrupted) and opened.session.tokens == before
    check_engine(cycle.engine)
