"""One generation from start to end: connect, load and check the draft model, run the
speculative loop, optionally measure the verifier alone on the same prompt."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Protocol

from drafter.client import VerifierClient
from drafter.compat import check_protocol, check_vocabulary
from drafter.draft_length import AdaptiveLength, DoublingLength, DraftLength, FixedLength
from drafter.errors import DrafterError
from drafter.loop import CandidateGenerator, RoundEvent, SpeculativeLoop, SpeculativeResult
from drafter.model import DraftModel, DraftPolicy
from drafter.ngram import ModelWithNgram, NgramDrafter
from drafter.output import BaselineResult
from drafter.translate import TranslatingDrafter, cached_vocab_file, vocab_matches
from server.protocol import (
    GenerateRequest,
    InfoResponse,
    PrefillRequest,
    SamplingParams,
    Strategy,
    strategy_for,
)
from server.runtime import LlamaError, LlamaVocab

# The drafter's cache holds the committed tokens plus up to 2k + 1 unverified drafts.
DRAFTER_CTX_MARGIN = 256

DrafterKind = Literal["model", "ngram", "model+ngram"]


@dataclass
class RunOptions:
    server: str
    model: Path
    prompt: str
    chat: bool = False
    system: str | None = None
    draft_n: int | Literal["auto"] = 4
    drafter: DrafterKind = "model"
    pipeline: bool | None = None  # None: on where it can help (see `use_pipeline`)
    p_min: float = 0.0
    max_tokens: int = 80
    n_gpu_layers: int | None = None
    threads: int = 0
    timeout: float = 60.0
    baseline: bool = False
    verbose: bool = False
    api_key: str | None = None
    ca_cert: Path | None = None
    retries: int = 6
    sampling: SamplingParams = field(default_factory=SamplingParams)
    strategy: Strategy | None = None
    threshold: float | None = None
    # Draft through text for a verifier with another tokenizer (off: refuse the pair).
    translate: bool = True

    @property
    def effective_strategy(self) -> Strategy:
        return strategy_for(self.strategy, self.sampling)

    @property
    def use_pipeline(self) -> bool:
        """Pipelining overlaps model drafting with the round trip: nothing to overlap for
        n-gram drafts. Off by default for seeded sampling: how far it drafts ahead
        depends on timing, and so would the drafter's random draws, and the output."""
        if self.pipeline is not None:
            return self.pipeline
        seeded_sampling = self.sampling.seed is not None and not self.sampling.greedy
        return self.drafter != "ngram" and not seeded_sampling


class Renderer(Protocol):
    def status(self, message: str) -> None: ...

    def start(self, token_bytes: Callable[[int], bytes]) -> None: ...

    def round(self, event: RoundEvent) -> None: ...

    def finish(self, result: SpeculativeResult, baseline: BaselineResult | None) -> None: ...


def connect(options: RunOptions, max_retries: int | None = None) -> VerifierClient:
    return VerifierClient(
        options.server,
        timeout=options.timeout,
        api_key=options.api_key,
        ca_cert=options.ca_cert,
        max_retries=options.retries if max_retries is None else max_retries,
    )


def load_checked_drafter(
    client: VerifierClient, options: RunOptions, n_seq: int = 1, translate: bool | None = None
) -> tuple[DraftModel, InfoResponse, str]:
    """The draft model (sequence 0 of a context of `n_seq`), refused unless its ids can
    reach the verifier (the same or a compatible vocabulary, or with `translate`, any);
    /info; and a sentence on how it drafts, naming both models, where that is not plain."""
    info = client.info()
    check_protocol(info)
    if options.draft_n != "auto" and options.draft_n > info.max_draft:
        raise DrafterError(
            f"--draft-n {options.draft_n} exceeds the verifier's max_draft={info.max_draft}"
        )
    model = DraftModel(
        options.model,
        n_ctx=info.n_ctx + DRAFTER_CTX_MARGIN,
        n_seq=n_seq,
        n_gpu_layers=options.n_gpu_layers,
        n_threads=options.threads,
        verbose=options.verbose,
    )
    try:
        mode, note = check_vocabulary(
            info,
            model.vocab_facts(),
            drafter_name=model.name,
            drafter_path=options.model,
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


def load_verifier_vocab(client: VerifierClient, info: InfoResponse) -> LlamaVocab:
    """The verifier's vocabulary, for drafting through text: fetched once per hash."""
    try:
        path = cached_vocab_file(info.vocab_hash, client.vocab_file)
        return vocab_matches(path, info.vocab_hash)
    except (ValueError, OSError, LlamaError) as exc:
        raise DrafterError(f"the verifier's vocabulary file is not usable: {exc}") from exc


def prompt_request(vocab: LlamaVocab, options: RunOptions) -> PrefillRequest:
    """The prefill of --prompt; with --chat, through `vocab`'s chat template (the
    verifier's own where the drafter's tokenizer is another)."""
    prompt, add_bos = options.prompt, True
    if options.chat:
        prompt = vocab.chat_prompt(options.prompt, options.system)
        # Some templates write the BOS text themselves; another would change the prompt.
        add_bos = not vocab.starts_with_bos(prompt)
    return PrefillRequest(
        prompt=prompt,
        add_bos=add_bos,
        sampling=options.sampling,
        strategy=options.strategy,
        threshold=options.threshold,
    )


def draft_policy(options: RunOptions) -> DraftPolicy:
    """Rejection sampling needs drafts drawn from q; for greedy, match and threshold the
    drafter's argmax is the draft most likely to be accepted."""
    seed = options.sampling.seed
    return DraftPolicy(
        sampling=options.sampling,
        sample_drafts=options.effective_strategy == "rejection",
        # A stream of its own, unlike the verifier's, but fixed by the same seed.
        seed=None if seed is None else seed + 1,
        p_min=options.p_min,
    )


def candidate_generator(
    model: DraftModel, options: RunOptions, target: LlamaVocab | None = None
) -> CandidateGenerator:
    """Who drafts: the draft model (through text when `target`, the verifier's
    vocabulary, is given), prompt lookup, or prompt lookup with the model behind."""
    drafter = model if target is None else TranslatingDrafter(model, target)
    if options.drafter == "model":
        return drafter
    # Prompt lookup drafts the verifier's own ids, so its q spans the verifier's vocabulary.
    sampled = options.effective_strategy == "rejection"
    n_vocab = model.target_n_vocab if target is None else target.n_vocab
    ngram = NgramDrafter(n_vocab, sample_drafts=sampled)
    return ngram if options.drafter == "ngram" else ModelWithNgram(ngram, drafter)


def draft_length(options: RunOptions, info: InfoResponse) -> DraftLength:
    """`auto`: HF's schedule for a model's drafts, doubling for prompt lookup's (see
    drafter/draft_length.py)."""
    if options.draft_n != "auto":
        return FixedLength(options.draft_n)
    if options.drafter == "ngram":
        return DoublingLength(maximum=info.max_draft)
    return AdaptiveLength(maximum=info.max_draft)


def speculative_loop(
    model: DraftModel,
    client: VerifierClient,
    info: InfoResponse,
    options: RunOptions,
    target: LlamaVocab | None = None,
) -> SpeculativeLoop:
    model.configure(draft_policy(options))
    return SpeculativeLoop(
        candidate_generator(model, options, target),
        client,
        draft_n=draft_length(options, info),
        n_ctx=info.n_ctx,
        pipeline=options.use_pipeline,
        vocab=model.vocab_relation,
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


def run(options: RunOptions, renderer: Renderer) -> SpeculativeResult:
    with connect(options) as client:
        renderer.status(f"verifier {options.server}; loading {options.model.name}")
        model, info, note = load_checked_drafter(client, options, translate=options.translate)
        target = None
        try:
            if note:
                renderer.status(note)
            if model.vocab_relation == "translated":
                target = load_verifier_vocab(client, info)
                if options.effective_strategy == "rejection":
                    # q over the drafter's vocabulary is not a distribution over the
                    # verifier's tokens: `match` is lossless without one.
                    renderer.status(
                        "rejection sampling needs the drafter's probabilities over the "
                        "verifier's tokens, which another tokenizer cannot give: verifying "
                        "with --strategy match instead (lossless too)"
                    )
                    options = replace(options, strategy="match")
            request = prompt_request(target or model.runtime, options)
            loop = speculative_loop(model, client, info, options, target)
            renderer.start((target or model).token_bytes)
            for event in loop.run(request, options.max_tokens):
                renderer.round(event)
            result = loop.result
            baseline = None
            if options.baseline:
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
