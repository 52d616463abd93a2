"""A CPU engine's dtype: 'auto' resolves to float32, the choice is logged, and an engine that dies
serving a half dtype on CPU is reported in one line naming the dtype, the CPU's flags and
`--dtype float32` (issue 34)."""

from __future__ import annotations

import pytest

from async_grpo.config.worker_options import EngineConfig
from async_grpo.inference.engine_dtype import (
    cpu_flags, cpu_half_precision_failure, dtype_choice_line, resolve_engine_dtype,
)

INTEL_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
AMD_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"


@pytest.mark.parametrize("text, flags", [(INTEL_AMX, ("avx2", "avx512_bf16", "amx_bf16", "amx_tile")),
                                         (AMD_AVX2, ("avx2",)), ("", ())])
def test_cpu_flags_reads_the_flags_line(text: str, flags: tuple[str, ...]) -> None:
    assert cpu_flags(text) == flags


def test_this_machines_flags_are_read() -> None:
    assert set(cpu_flags()) <= {"avx2", "avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize("requested, on_cpu, served", [
    ("auto", True, "float32"), ("auto", False, "auto"), ("bfloat16", True, "bfloat16"),
    ("float32", True, "float32"), ("bfloat16", False, "bfloat16"),
])
def test_auto_is_float32_on_a_cpu_engine_only(requested: str, on_cpu: bool, served: str) -> None:
    assert resolve_engine_dtype(requested, on_cpu) == served


def test_the_engine_default_is_auto_and_the_choice_line_says_what_happened() -> None:
    assert EngineConfig().dtype == "auto"
    line = dtype_choice_line("auto", "float32", on_cpu=True)
    assert line.startswith("engine dtype auto -> float32 (CPU engine") and "--dtype" in line
    assert dtype_choice_line("bfloat16", "bfloat16", on_cpu=True) == "engine dtype bfloat16 (as configured)"


def test_a_half_dtype_failure_on_cpu_is_one_line_with_dtype_flags_and_the_fix() -> None:
    line = cpu_half_precision_failure("bfloat16", on_cpu=True, flags=("avx2", "avx512_bf16", "amx_bf16", "amx_tile"))
    assert line is not None and "\n" not in line
    assert "dtype bfloat16" in line and "flags: avx2 avx512_bf16 amx_bf16 amx_tile" in line
    assert "--dtype float32" in line and "EngineDeadError" not in line


@pytest.mark.parametrize("dtype, on_cpu", [("float32", True), ("bfloat16", False), ("auto", False)])
def test_other_failures_keep_their_own_message(dtype: str, on_cpu: bool) -> None:
    assert cpu_half_precision_failure(dtype, on_cpu, ("avx2",)) is None


def test_engine_args_serve_auto_as_float32_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_worker
    from async_grpo.inference import engine_start

    monkeypatch.setattr(engine_start, "on_cpu_platform", lambda: True)
    config = vllm_worker.GenerationWorkerConfig(model_path="m")
    assert engine_start.engine_args(config, in_process=True)["dtype"] == "float32"
    monkeypatch.setattr(engine_start, "on_cpu_platform", lambda: False)
    assert engine_start.engine_args(config, in_process=False)["dtype"] == "auto"


async def _engine_dies(engine: object, request_id: str) -> int:
    """The canary's forward on an engine that died in it, as vLLM's CPU bf16 does on AMX CPUs."""
    raise RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause.")


@pytest.mark.parametrize("dtype, hinted", [("bfloat16", True), ("float32", False)])
def test_a_worker_whose_cpu_engine_dies_in_its_self_check_says_why(monkeypatch: pytest.MonkeyPatch, dtype: str,
                                                                   hinted: bool) -> None:
    import asyncio

    import vllm_worker
    from async_grpo.inference import engine_start

    monkeypatch.setattr(engine_start, "on_cpu_platform", lambda: True)
    monkeypatch.setattr(engine_start, "cpu_flags", lambda: ("avx2", "avx512_bf16", "amx_bf16", "amx_tile"))
    monkeypatch.setattr(vllm_worker, "canary_tokens", _engine_dies)
    worker = vllm_worker.GenerationWorker("generation-worker-0",
                                          vllm_worker.GenerationWorkerConfig(model_path="m", engine=EngineConfig(dtype=dtype)))
    worker._engine = object()  # started: the canary is what dies
    with pytest.raises(Exception) as failure:
        asyncio.run(worker._self_check())
    message = str(failure.value)
    assert ("--dtype float32" in message and "amx_bf16 amx_tile" in message) is hinted, message
    assert ("EngineCore encountered an issue" in message) is not hinted, message
