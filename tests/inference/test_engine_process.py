"""engine_process: when a generation worker's engine core may be a fork of the worker, and what the
forked child gets before vLLM's entry point runs. A real worker actor's forked engine is checked in
tests/inference/test_vllm_worker.py (vllm tier), a worker built in the test process (after its
tensor work) in tests/inference/test_lora_vllm.py."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import pytest

from async_grpo.inference.engine_process import forked_engine_core, forks_engine_core

pytestmark = [pytest.mark.system]  # a forked child (and vLLM's import starts a helper process)

CHILD_TIMEOUT_S = 60.0


def test_only_an_eager_cpu_engine_forks_and_only_with_an_openmp_runtime_that_releases_its_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from async_grpo.inference import engine_process

    conditions = dict(enabled=True, on_cpu=True, enforce_eager=True)
    assert forks_engine_core(**conditions)  # torch's bundled libgomp has omp_pause_resource_all
    for name in conditions:
        assert not forks_engine_core(**{**conditions, name: False}), name
    monkeypatch.setattr(engine_process, "_openmp_runtime", lambda: None)
    assert not forks_engine_core(**conditions)


def _parallel_matmul(*, queue: Any) -> None:
    """A forked child's target: one matmul large enough for OpenMP's threads, then report."""
    import torch

    a = torch.ones(512, 512)
    queue.put(float((a @ a)[0, 0]))


def test_a_fork_after_this_thread_ran_openmp_computes_in_parallel_instead_of_hanging() -> None:
    """The hazard the fork guards against: this thread has run a parallel matmul (its OpenMP pool
    is up), then forks. Without releasing the pool first the child hangs on its own first parallel
    region (checked by hand with the release removed: no result within the timeout); released, it
    computes, and so does this process afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a pool even on a one-core machine
    try:
        a = torch.ones(512, 512)
        assert float((a @ a)[0, 0]) == 512.0
        with forked_engine_core(True) as context:
            queue = context.Queue()
            process = context.Process(target=_parallel_matmul, name="EngineCore", kwargs={"queue": queue})
            process.start()
            try:
                assert queue.get(timeout=CHILD_TIMEOUT_S) == 512.0
            finally:
                process.join(CHILD_TIMEOUT_S)
                if process.is_alive():
                    process.kill()
        assert process.exitcode == 0
        assert float((a @ a)[0, 0]) == 512.0
    finally:
        torch.set_num_threads(threads)


def test_the_launcher_forks_only_inside_the_block_and_is_restored_after_an_error() -> None:
    import vllm.v1.engine.utils as launcher

    original = launcher.get_mp_context
    with forked_engine_core(False) as context:
        assert context is None and launcher.get_mp_context is original
    with pytest.raises(ZeroDivisionError), forked_engine_core(True) as context:
        assert launcher.get_mp_context() is context
        assert context.get_start_method() == "fork"
        1 / 0
    assert launcher.get_mp_context is original


def test_a_vllm_whose_launcher_lacks_the_context_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.engine.utils as launcher

    monkeypatch.delattr(launcher, "get_mp_context")
    with pytest.raises(RuntimeError, match="get_mp_context is gone.*fork_engine_core false"):
        with forked_engine_core(True):
            pass


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed by now
        return ""


def _report(first: str, *, queue: Any) -> None:
    """The forked child's target: what it was given and what it sees."""
    import torch._dynamo

    title = open(f"/proc/{os.getpid()}/cmdline", "rb").read().split(b"\0")[0].decode().strip()
    sockets = [fd for fd in os.listdir("/proc/self/fd") if _target(fd).startswith("socket:")]
    queue.put({"first": first, "dynamo_disabled": torch._dynamo.config.disable, "title": title,
               "parent": os.getppid(), "sockets": sockets})


def test_the_forked_child_is_titled_has_dynamo_off_and_no_socket_then_runs_the_target() -> None:
    """What vLLM's launcher does with the context (vllm.v1.engine.utils.CoreEngineProcManager):
    Process(target=..., name='EngineCore', kwargs=...), start(). The child is titled as a spawned
    engine core titles itself, has torch.compile off as TORCHDYNAMO_DISABLE at import would, and
    holds none of this process's sockets (a Ray worker's would keep it alive in Ray's eyes); this
    process keeps its own dynamo setting and its sockets."""
    import socket

    import torch._dynamo

    before = torch._dynamo.config.disable
    listener = socket.create_server(("127.0.0.1", 0))  # as a Ray worker's gRPC server
    with listener, forked_engine_core(True) as context:
        queue = context.Queue()
        process = context.Process(target=_report, name="EngineCore", args=("given",), kwargs={"queue": queue})
        process.start()
        try:
            seen = queue.get(timeout=CHILD_TIMEOUT_S)
        finally:
            process.join(CHILD_TIMEOUT_S)
        assert listener.getsockname()[1] > 0  # still this process's
    assert seen == {"first": "given", "dynamo_disabled": True, "title": "VLLM::EngineCore", "parent": os.getpid(),
                    "sockets": []}
    assert process.exitcode == 0 and context.processes_made == 1
    assert isinstance(process, multiprocessing.context.ForkProcess)
    assert torch._dynamo.config.disable == before
