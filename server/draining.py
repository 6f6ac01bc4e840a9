"""uvicorn, with the first SIGTERM/SIGINT draining the app before it stops.

uvicorn alone stops at once on a signal, cutting in-flight streams without an error event. Here the
first signal starts the app's drain (stop admitting, let in-flight requests finish up to a timeout,
end the rest with an error event) and only then stops uvicorn; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable

import uvicorn


class DrainingServer(uvicorn.Server):
    """`drain` is awaited on the event loop when the first signal arrives."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self._drain = drain  # async callable: stop admitting, wait, end the rest
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded as a captured signal, so uvicorn does not re-raise it after stopping: a
        # drained shutdown exits 0.
        if self._draining or self._loop is None:
            self.force_exit = self.should_exit and sig == signal.SIGINT
            self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True
