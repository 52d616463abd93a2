"""Per-process settings of a run, by process kind: which processes get glibc's fixed malloc
thresholds, and how many threads each compute process uses.

The vLLM engine core needs fixed thresholds to keep its heap flat over a long run: by default
glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), so later
blocks of that size come from the heap, whose freed pages stay resident; over steps 50-300 of the
soak the engine core's heap ([heap] in smaps) grew 548 -> 705 MiB and its RSS 1.09-1.14x, and
with a fixed 256 KiB mmap and trim threshold 217 -> 249 MiB and 1.03x (benchmarks/soak.py,
RESULTS.md). The same setting in the trainer ranks made every allocation over 256 KiB a fresh
mmap, page-faulted in and unmapped again: ~300,000 minor faults per demo step per trainer and a
third of the ranks' CPU in the kernel (benchmarks/step_profile.py, RESULTS.md), so it is given to
the engine side only. Ray's GCS and raylet run on jemalloc and ignore these variables.

Threads: a local run's compute processes (the trainer ranks, each vLLM engine core, each logprob
worker) share the machine's cores, and with max_lag >= 1 they are busy at the same time. Each
gets max(1, cores // compute processes) intra-op threads (OMP_NUM_THREADS and MKL_NUM_THREADS,
which torch reads at start), so they do not oversubscribe the cores and fight: on the 2-core
machine, one each, as torchrun (for several ranks) and Ray (for a 1-CPU actor) already chose; on a
16-core host with 2 ranks, an engine and a logprob worker, four each.

`tune` False restores the settings of before this module (every process on the fixed
thresholds, nothing else set): the baseline that benchmarks/step_profile.py measures against.
"""

from __future__ import annotations

import os

from async_grpo.launch.ray_env import GENERATION

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


def worker_env(kind: str, tune: bool) -> dict[str, str]:
    """What a worker actor of `kind` gets in its runtime env (its children, such as the vLLM
    engine core, inherit it): the fixed thresholds for generation workers when tuned."""
    return _operator_first(FIXED_MALLOC_ENV) if tune and kind == GENERATION else {}


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
