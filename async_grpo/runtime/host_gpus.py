"""The GPUs this machine gives a run: how many, and the names its child processes see them by.

One function answers for the launcher, the trainer's start-up check, the demo and the test suite,
so that they never disagree. It counts what the NVIDIA driver lists, unless
`ASYNC_GRPO_HOST_GPUS=N` says otherwise (a container whose listing is hidden, or a test that
plans for another machine on this one). A `CUDA_VISIBLE_DEVICES` set by the user or a scheduler
(SLURM, Kubernetes) narrows that to the GPUs the job owns: plans place on positions 0..N-1 of
that set, and `child_visible_devices` turns positions back into the names the parent was given.

    python -m async_grpo.runtime.host_gpus     # prints the count (scripts/demo.sh reads it)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HOST_GPUS_ENV = "ASYNC_GRPO_HOST_GPUS"
"""Overrides the driver's count of GPUs (an integer >= 0)."""
# Where the NVIDIA driver lists the machine's GPUs, one folder each, whatever
# CUDA_VISIBLE_DEVICES says: the way to tell "this process was given no GPU" from "this machine
# has none". ASYNC_GRPO_NVIDIA_GPUS_DIR moves it (scripts/device.sh reads the same variable).
NVIDIA_GPUS_DIR_ENV = "ASYNC_GRPO_NVIDIA_GPUS_DIR"
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")


class HostGpuError(ValueError):
    """The environment names GPUs in a way that cannot be planned for (one line)."""


@dataclass(frozen=True)
class HostGpus:
    """The GPUs a run may use: `names[k]` is what a child process's CUDA_VISIBLE_DEVICES says for
    plan position k (indices, or UUIDs where a scheduler wrote those)."""

    names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.names)

    def child_visible_devices(self, positions: tuple[int, ...] | list[int]) -> str:
        """CUDA_VISIBLE_DEVICES for a child given the plan's `positions`."""
        for position in positions:
            if not 0 <= position < self.count:
                raise HostGpuError(f"plan position {position} is outside the {self.count} GPU(s) this run was given")
        return ",".join(self.names[p] for p in positions)


def listed_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """GPUs in this machine: ASYNC_GRPO_HOST_GPUS when set, else the driver's listing (0 without it)."""
    env = os.environ if environ is None else environ
    forced = env.get(HOST_GPUS_ENV)
    if forced is not None and forced.strip() != "":
        try:
            count = int(forced)
        except ValueError:
            count = -1
        if count < 0:
            raise HostGpuError(f"{HOST_GPUS_ENV} must be an integer >= 0, got {forced!r}")
        return count
    listing = Path(env.get(NVIDIA_GPUS_DIR_ENV) or NVIDIA_GPUS_DIR)
    return len(list(listing.iterdir())) if listing.is_dir() else 0


def host_gpus(environ: Mapping[str, str] | None = None) -> HostGpus:
    """The GPUs a run started from this environment may use: those CUDA_VISIBLE_DEVICES names
    when it is set (empty: none), else every listed GPU by index."""
    env = os.environ if environ is None else environ
    listed = listed_gpu_count(env)
    if listed == 0:
        return HostGpus(names=())
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return HostGpus(names=tuple(str(i) for i in range(listed)))
    names = tuple(name.strip() for name in visible.split(",") if name.strip())
    # CUDA stops at the first entry that is not a valid device (-1 is the usual way to hide all).
    usable: list[str] = []
    for name in names:
        if name.lstrip("-").isdigit() and not 0 <= int(name) < listed:
            break
        usable.append(name)
    if len(set(usable)) != len(usable):
        raise HostGpuError(f"CUDA_VISIBLE_DEVICES={visible!r} names a GPU twice")
    return HostGpus(names=tuple(usable))


def host_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """How many GPUs a run may use (host_gpus(...).count)."""
    return host_gpus(environ).count


def planned_gpus(count: int | None = None) -> HostGpus:
    """The GPUs a plan places on: `count` of them by index when given (a plan for another
    machine, or Ray's fake GPUs on this one), else host_gpus()."""
    if count is not None:
        return HostGpus(names=tuple(str(i) for i in range(count)))
    return host_gpus()


# What a plan assumes of a GPU that this machine lacks (a count given without CUDA here): the
# memory of an 80 GB A100/H100, the most common training GPU.
ASSUMED_GPU_MEMORY_BYTES = 80 * 2**30


def gpu_memory_bytes(gpus: int, memory_gib: float | None = None) -> int:
    """Memory of one of `gpus` GPUs for the plan: `memory_gib` when given, else what CUDA reports
    for the first visible GPU, else ASSUMED_GPU_MEMORY_BYTES (0 without GPUs)."""
    if gpus == 0:
        return 0
    if memory_gib is not None:
        return int(memory_gib * 2**30)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return ASSUMED_GPU_MEMORY_BYTES


def main() -> None:
    """Print how many GPUs a run may use (for shell scripts)."""
    print(host_gpu_count())


if __name__ == "__main__":
    main()
