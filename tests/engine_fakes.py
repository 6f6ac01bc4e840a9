"""Stand-ins for the engine's parts in tests of what happens around a step (the engine loop, the server)."""

from __future__ import annotations

import threading


class BlockingStep:
    """Stands in for `engine.step`: signals `entered`, blocks until `gate` is set, then raises `error`
    (or, with none, returns no outputs)."""

    def __init__(self, error: BaseException | None = None):
        self.entered, self.gate, self.error = threading.Event(), threading.Event(), error

    def __call__(self):
        self.entered.set()
        self.gate.wait()
        if self.error is not None:
            raise self.error
        return []
