"""Where a request's prompt is made ready (its chat template rendered, its text
tokenized, its grammar of tool calls written): a pool of threads of its own, with a
bound on the requests it holds, counted at admission, before any work. Rendering a long
prompt takes a while; on the event loop's default pool, a handful of huge requests
(token counts among them, which take no generation slot) would hold the threads that
`/health` and the verifier's checks need, and any number of them could wait there."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from drafter.serve.slots import QueueFull

T = TypeVar("T")


class RenderGate:
    def __init__(self, workers: int, waiting: int):
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="render")
        self.limit = max(1, workers) + waiting
        self.admitted = 0  # on the event loop only: checked and taken with no await between

    async def run(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` on the gate's threads; QueueFull at once where the gate holds its
        limit. A request that goes away leaves its place (its work, once begun, runs out
        on the thread: a render cannot be stopped midway)."""
        if self.admitted >= self.limit:
            raise QueueFull(
                f"{self.admitted} requests' prompts are being prepared, the most this "
                "server takes at once; try again shortly"
            )
        self.admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)
        finally:
            self.admitted -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
