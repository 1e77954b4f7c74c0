"""A chunk: a round without a draft that asks for several of the verifier's own tokens
(`chunk_tokens`). The engine's cycle keeps it queued and gives it one row in every pass
of rounds until it has its tokens, as continuous batching does for plain decoding, then
answers once with all of them: one token per pass, each from the same single-token round
a drafted session's pending token gets, so the tokens are the verifier's own. Where the
session's text repeats, a step carries the verifier's own copy of the repeat as a draft
(copy_draft.py) and commits several.

Pure bookkeeping: what the next step asks, when the chunk is done, the one answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.shared.protocol import RoundTimings, VerifyRequest, VerifyResponse


@dataclass
class ChunkSteps:
    request: VerifyRequest  # the client's: its key is the one a replay of the chunk has
    steps: list[VerifyResponse] = field(default_factory=list)
    committed: int = 0  # the steps' tokens, counted as they come (`add`)
    # A client's lookup sized by the verifier (draft_accept): how many of its tokens the
    # first step verified (0: none, or the verifier's own copy instead); None: unsized.
    client_draft: int | None = None

    @property
    def wanted(self) -> int:
        return self.request.chunk_tokens or 1

    @property
    def left(self) -> int:
        """Tokens still wanted."""
        return self.wanted - self.committed

    def add(self, step: VerifyResponse) -> None:
        if not self.steps and self.client_draft and step.draft_verified is not None:
            self.client_draft = step.draft_verified  # verified less than sized: cut after
        self.steps.append(step)
        self.committed += len(step.tokens)

    def next_request(
        self, copy: list[int] | None = None, sized: int | None = None
    ) -> VerifyRequest:
        """The next step: the client's own round first, then one from where the last step
        left the session; with the verifier's own `copy` as its draft (copy_draft.py), or
        the first `sized` tokens of the client's lookup (None: the client's draft whole)."""
        if not self.steps:
            request = self.request
            if request.draft_accept is not None:
                self.client_draft = 0 if copy else len(request.draft_tokens[:sized])
            if not copy and sized is None:
                return request
            draft = copy or request.draft_tokens[:sized]
            probs = None if copy or request.draft_probs is None else request.draft_probs[:sized]
            update = {"draft_tokens": draft, "draft_probs": probs, "chunk_tokens": None}
            if copy:  # the verifier's own: no client's draft to judge or count
                update |= {"draft_kind": None, "draft_accept": None}
            return request.model_copy(update=update)
        n_past = self.steps[-1].total_tokens
        return VerifyRequest(
            session_id=self.request.session_id, n_past=n_past, draft_tokens=copy or []
        )

    def done(self, n_ctx: int) -> bool:
        if not self.steps:
            return False
        last = self.steps[-1]
        # A client's lookup verified in part or whole is the round: the client looks up
        # again from its answer (a copy goes on from the user's history, which only the
        # client holds). Verified none, the round is the chunk it asked for.
        return bool(self.client_draft) or self.left <= 0 or last.eos or last.total_tokens > n_ctx

    def answer(self, advised_draft: int | None) -> VerifyResponse:
        """The steps so far as one round's answer: a round without a client's draft but
        the sized lookup its first step verified, if any (the verifier's own copies in it
        are no accepted drafts of the client's). The steps
        carry no advice (it is the session's as the chunk ends: `advised_draft`)."""
        steps = self.steps
        return steps[-1].model_copy(
            update={
                "accepted_prefix_len": steps[0].accepted_prefix_len if self.client_draft else 0,
                "draft_verified": self.client_draft,
                "advised_draft": advised_draft,
                "tokens": [t for step in steps for t in step.tokens],
                # A step's predictions where it committed (a copied step's rows past
                # its first rejection predict nothing that stands).
                "preds": [t for step in steps for t in step.preds[: len(step.tokens)]],
                "logprobs": (
                    None
                    if steps[0].logprobs is None
                    else [p for step in steps for p in step.logprobs or ()]
                ),
                "timings": RoundTimings(
                    decode_ms=round(sum(s.timings.decode_ms for s in steps), 3),
                    engine_ms=round(sum(s.timings.engine_ms for s in steps), 3),
                    decoded_tokens=sum(s.timings.decoded_tokens for s in steps),
                ),
            }
        )
