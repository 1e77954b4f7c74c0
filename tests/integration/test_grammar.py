"""Decoding under a grammar, exact under split speculation: the real verifier and draft
model. Greedy output under a JSON schema equals the verifier alone under it (its
/generate), whatever the rounds (drafts of several lengths, chunks), and parses and
validates against the schema."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from server.shared.constraint import GrammarError
from server.shared.grammars import Grammars
from server.shared.protocol import Grammar, PrefillRequest, VerifyRequest
from server.shared.runtime import LlamaVocab
from tests.fixtures.scripted_length import ScriptedLength
from tests.fixtures.speculate import speculate

pytestmark = pytest.mark.integration

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
ROUNDS = [(0, 3), (3, 1), (1, 1), (0, 1), (6, 1), (2, 1)]  # drafts and chunks in turn


def matches_schema(value: dict) -> bool:
    return (
        set(value) == {"name", "age", "city"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 24
        and isinstance(value["age"], int)
        and 0 <= value["age"] <= 150
        and value["city"] in ("Paris", "London", "Rome")
    )


@pytest.fixture(scope="module")
def vocab(verifier_model) -> LlamaVocab:
    return LlamaVocab(verifier_model, vocab_only=True)


def test_a_row_is_masked_by_the_state_after_the_drafts_before_it(vocab):
    grammars = Grammars(vocab.grammar_tokenizer, vocab.n_vocab)
    constraint = grammars.constraint("regex", "(ab)+")
    a, b = (vocab.tokenize(c, add_special=False)[0] for c in "ab")
    rows = constraint.mask_rows(np.zeros((3, vocab.n_vocab), dtype=np.float32), [a, b])
    assert rows[0, a] == 0 and rows[0, b] == -np.inf  # first: only "a"
    assert rows[1, b] == 0 and rows[1, a] == -np.inf  # after "a": only "b"
    assert rows[2, a] == 0  # after "ab": "a" again (or the end)
    # A forbidden draft: its row forbids it; the state is where it was.
    rows = constraint.mask_rows(np.zeros((3, vocab.n_vocab), dtype=np.float32), [b, a])
    assert rows[0, b] == -np.inf
    undo = constraint.commit([a])
    assert constraint.mask_rows(np.zeros((1, vocab.n_vocab), dtype=np.float32), [])[0, a] < 0
    undo()
    with pytest.raises(GrammarError):
        constraint.commit([b])
    assert constraint.mask_rows(np.zeros((1, vocab.n_vocab), dtype=np.float32), [])[0, a] == 0
    with pytest.raises(GrammarError):
        grammars.constraint("lark", "start: (")


def generate(url: str, prompt_ids: list[int], grammar: dict, max_tokens: int = 64) -> dict:
    response = httpx.post(
        f"{url}/generate",
        json={"prompt_tokens": prompt_ids, "max_tokens": max_tokens, "grammar": grammar},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
def test_greedy_under_a_json_schema_equals_the_verifier_alone_and_validates(
    live_verifier, drafter_model, pipeline
):
    grammar = Grammar(kind="json_schema", source=PERSON)
    with VerifierClient(live_verifier.url) as client:
        opened = client.prefill(PrefillRequest(prompt=PROMPT))
        client.delete_session(opened.session_id)
    prompt_ids = list(opened.prompt_ids)
    alone = generate(live_verifier.url, prompt_ids, grammar.model_dump())
    assert matches_schema(json.loads(alone["text"]))
    request = PrefillRequest(prompt_tokens=prompt_ids, add_bos=False, grammar=grammar)
    rounds, result = speculate(
        live_verifier.url, drafter_model, request, 64, ScriptedLength(ROUNDS), pipeline
    )
    assert result.tokens == alone["tokens"]
    assert any(r.accepted_prefix_len for r in rounds), "no draft was accepted"
    assert any(r.accepted_prefix_len < len(r.draft_tokens) for r in rounds), "none rejected"


def test_a_grammar_that_does_not_compile_is_a_400_naming_it(live_verifier):
    response = httpx.post(
        f"{live_verifier.url}/prefill",
        json={"prompt": "x", "grammar": {"kind": "lark", "source": "start: ("}},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_grammar"


def test_drafts_follow_the_grammar_so_more_are_accepted(live_verifier, drafter_model, monkeypatch):
    """The draft model drafts under the session's grammar too: the same output, and more
    of its drafts taken than when it drafts free (only acceptance is at stake). A grammar
    the model would not write on its own shows it: free drafts are words of a sentence."""
    grammar = Grammar(kind="regex", source=r"(yes|no)(, (yes|no)){0,40}")

    def run() -> tuple[list[int], int]:
        request = PrefillRequest(prompt=PROMPT, grammar=grammar)
        _, result = speculate(live_verifier.url, drafter_model, request, 48, 4)
        return result.tokens, result.stats.accepted

    followed, accepted_following = run()
    monkeypatch.setattr(DraftModel, "follow", lambda *args: None)
    free, accepted_free = run()
    assert followed == free
    assert accepted_following > accepted_free


def test_a_schemas_property_order_is_its_own(vocab):
    """Two schemas alike but for their properties' order are two grammars (the keys come
    in the order given): one compiled first must not answer for the other."""
    grammars = Grammars(vocab.grammar_tokenizer, vocab.n_vocab)
    properties = {"name": {"type": "string"}, "age": {"type": "integer"}}
    forward = {"type": "object", "properties": properties, "required": ["name", "age"]}
    backward = {**forward, "properties": dict(reversed(properties.items()))}
    start = vocab.tokenize('{"age": 3', add_special=False)
    grammars.constraint("json_schema", forward)  # compiled and kept first
    grammars.constraint("json_schema", backward).commit(start)
    with pytest.raises(GrammarError):
        grammars.constraint("json_schema", forward).commit(start)


def test_a_session_opened_again_goes_on_under_its_grammar_and_penalties(live_verifier):
    """A client that lost its session opens it again on everything committed, the
    generated tokens said as such: the grammar's state and the penalties' counts are
    after them, and the rest is what the first session would have given."""
    grammar = Grammar(kind="json_schema", source=PERSON)
    sampling = {"presence_penalty": 0.5, "frequency_penalty": 0.3}
    with VerifierClient(live_verifier.url) as client:
        opened = client.prefill(PrefillRequest(prompt=PROMPT))
        client.delete_session(opened.session_id)
    prompt_ids = list(opened.prompt_ids)
    body = {"prompt_tokens": prompt_ids, "max_tokens": 40, "grammar": grammar.model_dump()}
    whole = httpx.post(
        f"{live_verifier.url}/generate", json={**body, "sampling": sampling}, timeout=120
    ).json()["tokens"]
    cut = 6
    reopened = {
        "prompt_tokens": prompt_ids + whole[:cut],
        "generated_tokens": cut,
        "grammar": grammar.model_dump(),
        "sampling": sampling,
    }
    with VerifierClient(live_verifier.url) as client:
        session = client.prefill(PrefillRequest.model_validate(reopened))
        rest: list[int] = []
        total = session.total_tokens
        while len(rest) < len(whole) - cut:
            answer = client.verify(VerifyRequest(session_id=session.session_id, n_past=total))
            rest += answer.tokens
            total = answer.total_tokens
            if answer.eos:
                break
        client.delete_session(session.session_id)
    assert rest == whole[cut:]


def test_tools_defs_of_one_name_stay_apart_in_the_grammar_of_calls(vocab):
    """Two tools' parameters (pydantic's schemas of nested models), each with a `$defs`
    entry `City` of its own shape: the grammar of a call to either takes each tool's
    City where that tool's arguments have one, and never the other's."""
    from drafter.serve.chat_api import ChatCompletionRequest
    from drafter.serve.tools import CLOSE, OPEN, tool_grammar
    from tests.fixtures.tool_models import FIND_CITY, PLAN_TRIP

    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "Where to?"}],
        tools=[PLAN_TRIP, FIND_CITY],
        tool_choice="required",
    )
    grammar = tool_grammar(request)
    grammars = Grammars(vocab.grammar_tokenizer, vocab.n_vocab)

    def allowed(name: str, arguments: dict) -> bool:
        call = json.dumps({"name": name, "arguments": arguments})
        tokens = vocab.tokenize(f"{OPEN}{call}{CLOSE}", add_special=False)
        try:
            grammars.constraint(grammar.kind, grammar.source).commit(tokens)
        except GrammarError:
            return False
        return True

    rome = {"name": "Rome", "country": "Italy"}
    assert allowed("plan_trip", {"city": rome, "nights": 3})
    assert allowed("find_city", {"city": {"code": "ROM"}})
    assert not allowed("plan_trip", {"city": {"code": "ROM"}, "nights": 3})
    assert not allowed("find_city", {"city": rome})
