"""The start-up lines (`jaxserve: ...` on stderr): what the engine decided and how long it took.

They go through the `jaxserve.startup` logger, shown at INFO as vLLM's are: a program that embeds the
engine silences them with `logging.getLogger("jaxserve").setLevel(logging.WARNING)` or sends them
elsewhere with its own handler. The handler writes to whatever `sys.stderr` is when a line is logged (a
redirect, a test's capture), and the lines do not also reach the root logger's handlers.
"""

from __future__ import annotations

import logging
import sys


class _CurrentStderr(logging.StreamHandler):
    """A StreamHandler on the `sys.stderr` of the moment, as `logging.lastResort` is."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):  # StreamHandler.__init__ sets one; the current stderr is always used
        pass


STARTUP = logging.getLogger("jaxserve.startup")
if not STARTUP.handlers:
    _handler = _CurrentStderr()
    _handler.setFormatter(logging.Formatter("jaxserve: %(message)s"))
    STARTUP.addHandler(_handler)
    STARTUP.propagate = False
if logging.getLogger("jaxserve").level == logging.NOTSET:  # a level the program set first is kept
    logging.getLogger("jaxserve").setLevel(logging.INFO)
