"""A pool of verifier processes with a hard per-sample deadline: math-verify (VerifierPool.score)
and plug-in reward functions (VerifierPool.score_function), in processes that can be killed.

math-verify cannot be interrupted from inside (math_verifier.py; an exponent tower such as
`\\boxed{5^{5^{5^{5^5}}}}` or a megabyte of LaTeX can hang it for minutes), so each verification
runs in the main thread of a worker process of its own (math_verify_process.py). One dispatcher
thread per process sends it one task at a time as JSON over a pipe and waits at most `timeout_s`;
a process that overruns is killed, its sample scores 0 with error "timeout", and a replacement
process is started. A hostile output thus costs one deadline and one process restart, never a
stalled pool.

Processes come from multiprocessing's forkserver: a fresh single-threaded interpreter (started
like a spawn child, so forking from it is safe even when the pool lives in a threaded Ray actor or
beside vLLM) that has sympy and math-verify imported already. A replacement is then ready in
~0.2 s instead of the ~1.2 s a spawn child spends importing them (measured on this 2-core
machine), which is most of what a timeout costs beyond its deadline.

Before a completion reaches a process, the pool answers the pre-checks and the plain-number fast
path itself, in the caller's thread (math_verifier.quick_verdict); everything else goes to
math-verify in a process under the deadline.

    pool = VerifierPool()  # one process per core (at least 2), 1 s deadline: VerifierPoolConfig
    results = await pool.score(["so the sum is \\boxed{7}", "8"], gt_answer="7")
    pool.close()

Failures are counted by their typed kind (reward_failure.FailureKind) in stats(). On a Ray
cluster the processes are shared and spread over nodes by math_verify_cluster.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from async_grpo.config.reward_config import RewardFunctionError, load_function
from async_grpo.rewards import reward_functions
from async_grpo.rewards.math_verifier import DEFAULT_LIMITS, AnswerLimits, RewardResult, failure, quick_verdict
from async_grpo.rewards.reward_failure import FailureKind
from async_grpo.rewards.reward_functions import FunctionScore
from async_grpo.rewards.math_verify_process import (
    FORKSERVER_PRELOAD, MAX_FUNCTION_REPLY_BYTES, WorkerSlot, WorkerStartError, decode_result,
)

logger = logging.getLogger(__name__)

# Characters of a completion quoted in a timeout log line.
_LOG_SNIPPET_CHARS = 80
# Completions longer than this are never cached: they are rarely repeated and would bloat the cache.
_MAX_CACHED_COMPLETION_CHARS = 1024
# Default pool size: one process per usable core, but never one (a lone process that is killed at
# the deadline stalls every other result for the deadline plus a restart), and at most 32 (each
# process holds tens of MB with sympy loaded; benchmarks/RESULTS.md, "Reward verification").
_MIN_DEFAULT_PROCESSES = 2
_MAX_DEFAULT_PROCESSES = 32
# Default deadline per verification: over 5x the worst clean p99 latency (queueing included) that
# benchmarks/reward.py has measured (benchmarks/RESULTS.md, "Reward verification"), headroom for a
# machine shared with generation and training, while a hostile input that evades the pre-checks
# holds a process for 1 s, not 10.
DEFAULT_TIMEOUT_S = 1.0

# stats()'s counters, in the order it reports them.
_COUNTERS = ("scored", "failed", "timeouts", "parse_errors", "verify_errors", "rejected", "fast_path", "crashes",
             "restarts", "cancelled", "cache_hits", "function_calls", "function_failed", "function_raised",
             "function_bad_returns", "function_timeouts", "function_crashes", "function_rejected")
# The counter each kind of a failed math-verify result adds to (besides "failed").
_RESULT_COUNTERS = {FailureKind.TIMEOUT: "timeouts", FailureKind.PARSE_ERROR: "parse_errors",
                    FailureKind.VERIFY_ERROR: "verify_errors", FailureKind.REJECTED: "rejected"}
# The counter each kind of a failed reward-function score adds to (besides "function_failed");
# any other kind (a crash) counts as function_crashes.
_FUNCTION_COUNTERS = {FailureKind.RAISED: "function_raised", FailureKind.BAD_RETURN: "function_bad_returns",
                      FailureKind.TIMEOUT: "function_timeouts", FailureKind.REJECTED: "function_rejected"}
# Failures another run of the same input need not repeat (load, or a dying process): never cached.
_UNREPEATABLE = frozenset({FailureKind.TIMEOUT, FailureKind.VERIFY_ERROR})


def default_num_processes() -> int:
    """Verifier processes for this machine: its usable cores (the CPU affinity of this process,
    which container CPU sets narrow), at least _MIN_DEFAULT_PROCESSES, at most _MAX_DEFAULT_PROCESSES."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without sched_getaffinity (macOS)
        cores = os.cpu_count() or 1
    return min(max(cores, _MIN_DEFAULT_PROCESSES), _MAX_DEFAULT_PROCESSES)


@dataclass(kw_only=True, frozen=True)
class VerifierPoolConfig:
    """How a VerifierPool is sized and what it lets through to math-verify."""

    num_processes: int | None = None
    """Worker processes (each verifies one completion at a time, ~one CPU core when busy). None:
    default_num_processes(), i.e. one per usable core of the machine the pool starts on, at least
    2 (one process killed at a deadline must not stall the rest) and at most 32."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Hard deadline per verification; a process past it is killed and replaced, the sample scores
    0 with error "timeout". Default 1 s: benchmarks/reward.py's clean p99 latency through
    math-verify on the 2-core machine, queueing included, was 24-166 ms (quiet to busy machine;
    RESULTS.md "Reward verification"), so 1 s leaves >5x headroom for a loaded machine while a
    hostile input that evades the pre-checks costs 1 s of a process, not 10."""
    cache_size: int = 65536
    """Entries of the (gold, completion) -> result LRU cache; 0 turns the cache and the
    within-call deduplication off."""
    limits: AnswerLimits = DEFAULT_LIMITS
    """Caps of the pre-checks run before math-verify (AnswerLimits)."""
    fast_path: bool = True
    """Decide plain-number answers against plain-number golds without math-verify (same verdict,
    no process). False sends them to math-verify too: for measuring math-verify itself."""

    def __post_init__(self) -> None:
        if self.num_processes is not None and (not isinstance(self.num_processes, int) or self.num_processes < 1):
            raise ValueError(f"VerifierPoolConfig.num_processes must be an int >= 1 or None, got {self.num_processes!r}")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"VerifierPoolConfig.timeout_s must be a finite number > 0, got {timeout!r}")
        if not isinstance(self.cache_size, int) or self.cache_size < 0:
            raise ValueError(f"VerifierPoolConfig.cache_size must be an int >= 0, got {self.cache_size!r}")
        if not isinstance(self.limits, AnswerLimits):
            raise ValueError(f"VerifierPoolConfig.limits must be an AnswerLimits, got {type(self.limits).__name__}")



class VerifierCounts:
    """The pool's counters (VerifierPool.stats), each failure counted by its typed kind.
    Thread-safe: callers and dispatcher threads record into one instance."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)

    def add(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def record(self, result: RewardResult) -> None:
        """One math-verify result: scored, and failed with its kind's counter when it failed."""
        with self._lock:
            self._counts["scored"] += 1
            if result.failed:
                self._counts["failed"] += 1
            counter = _RESULT_COUNTERS.get(result.kind)  # type: ignore[arg-type] # None: no kind, no counter
            if counter is not None:
                self._counts[counter] += 1

    def record_function(self, scores: Sequence[FunctionScore]) -> None:
        """Reward-function scores: each a call, and a failed one under its kind's counter."""
        with self._lock:
            for score in scores:
                self._counts["function_calls"] += 1
                if not score.failed:
                    continue
                self._counts["function_failed"] += 1
                self._counts[_FUNCTION_COUNTERS.get(score.kind, "function_crashes")] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class ResultCache:
    """(gold, completion) -> RewardResult, least recently used first out; thread-safe. Results of
    the _UNREPEATABLE kinds are never kept; a size of 0 keeps nothing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], RewardResult] = OrderedDict()

    def get(self, key: tuple[str, str]) -> RewardResult | None:
        with self._lock:
            result = self._entries.get(key)
            if result is not None:
                self._entries.move_to_end(key)
            return result

    def put(self, key: tuple[str, str], result: RewardResult) -> None:
        if self.size == 0 or result.kind in _UNREPEATABLE:
            return
        with self._lock:
            self._entries[key] = result
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)


def _in_order(count: int, index_groups: list[list[int]], results: list[list[FunctionScore]]) -> list[FunctionScore]:
    """Scores of `count` calls in call order, from per-task (indices, scores) pieces."""
    ordered: list[FunctionScore | None] = [None] * count
    for indices, scores in zip(index_groups, results):
        for i, score in zip(indices, scores, strict=True):
            ordered[i] = score
    assert all(score is not None for score in ordered), "a call got no score"
    return ordered  # type: ignore[return-value]



@dataclass(slots=True)
class _Task:
    """One completion waiting for a verifier process."""

    payload: bytes
    """JSON {"gold": ..., "completion": ...} as sent to the process."""
    completion_chars: int
    """Length of the completion, for log lines."""
    snippet: str
    """Start of the completion, for log lines."""
    future: Future
    """Resolved with the RewardResult by the dispatcher thread."""
    cache_key: tuple[str, str] | None
    """(gold, completion) under which a deterministic result is cached, or None: do not cache."""
    timeout_s: float | None = None
    """This task's deadline; None: the pool's timeout_s."""
    function_ref: str = ""
    """The reward function of a function task ("module:function")."""
    num_calls: int = 0
    """Reward-function calls in the payload (0: a math-verify task); the future then resolves to
    a list of that many FunctionScores."""

    @staticmethod
    def for_completion(completion: str, gt_answer: str, cache_key: tuple[str, str] | None) -> _Task:
        """A math-verify task: one completion against its gold answer."""
        return _Task(payload=json.dumps({"gold": gt_answer, "completion": completion}).encode("utf-8"),
                     completion_chars=len(completion), snippet=completion[:_LOG_SNIPPET_CHARS], future=Future(),
                     cache_key=cache_key)

    @staticmethod
    def for_function(ref: str, group: list[Mapping[str, Any]], timeout_s: float | None) -> _Task:
        """A reward-function task: `ref` on the calls of `group` (one, or a batched function's batch)."""
        return _Task(payload=json.dumps({"function": ref, "calls": group}).encode("utf-8"),
                     completion_chars=sum(len(str(call.get("completion", ""))) for call in group),
                     snippet=f"{ref} on {str(group[0].get('completion', ''))[:_LOG_SNIPPET_CHARS]}",
                     future=Future(), cache_key=None, timeout_s=timeout_s, num_calls=len(group), function_ref=ref)


def _check_score_arguments(completions: Sequence[str], gt_answer: str) -> None:
    """TypeError naming the argument, unless completions is a list of str and gt_answer a str."""
    if not isinstance(gt_answer, str):
        raise TypeError(f"VerifierPool.score: gt_answer must be str, got {type(gt_answer).__name__}")
    if isinstance(completions, str):
        raise TypeError("VerifierPool.score: completions must be a list of str, got a single str")
    for i, completion in enumerate(completions):
        if not isinstance(completion, str):
            raise TypeError(f"VerifierPool.score: completions[{i}] must be str, got {type(completion).__name__}")


class VerifierPool:
    """A pool of math-verify processes with a hard per-sample deadline (see the module docstring).

    Built from a VerifierPoolConfig, or from its fields as keywords
    (`VerifierPool(num_processes=2, timeout_s=2.0)`), or both (the keywords override the config).

    Thread-safe and event-loop agnostic: dispatcher threads do the waiting, so `score` may be
    awaited from any event loop and `score_sync` called from any thread.

    A call's completions are queued one by one and taken by whichever process is free, so a slow
    completion holds one process while the others serve the rest of the call and other calls;
    inputs that the pre-checks reject or the fast path answers (quick_verdict) are resolved in the
    caller's thread and never queue at all.

    Results are deterministic in (gold, completion) except timeouts and process deaths, so the
    others are kept in an LRU cache of `cache_size` entries, and a completion repeated within one
    call is verified once. GRPO samples the same short answer many times (a demo step of 512
    rollouts has a few dozen distinct (gold, completion) pairs), and each verification costs a
    pipe round trip plus math-verify's parse: ~1-3 ms of CPU. `cache_size=0` turns both off.
    """

    def __init__(self, config: VerifierPoolConfig | None = None, /, **overrides: Any) -> None:
        config = replace(config or VerifierPoolConfig(), **overrides)
        self.config = config
        self.num_processes = config.num_processes or default_num_processes()
        self.timeout_s = float(config.timeout_s)
        self.cache_size = config.cache_size
        self.limits = config.limits
        self._cache = ResultCache(config.cache_size)
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._counts = VerifierCounts()
        ctx = multiprocessing.get_context("forkserver")
        # Takes effect when this process's forkserver first starts (a no-op if one already runs).
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._slots = [WorkerSlot(ctx, i) for i in range(self.num_processes)]
        self._start_all()
        self._threads = [
            threading.Thread(target=self._dispatch_loop, args=(slot,), name=f"verifier-dispatch-{slot.index}", daemon=True)
            for slot in self._slots
        ]
        for thread in self._threads:
            thread.start()
        logger.info(
            "verifier pool ready: %d processes, %.1f s deadline per sample, %s",
            self.num_processes, self.timeout_s, self.limits,
        )

    def _start_all(self) -> None:
        """Start every process at once (imports overlap), then wait for each; all or nothing."""
        try:
            for slot in self._slots:
                slot.start()
            for slot in self._slots:
                slot.wait_ready()
        except BaseException:
            for slot in self._slots:
                slot.kill()
            raise

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def score(self, completions: Sequence[str], gt_answer: str) -> list[RewardResult]:
        """Score completions against one gold answer, concurrently across the pool, in order."""
        futures = self._submit(completions, gt_answer)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def score_sync(self, completions: Sequence[str], gt_answer: str) -> list[RewardResult]:
        """Blocking form of `score`, for code without an event loop."""
        return [future.result() for future in self._submit(completions, gt_answer)]

    async def score_function(self, ref: str, calls: Sequence[Mapping[str, Any]],
                             timeout_s: float | None = None) -> list[FunctionScore]:
        """Score completions with the reward function `ref` ("module:function", see
        reward_functions) in the pool's processes, each call under the deadline (a batched
        function: the whole batch under one deadline). calls: {prompt, completion, token_ids,
        metadata} dicts, JSON-serialisable. A function that raises, hangs past the deadline,
        kills its process or returns a non-number gives those completions reward 0, failed, with
        the reason in `error`, counted in stats(); never an exception."""
        parts = self._submit_function(ref, calls, timeout_s)
        results = await asyncio.gather(*(asyncio.wrap_future(f) for _, f in parts))
        return _in_order(len(calls), [indices for indices, _ in parts], results)

    def score_function_sync(self, ref: str, calls: Sequence[Mapping[str, Any]],
                            timeout_s: float | None = None) -> list[FunctionScore]:
        """Blocking form of `score_function`."""
        parts = self._submit_function(ref, calls, timeout_s)
        return _in_order(len(calls), [indices for indices, _ in parts], [f.result() for _, f in parts])

    def _submit_function(self, ref: str, calls: Sequence[Mapping[str, Any]],
                         timeout_s: float | None) -> list[tuple[list[int], Future]]:
        """(indices of the calls, future of their scores) per task. A completion longer than
        limits.max_completion_chars is rejected here, as for math-verify: no real completion is
        that long, and a megabyte would cost every process on its way through the pipe."""
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool.score_function called after close()")
        # Importing it here too keeps a batched function's batch together (the process imports it
        # again; a module that fails here fails there the same way).
        try:
            batch = reward_functions.is_batched(load_function(ref))
        except RewardFunctionError:
            batch = False
        cap = self.limits.max_completion_chars
        parts: list[tuple[list[int], Future]] = []
        accepted = []
        for i, call in enumerate(calls):
            length = len(str(call.get("completion", "")))
            if length <= cap:
                accepted.append(i)
                continue
            rejected = reward_functions.failure(FailureKind.REJECTED, f"completion length {length} exceeds "
                                                                 f"max_completion_chars={cap}")
            self._counts.record_function([rejected])
            future: Future = Future()
            future.set_result([rejected])
            parts.append(([i], future))
        groups = [accepted] if batch and accepted else [[i] for i in accepted]
        for indices in groups:
            task = _Task.for_function(ref, [calls[i] for i in indices], timeout_s)
            self._tasks.put(task)
            parts.append((indices, task.future))
        return parts

    def stats(self) -> dict[str, int]:
        """Counters since start: scored (results computed: by a process, a pre-check or the fast
        path), failed, and failures by kind (timeouts, parse_errors, verify_errors, rejected by a
        pre-check, crashes), fast_path (plain-number verdicts, no process), restarts (replacement
        processes started), cancelled (tasks dropped because their caller went away), cache_hits
        (samples answered from the cache or by an identical completion of the same call),
        num_processes; for reward functions (score_function): function_calls (completions
        scored), function_failed, and failures by kind: function_raised, function_bad_returns,
        function_timeouts, function_crashes, function_rejected (longer than
        limits.max_completion_chars, never sent to a process)."""
        return {**self._counts.snapshot(), "num_processes": self.num_processes}

    def close(self) -> None:
        """Fail queued samples, stop the dispatchers (each finishes its current sample) and processes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None and task.future.set_running_or_notify_cancel():
                task.future.set_exception(RuntimeError("VerifierPool closed before this sample was scored"))
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()
        for slot in self._slots:
            slot.stop()
        logger.info("verifier pool closed: %s", self.stats())

    def _submit(self, completions: Sequence[str], gt_answer: str) -> list[Future]:
        _check_score_arguments(completions, gt_answer)
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool.score called after close()")
        futures: list[Future] = []
        in_this_call: dict[str, Future] = {}
        for completion in completions:
            known = in_this_call.get(completion) or self._cached_future(gt_answer, completion)
            if known is not None:
                self._counts.add("cache_hits")
                futures.append(known)
                continue
            cacheable = self.cache_size > 0 and len(completion) <= _MAX_CACHED_COMPLETION_CHARS
            cache_key = (gt_answer, completion) if cacheable else None
            future = self._answer_now(completion, gt_answer, cache_key)
            if future is None:
                future = self._enqueue(completion, gt_answer, cache_key)
            futures.append(future)
            if cacheable:
                in_this_call[completion] = future
        return futures

    def _answer_now(self, completion: str, gt_answer: str, cache_key: tuple[str, str] | None) -> Future | None:
        """A resolved Future when the pre-checks reject the completion or the fast path decides
        it (no process, no queue: a hostile input never waits for or holds a verifier), else None."""
        result = quick_verdict(completion, gt_answer, self.limits, self.config.fast_path)
        if result is None:
            return None
        if not result.failed:
            self._counts.add("fast_path")
        self._counts.record(result)
        if cache_key is not None:
            self._cache.put(cache_key, result)
        future: Future = Future()
        future.set_result(result)
        return future

    def _enqueue(self, completion: str, gt_answer: str, cache_key: tuple[str, str] | None) -> Future:
        task = _Task.for_completion(completion, gt_answer, cache_key)
        self._tasks.put(task)
        return task.future

    def _cached_future(self, gt_answer: str, completion: str) -> Future | None:
        """A resolved Future holding the cached result for (gt_answer, completion), or None."""
        if self.cache_size == 0:
            return None
        result = self._cache.get((gt_answer, completion))
        if result is None:
            return None
        future: Future = Future()
        future.set_result(result)
        return future

    def _dispatch_loop(self, slot: WorkerSlot) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if not task.future.set_running_or_notify_cancel():
                self._counts.add("cancelled")
                continue
            # A replacement that failed to start after a kill gets one more try per sample.
            had_process = slot.alive or self._restart(slot)
            if task.num_calls:
                scores = self._run_function_task(slot, task) if had_process else [reward_functions.failure(
                    FailureKind.CRASH, f"verifier process {slot.index} could not be started (see log)")] * task.num_calls
                self._counts.record_function(scores)
                task.future.set_result(scores)
                if had_process and not slot.alive:
                    self._restart(slot)
                continue
            try:
                result = self._run_task(slot, task) if had_process else failure(
                    FailureKind.VERIFY_ERROR, f"verifier process {slot.index} could not be started (see log)"
                )
            except Exception as exc:  # noqa: BLE001 - a dispatcher must outlive any one sample
                logger.exception("verifier dispatcher %d failed on a sample", slot.index)
                task.future.set_exception(exc)
                continue
            self._counts.record(result)
            if task.cache_key is not None:
                self._cache.put(task.cache_key, result)
            task.future.set_result(result)
            if had_process and not slot.alive:
                self._restart(slot)  # after answering, so the caller does not wait for it

    def _run_function_task(self, slot: WorkerSlot, task: _Task) -> list[FunctionScore]:
        """Run one reward-function task; kills the process on timeout, death or protocol failure."""
        timeout = self.timeout_s if task.timeout_s is None else task.timeout_s
        try:
            if task.function_ref not in slot.loaded:
                slot.load(task.function_ref)
            reply = slot.run(task.payload, timeout, MAX_FUNCTION_REPLY_BYTES)
            scores = None if reply is None else [FunctionScore.from_json(s) for s in json.loads(reply)["scores"]]
            if scores is not None and len(scores) != task.num_calls:
                raise ValueError(f"{len(scores)} scores for {task.num_calls} calls")
        except (EOFError, OSError, ValueError, KeyError, TypeError, TimeoutError) as exc:
            exitcode = slot.kill()
            logger.error("verifier process %d died or broke protocol in %s (exit code %s): %r",
                         slot.index, task.snippet, exitcode, exc)
            return [reward_functions.failure(FailureKind.CRASH, f"verifier process died (exit code {exitcode})")] * task.num_calls
        if scores is None:
            slot.kill()
            logger.warning("reward function timeout after %.1f s (%s); replacing process %d", timeout, task.snippet,
                           slot.index)
            return [reward_functions.failure(FailureKind.TIMEOUT)] * task.num_calls
        return scores

    def _run_task(self, slot: WorkerSlot, task: _Task) -> RewardResult:
        """Run one task on the slot's process; kills the process on timeout or protocol failure."""
        try:
            reply = slot.run(task.payload, self.timeout_s)
            result = None if reply is None else decode_result(reply)
        except (EOFError, OSError, ValueError, KeyError) as exc:
            exitcode = slot.kill()
            self._counts.add("crashes")
            logger.error("verifier process %d died or broke protocol (exit code %s): %r", slot.index, exitcode, exc)
            return failure(FailureKind.VERIFY_ERROR, f"verifier process died (exit code {exitcode})")
        if result is None:
            slot.kill()
            logger.warning(
                "verifier timeout after %.1f s on a %d-char completion starting %r; replacing process %d",
                self.timeout_s, task.completion_chars, task.snippet, slot.index,
            )
            return failure(FailureKind.TIMEOUT)
        return result

    def _restart(self, slot: WorkerSlot) -> bool:
        """Start a replacement process for a slot whose process was killed; False if it failed."""
        try:
            slot.start()
            slot.wait_ready()
        except (WorkerStartError, OSError):
            logger.exception("could not start a replacement verifier process %d", slot.index)
            return False
        self._counts.add("restarts")
        return True
