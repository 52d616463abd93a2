"""One verifier process and the parent's end of its pipe: what runs inside the process
(`worker_main`: JSON task in, JSON reply out, until EOF) and the handle the pool's dispatcher
threads drive (`WorkerSlot`: start, wait until ready, run a task under a deadline, kill).

Each verification runs in the main thread of a process of its own because math-verify enforces
its timeouts with `signal.alarm`, which raises outside the main thread and cannot interrupt long
C-level work: the parent waits at most the deadline for a reply and kills the process when it
does not come (math_verify_pool.VerifierPool). Replies are small JSON objects with a size cap;
nothing from a pipe is unpickled.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
from multiprocessing.connection import Connection
from typing import Any

from async_grpo.config.reward_config import RewardFunctionError, load_function
from async_grpo.rewards import reward_functions
from async_grpo.rewards.math_verifier import RewardResult, verify_with_math_verify
from async_grpo.rewards.reward_failure import FailureKind

# A new process warms math-verify's LaTeX parser (~0.2 s from the forkserver; the server's own
# first start imports sympy, a few seconds on a busy machine or in a Ray worker); past this it is broken.
STARTUP_TIMEOUT_S = 120.0
# Seconds a closing pool waits for a process to exit after its pipe closes before killing it.
_SHUTDOWN_GRACE_S = 5.0
# A reply is one small JSON object; anything larger means the process broke the protocol. A
# reward function's reply carries one score (with its named parts) per completion of its batch.
_MAX_REPLY_BYTES = 1 << 16
MAX_FUNCTION_REPLY_BYTES = 1 << 22
# Imported once by the forkserver so that every process forked from it starts with them loaded,
# and warm (math_verify_warmup verifies one answer: a replacement process then starts in ~0.03 s).
FORKSERVER_PRELOAD = ["async_grpo.rewards.math_verify_process", "math_verify", "sympy",
                      "async_grpo.rewards.math_verify_warmup"]
_READY_MESSAGE = b'{"ready": true}'


class WorkerStartError(RuntimeError):
    """A verifier process did not come up (crashed while importing math-verify, or too slow)."""


def worker_main(conn: Connection) -> None:
    """Entry point of a verifier process: JSON task in, JSON RewardResult out, until EOF."""
    # Ctrl-C reaches the whole process group; the parent decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The "timeout is disabled" warning is expected: the parent enforces the deadline.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verify_with_math_verify("1", "1")  # import sympy/math-verify and build the LaTeX parser before "ready"
    conn.send_bytes(_READY_MESSAGE)
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return
        if "function" in request:
            conn.send_bytes(_run_function(request["function"], request["calls"]))
            continue
        if "load" in request:
            conn.send_bytes(_load_function(request["load"]))
            continue
        # The parent ran the pre-checks and the fast path (quick_verdict) before sending it here.
        result = verify_with_math_verify(request["completion"], request["gold"])
        conn.send_bytes(encode_result(result))


def _load_function(ref: str) -> bytes:
    """Import a reward function's module ahead of its first call (inside a verifier process), so
    that its import time (reasoning-gym: seconds) never counts against a call's deadline."""
    try:
        load_function(ref)
    except RewardFunctionError as exc:
        return json.dumps({"loaded": False, "error": str(exc)}).encode("utf-8")
    return json.dumps({"loaded": True}).encode("utf-8")


def _run_function(ref: str, calls: list[dict[str, Any]]) -> bytes:
    """A reward function's scores on `calls`, as the JSON reply (inside a verifier process)."""
    try:
        function = load_function(ref)
    except RewardFunctionError as exc:
        scores = [reward_functions.failure(FailureKind.RAISED, str(exc))] * len(calls)
    else:
        scores = reward_functions.call_function(function, calls)
    reply = json.dumps({"scores": [score.as_json() for score in scores]}).encode("utf-8")
    if len(reply) > MAX_FUNCTION_REPLY_BYTES:
        detail = f"reply of {len(reply)} bytes exceeds {MAX_FUNCTION_REPLY_BYTES}"
        reply = json.dumps({"scores": [reward_functions.failure(FailureKind.BAD_RETURN, detail).as_json()]
                            * len(calls)}).encode("utf-8")
    return reply


def encode_result(result: RewardResult) -> bytes:
    """A RewardResult as the JSON reply of a verifier process (the kind as its value)."""
    kind = None if result.kind is None else result.kind.value
    return json.dumps({"reward": result.reward, "failed": result.failed, "error": result.error,
                       "kind": kind}).encode("utf-8")


def decode_result(data: bytes) -> RewardResult:
    """The RewardResult of encode_result's reply; KeyError/ValueError when it is not one."""
    reply = json.loads(data)
    kind = None if reply["kind"] is None else FailureKind(reply["kind"])
    return RewardResult(reward=float(reply["reward"]), failed=bool(reply["failed"]), error=str(reply["error"]),
                        kind=kind)


class WorkerSlot:
    """One verifier process and the parent's end of its pipe; used by one dispatcher thread."""

    def __init__(self, ctx: multiprocessing.context.ForkServerContext, index: int) -> None:
        self.index = index
        self._ctx = ctx
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self.loaded: set[str] = set()
        """Reward functions this slot's current process has imported (see load)."""

    @property
    def alive(self) -> bool:
        return self._process is not None

    def start(self) -> None:
        """Start the process; call wait_ready() before sending it work."""
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main, args=(child_conn,), name=f"math-verifier-{self.index}", daemon=True
        )
        try:
            process.start()
        except BaseException:
            parent_conn.close()
            raise
        finally:
            child_conn.close()  # the child has its copy; closing ours lets the parent see EOF when it dies
        self._process, self._conn = process, parent_conn
        self.loaded = set()

    def load(self, ref: str) -> None:
        """Have the process import reward function `ref`, waiting up to STARTUP_TIMEOUT_S (an
        import is start-up work, not scoring). A module that fails to import is not an error
        here: the call then fails the same way and reports it. Raises EOFError/OSError when the
        process died, TimeoutError when the import outlasted the wait."""
        assert self._conn is not None, "load() on a slot without a process"
        self._conn.send_bytes(json.dumps({"load": ref}).encode("utf-8"))
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            raise TimeoutError(f"importing {ref} took more than {STARTUP_TIMEOUT_S:.0f} s")
        self._conn.recv_bytes(_MAX_REPLY_BYTES)
        self.loaded.add(ref)

    def wait_ready(self) -> None:
        """Block until the process has imported math-verify, or raise WorkerStartError."""
        assert self._conn is not None, "wait_ready() before start()"
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise WorkerStartError(f"verifier process {self.index} not ready after {STARTUP_TIMEOUT_S:.0f} s")
        try:
            message = self._conn.recv_bytes(_MAX_REPLY_BYTES)
        except (EOFError, OSError):
            exitcode = self.kill()
            raise WorkerStartError(
                f"verifier process {self.index} exited during startup (exit code {exitcode}); its stderr says why"
            ) from None
        if message != _READY_MESSAGE:
            self.kill()
            raise WorkerStartError(f"verifier process {self.index} sent {message[:100]!r} instead of ready")

    def run(self, payload: bytes, timeout_s: float, max_reply_bytes: int = _MAX_REPLY_BYTES) -> bytes | None:
        """Send one task and wait for its reply; None when the deadline passed first.

        Raises EOFError/OSError when the process died or broke the protocol.
        """
        assert self._conn is not None, "run() on a slot without a process"
        self._conn.send_bytes(payload)
        if not self._conn.poll(timeout_s):
            return None
        return self._conn.recv_bytes(max_reply_bytes)

    def kill(self) -> int | None:
        """SIGKILL the process (if any), reap it and return its exit code."""
        process, conn = self._process, self._conn
        self._process, self._conn = None, None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        process.kill()
        process.join()
        exitcode = process.exitcode
        process.close()
        return exitcode

    def stop(self) -> None:
        """Close the pipe so the process exits on EOF; kill it if it does not within the grace."""
        process, conn = self._process, self._conn
        if conn is not None:
            conn.close()
            self._conn = None
        if process is None:
            return
        process.join(_SHUTDOWN_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()
        process.close()
        self._process = None


