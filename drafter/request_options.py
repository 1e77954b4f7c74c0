"""What one generation asks for, apart from how the process is configured.

A request's options (its sampling, penalties and seed, its grammar, its strategy, its
limit, whether it may be pipelined) travel in one `RequestOptions` from the edge to the
loop: the CLI makes one from its settings (`DrafterSettings.request_options`), `serve`
one from each request (`RequestOptions.for_request`), and never from the process's
settings. What the process is configured with (the drafter, the draft length, threads,
timeouts, the verifier's URL) stays in DrafterSettings.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from server.shared.protocol import (
    MAX_TOP_LOGPROBS,
    Grammar,
    PrefillRequest,
    PromptInput,
    SamplingParams,
    Strategy,
    strategy_for,
)


class RequestOptions(BaseModel):
    """One generation's options: what the verifier is told at its prefill, and what the
    drafter drafts by (its draws, its policy, its length for a seeded run)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Temperature, top-k, top-p, the seed, and the penalties and biases of the logits.
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    grammar: Grammar | None = None  # the constraint the verifier decodes under
    strategy: Strategy | None = None  # None: the sampling's own (strategy_for)
    # As the prefill bounds them, so that a bad one is refused where the options are made.
    threshold: float | None = Field(None, gt=0.0, le=1.0)  # with strategy threshold
    # The verifier's log-probabilities with each token, and this many likeliest tokens'.
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int  # tokens to generate at most
    # Whether to draft ahead while a round is out; None: the process's --pipeline, else
    # on for a model drafter except for seeded sampling (drafter/runner.py `pipelined`).
    pipeline: bool | None = None

    @classmethod
    def for_request(
        cls,
        sampling: SamplingParams,
        max_tokens: int,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
    ) -> RequestOptions:
        """A `serve` request's options: its own sampling, grammar and limit. Seeded
        sampling is never pipelined: how far it drafts ahead depends on timing, and so
        would the drafter's random draws, and the output."""
        return cls(
            sampling=sampling,
            grammar=grammar,
            logprobs=logprobs,
            max_tokens=max_tokens,
            pipeline=False if seeded_sampling(sampling) else None,
        )

    @property
    def seed(self) -> int | None:
        return self.sampling.seed

    @property
    def seeded_sampling(self) -> bool:
        """A seed for draws that happen (greedy has none to fix)."""
        return seeded_sampling(self.sampling)

    @property
    def effective_strategy(self) -> Strategy:
        return strategy_for(self.strategy, self.sampling)

    def through_text(self) -> RequestOptions:
        """For a draft model of another tokenizer: its q is no distribution over the
        verifier's tokens, so rejection sampling becomes sample-and-match (lossless
        without one); every other strategy as it was."""
        if self.effective_strategy != Strategy.rejection:
            return self
        return self.model_copy(update={"strategy": Strategy.match})

    def prefill(self, prompt: PromptInput, cache_scope: str | None = None) -> PrefillRequest:
        """The verifier's /prefill for `prompt` under these options; `cache_scope`: whose
        cached prefixes it may reuse within the verifier key (`serve`'s client's)."""
        return PrefillRequest(
            **prompt.model_dump(include={"prompt", "prompt_tokens", "add_bos"}, exclude_none=True),
            sampling=self.sampling,
            grammar=self.grammar,
            strategy=self.strategy,
            threshold=self.threshold,
            logprobs=self.logprobs,
            cache_scope=cache_scope,
        )


def seeded_sampling(sampling: SamplingParams) -> bool:
    return sampling.seed is not None and not sampling.greedy
