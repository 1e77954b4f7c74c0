"""One generation from start to end: connect, load and check the draft model, run the
speculative loop, optionally measure the verifier alone on the same prompt."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from drafter.client import VerifierClient
from drafter.drafters.compat import check_protocol, check_vocabulary
from drafter.drafters.history_lookup import HistoryLookup
from drafter.drafters.model import DraftModel, DraftPolicy
from drafter.drafters.model import where as draft_where
from drafter.drafters.ngram import ModelWithLookup, NgramDrafter
from drafter.drafters.suffix import SuffixDrafter, SuffixHistory
from drafter.drafters.translate import TranslatingDrafter, cached_vocab_file, vocab_matches
from drafter.errors import DrafterError
from drafter.length.draft_length import LinkAwareLength
from drafter.length.length_memory import LengthMemory, RememberingLength
from drafter.length.lookup_gate import LookupGate
from drafter.length.plain_lengths import DoublingLength, FixedLength
from drafter.output import BaselineResult
from drafter.request_options import RequestOptions
from drafter.settings import (
    LOOKUPS,
    MODEL_WITH_LOOKUP,
    WITH_HISTORY,
    DrafterKind,
    DrafterSettings,
    OutputFormat,
)
from drafter.speculative.candidates import Drafter, DraftLength
from drafter.speculative.loop import RoundEvent, SpeculativeLoop, SpeculativeResult
from server.shared.info import InfoResponse
from server.shared.protocol import GenerateRequest, PromptInput, SamplingParams, Strategy
from server.shared.runtime import LlamaError, LlamaVocab

# What `auto` drafts with a seed (a fixed length, so that the run repeats).
SEEDED_DRAFT_N = 4


class Renderer(Protocol):
    def status(self, message: str) -> None: ...

    def start(self, token_bytes: Callable[[int], bytes]) -> None: ...

    def round(self, event: RoundEvent) -> None: ...

    def finish(self, result: SpeculativeResult, baseline: BaselineResult | None) -> None: ...


def connect(
    settings: DrafterSettings, max_retries: int | None = None, restart_wait_s: float | None = None
) -> VerifierClient:
    return VerifierClient(
        settings.server,
        timeout=settings.timeout,
        api_key=settings.api_key,
        ca_cert=settings.ca_cert,
        max_retries=settings.retries if max_retries is None else max_retries,
        restart_wait_s=settings.restart_wait if restart_wait_s is None else restart_wait_s,
    )


def draft_context(info: InfoResponse) -> int:
    """The draft cache's room: the committed tokens plus up to 2k + 1 unverified drafts,
    and no more, so that a draft model trained for the verifier's context is not asked
    for positions past it (llama.cpp warns of an overflow there)."""
    return info.n_ctx + 2 * info.max_draft + 1


def load_checked_drafter(
    client: VerifierClient, settings: DrafterSettings, n_seq: int = 1, translate: bool | None = None
) -> tuple[DraftModel, InfoResponse, str]:
    """The draft model (sequence 0 of a context of `n_seq`), refused unless its ids can
    reach the verifier (the same or a compatible vocabulary, or with `translate`, any);
    /info; and a sentence on how it drafts, naming both models, where that is not plain."""
    info = client.info()
    check_protocol(info)
    if settings.draft_n != "auto" and settings.draft_n > info.max_draft:
        raise DrafterError(
            f"--draft-n {settings.draft_n} exceeds the verifier's max_draft={info.max_draft}"
        )
    model = DraftModel(
        settings.model,
        n_ctx=draft_context(info),
        n_seq=n_seq,
        n_gpu_layers=settings.n_gpu_layers,
        n_threads=settings.threads,
        verbose=settings.verbose,
    )
    try:
        mode, note = check_vocabulary(
            info,
            model.vocab_facts(),
            drafter_name=model.name,
            drafter_path=settings.model,
            translate=translate,
        )
    except DrafterError:
        model.close()
        raise
    if mode == "translated":
        model.context.vocab_relation = mode  # its own ids never leave the drafter
    else:
        model.draft_for(info.n_vocab, mode)
    return model, info, note


def verifier_where(info: InfoResponse) -> str:
    """Where the verifier computes, as its /info says (an older verifier does not)."""
    if not info.backend:
        return "an unnamed backend"
    layers = f", {info.gpu_layers} of {info.n_layer + 1} layers" if info.gpu_layers else ""
    return f"{info.backend} ({info.device}){layers}" if info.device else info.backend + layers


def load_verifier_vocab(client: VerifierClient, info: InfoResponse) -> LlamaVocab:
    """The verifier's vocabulary, for drafting through text: fetched once per hash."""
    try:
        path = cached_vocab_file(info.vocab_hash, client.vocab_file)
        return vocab_matches(path, info.vocab_hash)
    except (ValueError, OSError, LlamaError) as exc:
        raise DrafterError(f"the verifier's vocabulary file is not usable: {exc}") from exc


def prompt_input(vocab: LlamaVocab, settings: DrafterSettings) -> PromptInput:
    """--prompt as the verifier gets it; with --chat, through `vocab`'s chat template (the
    verifier's own where the drafter's tokenizer is another)."""
    assert settings.prompt is not None, "the CLI asks for --prompt before it runs"
    prompt, add_bos = settings.prompt, True
    if settings.chat:
        prompt = vocab.chat_prompt(prompt, settings.system)
        # Some templates write the BOS text themselves; another would change the prompt.
        add_bos = not vocab.starts_with_bos(prompt)
    return PromptInput(prompt=prompt, add_bos=add_bos)


def check_prompt_fits(vocab: LlamaVocab, request: PromptInput, info: InfoResponse) -> None:
    """Refused here, before anything is decoded on either side: a prompt the verifier's
    context cannot hold with at least one new token."""
    n = len(vocab.tokenize(request.prompt or "", add_special=request.add_bos))
    if n >= info.n_ctx:
        raise DrafterError(
            f"the prompt is {n} tokens; the verifier's context holds {info.n_ctx} tokens, "
            f"prompt and answer together ({info.context_hint()})"
        )


def draft_policy(settings: DrafterSettings, options: RequestOptions) -> DraftPolicy:
    """Rejection sampling needs drafts drawn from q; for greedy, match and threshold the
    drafter's argmax is the draft most likely to be accepted."""
    seed = options.seed
    return DraftPolicy(
        sampling=options.sampling,
        sample_drafts=options.effective_strategy == Strategy.rejection,
        # A stream of its own, unlike the verifier's, but fixed by the same seed.
        seed=None if seed is None else seed + 1,
        p_min=settings.p_min,
    )


def candidate_generator(
    model: DraftModel,
    settings: DrafterSettings,
    options: RequestOptions,
    target: LlamaVocab | None = None,
    history: SuffixHistory | None = None,
    sized: bool = False,
    copy_ngram: int = 0,
) -> Drafter:
    """Who drafts: the draft model (through text when `target`, the verifier's
    vocabulary, is given), a lookup (prompt lookup, or the suffix drafter over `history`,
    the user's own), or a lookup with the model behind. `sized`: the verifier sizes a
    lookup's draft at its estimated acceptance (/info `lookup_sizing`); `copy_ngram`: the
    repeat its chunks copy from (/info `chunk_copy_ngram`), which `model+history` leaves
    to it."""
    drafter = model if target is None else TranslatingDrafter(model, target)
    if settings.drafter == DrafterKind.model:
        return drafter
    if options.seed is not None:
        # The same seed gives the same text: a draft decides how a round's draws fall,
        # so none may come from what ran before (the history starts empty, as the
        # model's sequence does: drafter/serve/backend.py), nor be sized by the verifier's
        # measured times (a lookup goes unsized: docs/sampling.md says what repeats).
        history, sized = None, False
    # A lookup drafts the verifier's own ids, so its q spans the verifier's vocabulary.
    sampled = options.effective_strategy == Strategy.rejection
    n_vocab = model.target_n_vocab if target is None else target.n_vocab
    if settings.drafter == DrafterKind.model_history:
        # The verifier copies only where a draft is judged without its probabilities.
        copies = 0 if sampled else copy_ngram
        lookup: Drafter = HistoryLookup(
            n_vocab, history, copy_ngram=copies, sample_drafts=sampled, sized=sized
        )
    elif settings.drafter in WITH_HISTORY:
        lookup = SuffixDrafter(n_vocab, history, sample_drafts=sampled, sized=sized)
    else:
        lookup = NgramDrafter(n_vocab, sample_drafts=sampled)
    return lookup if settings.drafter in LOOKUPS else ModelWithLookup(lookup, drafter)


def user_history(settings: DrafterSettings) -> SuffixHistory | None:
    """The suffix drafter's history for this process (None for other drafters)."""
    if settings.drafter not in WITH_HISTORY:
        return None
    try:
        return SuffixHistory(settings.history_tokens, path=settings.history_file)
    except OSError as exc:
        raise DrafterError(f"--history-file {settings.history_file}: {exc}") from None


def draft_length(
    settings: DrafterSettings,
    options: RequestOptions,
    info: InfoResponse,
    watched: bool = True,
    memory: LengthMemory | None = None,
    draft_s_prior: float | None = None,
) -> DraftLength:
    """`auto`: the link-aware cost model for a model's drafts, doubling for prompt
    lookup's (see drafter/length/draft_length.py). `watched`: the tokens are shown or looked
    through as they come, which paces the chunks of rounds without a draft (ChunkPace);
    `memory`: what earlier generations of the same `serve` slot measured
    (drafter/length/length_memory.py); `draft_s_prior`: the draft model's time a draft token
    before drafted rounds measure it (DraftModel.warm_up)."""
    if settings.draft_n != "auto":
        return FixedLength(settings.draft_n, max_chunk=info.max_chunk_tokens, watched=watched)
    if settings.drafter in LOOKUPS:
        # Chunks are paced by measured times, and a seeded run must repeat: a token a round.
        seeded = options.seed is not None
        return DoublingLength(info.max_draft, max_chunk=1 if seeded else info.max_chunk_tokens)
    if options.seed is not None:
        # The length decides how many random draws a round takes on both sides, and the
        # cost model follows measured times, which vary: a seeded run must repeat.
        return FixedLength(min(SEEDED_DRAFT_N, info.max_draft))
    # A lookup behind the model looks through the text between chunks for a match: chunks
    # paced as a watched generation's, so that a copied span is found soon. Not the
    # history's alone: the session's own repeats, the most of them, the verifier copies.
    watched = watched or settings.drafter in MODEL_WITH_LOOKUP - {DrafterKind.model_history}
    maximum, max_chunk = info.max_draft, info.max_chunk_tokens
    if memory is not None:
        return RememberingLength(
            maximum=maximum, max_chunk=max_chunk, watched=watched,
            draft_s_prior=draft_s_prior, memory=memory,
        )  # fmt: skip
    return LinkAwareLength(
        maximum=maximum, max_chunk=max_chunk, watched=watched, draft_s_prior=draft_s_prior
    )


def pipelined(settings: DrafterSettings, options: RequestOptions) -> bool:
    """Pipelining overlaps model drafting with the round trip: nothing to overlap for
    n-gram drafts. As the request says, else as --pipeline says; off by default for seeded
    sampling: how far it drafts ahead depends on timing, and so would the drafter's random
    draws, and the output."""
    if options.pipeline is not None:
        return options.pipeline
    if settings.pipeline is not None:
        return settings.pipeline
    return settings.drafter not in LOOKUPS and not options.seeded_sampling


def speculative_loop(
    model: DraftModel,
    client: VerifierClient,
    info: InfoResponse,
    settings: DrafterSettings,
    options: RequestOptions,
    target: LlamaVocab | None = None,
    watched: bool = True,
    history: SuffixHistory | None = None,
    memory: LengthMemory | None = None,
) -> SpeculativeLoop:
    """The loop for one generation: its request's `options` (what it drafts by), the
    process's `settings` (who drafts, how long, how far ahead). Run it with
    `options.prefill(prompt)` and `options.max_tokens`."""
    model.configure(draft_policy(settings, options))
    length = draft_length(settings, options, info, watched, memory, model.context.draft_token_s)
    # Where `auto` has the model step aside, a lookup's free drafts may still pay.
    gated = isinstance(length, LinkAwareLength) and settings.drafter in MODEL_WITH_LOOKUP
    return SpeculativeLoop(
        candidate_generator(
            model, settings, options, target, history, info.lookup_sizing, info.chunk_copy_ngram
        ),
        client,
        draft_n=length,
        n_ctx=info.n_ctx,
        pipeline=pipelined(settings, options),
        branches=settings.branches,
        vocab=model.vocab_relation,
        lookups=LookupGate(info.max_draft, sized=info.lookup_sizing) if gated else None,
        mark_lookups=info.lookup_drafts,
    )


def measure_baseline(
    client: VerifierClient,
    prompt_ids: list[int],
    max_tokens: int,
    sampling: SamplingParams | None = None,
) -> BaselineResult:
    began = time.perf_counter()
    response = client.generate(
        GenerateRequest(
            prompt_tokens=prompt_ids,
            add_bos=False,
            max_tokens=max_tokens,
            sampling=sampling or SamplingParams(),
        )
    )
    return BaselineResult(
        tokens=response.tokens,
        total_time_s=time.perf_counter() - began,
        server_tokens_per_s=response.timings.tokens_per_s,
    )


def run(settings: DrafterSettings, renderer: Renderer) -> SpeculativeResult:
    with connect(settings) as client:
        renderer.status(f"verifier {settings.server}; loading {settings.model.name}")
        model, info, note = load_checked_drafter(client, settings, translate=settings.translate)
        target, options = None, settings.request_options()
        try:
            renderer.status(
                f"draft model on {draft_where(model)}; verifier on {verifier_where(info)}"
            )
            if note:
                renderer.status(note)
            if model.vocab_relation == "translated":
                target = load_verifier_vocab(client, info)
                if options.effective_strategy == Strategy.rejection:
                    # q over the drafter's vocabulary is not a distribution over the
                    # verifier's tokens: `match` is lossless without one.
                    renderer.status(
                        "rejection sampling needs the drafter's probabilities over the "
                        "verifier's tokens, which another tokenizer cannot give: verifying "
                        "with --strategy match instead (lossless too)"
                    )
                    options = options.through_text()
            prompt = prompt_input(target or model.runtime, settings)
            check_prompt_fits(target or model.runtime, prompt, info)
            # Text on a terminal is read as it comes; JSON only once it is whole.
            watched = settings.output == OutputFormat.text
            history = user_history(settings)
            loop = speculative_loop(
                model, client, info, settings, options, target, watched, history
            )
            renderer.start((target or model).token_bytes)
            rounds = loop.run(options.prefill(prompt), options.max_tokens)
            try:
                for event in rounds:
                    renderer.round(event)
            except KeyboardInterrupt:
                rounds.close()  # its session ends, its stats are final
                loop.result.finish_reason = "interrupted"
                renderer.finish(loop.result, None)  # what was made so far, and its stats
                raise
            result = loop.result
            baseline = None
            if settings.baseline:
                renderer.status("measuring the verifier alone on the same prompt (/generate)")
                baseline = measure_baseline(
                    client, result.prompt_ids, options.max_tokens, options.sampling
                )
            renderer.finish(result, baseline)
            return result
        finally:
            if target is not None:
                target.close()
            model.close()
