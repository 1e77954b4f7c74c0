"""Threads that serve their owners in turn. Each owner's tasks run one at a time, in
order; the threads take owners round-robin. So an owner whose tasks are slow (a grammar
whose masks take long, one that is slow to compile) holds at most one thread, and another
owner's task waits at most for the tasks that were running when it came, never for a
queue of the slow owner's. `concurrent.futures.ThreadPoolExecutor` serves tasks in
arrival order, which is what this must not do.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from server.verifier.errors import ServerFull

# How much lower the threads that compile grammars and compute their masks run: the
# work a client's grammar costs takes the cores only when the engine leaves them.
GRAMMAR_NICE = 10


class KeyedPool:
    def __init__(self, workers: int, name: str, per_owner: int, nice: int = 0):
        """`per_owner`: tasks one owner may have waiting or running (0: any number); more
        are refused (ServerFull: 503, to retry). `nice`: the threads' scheduling
        priority, lowered by that much where the system lets a thread have its own
        (Linux): a client's grammar work then yields the cores to the engine thread and
        the event loop, which answer every client."""
        self.per_owner = per_owner
        self.nice = nice
        self._tasks: dict[str, deque[tuple[Future, Callable[[], Any]]]] = {}
        self._turns: deque[str] = deque()  # owners with a task waiting and none running
        self._running: set[str] = set()
        self._wake = threading.Condition()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, owner: str, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._wake:
            if self._stopping:
                raise ServerFull("the verifier is shutting down")
            tasks = self._tasks.setdefault(owner, deque())
            if self.per_owner and len(tasks) + (owner in self._running) >= self.per_owner:
                raise ServerFull(
                    f"this key has {self.per_owner} grammar tasks waiting or running; retry shortly"
                )
            tasks.append((future, fn))
            if owner not in self._running and owner not in self._turns:
                self._turns.append(owner)
            self._wake.notify()
        return future

    def shutdown(self) -> None:
        """Tasks still waiting are cancelled; running ones end; the threads with them."""
        with self._wake:
            self._stopping = True
            for tasks in self._tasks.values():
                for future, _ in tasks:
                    future.cancel()
            self._tasks.clear()
            self._turns.clear()
            self._wake.notify_all()
        for thread in self._threads:
            thread.join()

    def _serve(self) -> None:
        if self.nice:
            with contextlib.suppress(AttributeError, OSError):  # no per-thread priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        while True:
            with self._wake:
                while not self._turns and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                owner = self._turns.popleft()
                future, fn = self._tasks[owner].popleft()
                self._running.add(owner)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # the caller's to hear of, not this thread's end
                    future.set_exception(exc)
            with self._wake:
                self._running.discard(owner)
                if self._tasks.get(owner):
                    self._turns.append(owner)
                else:
                    self._tasks.pop(owner, None)
