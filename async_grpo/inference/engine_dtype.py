"""The dtype a generation engine serves in, and the one line a CPU engine's death in half
precision gets.

vLLM's 'auto' serves an fp32 checkpoint in bfloat16 on its CPU backend wherever the CPU has bf16
instructions. On an Intel Xeon with AMX (avx512_bf16, amx_bf16, amx_tile), vLLM 0.32's CPU build
then kills its worker process on the tiny demo model's first forward (EngineDeadError); on an
AMD EPYC with avx512_bf16 and no AMX, head sizes 32/64/128 ran in float32, bfloat16 and float16
(`python -m benchmarks.cpu_engine_dtypes`, RESULTS.md). A CPU engine therefore resolves 'auto' to
float32, which is also what the CPU trainer computes in, so sampling logprobs match the
trainer's; a half dtype on CPU is served only when asked for by name, and if the engine then dies,
the worker says so in one line that names the dtype, the CPU's flags and the way out.
"""

from __future__ import annotations

from pathlib import Path

AUTO_DTYPE = "auto"
CPU_AUTO_DTYPE = "float32"
HALF_DTYPES = ("bfloat16", "float16", "half")
# The CPU features that decide vLLM's CPU kernels for bf16: plain AVX2, AVX-512 bf16, AMX tiles.
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512_bf16", "amx_bf16", "amx_tile")
_CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The flags of CPU_FLAGS_OF_INTEREST this machine's CPU has (from /proc/cpuinfo, or the
    `cpuinfo` text given), in that order; () where /proc/cpuinfo cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text()
        except OSError:
            return ()
    present: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            present.update(value.split())
    return tuple(flag for flag in CPU_FLAGS_OF_INTEREST if flag in present)


def resolve_engine_dtype(dtype: str, on_cpu: bool) -> str:
    """The dtype to hand vLLM: 'auto' becomes float32 on a CPU engine; anything else stays."""
    return CPU_AUTO_DTYPE if on_cpu and dtype == AUTO_DTYPE else dtype


def dtype_choice_line(requested: str, resolved: str, on_cpu: bool) -> str:
    """How the engine's dtype was chosen, for the worker's start-up log."""
    if requested == resolved:
        return f"engine dtype {resolved} (as configured)"
    where = "CPU engine: the CPU trainer's dtype, and vLLM's CPU bf16 crashes on some CPUs" if on_cpu else ""
    return f"engine dtype {requested} -> {resolved} ({where}; --dtype to change)"


def cpu_half_precision_failure(dtype: str, on_cpu: bool, flags: tuple[str, ...]) -> str | None:
    """The line that replaces an engine failure on a CPU engine serving a half dtype (None when
    the failure has nothing to do with that: a GPU engine, or float32)."""
    if not on_cpu or dtype not in HALF_DTYPES:
        return None
    shown = " ".join(flags) if flags else "unknown"
    return (f"vLLM's CPU engine died serving dtype {dtype} on this CPU (flags: {shown}); vLLM 0.32's CPU build "
            f"crashes in half precision on some CPUs (seen on AMX: amx_bf16 amx_tile): start the worker with "
            f"--dtype float32 (the engine's own error is in the worker log above)")
