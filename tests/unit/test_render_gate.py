"""serve's render gate: a request's prompt is made ready on threads of its own, at most
`workers + waiting` requests held, the bound taken at admission (stepped on the event
loop, no timing)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from drafter.serve.render_gate import RenderGate
from drafter.serve.slots import QueueFull


def test_the_gate_holds_its_limit_and_refuses_the_rest_at_once():
    async def scenario():
        gate = RenderGate(workers=1, waiting=2)
        release = threading.Event()
        held = [asyncio.create_task(gate.run(release.wait)) for _ in range(3)]
        await asyncio.sleep(0)  # each task has taken its place
        assert gate.admitted == 3
        with pytest.raises(QueueFull):
            await gate.run(lambda: "never run")
        held[2].cancel()  # a request that goes away leaves its place
        await asyncio.gather(held[2], return_exceptions=True)
        assert gate.admitted == 2
        release.set()
        assert await asyncio.gather(*held[:2]) == [True, True]
        assert gate.admitted == 0
        assert await gate.run(lambda x: x + 1, 41) == 42
        gate.close()

    asyncio.run(scenario())


def test_an_error_in_the_work_is_the_callers_and_frees_the_place():
    async def scenario():
        gate = RenderGate(workers=1, waiting=0)

        def fails():
            raise ValueError("bad prompt")

        with pytest.raises(ValueError, match="bad prompt"):
            await gate.run(fails)
        assert gate.admitted == 0
        gate.close()

    asyncio.run(scenario())
