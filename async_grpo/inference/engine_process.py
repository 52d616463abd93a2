"""How a generation worker's vLLM engine-core process starts: its environment, and a fork of the
worker instead of a fresh interpreter where that is safe.

vLLM 0.32 starts the engine core with multiprocessing's spawn whenever it runs inside a Ray actor
or on its CPU platform (vllm.utils.system_utils._maybe_force_spawn, vllm.platforms.cpu), so the
new interpreter imports torch and vLLM all over again, although the worker actor that starts it
has imported both already. A fork starts the engine core from the worker's imports instead: a
shorter start with the same seeded rollouts, but slower steps in some runs (benchmarks/RESULTS.md,
"A generation worker's start: engine core spawned vs forked").

A fork is only safe where three things hold, which `forks_engine_core` checks:

- The forking thread holds no OpenMP thread pool. torch's GNU OpenMP runtime hangs a forked child
  on its first parallel region once the forking thread has started its pool (checked: a matmul in
  the parent, then one in a forked child, never returns). So the fork first releases that pool
  with OpenMP 5.0's `omp_pause_resource_all(omp_pause_hard)` (release_openmp_threads; the parent
  starts a new pool at its next parallel region), which needs a runtime that has it: torch's
  bundled libgomp does.
- An eager engine (EngineConfig.enforce_eager). torch reads TORCHDYNAMO_DISABLE and inductor's
  settings from the environment when it is imported, which a forked child does not repeat. The
  child turns dynamo off itself, as the spawned one's import would have (engine_process_env
  below); a compiled engine, whose inductor settings vLLM's CPU platform puts in the environment
  just before the start, keeps vLLM's spawn.
- vLLM's CPU platform: CUDA cannot cross a fork.

The fork replaces `get_mp_context` in vLLM's engine launcher (vllm.v1.engine.utils) for the length
of the engine's construction only. The child titles itself as vLLM's would, lets go of the
worker's sockets (which a spawned child closes at exec), turns dynamo off, then runs vLLM's own
engine-core code unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import multiprocessing.context
import os
import stat
from collections.abc import Callable, Iterator
from typing import Any

from async_grpo.config.worker_options import EngineConfig

_LAUNCHER_MODULE = "vllm.v1.engine.utils"


def engine_process_env(engine: EngineConfig) -> dict[str, str]:
    """Environment the engine-core process starts with (it inherits this process's). An eager
    engine compiles nothing: vLLM 0.32 compiles two sampler helpers with inductor even under
    enforce_eager (v1/sample/ops: batched_count_greater_than for the sampled tokens' ranks, and
    compiled_random_sample), and inductor's C++ builds on the first sampled batch of every new
    engine-core process took 17.5 s against 0.15 s with dynamo off (2 cores, the demo model, a
    fresh temp folder as each local cluster has; 9.8 s with the launcher's shared inductor cache).
    Those helpers then run as plain torch ops; a compiled engine keeps them compiled."""
    return {"TORCHDYNAMO_DISABLE": "1"} if engine.enforce_eager else {}


# omp_pause_resource_all's `omp_pause_hard` (OpenMP 5.0, omp.h): free the runtime's threads.
_OMP_PAUSE_HARD = 2


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """torch's own OpenMP runtime (torch/lib/libgomp.so.1, the one its ops run on), if it has
    omp_pause_resource_all; None otherwise (another build, or an older runtime). Looked up once:
    forks_engine_core asks, then every fork."""
    import torch  # noqa: PLC0415 (imported by vLLM already)

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    try:
        runtime = ctypes.CDLL(path)
    except OSError:
        return None
    return runtime if hasattr(runtime, "omp_pause_resource_all") else None


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP thread pool, so that a fork made next from this thread
    starts its own; whether that was done (False: no runtime with omp_pause_resource_all, or it
    refused, as it does inside a parallel region)."""
    runtime = _openmp_runtime()
    return runtime is not None and runtime.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0


def forks_engine_core(*, enabled: bool, on_cpu: bool, enforce_eager: bool) -> bool:
    """Whether an engine start may fork its engine core (module docstring: the three conditions).

    enabled: EngineConfig.fork_engine_core."""
    return enabled and on_cpu and enforce_eager and _openmp_runtime() is not None


class _ForkProcess(multiprocessing.context.ForkProcess):
    """A fork that releases the forking thread's OpenMP pool first (module docstring)."""

    def start(self) -> None:
        if not release_openmp_threads():
            raise RuntimeError("could not release OpenMP's threads before forking the engine core "
                               "(omp_pause_resource_all refused): set fork_engine_core false (vLLM's own spawn)")
        super().start()


class _ForkContext:
    """What vLLM's engine launcher gets from `get_mp_context()` while a fork is in force: the fork
    context, whose processes release OpenMP's pool, fork and run `_as_engine_core` first. Counts
    the processes it made, so the caller knows that vLLM's launcher did ask it (a vLLM that starts
    its engine core elsewhere would leave the count at 0)."""

    def __init__(self) -> None:
        self._fork = multiprocessing.get_context("fork")
        self.processes_made = 0

    def Process(self, *, target: Callable[..., Any], name: str | None = None,  # noqa: N802 (multiprocessing's name)
                args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                daemon: bool | None = None) -> multiprocessing.process.BaseProcess:
        self.processes_made += 1
        return _ForkProcess(target=_as_engine_core, name=name, args=(target, name or "EngineCore", *args),
                            kwargs=kwargs or {}, daemon=daemon)

    def __getattr__(self, attribute: str) -> Any:  # Queue, Event, ...: the fork context's own
        return getattr(self._fork, attribute)


def _as_engine_core(target: Callable[..., Any], title: str, *args: Any, **kwargs: Any) -> None:
    """The forked child: what a spawned engine core's fresh imports would have given it, then vLLM's
    engine-core entry point."""
    import torch._dynamo  # noqa: PLC0415 (imported by vLLM in the parent already)
    import vllm.envs  # noqa: PLC0415

    _release_inherited_sockets()
    # TORCHDYNAMO_DISABLE=1 (engine_process_env) is read at torch's import, which
    # happened in the parent before the variable was set.
    torch._dynamo.config.disable = True
    _set_title(f"{vllm.envs.VLLM_PROCESS_NAME_PREFIX}::{title}")
    target(*args, **kwargs)


def _release_inherited_sockets() -> None:
    """Let go of every socket the child inherited from the worker: Ray's connections to its raylet
    and GCS and the actor's gRPC server among them. While a copy is open, Ray does not see a killed
    worker die (its raylet connection stays up), so it neither replaces the worker nor ends this
    child with it (seen: a SIGKILLed worker's actor hung its callers for minutes). A spawned
    engine core closes them at exec. Each is pointed at /dev/null rather than closed, so that its
    number stays taken: a stale Python object of the parent's that closes its fd when collected
    here then closes /dev/null, not a socket of the engine core's own that reused the number."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd > 2 and fd != null and _is_socket(fd):
                os.dup2(null, fd)
    finally:
        os.close(null)


def _is_socket(fd: int) -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:  # the listing's own descriptor, closed by now
        return False


def _set_title(title: str) -> None:
    """The process title a spawned engine core gives itself (VLLM::EngineCore: process monitors and
    the tests find engine cores by it). vLLM sets it with the setproctitle package, which cannot
    find the command line of a Ray worker (Ray retitled it with its own copy) and then changes
    nothing, so a fork of a Ray actor retitles itself with Ray's."""
    try:
        from ray._raylet import setproctitle  # noqa: PLC0415
    except ImportError:
        return  # not a Ray install: vLLM's own setproctitle call will work
    setproctitle(title)


@contextlib.contextmanager
def forked_engine_core(fork: bool) -> Iterator[_ForkContext | None]:
    """Within the block, vLLM's engine launcher starts engine cores as forks of this process
    (fork=False: unchanged, yields None). Build the engine inside it; the context it yields
    counts the processes it made."""
    if not fork:
        yield None
        return
    import importlib  # noqa: PLC0415

    launcher = importlib.import_module(_LAUNCHER_MODULE)
    original = getattr(launcher, "get_mp_context", None)
    if original is None:
        raise RuntimeError(f"{_LAUNCHER_MODULE}.get_mp_context is gone from this vLLM: set fork_engine_core false "
                           f"(vLLM's own spawn) and report the vLLM version")
    context = _ForkContext()
    launcher.get_mp_context = lambda: context
    try:
        yield context
    finally:
        launcher.get_mp_context = original
