"""The draft model evaluating a prompt on a thread of its own while the verifier prefills
it: the first draft then finds the prompt cached. Stopped (between pieces of the prompt)
once the prefill's advice says the first rounds carry no draft: the draft model then does
no work until a drafted round is near. And catching up, while a round without a draft is
out, with the tokens such rounds brought, as far as it gets before the answer comes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from drafter.speculative.candidates import Drafter
from server.shared.protocol import PrefillRequest

Warm = Callable[[PrefillRequest, Callable[[], bool]], None]


class Warming:
    def __init__(self) -> None:
        self._future: Future | None = None
        self._stop = threading.Event()

    def start(self, warm: Warm, prefill: PrefillRequest) -> None:
        """`warm(prefill, stop)` on a thread: it evaluates the prompt, and no further once
        `stop()` is true."""
        self._stop = threading.Event()
        thread = ThreadPoolExecutor(1, thread_name_prefix="warm")
        self._future = thread.submit(warm, prefill, self._stop.is_set)
        thread.shutdown(wait=False)

    def stop(self) -> None:
        """The warming, if one is under way, ends at its next piece; `wait` for it before
        using the draft model."""
        self._stop.set()

    def running(self) -> bool:
        future = self._future
        return future is not None and not future.done()

    def wait(self) -> None:
        """Until the warming, if one is under way, is over: the draft model is used from
        one thread at a time. A drafter that cannot take the prompt fails again at its
        first draft, with the session open (and closed by the loop)."""
        future, self._future = self._future, None
        if future is not None:
            with contextlib.suppress(Exception):
                future.result()

    def catch_up(
        self, drafter: Drafter, committed: Sequence[int], stop: Callable[[], bool] | None = None
    ) -> bool:
        """The drafter evaluates the committed tokens its cache lacks, so that the next
        draft starts at once, until `stop()`; not while a warming that was not stopped
        still runs (the round must not wait for the whole prompt). Whether it holds them
        all now (a drafter without a cache always does)."""
        if not drafter.catches_up:
            return True
        if self._future is not None and not self._future.done() and not self._stop.is_set():
            return False
        self.wait()
        return drafter.catch_up(committed, stop)
