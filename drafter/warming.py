"""The draft model evaluating a prompt on a thread of its own while the verifier prefills
it: the first draft then finds the prompt cached, and rounds without a draft (where the
verifier advises none) need not wait for it at all. And catching up, while a round without
a draft is out, with the tokens such rounds brought."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from server.shared.protocol import PrefillRequest


class Warming:
    def __init__(self) -> None:
        self._future: Future | None = None

    def start(self, warm: Callable[[PrefillRequest], None], prefill: PrefillRequest) -> None:
        thread = ThreadPoolExecutor(1, thread_name_prefix="warm")
        self._future = thread.submit(warm, prefill)
        thread.shutdown(wait=False)

    def wait(self) -> None:
        """Until the warming, if one is under way, is over: the draft model is used from
        one thread at a time. A drafter that cannot take the prompt fails again at its
        first draft, with the session open (and closed by the loop)."""
        future, self._future = self._future, None
        if future is not None:
            with contextlib.suppress(Exception):
                future.result()

    def catch_up(self, drafter: object, committed: Sequence[int]) -> None:
        """The drafter evaluates the committed tokens its cache lacks, so that the next
        draft starts at once; not while the warming still runs (the round must not wait
        for it), nor for a drafter without a cache."""
        catch_up = getattr(drafter, "catch_up", None)
        if catch_up is None or (self._future is not None and not self._future.done()):
            return
        self.wait()
        catch_up(committed)
