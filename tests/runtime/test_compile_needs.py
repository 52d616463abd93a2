"""A compiling vLLM engine's host needs (issue 56, item 5): a missing compiler or missing Python
headers is one line naming each and the two ways out, before the engine starts; an eager engine,
or a host that has both, passes. The host is faked: `which`, the environment and the include folder."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from async_grpo.config.worker_options import EngineConfig
from async_grpo.runtime.compile_needs import missing_compile_needs


def _which(*present: str):
    """A PATH on which only `present` are found."""
    return lambda command: f"/usr/bin/{command}" if command in present else None


@pytest.fixture
def headers(tmp_path: Path) -> str:
    """An include folder holding Python.h."""
    (tmp_path / "Python.h").write_text("/* the Python C API */\n")
    return str(tmp_path)


@pytest.mark.parametrize("on_cpu, compiler", [(True, "g++"), (False, "gcc"), (False, "clang")])
def test_a_host_with_a_compiler_and_the_headers_passes(headers: str, on_cpu: bool, compiler: str) -> None:
    assert missing_compile_needs(False, on_cpu=on_cpu, env={}, which=_which(compiler), include_dir=headers) is None


@pytest.mark.parametrize("on_cpu", [True, False])
def test_an_eager_engine_needs_nothing(tmp_path: Path, on_cpu: bool) -> None:
    assert missing_compile_needs(True, on_cpu=on_cpu, env={}, which=_which(), include_dir=str(tmp_path)) is None


def test_a_missing_compiler_and_headers_are_named_in_one_line(tmp_path: Path) -> None:
    line = missing_compile_needs(False, on_cpu=True, env={}, which=_which("gcc"), include_dir=str(tmp_path))
    assert line is not None and "\n" not in line
    assert line.startswith("the vLLM engine compiles its model (enforce_eager false): it needs ")
    assert "a C++ compiler (g++: not found)" in line
    assert f"Python headers (Python.h: not found in {tmp_path})" in line
    assert "apt-get install build-essential python3-dev" in line and "--enforce_eager true" in line


def test_on_cuda_the_c_compiler_is_what_is_missing(headers: str) -> None:
    line = missing_compile_needs(False, on_cpu=False, env={}, which=_which("g++"), include_dir=headers)
    assert line is not None and "a C compiler (gcc/clang: not found)" in line and "Python.h" not in line


def test_the_compiler_variable_names_the_compiler(headers: str) -> None:
    named = {"CXX": "/opt/llvm/bin/clang++"}
    assert missing_compile_needs(False, on_cpu=True, env=named, which=_which("/opt/llvm/bin/clang++"),
                                 include_dir=headers) is None
    line = missing_compile_needs(False, on_cpu=True, env=named, which=_which("g++"), include_dir=headers)
    assert line is not None and "a C++ compiler (CXX=/opt/llvm/bin/clang++: not found)" in line


def test_this_process_defaults_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-anywhere")
    line = missing_compile_needs(False, on_cpu=True)
    assert line is not None and "CXX=no-such-compiler-anywhere: not found" in line


def test_a_generation_worker_refuses_to_start_a_compiling_engine_without_a_compiler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's start fails in one line naming the worker and the need, before vLLM is asked."""
    import vllm_worker
    from async_grpo.inference import engine_start

    monkeypatch.setattr(engine_start, "on_cpu_platform", lambda: True)
    monkeypatch.setenv("CXX", "no-such-compiler-anywhere")
    config = vllm_worker.GenerationWorkerConfig(model_path="m", engine=EngineConfig(enforce_eager=False))
    worker = vllm_worker.GenerationWorker("generation-worker-0", config)
    with pytest.raises(Exception) as failure:
        asyncio.run(worker.start())
    message = str(failure.value)
    assert "\n" not in message and message.startswith("generation-worker-0 FAILED: engine did not start: ")
    assert "C++ compiler (CXX=no-such-compiler-anywhere: not found)" in message and "--enforce_eager true" in message
