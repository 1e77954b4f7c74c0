"""Whether the client of a request hung up before its answer: a request's `receive`
that, once the body is in, keeps listening for the disconnect.

uvicorn drops what is sent to a client that has gone, and logs nothing for it; whoever
counts or logs the request reads `gone` when the answer starts, and says 499 (nginx's
status for a client that closed the connection first).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Receive = Callable[[], Awaitable[dict]]
DISCONNECT = {"type": "http.disconnect"}


class HangUpWatch:
    def __init__(self, receive: Receive):
        self._receive = receive
        self._listening: asyncio.Future[dict] | None = None  # once the body is in

    async def receive(self) -> dict:
        """The request's next message, as the server sends it; after the body, every
        call is answered by one listening call (the disconnect, when it comes)."""
        if self._listening is not None:
            return await asyncio.shield(self._listening)
        message = await self._receive()
        if message["type"] != "http.request":
            self._listening = asyncio.get_running_loop().create_future()
            self._listening.set_result(message)
        elif not message.get("more_body", False):
            self._listening = asyncio.ensure_future(self._receive())
        return message

    @property
    def gone(self) -> bool:
        """Whether the client has hung up (known once its body was read)."""
        listening = self._listening
        return (
            listening is not None
            and listening.done()
            and not listening.cancelled()
            and listening.result()["type"] == "http.disconnect"
        )

    def close(self) -> None:
        if self._listening is not None and not self._listening.done():
            self._listening.cancel()
