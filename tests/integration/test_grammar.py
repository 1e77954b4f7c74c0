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
from drafter.loop import SpeculativeLoop
from drafter.model import DraftModel
from server.shared.constraint import GrammarError, Grammars
from server.shared.protocol import Grammar, PrefillRequest
from server.shared.runtime import LlamaVocab
from tests.conftest import TEST_N_CTX, TEST_THREADS
from tests.fixtures.scripted_length import ScriptedLength

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
    model = DraftModel(drafter_model, n_ctx=TEST_N_CTX + 256, n_threads=TEST_THREADS)
    try:
        with VerifierClient(live_verifier.url) as client:
            loop = SpeculativeLoop(
                model,
                client,
                draft_n=ScriptedLength(ROUNDS),
                n_ctx=TEST_N_CTX,
                pipeline=pipeline,
            )
            request = PrefillRequest(prompt_tokens=prompt_ids, add_bos=False, grammar=grammar)
            rounds = list(loop.run(request, 64))
    finally:
        model.close()
    assert loop.result.tokens == alone["tokens"]
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
