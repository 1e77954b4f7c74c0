"""Copies inside a chunk on the real model (server/verifier/decoding/copy_draft.py): a session
whose text repeats itself asks for chunks of the verifier's own tokens; whatever the
verifier copies (its cost model decides from measured passes, so how much is not fixed
here: tests/unit/test_copy_draft.py drives that with a set cost), the tokens are the
verifier's own, token for token what llama-cpp-python's decoder gives alone."""

from __future__ import annotations

import httpx
import pytest

from scripts.harness.metrics import Metrics
from server.verifier.decoding.copy_draft import COPY_NGRAM

pytestmark = pytest.mark.integration

PASSAGE = (
    "The verifier keeps one cache per session, so a round costs one pass over the draft "
    "and the pending token whatever the length of the context. "
)
PROMPT = f"Copy the text below twice.\n\n{PASSAGE}\n{PASSAGE}\n{PASSAGE[:60]}"
# The repeat with edits: copies break off at each, and go on after it (a resync).
EDITED = PASSAGE.replace("cache", "store").replace("pass", "step")
EDITED_PROMPT = f"Copy the text below, with its edits.\n\n{PASSAGE}\n{EDITED}\n{PASSAGE[:60]}"
WANTED = 48


@pytest.mark.parametrize("prompt", [PROMPT, EDITED_PROMPT], ids=["repeat", "edited"])
def test_chunks_over_a_repeated_passage_are_the_verifiers_own_tokens(
    live_verifier, reference, prompt
):
    url = live_verifier.url
    opened = httpx.post(f"{url}/prefill", json={"prompt": prompt}, timeout=300).json()
    before = Metrics.scrape(url)
    got, n_past, eos = [], opened["total_tokens"], False
    while len(got) < WANTED and not eos:
        step = {"session_id": opened["session_id"], "n_past": n_past, "chunk_tokens": 16}
        reply = httpx.post(f"{url}/verify", json=step, timeout=300)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["accepted_prefix_len"] == 0 and body["preds"] == body["tokens"]
        got += body["tokens"]
        n_past, eos = body["total_tokens"], body["eos"]
    httpx.delete(f"{url}/sessions/{opened['session_id']}", timeout=30)
    after = Metrics.scrape(url)
    copied = after.value("verifier_copied_tokens_total") - before.value(
        "verifier_copied_tokens_total"
    )
    accepted = after.value("verifier_copied_tokens_accepted_total") - before.value(
        "verifier_copied_tokens_accepted_total"
    )
    assert 0 <= accepted <= copied
    assert got == reference.greedy(opened["prompt_ids"], len(got))
    alone = {"prompt_tokens": opened["prompt_ids"], "max_tokens": len(got)}
    assert httpx.post(f"{url}/generate", json=alone, timeout=300).json()["tokens"] == got


def test_a_lookups_round_is_judged_as_any_draft_on_the_real_model(live_verifier, reference):
    """draft_kind 'lookup' (a client's copy of earlier text): the verifier says it takes
    the mark, and the round's tokens are the verifier's own, as with any draft."""
    url = live_verifier.url
    assert httpx.get(f"{url}/info", timeout=60).json()["lookup_drafts"] is True
    opened = httpx.post(f"{url}/prefill", json={"prompt": PROMPT}, timeout=300).json()
    own = reference.greedy(opened["prompt_ids"], 6)
    body = {"session_id": opened["session_id"], "n_past": opened["total_tokens"]}
    wrong_kind = httpx.post(
        f"{url}/verify", json={**body, "draft_tokens": own[:4], "draft_kind": "model"}, timeout=60
    )
    assert wrong_kind.status_code == 422  # the mark is `lookup` or nothing
    reply = httpx.post(
        f"{url}/verify", json={**body, "draft_tokens": own[:4], "draft_kind": "lookup"}, timeout=300
    ).json()
    httpx.delete(f"{url}/sessions/{opened['session_id']}", timeout=30)
    assert reply["accepted_prefix_len"] == 4 and reply["tokens"] == own[:5]


def test_a_sized_lookup_on_the_real_model_is_the_verifiers_own_tokens(live_verifier, reference):
    """draft_accept (the client's estimate of its lookup's acceptance): the verifier verifies
    what its measured passes say pays, or runs the chunk asked for; either way the tokens
    are the verifier's own, and the answer says how much of the draft was verified."""
    url = live_verifier.url
    info = httpx.get(f"{url}/info", timeout=60).json()
    assert info["lookup_sizing"] is True
    assert info["chunk_copy_ngram"] == COPY_NGRAM  # what `model+history` leaves to its copies
    for accept in (1.0, 0.0):
        opened = httpx.post(f"{url}/prefill", json={"prompt": PROMPT}, timeout=300).json()
        own = reference.greedy(opened["prompt_ids"], 8)
        body = {
            "session_id": opened["session_id"], "n_past": opened["total_tokens"],
            "draft_tokens": own[:6], "draft_kind": "lookup", "draft_accept": accept,
            "chunk_tokens": 3,
        }  # fmt: skip
        reply = httpx.post(f"{url}/verify", json=body, timeout=300)
        httpx.delete(f"{url}/sessions/{opened['session_id']}", timeout=30)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        verified = answer["draft_verified"]
        assert 0 <= verified <= 6 and answer["accepted_prefix_len"] == verified
        # Verified in part or whole: that draft's round; none: the chunk of 3 asked for.
        assert answer["tokens"] == (own[: verified + 1] if verified else own[:3])
        if accept == 0.0:  # no token accepted: no row of it pays, whatever a pass costs
            assert verified == 0
