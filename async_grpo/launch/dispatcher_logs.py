"""Reading a dispatcher's output: its registration line, and relaying its own warnings from its
log file to the local launcher's console.

A LocalCluster writes each dispatcher's output (Ray's and vLLM's start-up included) to a file;
DispatcherLogRelay follows those files and repeats the dispatcher's warnings, errors and
restart lines as warnings of the launcher, so a failing or replaced worker shows on the console.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import TextIO

logger = logging.getLogger(__name__)

_POLL_S = 0.5  # how often the relay looks at the dispatcher logs
REGISTERED_LINE = "worker {name} registered"
"""What a dispatcher prints once its worker has registered; launchers wait for it (local_cluster,
the launch scripts in docs/cluster.md)."""
# Ray relays the worker actor's output into the dispatcher's stdout as well, from another thread,
# so a relayed fragment may precede the registration line on the same line: it is matched at the
# line's end, not its start (write_line keeps the line and its newline in one write).
REGISTERED_PATTERN = re.compile(r"worker (\S+) registered$", re.MULTILINE)

# Dispatcher log lines the launcher repeats on its console as warnings: the dispatcher's own
# warnings and errors (a failed health check, a replacement starting) and its restart and give-up
# lines (worker_dispatcher's RESTARTING_LINE and final failure lines). vLLM's and Ray's lines in
# the same file, warnings included, stay there. Group 1: the dispatcher's message.
_RELAYED_LINE = re.compile(r"^\S+ \S+ (?:WARNING|ERROR|CRITICAL) __main__: (.*)$"
                           r"|^(worker \S+ restarting \(.*|.*; giving up after .*|.*; not restarting it: .*)$")


def write_line(text: str, stream: TextIO) -> None:
    """Write `text` and its newline in one call, then flush. print() writes them apart, and the
    worker output that Ray relays into the same stream from another thread can land in between,
    hiding the line from whoever reads the log (a launcher waiting for REGISTERED_LINE)."""
    stream.write(text + "\n")
    stream.flush()


def registered_worker(text: str) -> str | None:
    """The name of the worker whose registration line is in `text` (a dispatcher's output), or None."""
    match = REGISTERED_PATTERN.search(text)
    return None if match is None else match.group(1)


def relayed(line: str) -> str | None:
    """The part of a dispatcher log line that the launcher repeats as a warning (None: not one)."""
    match = _RELAYED_LINE.match(line.rstrip("\n"))
    return None if match is None else match.group(1) or match.group(2)


class DispatcherLogRelay:
    """Follows the dispatcher logs and logs their `relayed` lines as warnings of this process, so
    that a failing or replaced worker shows on the launcher's console (its log stays in the file)."""

    def __init__(self, logs: list[tuple[str, Path]]) -> None:
        self._logs = logs
        self._offsets = {path: 0 for _, path in logs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="dispatcher-log-relay", daemon=True)

    def poll(self) -> None:
        """Relay the complete lines written since the last poll."""
        for label, path in self._logs:
            try:
                with path.open("rb") as f:
                    f.seek(self._offsets[path])
                    chunk = f.read()
            except OSError:  # not created yet, or removed with the run
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            self._offsets[path] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                message = relayed(line)
                if message is not None:
                    logger.warning("%s worker: %s", label, message)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Relay what is left, then stop following."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.poll()

    def _follow(self) -> None:
        while not self._stop.wait(_POLL_S):
            self.poll()
