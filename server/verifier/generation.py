"""The target model alone, token by token: the honest baseline behind /generate.

Each step is a verify round with an empty draft, so the baseline runs exactly the code
path (and the numerics) the speculative rounds use, and its steps share batches with
other sessions' rounds.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from server.shared.protocol import (
    GenerateRequest,
    GenerateResponse,
    GenerateTimings,
    PrefillRequest,
    VerifyRequest,
)
from server.verifier.scheduler import BatchScheduler


async def generate(
    scheduler: BatchScheduler,
    request: GenerateRequest,
    owner: str = "anonymous",
    client_gone: Callable[[], Awaitable[bool]] | None = None,
) -> GenerateResponse:
    """The verifier alone; stops early (freeing its session) if the client went away."""
    began = time.perf_counter()
    engine = scheduler.engine
    prefill = await scheduler.prefill(
        PrefillRequest(
            **request.model_dump(include={"prompt", "prompt_tokens"}, exclude_none=True),
            add_bos=request.add_bos,
            sampling=request.sampling,
            # With no drafts every strategy is plain sampling from p; match needs no probs.
            strategy=None if request.sampling.greedy else "match",
        ),
        owner,
    )
    prompt_done = time.perf_counter()
    tokens: list[int] = []
    eos = False
    total_tokens = prefill.total_tokens
    try:
        while len(tokens) < request.max_tokens and total_tokens <= engine.n_ctx:
            if client_gone is not None and await client_gone():
                break
            step = await scheduler.verify(
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
        await scheduler.call(
            lambda: engine.discard_session(prefill.session_id, prefill),
            prefill.session_id,
            owner,
            finishing=True,
        )
    ended = time.perf_counter()
    decode_s = ended - prompt_done
    return GenerateResponse(
        prompt_ids=prefill.prompt_ids,
        tokens=tokens,
        text=await scheduler.call(lambda: engine.detokenize(tokens), owner=owner, finishing=True),
        eos=eos,
        timings=GenerateTimings(
            prompt_ms=round((prompt_done - began) * 1000.0, 3),
            decode_ms=round(decode_s * 1000.0, 3),
            total_ms=round((ended - began) * 1000.0, 3),
            tokens_per_s=round(len(tokens) / decode_s, 3) if decode_s > 0 else 0.0,
        ),
    )
