"""Long prompts through a real verifier (docs/numerics.md, "Prompt chunks and prompt
reuse"): cold, a next turn that reuses the first, the same after the idle verifier
evaluated the first turn's answer again as a prompt's, and a session reopened with its
output: each token for token what llama-cpp-python's own decoder gives for the same
prompt cut where the engine cuts it (`ReferenceDecoder`)."""

from __future__ import annotations

import time

import httpx

from scripts.harness.metrics import Metrics
from server.verifier.kv.prompt_cuts import Replies, prompt_tiling, retile_plan

TEXT = (
    "A verifier keeps one cache per session. When the session ends, its cache stays "
    "behind for the same client's next prompt, which evaluates only what is new. "
) * 18  # about 560 tokens: more than one pass of n_batch = 512
MAX_TOKENS = 16
LONG = 70  # an answer longer than a tile (64 rows on the CPU build)
RETILED = "verifier_prompt_tokens_retiled_total"


def generate(url: str, prompt_tokens: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    body = {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens}
    answer = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def test_long_prompts_answer_as_the_reference_cold_reused_again_and_reopened(
    live_verifier, reference
):
    url = live_verifier.url
    info = httpx.get(f"{url}/info", timeout=30).json()
    assert info["prefix_cache"] and info["prefill_chunk_invariant"]
    opened = httpx.post(f"{url}/prefill", json={"prompt": TEXT}, timeout=300).json()
    httpx.delete(f"{url}/sessions/{opened['session_id']}", timeout=30)
    first = opened["prompt_ids"]
    assert len(first) > 512
    answer = generate(url, first)
    assert answer == reference.greedy(first, MAX_TOKENS)

    second = [*first, *answer, *first[1:6]]  # a next turn: the first, its answer, more
    retiled = Metrics.scrape(url).value(RETILED)
    # An answer past the next tile: idle, the verifier evaluates it again as a prompt's,
    # and the third turn reuses it (waited for as a state, never timed).
    long_answer = generate(url, second, LONG)
    assert len(long_answer) == LONG and long_answer == reference.greedy(second, LONG)
    tile = info["prompt_tile_rows"]
    cells = [*second, *long_answer[:-1]]  # no reply opener: one stretch
    plan = retile_plan(cells, prompt_tiling(second, len(second), tile), tile)
    # The answer crossed a tile: work to do (none where prompts are not tiled at all).
    assert (plan is not None) == (tile > 0)
    wanted = retiled + (len(cells) - plan[0] if plan else 0)
    deadline = time.monotonic() + 120
    while Metrics.scrape(url).value(RETILED) < wanted and time.monotonic() < deadline:
        time.sleep(1.0)
    assert Metrics.scrape(url).value(RETILED) >= wanted
    third = [*second, *long_answer, *first[6:9]]
    assert generate(url, third) == reference.greedy(third, MAX_TOKENS)

    # Reopened with 6 of its tokens generated (a verifier restart): it goes on exactly.
    body = {"prompt_tokens": [*first, *answer[:6]], "generated_tokens": 6}
    session = httpx.post(f"{url}/prefill", json=body, timeout=300).json()
    got, n_past = [], session["total_tokens"]
    while len(got) < MAX_TOKENS - 6:
        step = {"session_id": session["session_id"], "n_past": n_past, "draft_tokens": []}
        reply = httpx.post(f"{url}/verify", json=step, timeout=300).json()
        got += reply["tokens"]
        n_past = reply["total_tokens"]
    assert got[: MAX_TOKENS - 6] == answer[6:]


def session_greedy(url: str, prompt_tokens: list[int], n: int) -> tuple[int, list[int]]:
    """A session opened on `prompt_tokens`, `n` tokens decoded a round at a time (or to an
    end), then ended (its cells cached): the cells it reused, and its tokens."""
    body = {"prompt_tokens": prompt_tokens}
    opened = httpx.post(f"{url}/prefill", json=body, timeout=300)
    assert opened.status_code == 200, opened.text
    session = opened.json()
    got, n_past, eos = [], session["total_tokens"], False
    while len(got) < n and not eos:
        step = {"session_id": session["session_id"], "n_past": n_past, "draft_tokens": []}
        reply = httpx.post(f"{url}/verify", json=step, timeout=300).json()
        got += reply["tokens"]
        n_past, eos = reply["total_tokens"], reply["eos"]
    httpx.delete(f"{url}/sessions/{session['session_id']}", timeout=30)
    return session["cached_tokens"], got[:n]


def test_a_chats_next_turn_sent_at_once_keeps_its_answer_and_answers_as_the_reference(
    live_verifier, reference
):
    """A chat prompt's earlier answer (after the template's reply opener, up to its end of
    turn) is evaluated below the tile, as the rounds that generated it were: the next
    turn, sent at once, keeps every cell of the first turn and its answer, and answers as
    llama-cpp-python's decoder given the prompt cut stretch by stretch."""
    url = live_verifier.url
    tile = httpx.get(f"{url}/info", timeout=30).json()["prompt_tile_rows"]
    llm = reference.llm
    assert "<|im_start|>" in llm.metadata.get("tokenizer.chat_template", "")  # ChatML

    def tokens(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=True)

    first = tokens(f"<|im_start|>user\n{TEXT}<|im_end|>\n<|im_start|>assistant\n")
    cached, answer = session_greedy(url, first, LONG)
    assert cached == 0 and len(answer) > tile  # the reply crosses a tile
    end = tokens("<|im_end|>")
    reply = answer[:-1] if answer[-1] == end[0] else answer
    question = f"\n<|im_start|>user\nSay that again, shorter. {TEXT[:300]}<|im_end|>\n"
    second = [*first, *reply, *end, *tokens(f"{question}<|im_start|>assistant\n")]

    cached, got = session_greedy(url, second, MAX_TOKENS)
    assert cached == len(first) + len(answer) - 1  # every cell of the first session

    def tiled(start: int, end: int) -> list[tuple[int, int]]:  # a stretch's tiled part
        evaluated = end - start - 1
        return [(start, start + evaluated)] if tile and evaluated >= tile else []

    reply_end = len(first) + len(reply)
    spans = [*tiled(0, len(first)), *tiled(reply_end, len(second))]
    assert got == reference.greedy(second, MAX_TOKENS, spans=spans)


def test_a_short_next_message_late_in_a_chat_goes_padded_to_a_tile_and_answers_as_the_reference(
    live_verifier, reference
):
    """A next message a few words long after a long first turn: below the tile its rows'
    attention would each run over the whole context, so it goes in one tiled pass padded
    to a tile (the padding's cells removed after). The next turn keeps every earlier cell
    and answers as llama-cpp-python's decoder given the prompt cut and padded alike."""
    url = live_verifier.url
    info = httpx.get(f"{url}/info", timeout=30).json()
    tile = info["prompt_tile_rows"]
    assert info["prompt_pad"] == ("auto" if tile else "off")
    llm = reference.llm

    def tokens(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=True)

    opener = tokens("<|im_start|>assistant\n")
    first = tokens(f"<|im_start|>user\n{TEXT}<|im_end|>\n<|im_start|>assistant\n")
    cached, answer = session_greedy(url, first, 8)
    end = tokens("<|im_end|>")
    reply = answer[:-1] if answer[-1] == end[0] else answer
    question = (
        "\n<|im_start|>user\nSay it again in fewer words, and keep the cache part.<|im_end|>\n"
    )
    second = [*first, *reply, *end, *tokens(f"{question}<|im_start|>assistant\n")]
    spans = prompt_tiling(
        second, len(second), tile, Replies(tuple(opener), frozenset(reference.eog_ids)), "auto"
    )
    if tile:  # the new stretch, short of a tile, goes tiled (padded): the case under test
        assert spans[-1][0] == len(first) + len(reply) and spans[-1][1] - spans[-1][0] < tile
    shaping = Metrics.scrape(url).value("verifier_shaping_rows_total", kind="prompt")
    cached, got = session_greedy(url, second, MAX_TOKENS)
    assert cached == len(first) + len(answer) - 1  # every cell of the first session
    padding = tile - (spans[-1][1] - spans[-1][0]) if tile else 0
    after = Metrics.scrape(url).value("verifier_shaping_rows_total", kind="prompt")
    assert after - shaping == padding
    assert got == reference.greedy(second, MAX_TOKENS, spans=spans)
