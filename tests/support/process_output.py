"""Reading a child process's output while it runs: wait for a line, show its tail on failure."""

from __future__ import annotations

import re
import subprocess
import threading
import time


class OutputLog:
    """Collects a subprocess's merged output lines on a thread; lets the test wait for a line."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pump, args=(process,), daemon=True)
        self._thread.start()

    def _pump(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, text: str, process: subprocess.Popen, bound_s: float) -> None:
        self.wait_for_match(re.escape(text), process, bound_s)

    def wait_for_match(self, pattern: str, process: subprocess.Popen, bound_s: float, skip: int = 0) -> re.Match:
        """The first line after the first `skip` lines that matches `pattern` whole (stripped)."""
        deadline = time.monotonic() + bound_s
        with self._cond:
            while True:
                for line in self.lines[skip:]:
                    if match := re.fullmatch(pattern, line.strip()):
                        return match
                if process.poll() is not None and not self._thread.is_alive():
                    raise AssertionError(f"process exited ({process.returncode}) before {pattern!r}:\n{self.tail()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"no {pattern!r} within {bound_s:.0f} s:\n{self.tail()}")
                self._cond.wait(1.0)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])
