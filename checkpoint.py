"""Crash-safe training checkpoints: a full HF model directory plus optimizer, scheduler, data and RNG.

Layout of run_dir/checkpoints/step_000010/:
    config.json, model.safetensors, tokenizer files   (loadable by vLLM and transformers)
    optimizer.pt        full (unsharded) AdamW state, tensors only (loaded with weights_only=True)
    rng_rank{r}.pt      each rank's torch RNG states: {"cpu": ..., "cuda": ... (on GPU ranks)}
    trainer_state.json  step, sampler position, scheduler state (written last)

Everything is written into `step_000010.tmp` and renamed into place once complete, so a crash
mid-write never leaves a directory that looks like a checkpoint; `latest_checkpoint` ignores
`.tmp` directories (a later save of the same step replaces them).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler

from fsdp_setup import DistInfo
from weight_sync import export_hf_checkpoint

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_STATE_FILE = "trainer_state.json"


@dataclass(slots=True)
class TrainerState:
    """What besides weights and optimizer a resumed run needs."""

    step: int
    """The next step to run."""
    sampler_state: dict[str, Any] = field(default_factory=dict)
    """InfiniteDistributedSampler.state_dict() at the start of `step`."""
    scheduler_state: dict[str, Any] = field(default_factory=dict)
    """LR scheduler state_dict()."""


def checkpoints_root(run_dir: Path) -> Path:
    """Folder holding a run's step_NNNNNN checkpoints."""
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None. `.tmp` directories never count."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return None
    complete = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / _STATE_FILE).is_file():
            complete.append((int(match.group(1)), path))
        elif path.name.endswith(".tmp"):
            logger.warning("ignoring incomplete checkpoint %s", path)
    return max(complete)[1] if complete else None


def _jsonable(value: Any) -> Any:
    """Scheduler state holds tensors or callables in some torch versions: keep what JSON can hold."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items() if not callable(v)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


def _rng_state() -> dict[str, torch.Tensor]:
    """This process's torch RNG states: the CPU generator and, on a GPU rank, its device's.

    Python's and numpy's global generators are not saved: the trainer draws from neither (the data
    sampler keeps its own seeded generator, whose position is in trainer_state.json).
    """
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(saved: dict[str, torch.Tensor] | torch.Tensor) -> None:
    """Restore what _rng_state saved (or a bare CPU state, the format of earlier checkpoints)."""
    if isinstance(saved, torch.Tensor):
        saved = {"cpu": saved}
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])


def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
                    state: TrainerState, source_model_path: str, dist: DistInfo, *, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path."""
    final = checkpoints_root(run_dir) / f"step_{state.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if dist.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch_dist.barrier()
    export_hf_checkpoint(model, tmp, source_model_path)
    optim_state = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    torch.save(_rng_state(), tmp / f"rng_rank{dist.rank}.pt")
    torch_dist.barrier()  # every rank's files are in tmp before rank 0 renames it into place
    if dist.rank == 0:
        torch.save(optim_state, tmp / "optimizer.pt")
        state.scheduler_state = _jsonable(scheduler.state_dict())
        (tmp / _STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(run_dir, keep)
        logger.info("checkpoint written: %s", final)
    torch_dist.barrier()
    return final


def _prune(run_dir: Path, keep: int) -> None:
    """Delete all but the `keep` newest complete checkpoints."""
    complete = sorted(
        (int(m.group(1)), p) for p in checkpoints_root(run_dir).iterdir() if (m := _STEP_DIR.match(p.name))
    )
    for _, path in complete[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
                    dist: DistInfo) -> TrainerState:
    """Collective: restore optimizer, scheduler and RNG (weights come from the HF files via
    build_training_model). Returns the trainer state."""
    state = TrainerState(**json.loads((path / _STATE_FILE).read_text()))
    optim_full = torch.load(path / "optimizer.pt", weights_only=True) if dist.rank == 0 else {}
    set_optimizer_state_dict(
        model, optimizer, optim_state_dict=optim_full,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    scheduler.load_state_dict(state.scheduler_state)
    rng_file = path / f"rng_rank{dist.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        logger.warning("%s has no RNG state for rank %d (saved with fewer ranks?): keeping this run's seed",
                       path, dist.rank)
    return state
