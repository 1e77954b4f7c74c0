"""The loop's sessions on the verifier: opened under an id the drafter chose (so that a
balancer routes by it and a recovery re-opens it under the same id), opened again from
the committed tokens when the verifier lost one, and closed best effort."""

from __future__ import annotations

import contextlib
from typing import Protocol

from drafter.errors import VerifierRejected
from server.shared.protocol import PrefillRequest, PrefillResponse


class SessionVerifier(Protocol):
    def prefill(self, request: PrefillRequest) -> PrefillResponse: ...

    def delete_session(self, session_id: str) -> None: ...


class RemoteSessions:
    def __init__(self, verifier: SessionVerifier):
        self.verifier = verifier
        self.chosen_id: str | None = None  # the running (or last) generation's id

    def open(self, request: PrefillRequest) -> PrefillResponse:
        try:
            opened = self.verifier.prefill(request)
        except VerifierRejected as exc:
            chosen = self.chosen_id
            if exc.error_type != "session_exists" or chosen is None or request.session_id != chosen:
                raise
            # The id is our own random one: a prefill retried after its answer was lost
            # has opened it already. That session is dropped and opened again, once.
            self.close(chosen)
            opened = self.verifier.prefill(request)
        if opened.session_id != request.session_id:
            raise VerifierRejected(
                502,
                "protocol_error",
                f"asked for session {request.session_id!r}, "
                f"the verifier opened {opened.session_id!r}",
            )
        return opened

    def reopen(self, prefill: PrefillRequest, committed: list[int], prompt_len: int) -> str:
        """The session opened again on everything committed so far (the generated tokens
        said as such: penalties count them, a grammar's state is after them)."""
        update = {
            "prompt": None,
            "prompt_tokens": list(committed),
            "add_bos": False,
            "generated_tokens": len(committed) - prompt_len,
        }
        return self.open(prefill.model_copy(update=update)).session_id

    def close(self, session_id: str) -> None:
        # Best effort: the session holds a KV sequence on the server until it is freed,
        # and a failed cleanup must not hide the result.
        with contextlib.suppress(Exception):
            self.verifier.delete_session(session_id)


def within_limit(
    max_tokens: int, opened: PrefillResponse, request: PrefillRequest
) -> tuple[int, bool]:
    """The tokens a generation may ask for: `max_tokens`, or fewer where the verifier
    bounds the session's (`grammar_token_limit`: its grammar's end unproven; the request's
    generated_tokens counted); and whether that bound is the one that holds."""
    limit, generated = opened.grammar_token_limit, request.generated_tokens
    if limit is None or limit - generated >= max_tokens:
        return max_tokens, False
    return max(0, limit - generated), True
