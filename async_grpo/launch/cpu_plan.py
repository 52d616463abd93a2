"""Which CPU cores each process of a local CPU run may use, and how many threads it runs: the CPU
side of the launcher's plan (placement.py plans GPUs).

Two choices (`--cpu_split`):

- shared (the default): every process may run on every usable core and the OS schedules them;
  each compute process (trainer rank, engine, logprob-type worker) gets
  cores // compute processes intra-op threads (process_tuning.threads_per_process).
- split: generation and training get cores of their own, so that with max_lag >= 1 one step's
  generation runs beside the previous step's training instead of taking turns on the same cores.
  The first `--cpu_generation_cores` usable cores (default half) hold the generation side: each
  generation engine and logprob-type worker a slice of its own when there are enough (the slices
  split those cores evenly, engines first for the remainder), all of them on all those cores
  otherwise; the Ray head and its bookkeeping actors (registries, batcher, verifier pool) and the
  dispatchers run there too. The trainer ranks share the remaining cores, each with
  cores // ranks threads. A process runs as many intra-op threads as its cores (OMP_NUM_THREADS).

How a plan is applied: a process started from a thread pinned with `pinned_thread` inherits that
thread's cores (Linux affinity is per thread and a fork copies the forking thread's), so the
launcher starts Ray's head (whose raylet starts every actor) and each dispatcher on the
generation cores, and torchrun (whose ranks inherit it) on the training cores. A worker actor is
started by the raylet, not by its dispatcher: the launcher gives the dispatcher its worker's
slice in CPU_CORES_ENV, and the actors the dispatcher creates run under Ray's `py_executable`
(ray_env.actor_runtime_env) `python -m async_grpo.launch.cpu_plan CORES python ...`, which pins
itself and execs Ray's worker, so the actor's process and its vLLM engine core run on the slice
from their start (a registry the dispatcher happens to create lands on that slice too).
vLLM's CPU engine then binds its OpenMP threads within the cores it was started on
(VLLM_CPU_OMP_THREADS_BIND=auto, keeping one for its scheduler when it has more than one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

CPU_CORES_ENV = "ASYNC_GRPO_CPU_CORES"
"""The cores (a list such as '0-1,4') of the worker a dispatcher starts: its actors run on them."""
GENERATION_KINDS = ("generation",)
"""Worker kinds that run a vLLM engine; every other kind is a logprob-type worker."""
SPLIT_MIN_CORES = 2  # one for each side


class CpuPlanError(ValueError):
    """The split asked for cannot be made on this host (one line, naming the numbers)."""


@dataclass(kw_only=True, frozen=True)
class CpuPlanConfig:
    """How a CPU run's processes share the host's cores (embedded in the launcher's config)."""

    cpu_split: Literal["shared", "split"] = "shared"
    """'shared': every process on every usable core. 'split': generation (engines, logprob workers,
    Ray, the batcher) and training (the trainer ranks) on cores of their own, so that max_lag >= 1
    overlaps them. CPU-only runs (no GPU in the plan)."""
    cpu_generation_cores: int | None = None
    """With cpu_split 'split': how many of the usable cores (the first ones) generation gets; the
    rest train. None: half of them, rounded down."""

    def __post_init__(self) -> None:
        if self.cpu_generation_cores is not None and self.cpu_generation_cores < 1:
            raise ValueError(f"CpuPlanConfig.cpu_generation_cores must be >= 1 or None, got {self.cpu_generation_cores}")
        if self.cpu_generation_cores is not None and self.cpu_split != "split":
            raise ValueError("CpuPlanConfig.cpu_generation_cores needs cpu_split 'split' (--cpu_split split)")


@dataclass(kw_only=True, frozen=True)
class CpuPlan:
    """Cores and threads per process of one local run (module docstring)."""

    split: bool
    cores: tuple[int, ...]
    """The usable cores the plan shares out (the launcher's affinity)."""
    driver: tuple[int, ...]
    """The Ray head and its bookkeeping actors, and the dispatchers."""
    workers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Each worker's cores, by its label ('generation-0', 'logprob-0', ...)."""
    worker_threads: dict[str, int] = field(default_factory=dict)
    """Each worker's intra-op threads, by its label."""
    trainer: tuple[int, ...] = ()
    """The trainer ranks' cores (shared by its ranks)."""
    trainer_ranks: int = 1
    shared_threads: int = 1
    """Threads of each compute process when shared (and of workers the plan did not list)."""

    def worker_cores(self, label: str) -> tuple[int, ...]:
        """A worker's cores (every usable core when shared, or for a worker the plan did not list)."""
        return self.workers.get(label, self.cores if not self.split else self.driver)

    def threads_of(self, label: str) -> int:
        """A worker's intra-op threads."""
        return self.worker_threads.get(label, self.shared_threads)

    def trainer_threads(self, ranks: int) -> int:
        """Intra-op threads of each of `ranks` trainer ranks."""
        if not self.split:  # every compute process shares every core
            return max(1, len(self.cores) // max(ranks + len(self.workers), 1))
        return max(1, len(self.trainer) // max(ranks, 1))

    def pinned(self, cores: tuple[int, ...]) -> tuple[int, ...] | None:
        """`cores` when this plan pins processes (split), None when every process keeps every core."""
        return cores if self.split else None

    def dispatcher_env(self, label: str) -> dict[str, str]:
        """What a worker's dispatcher passes on to its actor: the worker's cores (split only)."""
        return {CPU_CORES_ENV: core_list(self.worker_cores(label))} if self.split else {}

    def lines(self) -> list[str]:
        """The plan as the launcher prints it, one block."""
        if not self.split:
            processes = self.trainer_ranks + len(self.workers)
            return [f"cpu plan: shared, {len(self.cores)} usable cores ({core_list(self.cores)}): every process on "
                    f"all of them, {self.shared_threads} thread(s) per compute process ({processes}); "
                    f"--cpu_split split gives generation and training cores of their own"]
        generation = sorted(set(self.driver))
        lines = [f"cpu plan: split, {len(self.cores)} usable cores: generation {core_list(generation)} | "
                 f"training {core_list(self.trainer)} (--cpu_generation_cores changes the split)"]
        for label, cores in self.workers.items():
            engine = " (vLLM binds its OpenMP threads within them)" if _kind(label) in GENERATION_KINDS else ""
            lines.append(f"  {label:<13} cores {core_list(cores):<8} {self.threads_of(label)} thread(s){engine}")
        lines.append(f"  {'trainer':<13} cores {core_list(self.trainer):<8} {self.trainer_ranks} rank(s), "
                     f"{self.trainer_threads(self.trainer_ranks)} thread(s) each")
        lines.append(f"  {'driver':<13} cores {core_list(self.driver):<8} Ray head, registries, batcher, "
                     f"verifier pool, dispatchers")
        return lines


def _kind(label: str) -> str:
    return label.rsplit("-", 1)[0]


def worker_labels(worker_counts: Mapping[str, int]) -> list[str]:
    """'generation-0', ..., then the logprob-type workers, in the launcher's start order."""
    return [f"{kind}-{i}" for kind, count in worker_counts.items() for i in range(count)]


def usable_core_ids() -> tuple[int, ...]:
    """The cores this process may run on (its affinity: a container's or taskset's limit), sorted."""
    return tuple(sorted(os.sched_getaffinity(0)))


def plan_cpu(config: CpuPlanConfig, cores: Iterable[int], worker_counts: Mapping[str, int], trainer_ranks: int,
             host_gpus: int = 0) -> CpuPlan:
    """The CPU plan of a run with these workers and ranks on `cores` (module docstring);
    CpuPlanError when the split cannot be made."""
    cores = tuple(sorted(cores))
    labels = worker_labels(worker_counts)
    if config.cpu_split == "shared":
        threads = max(1, len(cores) // max(trainer_ranks + len(labels), 1))
        return CpuPlan(split=False, cores=cores, driver=cores, workers={label: cores for label in labels},
                       worker_threads={label: threads for label in labels}, trainer=cores,
                       trainer_ranks=trainer_ranks, shared_threads=threads)
    if host_gpus:
        raise CpuPlanError(f"--cpu_split split shares out CPU cores for a CPU-only run, and this plan uses {host_gpus} "
                           f"GPU(s): leave --cpu_split at shared")
    if len(cores) < SPLIT_MIN_CORES:
        raise CpuPlanError(f"--cpu_split split needs {SPLIT_MIN_CORES} usable cores or more (one per side), and this "
                           f"host has {len(cores)} ({core_list(cores)})")
    wanted = config.cpu_generation_cores or len(cores) // 2
    if wanted >= len(cores):
        raise CpuPlanError(f"--cpu_generation_cores {wanted} leaves training no core: this host has {len(cores)} usable "
                           f"cores ({core_list(cores)}); give generation {len(cores) - 1} or fewer")
    generation, training = cores[:wanted], cores[wanted:]
    slices = _slices(generation, labels)
    # Workers that share the generation cores split them; a worker with a slice runs a thread per core.
    crowded = len(labels) > len(generation)
    threads = {label: max(1, len(got) // len(labels)) if crowded else len(got) for label, got in slices.items()}
    return CpuPlan(split=True, cores=cores, driver=generation, workers=slices, worker_threads=threads,
                   trainer=training, trainer_ranks=trainer_ranks, shared_threads=1)


def _slices(cores: tuple[int, ...], labels: list[str]) -> dict[str, tuple[int, ...]]:
    """Each worker's cores: consecutive slices of `cores` as even as can be, the first workers
    (the engines) one core larger for the remainder; all of `cores` each when there are more
    workers than cores."""
    if len(labels) > len(cores):
        return {label: cores for label in labels}
    base, extra = divmod(len(cores), max(len(labels), 1))
    slices, start = {}, 0
    for i, label in enumerate(labels):
        size = base + (1 if i < extra else 0)
        slices[label] = cores[start:start + size]
        start += size
    return slices


def core_list(cores: Iterable[int]) -> str:
    """'0-3,6' for cores 0, 1, 2, 3 and 6 (the form taskset and /proc use)."""
    ordered = sorted(set(cores))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def parse_core_list(text: str) -> set[int]:
    """The cores of a list such as '0-3,6' (core_list's form); ValueError for anything else."""
    cores: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{CPU_CORES_ENV}: not a core list: {text!r} (expected e.g. '0-3,6')")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


@contextlib.contextmanager
def pinned_thread(cores: Iterable[int] | None) -> Iterator[None]:
    """The calling thread on `cores` within the block, so that the processes it starts inherit
    them (None: unchanged); its own cores are restored after."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pinned_python(cores: str) -> str:
    """Ray's py_executable for actors on `cores` (core_list's form): this module pins itself to
    them, then execs this Python with Ray's worker arguments (the actor keeps the cores)."""
    python = shlex.quote(sys.executable)
    return f"{python} -m {__name__} {shlex.quote(cores)} {python}"


def _exec_pinned(argv: list[str]) -> None:
    """`CORES PROGRAM ARGS...`: run PROGRAM ARGS on CORES, in this process (pinned_python)."""
    os.sched_setaffinity(0, parse_core_list(argv[0]))
    os.execv(argv[1], argv[1:])


if __name__ == "__main__":
    _exec_pinned(sys.argv[1:])
