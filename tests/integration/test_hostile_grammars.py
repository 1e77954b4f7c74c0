"""Grammars on a shared verifier (docs/deployment.md, "Grammars"): a key's constraint
costs that key. With the real vocabulary: a round's masks computed
row by row are the states' own masks; a grammar slower than its row budget is failed
for good; compile limits refuse a grammar and remember it; one key's compiled grammars
never evict another's. Through a real verifier with two keys: mallory's ambiguous
grammar (rounds of 16 drafts) and nested counted repetition beside alice, whose rounds
are all answered and token for token what she gets alone, with and without a grammar."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from server.shared import grammars as grammars_module
from server.shared.constraint import GrammarError, GrammarTooSlow
from server.shared.grammars import GrammarLimits, Grammars
from server.shared.runtime import LlamaVocab
from tests.conftest import start_verifier
from tests.integration.test_grammar import PERSON, PROMPT

pytestmark = pytest.mark.integration

AMBIGUOUS = 'start: x\nx: x x | x x x | "a" | "b" | " "'
NESTED = "((a{1000}){1000}){1000}"  # a lexer of about 190 MB, seconds to build
ALICE, MALLORY = "alice-key-0123456789", "mallory-key-0123456789"
# Its only way to an end through llguidance's `%json`, which the check does not read; and
# no end before 300 characters, more than the bound's tokens can hold.
UNPROVEN = {"kind": "lark", "source": 'start: /a{300}/ tail\ntail: %json {"type": "string"}'}
UNPROVEN_BOUND = 8


@pytest.fixture(scope="module")
def vocab(verifier_model) -> LlamaVocab:
    return LlamaVocab(verifier_model, vocab_only=True)


def grammars(vocab, **limits) -> Grammars:
    return Grammars(vocab.grammar_tokenizer, vocab.n_vocab, GrammarLimits(**limits))


def test_masks_row_by_row_are_the_states_own_after_each_draft_token(vocab):
    constraint = grammars(vocab).constraint("json_schema", PERSON)
    draft = vocab.tokenize('{"name": "Ann", "age": 42, "city"', add_special=False)
    bad = vocab.tokenize("}", add_special=False)  # forbidden after '{"name"'
    for tokens in (draft, [*draft[:3], *bad, *draft[3:6]]):
        rows = constraint.row_masks(tokens)
        undo = []
        for i, token in enumerate(tokens):
            assert np.array_equal(rows[i], constraint.row_masks([])[0]), i
            if not rows[i].view(np.uint8)[token // 8] >> (token % 8) & 1:
                assert (rows[i + 1 :] == -1).all()  # after a forbidden token: never read
                break
            undo.append(constraint.commit([token]))
        for step in reversed(undo):
            step()
    assert np.array_equal(constraint.row_masks([]), grammars(vocab).constraint(
        "json_schema", PERSON).row_masks([]))  # fmt: skip


def test_committed_tokens_are_consumed_by_the_next_masks_and_a_refusal_fails_the_grammar(vocab):
    shelf = grammars(vocab)
    deferred, committed = (shelf.constraint("regex", "(ab)+") for _ in range(2))
    a, b = (vocab.tokenize(c, add_special=False)[0] for c in "ab")
    deferred.defer([a, b, a])
    committed.commit([a, b, a])
    assert np.array_equal(deferred.row_masks([b]), committed.row_masks([b]))
    undo = deferred.defer([b])
    undo()  # handed back before any mask: as if never handed
    assert np.array_equal(deferred.row_masks([]), committed.row_masks([]))
    deferred.defer([a])  # "a" after "aba": refused when the next masks consume it
    for _ in range(2):
        with pytest.raises(GrammarError, match="refused its committed tokens"):
            deferred.row_masks([])


def test_a_row_over_its_budget_fails_the_grammar_for_good(vocab):
    constraint = grammars(vocab).constraint("lark", AMBIGUOUS)
    with pytest.raises(GrammarTooSlow, match="VERIFIER_GRAMMAR_ROW_MS"):
        constraint.row_masks([], row_budget_s=1e-9)
    with pytest.raises(GrammarError, match="VERIFIER_GRAMMAR_ROW_MS"):
        constraint.row_masks([])  # no budget now: failed all the same


def counting_compiles(monkeypatch) -> list[str]:
    compiled: list[str] = []
    real = grammars_module.compile_grammar

    def compile_grammar(kind, source, *rest):
        compiled.append(str(source))
        return real(kind, source, *rest)

    monkeypatch.setattr(grammars_module, "compile_grammar", compile_grammar)
    return compiled


def test_compile_limits_refuse_a_grammar_and_remember_it(vocab, monkeypatch):
    compiled = counting_compiles(monkeypatch)
    slow = grammars(vocab, compile_s=1e-9)
    for _ in range(2):
        with pytest.raises(GrammarError, match="VERIFIER_GRAMMAR_COMPILE_S"):
            slow.constraint("regex", "(ab)+", owner="mallory")
    assert compiled == ["(ab)+"]  # the second refused without compiling
    big = grammars(vocab, grammar_bytes=64_000_000)
    before = grammars_module.allocated_bytes()
    for n in range(2):  # each measured whole: the first's memory is gone when it is refused
        with pytest.raises(GrammarError, match="VERIFIER_GRAMMAR_MAX_MB") as refused:
            big.constraint("regex", f"{NESTED}x{n}", owner="mallory")
        assert grammars_module.allocated_bytes() - before < 32_000_000
        del refused
    assert big.held_bytes("mallory") == 0


def test_a_keys_grammars_never_evict_anothers(vocab, monkeypatch):
    compiled = counting_compiles(monkeypatch)
    shelf = grammars(vocab, kept_per_owner=2)
    shelf.constraint("regex", "alice+", owner="alice")
    for n in range(4):
        shelf.constraint("regex", f"m{n}+", owner="mallory")
    shelf.constraint("regex", "alice+", owner="alice")  # kept: no compile
    shelf.constraint("regex", "m3+", owner="mallory")  # among her two newest: kept
    shelf.constraint("regex", "m0+", owner="mallory")  # her oldest went: compiled again
    shelf.constraint("regex", "alice+", owner="mallory")  # alice's is not hers
    assert compiled == ["alice+", "m0+", "m1+", "m2+", "m3+", "m0+", "alice+"]


def prefill(client: httpx.Client, key: str, grammar: dict | None, prompt: str = PROMPT):
    body = {"prompt": prompt, **({"grammar": grammar} if grammar else {})}
    return client.post("/prefill", json=body, headers=auth(key))


def auth(key: str) -> dict[str, str]:
    return {"X-API-Key": key} if key else {}


def rounds(client, key, session_id, n_past, tokens: int, draft: list[int] = ()) -> tuple:
    """Rounds until `tokens` are committed: (every status, the tokens)."""
    statuses, got = [], []
    while len(got) < tokens:
        body = {"session_id": session_id, "n_past": n_past, "draft_tokens": list(draft)}
        answer = client.post("/verify", json=body, headers=auth(key))
        statuses.append(answer.status_code)
        if answer.status_code != 200:
            break
        got += answer.json()["tokens"]
        n_past = answer.json()["total_tokens"]
        if answer.json()["eos"]:
            break
    return statuses, got


@pytest.fixture(scope="module")
def two_keys(verifier_model):
    # A small bound on grammars whose end is unproven: none of the others' is.
    verifier = start_verifier(
        verifier_model, api_keys=f"{ALICE},{MALLORY}", max_sessions=6, max_draft=16,
        grammar_unproven_tokens=UNPROVEN_BOUND,
    )  # fmt: skip
    yield verifier
    verifier.stop()


def test_mallorys_grammars_cost_mallory_and_alice_is_answered_exactly(two_keys, vocab):
    client = httpx.Client(base_url=two_keys.url, timeout=300)
    json_grammar = {"kind": "json_schema", "source": PERSON}

    def generate(grammar=None) -> list[int]:
        body = {"prompt": PROMPT, "max_tokens": 24, **({"grammar": grammar} if grammar else {})}
        answer = client.post("/generate", json=body, headers={"X-API-Key": ALICE})
        assert answer.status_code == 200, answer.text
        return answer.json()["tokens"]

    alone = {"plain": generate(), "json": generate(json_grammar)}
    a, b = (vocab.tokenize(c, add_special=False)[0] for c in "ab")
    mallory_statuses: list[int] = []
    alice_done = threading.Event()

    def mallory() -> None:
        with httpx.Client(base_url=two_keys.url, timeout=300) as own:
            big = prefill(own, MALLORY, {"kind": "regex", "source": NESTED})
            mallory_statuses.append(big.status_code)
            assert big.status_code == 400 and "VERIFIER_GRAMMAR_MAX_MB" in big.text
            while not alice_done.is_set():
                opened = prefill(own, MALLORY, {"kind": "lark", "source": AMBIGUOUS}, "x")
                mallory_statuses.append(opened.status_code)
                if opened.status_code != 200:
                    continue
                session = opened.json()
                statuses, _ = rounds(
                    own, MALLORY, session["session_id"], session["total_tokens"], 48,
                    [a, b] * 8,
                )  # fmt: skip
                mallory_statuses.extend(statuses)
                own.delete(f"/sessions/{session['session_id']}", headers={"X-API-Key": MALLORY})

    attackers = [threading.Thread(target=mallory) for _ in range(2)]
    for thread in attackers:
        thread.start()
    try:
        results = {}
        for name, grammar in (("plain", None), ("json", json_grammar)):
            opened = prefill(client, ALICE, grammar)
            assert opened.status_code == 200, opened.text
            session = opened.json()
            statuses, got = rounds(
                client, ALICE, session["session_id"], session["total_tokens"], 24
            )
            assert set(statuses) == {200}
            results[name] = got[:24]
    finally:
        alice_done.set()
        for thread in attackers:
            thread.join(timeout=600)
    assert results == alone
    assert mallory_statuses and set(mallory_statuses) <= {200, 400, 503}


def test_a_grammar_over_its_row_budget_ends_that_sessions_generation(verifier_model):
    verifier = start_verifier(verifier_model, grammar_row_ms=0.001, max_sessions=2)
    try:
        with httpx.Client(base_url=verifier.url, timeout=300) as client:
            opened = prefill(client, "", {"kind": "json_schema", "source": PERSON})
            assert opened.status_code == 200, opened.text
            session = opened.json()
            for _ in range(2):  # refused, and again at once: the grammar failed for good
                statuses, _ = rounds(client, "", session["session_id"], session["total_tokens"], 4)
                assert statuses == [400]
            body = {"session_id": session["session_id"], "n_past": session["total_tokens"]}
            answer = client.post("/verify", json=body)
            assert "VERIFIER_GRAMMAR_ROW_MS" in answer.json()["error"]["message"]
            plain = prefill(client, "", None)  # a session without a grammar: untouched
            statuses, got = rounds(
                client, "", plain.json()["session_id"], plain.json()["total_tokens"], 4
            )
            assert set(statuses) == {200} and len(got) >= 4
    finally:
        verifier.stop()


def test_grammars_that_can_never_end_are_refused_at_prefill(two_keys):
    never = [
        {"kind": "lark", "source": 'start: "a" start'},
        {"kind": "gbnf", "source": 'root ::= "a" root'},
        {"kind": "json_schema", "source": {"$ref": "#"}},
        {"kind": "json_schema", "source": {
            "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}},
    ]  # fmt: skip
    with httpx.Client(base_url=two_keys.url, timeout=300) as client:
        for grammar in never:
            answer = prefill(client, MALLORY, grammar)
            assert answer.status_code == 400, (grammar, answer.text)
            assert "can never end" in answer.json()["error"]["message"]
        linked = {  # recursive, but `next` may be null: it ends
            "$defs": {"Node": {"type": "object", "required": ["next"], "properties": {
                "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}},
            "$ref": "#/$defs/Node",
        }  # fmt: skip
        answer = prefill(client, MALLORY, {"kind": "json_schema", "source": linked})
        assert answer.status_code == 200, answer.text
        client.delete(f"/sessions/{answer.json()['session_id']}", headers=auth(MALLORY))


def test_a_grammar_nested_past_what_json_reads_is_refused_not_an_error(vocab):
    shelf = grammars(vocab)
    for kind, source in (
        ("regex", "[" * 3000),
        ("lark", "[" * 3000),
        ("json_schema", '{"a":' * 3000),
    ):
        with pytest.raises(GrammarError):
            shelf.constraint(kind, source)


def test_a_grammar_whose_end_is_unproven_stops_at_its_bound_and_says_so(two_keys):
    with httpx.Client(base_url=two_keys.url, timeout=300) as client:
        body = {"prompt": PROMPT, "max_tokens": 64, "grammar": UNPROVEN}
        alone = client.post("/generate", json=body, headers=auth(ALICE)).json()
        assert alone["grammar_token_limit"] == UNPROVEN_BOUND and not alone["eos"]
        assert len(alone["tokens"]) == UNPROVEN_BOUND
        opened = prefill(client, ALICE, UNPROVEN)
        assert opened.status_code == 200, opened.text
        session = opened.json()
        assert session["grammar_token_limit"] == UNPROVEN_BOUND
        # A chunk asking for more ends at the bound, with the verifier's own tokens.
        round_ = {"session_id": session["session_id"], "n_past": session["total_tokens"]}
        chunk = client.post("/verify", json=round_ | {"chunk_tokens": 20}, headers=auth(ALICE))
        assert chunk.status_code == 200, chunk.text
        assert chunk.json()["tokens"] == alone["tokens"]
        past = {**round_, "n_past": chunk.json()["total_tokens"]}
        refused = client.post("/verify", json=past, headers=auth(ALICE))
        assert refused.status_code == 400
        assert refused.json()["error"]["type"] == "grammar_token_limit"
        assert "VERIFIER_GRAMMAR_UNPROVEN_TOKENS" in refused.json()["error"]["message"]
        client.delete(f"/sessions/{session['session_id']}", headers=auth(ALICE))
        proven = prefill(client, ALICE, {"kind": "json_schema", "source": PERSON})
        assert proven.status_code == 200 and "grammar_token_limit" not in proven.json()
        client.delete(f"/sessions/{proven.json()['session_id']}", headers=auth(ALICE))
