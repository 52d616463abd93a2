"""Per-process settings of a run, by process kind: which allocator each process runs on, and how
many intra-op threads each compute process uses.

Allocators: a generation worker's actor and its vLLM engine core (which inherits the actor's
environment) run on the jemalloc Ray ships for its raylet and GCS (ray/core/libjemalloc.so),
preloaded with LD_PRELOAD. Under glibc the engine core had no good setting: the default dynamic
mmap threshold lets its heap grow with freed pages, and fixed thresholds either make every large
block a fresh mmap, page-faulted in and out on the generation path, or still let it grow. Where
Ray's build lacks the library the generation worker falls back to fixed 256 KiB thresholds. The
trainer ranks keep glibc's defaults: fixed thresholds made them fault far more. Figures:
benchmarks/RESULTS.md, "One FSDP unit for a tiny model, jemalloc on the generation path" and
"Where a demo step goes now, and the settings of before".

Threads: a local run's compute processes (the trainer ranks, each vLLM engine core, each logprob
worker) share the machine's cores, and with max_lag >= 1 they are busy at the same time. Each gets
max(1, cores // compute processes) intra-op threads (OMP_NUM_THREADS and MKL_NUM_THREADS, which
torch reads at start), so they do not oversubscribe the cores. That is the CPU plan's shared
mode; its split mode gives each process its own cores and as many threads (launch/cpu_plan.py).

`tune` False restores the earlier settings (every process on glibc with the fixed thresholds,
nothing else set): the baseline that benchmarks/step_profile.py measures against.
"""

from __future__ import annotations

import os

from async_grpo.config.actor_names import GENERATION

_THRESHOLD_BYTES = 256 * 1024
FIXED_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(_THRESHOLD_BYTES), "MALLOC_TRIM_THRESHOLD_": str(_THRESHOLD_BYTES)}
"""glibc's fixed 256 KiB mmap and trim thresholds (an operator's own values win)."""


def _operator_first(values: dict[str, str]) -> dict[str, str]:
    """`values`, except where this process's environment sets the same variable (the operator's)."""
    return {name: os.environ.get(name, value) for name, value in values.items()}


def launcher_child_env(tune: bool) -> dict[str, str]:
    """What every process a local launcher starts gets (the Ray head, dispatchers, torchrun and
    its ranks): nothing when tuned; the fixed thresholds for all, as before, when not."""
    return {} if tune else _operator_first(FIXED_MALLOC_ENV)


def rays_jemalloc() -> str | None:
    """The jemalloc library Ray ships for its own processes, or None where this Ray build lacks it."""
    import ray

    path = os.path.join(os.path.dirname(ray.__file__), "core", "libjemalloc.so")
    return path if os.path.isfile(path) else None


def worker_env(kind: str, tune: bool) -> dict[str, str]:
    """What a worker actor of `kind` gets in its runtime env (its children, such as the vLLM
    engine core, inherit it): when tuned, generation workers run on Ray's jemalloc (an operator's
    own LD_PRELOAD wins), or on the fixed thresholds where Ray ships none."""
    if not tune or kind != GENERATION:
        return {}
    jemalloc = rays_jemalloc()
    return _operator_first({"LD_PRELOAD": jemalloc} if jemalloc else FIXED_MALLOC_ENV)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or taskset's limit)."""
    return len(os.sched_getaffinity(0))


def threads_per_process(compute_processes: int, cores: int | None = None) -> int:
    """Intra-op threads for each of `compute_processes` processes sharing `cores` (default: this
    machine's usable cores)."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(compute_processes, 1))


def thread_env(threads: int, tune: bool) -> dict[str, str]:
    """OMP_NUM_THREADS and MKL_NUM_THREADS for a compute process when tuned (an operator's own
    values win); nothing when not."""
    if not tune:
        return {}
    return _operator_first({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
