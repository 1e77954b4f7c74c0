"""What `serve` runs behind its HTTP routes: the draft model and its slots, loaded on
first use, and one generation on a worker thread per slot.

The drafter's cache is kept between requests: each slot's sequence still holds its last
prompt and answer, and the next request that shares a prefix with them evaluates only
the rest (the loop syncs the cache by longest common prefix, drafter/drafters/model.py). Seeded
sampling is the exception (DraftModel.decodes_alone): its sequence starts empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from drafter.drafters.model import DraftModel
from drafter.drafters.model import where as draft_where
from drafter.principals import CacheScopes, Histories, serve_history_scope
from drafter.request_options import RequestOptions
from drafter.runner import (
    connect,
    load_checked_drafter,
    load_verifier_vocab,
    speculative_loop,
    verifier_where,
)
from drafter.serve.body_bounds import BodyBounds
from drafter.serve.chat_responses import SpeculativeFigures
from drafter.serve.errors import PromptTooLong
from drafter.serve.prompts import TextSide
from drafter.serve.render_gate import RenderGate
from drafter.serve.slots import GenerationSlot, SlotPool
from drafter.serve.text_out import Emit, TextOut
from drafter.settings import DrafterSettings, HistoryScope
from server.shared.info import InfoResponse
from server.shared.prefix import common_prefix_len
from server.shared.protocol import PromptInput
from server.shared.runtime import LlamaVocab

log = logging.getLogger("drafter.serve")


def fingerprint(info: InfoResponse, draft_model: str) -> str:
    """OpenAI's `system_fingerprint`: the same while the models and the verifier's build of
    them are, so that a client can tell when the same request may answer otherwise."""
    parts = (info.model, info.quantization, info.vocab_hash, str(info.batch_invariant))
    digest = hashlib.sha256("\0".join((*parts, draft_model)).encode()).hexdigest()
    return f"fp_{digest[:12]}"


@dataclass
class Finished:
    """What one generation produced, beside its text (which went out through `emit`)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, reused by the verifier
    completion_tokens: int = 0
    finish_reason: str = "stop"
    stop_sequence: str | None = None  # the one that ended the text, if one did
    figures: SpeculativeFigures | None = None


@dataclass
class Generation:
    """One request's work: what to decode, where its text goes, and its stop switch."""

    prompt: PromptInput  # what /prefill gets: the text, or the ids
    options: RequestOptions  # the request's own: sampling, grammar, limit...
    prompt_ids: list[int]  # the prompt as the draft model tokenizes it
    stop: list[str]
    emit: Emit  # text, with the logprobs of the tokens it begins
    cancel: threading.Event = field(default_factory=threading.Event)
    stream: bool = False  # the client reads the text as it comes
    principal: str | None = None  # whose key it came with ("key-N"); None: no client keys

    @property
    def watched(self) -> bool:
        """Whether its tokens are wanted as they come: streamed, or looked through for a
        stop sequence (a round past one is the verifier's time thrown away). Otherwise
        rounds without a draft are as large as the verifier takes."""
        return self.stream or bool(self.stop)


class SpeculativeBackend:
    def __init__(self, settings: DrafterSettings):
        self.settings = settings
        # The suffix drafter's histories: each principal's own (drafter/principals.py).
        scope = serve_history_scope(settings)
        self.histories = Histories(settings, scope)
        log.info("drafting from history: %s", self.histories.describe())
        # The slots' caches and the verifier's: each principal's too.
        self.caches = CacheScopes(scope, from_auto=settings.history_scope is HistoryScope.auto)
        self.pool: SlotPool | None = None
        self.info: InfoResponse | None = None
        self.model_id = "hetero-specdecode"
        self.system_fingerprint = ""
        self.target: LlamaVocab | None = None  # the verifier's vocabulary, if not ours
        self._loading = asyncio.Lock()
        self._workers = ThreadPoolExecutor(settings.parallel, thread_name_prefix="generation")
        self.render_gate = RenderGate(settings.parallel, settings.queue)
        self.body_bounds = BodyBounds(settings.max_body_bytes)  # the context's, at load
        self.max_prompt_chars = 0  # the most text the verifier's context can hold: at load
        self._running: set[threading.Event] = set()

    async def ready(self) -> SlotPool:
        """The slots, the draft model loaded and checked against the verifier on first use."""
        async with self._loading:
            if self.pool is None:
                self.pool = await asyncio.to_thread(self._load)
        return self.pool

    async def preload(self) -> None:
        """The draft model loaded now where the verifier answers (a request otherwise
        waits for the load, as long as a first decode or more); where it does not, the
        first request that finds it loads it, and its error is that request's. Never
        raises: what failed is logged, and the next request tries again."""
        try:
            health = await asyncio.to_thread(self.verifier_health)
            if health != "ok":
                log.info(
                    "verifier not answering at start (%s): the first request loads the draft model",
                    health,
                )
                return
            await self.ready()
        except Exception as exc:
            log.warning("draft model not loaded at start: %s", exc)

    def verifier_health(self) -> str:
        """ "ok", or why the verifier cannot be used (a short sentence). Blocking."""
        with connect(self.settings, max_retries=0, restart_wait_s=0) as client:
            try:
                client.info()
            except Exception as exc:
                return str(exc)
        return "ok"

    def _load(self) -> SlotPool:
        parallel = self.settings.parallel
        # The retries and the restart wait the settings say: a verifier killed mid-round
        # may reset a retry's connection or two before its port refuses them. A client
        # that hangs up ends its generation's wait (Generation.cancel).
        clients = [connect(self.settings) for _ in range(parallel)]
        try:
            first, self.info, note = load_checked_drafter(
                clients[0], self.settings, n_seq=parallel, translate=self.settings.translate
            )
            if first.vocab_relation == "translated":  # prompts and text: the verifier's
                try:
                    self.target = load_verifier_vocab(clients[0], self.info)
                except BaseException:
                    first.close()
                    raise
        except BaseException:
            for client in clients:
                client.close()
            raise
        models = [first, *(DraftModel.on(first.context, i) for i in range(1, parallel))]
        try:
            first.warm_up()
        except Exception as exc:  # only the first draft's time is at stake
            log.warning("draft model warm-up failed: %s", exc)
        self.model_id = self.info.model
        self.system_fingerprint = fingerprint(self.info, first.name)
        if note:
            log.info("%s", note)
        if not self.info.cache_scopes and not self.caches.shared:
            log.warning(
                "the verifier takes no cache_scope: its cached prompts are shared among "
                "`serve`'s clients, whose cached_tokens tell how long a prefix they share"
            )
        log.info(
            "draft model %s ready on %s for verifier %s on %s; generations at once: %d",
            first.name,
            draft_where(first),
            self.settings.server,
            verifier_where(self.info),
            parallel,
        )
        # No text longer than this fits: every token stands for at most its longest piece.
        vocab = self.target or first.runtime
        longest = max((len(piece) for piece in vocab.vocab_pieces()), default=1)
        self.max_prompt_chars = self.info.n_ctx * max(1, longest)
        self.body_bounds.learn(self.info.n_ctx, self.max_prompt_chars)
        slots = [GenerationSlot(m, c) for m, c in zip(models, clients, strict=True)]
        return SlotPool(slots, self.settings.queue)

    def text_side(self, model: DraftModel) -> TextSide:
        """The vocabulary the verifier's ids are in: the draft model's own, or for a
        translated pair, the verifier's (its chat template too)."""
        assert self.info is not None
        target = self.target
        if target is not None:

            def token_bytes(token: int) -> bytes:  # an id past the vocabulary: no text
                return target.token_bytes(token) if 0 <= token < target.n_vocab else b""

            return TextSide(target, token_bytes, self.info.model, self.max_prompt_chars)
        return TextSide(model.runtime, model.token_bytes, self.info.model, self.max_prompt_chars)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """A prompt the verifier's context cannot hold is refused before it takes a slot."""
        assert self.info is not None
        if len(prompt_ids) >= self.info.n_ctx:
            raise PromptTooLong(
                f"the prompt is {len(prompt_ids)} tokens; the verifier's context holds "
                f"{self.info.n_ctx}, prompt and answer together ({self.info.context_hint()})"
            )

    def start(self, slot: GenerationSlot, generation: Generation) -> asyncio.Future[Finished]:
        """Run the generation on a worker thread; the slot goes back to the pool when the
        thread is done with it (not before, even if whoever awaits this is cancelled)."""
        assert self.pool is not None
        pool = self.pool
        try:
            future = asyncio.get_running_loop().run_in_executor(
                self._workers, self._generate, slot, generation
            )
        except BaseException:  # shutting down: the slot was never used
            pool.release(slot)
            raise
        self._running.add(generation.cancel)

        def finished(_: asyncio.Future) -> None:
            self._running.discard(generation.cancel)
            pool.release(slot)

        future.add_done_callback(finished)
        return future

    @property
    def n_stopping(self) -> int:
        """Generations told to stop (their client left) that have not ended yet."""
        return sum(cancel.is_set() for cancel in list(self._running))

    def close(self) -> None:
        """Stop every generation within a round, wait for them, then free the model."""
        for cancel in list(self._running):
            cancel.set()
        self._workers.shutdown(wait=True)
        self.render_gate.close()
        if self.pool is not None:
            self.pool.close()
            self.pool.slots[0].model.close()
        if self.target is not None:
            self.target.close()

    def _generate(self, slot: GenerationSlot, generation: Generation) -> Finished:
        model, options = slot.model, generation.options
        if self.target is not None:
            # Another tokenizer's q is no distribution over the verifier's tokens:
            # sample-and-match is lossless without one (as the CLI does).
            options = options.through_text()
        assert self.info is not None
        principal = self.caches.of(generation.principal)
        slot.claim(principal)  # before its length memory is read
        slot.client.abandoned = generation.cancel.is_set
        loop = speculative_loop(
            model, slot.client, self.info, self.settings, options, self.target,
            generation.watched, self.histories.of(generation.principal), slot.length_memory,
        )  # fmt: skip
        if model.decodes_alone:
            model.reset()
        # Translated, the prompt's ids are the verifier's, not the cache's: not counted.
        draft_cached = (
            0 if self.target else common_prefix_len(model.cached_tokens, generation.prompt_ids)
        )
        out = TextOut(self.text_side(model).token_bytes, generation.stop, generation.emit)
        scope = self.caches.verifier_scope(principal) if self.info.cache_scopes else None
        rounds = loop.run(options.prefill(generation.prompt, scope), options.max_tokens)
        with contextlib.closing(rounds):  # closing the loop ends the verifier session
            for event in rounds:
                out.feed(event.tokens, event.logprobs)
                if out.stopped or generation.cancel.is_set():
                    break
            else:
                out.finish()
        result = loop.result
        stats = result.stats
        if generation.cancel.is_set():
            log.info("generation cancelled after %d tokens", len(result.tokens))
        else:
            log.info(
                "%d tokens in %d rounds: acceptance %.1f%%, %.2f tokens/round, %.1f tok/s",
                len(result.tokens),
                stats.rounds,
                100 * stats.acceptance_rate,
                stats.tokens_per_round,
                stats.tokens_per_s,
            )
        return Finished(
            prompt_tokens=stats.prompt_tokens,
            cached_tokens=stats.cached_prompt_tokens,
            completion_tokens=len(result.tokens),
            finish_reason="stop" if out.stopped or result.finish_reason == "eos" else "length",
            stop_sequence=out.stop_sequence,
            figures=SpeculativeFigures(
                strategy=result.strategy,
                lossless=result.lossless,
                vocab=result.vocab,
                rounds=stats.rounds,
                drafted=stats.drafted,
                accepted=stats.accepted,
                acceptance_rate=round(stats.acceptance_rate, 4),
                tokens_per_round=round(stats.tokens_per_round, 4),
                recoveries=stats.recoveries,
                draft_cached_tokens=draft_cached,
            ),
        )
