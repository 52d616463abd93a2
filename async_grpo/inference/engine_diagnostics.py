"""Why a vLLM engine failed to start, in one line.

AsyncLLM raises a generic "Engine core initialization failed" when its engine-core process dies
starting; the cause is only in that process's own traceback, which goes to this process's stderr
(a Ray actor's worker-*.err log). `StderrTail` reads what was written there since the start
began, and `root_cause_line` picks the exception line that says why.

Plain: no vLLM, no Ray.
"""

from __future__ import annotations

import contextlib
import os
import re

# A Python exception line in a traceback: "ValueError: ...", "torch.OutOfMemoryError: ...".
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): \S")
# What AsyncLLM raises when its engine-core process fails to start; the cause is only in that
# process's own traceback, which goes to the actor's stderr (Ray's worker-*.err log).
_GENERIC_ENGINE_START_ERRORS = ("Engine core initialization failed",)
_STDERR_TAIL_BYTES = 256 * 1024  # enough for vLLM's start-up tracebacks, small enough to read at once


def root_cause_line(log_text: str) -> str | None:
    """The last exception line of the tracebacks in `log_text` that is not vLLM's generic
    "Engine core initialization failed" wrapper, e.g. "ValueError: Available memory on node 0 ..."."""
    for line in reversed(log_text.splitlines()):
        line = line.strip()
        # Ray prefixes a worker's lines with "(pid=...)"-style tags when relayed; strip them.
        line = re.sub(r"^\([^)]*\)\s*", "", line)
        if _EXCEPTION_LINE.match(line) and not any(g in line for g in _GENERIC_ENGINE_START_ERRORS):
            return line
    return None


class StderrTail:
    """What this process (and its children, the engine core among them) wrote to its stderr file
    since construction: where a vLLM start-up failure's root cause is printed. Empty when stderr
    is not a regular file (a terminal, a pipe)."""

    def __init__(self) -> None:
        self._path = ""
        with contextlib.suppress(OSError):
            target = os.readlink("/proc/self/fd/2")
            if os.path.isfile(target):
                self._path, self._offset = target, os.path.getsize(target)

    def read(self) -> str:
        if not self._path:
            return ""
        with contextlib.suppress(OSError), open(self._path, "rb") as handle:
            start = max(self._offset, os.path.getsize(self._path) - _STDERR_TAIL_BYTES)
            handle.seek(start)
            return handle.read().decode(errors="replace")
        return ""
