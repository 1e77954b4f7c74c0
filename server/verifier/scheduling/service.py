"""What the routes call: one interface over the scheduler and the engine.

Routes parse HTTP and call only this; this says what each request does to the sessions.
Where each part runs:
- the event loop: checks, and waiting;
- the engine thread (through the scheduler's queue, behind the session's earlier work):
  everything that reads or changes sessions, decodes included, and a session's end;
- the text pool: `Engine.tokenize` and `Engine.detokenize`, which read the vocabulary
  only (tests/unit/test_service_boundary.py holds this);
- the grammar threads: a new session's grammar state (`Grammars` is thread-safe; the
  state is no session's until the prefill that carries it begins), a copy of one its key
  has compiled already in one, a compile (or a reopened session's state, which takes its
  generated tokens) in the other: a key's copy never waits for another key's grammar.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from server.shared.constraint import Constraint
from server.shared.info import InfoResponse
from server.shared.protocol import (
    GenerateRequest,
    GenerateResponse,
    GenerateTimings,
    PrefillRequest,
    PrefillResponse,
    Strategy,
    VerifyRequest,
    VerifyResponse,
)
from server.verifier.decoding.checks import routing_header, session_id_named
from server.verifier.decoding.decoding_rules import prepared_constraint
from server.verifier.decoding.engine import Engine, engine_info
from server.verifier.decoding.jobs import Opened
from server.verifier.decoding.vocab_file import vocab_only_gguf
from server.verifier.errors import PromptTooLong, ServerFull
from server.verifier.scheduling.keyed_pool import GRAMMAR_NICE, KeyedPool
from server.verifier.scheduling.scheduler import BatchScheduler

ClientGone = Callable[[], Awaitable[bool]]
P = TypeVar("P", PrefillRequest, GenerateRequest)
# Text work at once (tokenizing, detokenizing): off the engine thread and the event loop.
TEXT_WORKERS = 2
# Prompt texts one key may have in the text pool (waiting or being tokenized): another
# key's text never waits behind more than this many of a flooding key's.
TEXTS_PER_KEY = 2 * TEXT_WORKERS
# Grammars are compiled apart from texts, one at a time (a grammar's memory is measured
# as the process's), keys in turn (keyed_pool.py), this many a key waiting or compiling;
# copies of compiled ones apart from compiles, as many a key.
GRAMMARS_PER_KEY = 2


class VerifierService:
    def __init__(self, scheduler: BatchScheduler):
        self.scheduler = scheduler
        self.engine: Engine = scheduler.engine
        self._vocab_file: bytes | None = None
        self._vocab_file_lock = asyncio.Lock()
        self._text_pool = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="text")
        self._texts_by_key: Counter[str] = Counter()
        self._grammar_pool = KeyedPool(1, "grammars", per_owner=GRAMMARS_PER_KEY, nice=GRAMMAR_NICE)
        self._copy_pool = KeyedPool(1, "grammar-copies", GRAMMARS_PER_KEY, GRAMMAR_NICE)

    def close(self) -> None:
        # Text work still running uses the model: it ends before the engine frees it.
        self._text_pool.shutdown(wait=True, cancel_futures=True)
        self._grammar_pool.shutdown()
        self._copy_pool.shutdown()
        self.scheduler.close()

    async def _in_text_pool(self, fn: Callable, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self._text_pool, partial(fn, *args, **kwargs)
        )

    async def _prepared(self, request: P, owner: str) -> tuple[P, Constraint | None]:
        """The request with its prompt text tokenized (in the text pool, TEXTS_PER_KEY a
        key) and its grammar's state for the session: a copy where the key has it compiled
        (in the copy pool), or compiled (in the grammar pool: one at a time); each pool
        serves keys in turn, GRAMMARS_PER_KEY a key. A reopened session's state takes its
        generated tokens, each within the grammar's row budget, in the grammar pool: the
        copy pool only copies, so no key's grammar holds another key's copy. The engine
        thread only ever sees token ids and compiled grammars. A text that cannot fit is
        refused untokenized; work past a key's share is refused (503, to retry)."""
        if request.prompt is not None:
            request = await self._tokenized(request, owner)
        if request.grammar is None:
            return request, None
        grammars, prompt_ids = self.engine.grammars, request.prompt_tokens
        budget = self.engine.grammar_row_s

        def prepared(compile: bool) -> Constraint | None:
            return prepared_constraint(grammars, request, prompt_ids, owner, compile, budget)

        if not getattr(request, "generated_tokens", 0):  # /generate's: none
            copy = self._copy_pool.submit(owner, lambda: prepared(False))
            if (copied := await asyncio.wrap_future(copy)) is not None:
                return request, copied
        compiled = self._grammar_pool.submit(owner, lambda: prepared(True))
        return request, await asyncio.wrap_future(compiled)

    async def _tokenized(self, request: P, owner: str) -> P:
        if len(request.prompt) > self.engine.max_prompt_chars:
            raise PromptTooLong(
                f"the prompt has {len(request.prompt)} characters; no text over "
                f"{self.engine.max_prompt_chars} fits a session's {self.engine.n_ctx} tokens "
                "(VERIFIER_MAX_PROMPT_CHARS)"
            )
        if self._texts_by_key[owner] >= TEXTS_PER_KEY:
            raise ServerFull(f"this key has {TEXTS_PER_KEY} prompts being tokenized; retry shortly")
        self._texts_by_key[owner] += 1
        try:
            ids = await self._in_text_pool(self.engine.tokenize, request.prompt, request.add_bos)
        finally:
            self._texts_by_key[owner] -= 1
            if not self._texts_by_key[owner]:
                del self._texts_by_key[owner]
        return request.model_copy(update={"prompt": None, "prompt_tokens": ids, "add_bos": False})

    async def prefill(
        self,
        request: PrefillRequest,
        owner: str,
        gone: ClientGone | None = None,
        routing: Sequence[str] = (),
    ) -> PrefillResponse:
        """Open a session (`routing`: the request's X-Session-Id headers, which name the
        id it asks for, if any). If the client went away meanwhile, nobody will read the
        answer: the session it opened is ended at once rather than hold its sequence until
        the idle TTL (a client that chose the id and retries finds it free)."""
        session_id = session_id_named(routing_header(list(routing)), request.session_id)
        request = request.model_copy(update={"session_id": session_id})
        request, constraint = await self._prepared(request, owner)
        opened = await self.scheduler.prefill(request, owner, constraint)
        if gone is not None and await gone():
            await self._discard(opened, owner)
        return _with_limit(opened.response, constraint)

    async def verify(
        self, request: VerifyRequest, owner: str, routing: Sequence[str] = ()
    ) -> VerifyResponse:
        """A round (`routing`: its X-Session-Id headers, which must name its session).
        A round without a draft may ask for a chunk of the verifier's own tokens."""
        session_id_named(routing_header(list(routing)), request.session_id)
        return await self.scheduler.verify(request, owner)

    async def delete(self, session_id: str, owner: str, routing: Sequence[str] = ()) -> None:
        session_id_named(routing_header(list(routing)), session_id)
        await self.scheduler.end(session_id, owner)

    async def generate(
        self, request: GenerateRequest, owner: str, gone: ClientGone | None = None
    ) -> GenerateResponse:
        """The verifier alone, token by token: each step a round with an empty draft, so
        the baseline runs exactly the code path (and numerics) the speculative rounds
        use, beside other sessions' rounds. Stops early (freeing its session) if the
        client went away."""
        began = time.perf_counter()
        request, constraint = await self._prepared(request, owner)
        opened = await self.scheduler.prefill(
            PrefillRequest(
                **request.model_dump(include={"prompt", "prompt_tokens"}, exclude_none=True),
                add_bos=request.add_bos,
                sampling=request.sampling,
                grammar=request.grammar,
                # With no drafts every strategy is plain sampling from p: match needs no probs.
                strategy=None if request.sampling.greedy else Strategy.match,
            ),
            owner,
            constraint,
        )
        prefill = opened.response
        prompt_done = time.perf_counter()
        tokens: list[int] = []
        eos = False
        total_tokens = prefill.total_tokens
        limit = constraint.token_limit if constraint is not None else None
        wanted = min(request.max_tokens, limit or request.max_tokens)
        try:
            while len(tokens) < wanted and total_tokens <= self.engine.n_ctx:
                if gone is not None and await gone():
                    break
                step = await self.scheduler.verify(
                    VerifyRequest(session_id=prefill.session_id, n_past=total_tokens),
                    owner,
                    admitted=True,
                )
                tokens.extend(step.tokens)
                total_tokens = step.total_tokens
                if step.eos:
                    eos = True
                    break
        finally:
            await self._discard(opened, owner)
        ended = time.perf_counter()
        decode_s = ended - prompt_done
        text = await self._in_text_pool(self.engine.detokenize, tokens)
        return GenerateResponse(
            prompt_ids=prefill.prompt_ids,
            tokens=tokens,
            text=text,
            eos=eos,
            timings=GenerateTimings(
                prompt_ms=round((prompt_done - began) * 1000.0, 3),
                decode_ms=round(decode_s * 1000.0, 3),
                total_ms=round((ended - began) * 1000.0, 3),
                tokens_per_s=round(len(tokens) / decode_s, 3) if decode_s > 0 else 0.0,
            ),
            grammar_token_limit=limit,
        )

    def info(self) -> InfoResponse:
        return engine_info(self.engine)

    def vocab_etag(self) -> str:
        return f'"{self.engine.vocab.hash}"'

    def vocab_file_name(self) -> str:
        return f"{self.engine.runtime.model_path.stem}.vocab.gguf"

    def session_count(self) -> int:
        return self.engine.session_count

    async def vocab_file(self) -> bytes:
        """GET /vocab's file, written once on first demand, off the event loop."""
        async with self._vocab_file_lock:
            if self._vocab_file is None:
                path = self.engine.runtime.model_path
                self._vocab_file = await asyncio.to_thread(vocab_only_gguf, path)
        return self._vocab_file

    async def _discard(self, opened: Opened, owner: str) -> None:
        """End the session `opened` opened, if it is still that one and still there
        (eviction may have won)."""
        await self.scheduler.end(opened.session.session_id, owner, only=opened.session)


def _with_limit(response: PrefillResponse, constraint: Constraint | None) -> PrefillResponse:
    """The prefill's answer, naming the tokens the session may generate where its grammar
    bounds them (its end unproven: server/shared/grammar_ends.py)."""
    if constraint is None or constraint.token_limit is None:
        return response
    return response.model_copy(update={"grammar_token_limit": constraint.token_limit})
