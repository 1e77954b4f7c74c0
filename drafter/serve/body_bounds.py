"""How large a body `serve` reads, and where it is parsed and validated.

The cap is checked before a byte of the body is read (server/shared/request_body.py:
BodyLimit): `--max-body-bytes`, and once the verifier's context is known, no more than a
request could use with it. A prompt longer than n_ctx times the vocabulary's longest
piece is refused before it is tokenized (drafter/serve/prompts.py); a body that carries
more text than that is refused before it is read, so that a flood of huge bodies costs
their reading and parsing no more than it costs their prompts.

A large body is parsed and validated on the render gate's threads
(drafter/serve/render_gate.py), under its bound, not on the event loop that `/health` and
every stream are answered on. They share one interpreter lock, which json's parser and
pydantic's compiled validators hold as they work: the loop is answered between the
validators' Python steps, not through a parse. What the gate bounds is how many such
bodies are at work at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drafter.serve.chat_api import MAX_CHOICES
from drafter.serve.render_gate import RenderGate
from server.shared.protocol import MAX_GRAMMAR_CHARS
from server.shared.request_body import Scope, read_json

# The JSON bytes one byte of a prompt's text may take as clients write it: `\"`, `\n`,
# `\u00e9` (one character of two bytes in six), a pair of escapes for a character of four
# bytes. The vocabulary's pieces are measured in their own spelling, which for byte-level
# vocabularies is longer than the text (a space is two bytes), so the rare text escaped
# more than this (a control character as `\u0001`) still fits.
JSON_BYTES_PER_PROMPT_CHAR = 3
# The JSON around each token's worth of text at most: a message's or a content block's
# braces, keys and ids (each message is at least a token of its chat template's).
STRUCTURE_BYTES_PER_TOKEN = 64
# Fields that are not prompt text: a schema or a grammar (at most MAX_GRAMMAR_CHARS, one
# constraint a request, escaped and indented), stop sequences, logit biases, metadata.
OTHER_FIELDS_BYTES = 6 * MAX_GRAMMAR_CHARS + (128 << 10)
# A body this small is parsed and validated where it is read: a thread's round trip
# would cost more.
PARSED_ON_THE_LOOP_BYTES = 16 << 10


def prompts_per_body(path: str) -> int:
    """How many prompts a body to `path` may carry, each as long as the context:
    completions take several (each a generation of its own), every other API one."""
    return MAX_CHOICES if path.removeprefix("/v1").startswith("/completions") else 1


@dataclass(frozen=True)
class LearnedContext:
    """What the cap is computed from, learned at load: the verifier's context and the most
    text it can hold."""

    n_ctx: int
    max_prompt_chars: int

    def useful_bytes(self, path: str) -> int:
        """The most a body to `path` can carry that a request can use."""
        text = JSON_BYTES_PER_PROMPT_CHAR * self.max_prompt_chars
        structure = STRUCTURE_BYTES_PER_TOKEN * self.n_ctx
        return prompts_per_body(path) * (text + structure) + OTHER_FIELDS_BYTES


class BodyBounds:
    """The cap on a request's body (BodyLimit's `max_bytes`): the setting's, until `learn`
    is told the verifier's context."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        # Learned on the load's thread while requests are capped on the event loop: one
        # value, replaced whole and read once a request, so that no request is capped by
        # half of what was learned.
        self.context: LearnedContext | None = None

    def learn(self, n_ctx: int, max_prompt_chars: int) -> None:
        self.context = LearnedContext(n_ctx, max_prompt_chars)

    def useful_bytes(self, path: str) -> int | None:
        """The most a body to `path` can carry that a request can use, or None before the
        verifier's context is known."""
        context = self.context
        return None if context is None else context.useful_bytes(path)

    def __call__(self, scope: Scope) -> tuple[int, str]:
        setting = self.max_bytes, "this server's limit (--max-body-bytes)"
        context = self.context
        if context is None:
            return setting
        useful = context.useful_bytes(scope["path"])
        if useful >= self.max_bytes:
            return setting
        why = (
            f"more than a request can use with the verifier's context of {context.n_ctx} "
            "tokens (their text written as JSON, and the fields beside it)"
        )
        return useful, why


def read_request(body: bytes, validate: Callable[[Any], Any]) -> Any:
    """The body's JSON (`read_json`) as `validate` takes it: its route's request."""
    return validate(read_json(body))


async def parse_body(body: bytes, gate: RenderGate, validate: Callable[[Any], Any]) -> Any:
    """The body's request (`read_request`), a large body's parsed and validated on the
    gate's threads (QueueFull where the gate is full)."""
    if len(body) <= PARSED_ON_THE_LOOP_BYTES:
        return read_request(body, validate)
    return await gate.run(read_request, body, validate)
