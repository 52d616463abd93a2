"""Crash-safe training checkpoints: a full HF model directory plus optimizer, scheduler, data and RNG.

Layout of run_dir/checkpoints/step_000010/:
    config.json, model.safetensors, tokenizer files   (loadable by vLLM and transformers)
      or, for a LoRA policy (model.lora), only its adapter in PEFT format:
    adapter_config.json, adapter_model.safetensors    (PeftModel.from_pretrained, vLLM LoRARequest)
    optimizer.pt        full (unsharded) AdamW state, tensors only (loaded with weights_only=True)
    rng_rank{r}.pt      each rank's torch RNG states: {"cpu": ..., "cuda": ... (on GPU ranks)}
    trainer_state.json  step, sampler position, scheduler state (written last)

Everything is written into `step_000010.tmp` and renamed into place once complete, so a crash
mid-write never leaves a directory that looks like a checkpoint; `latest_checkpoint` ignores
`.tmp` directories (a later save of the same step replaces them).

A save has two phases (CheckpointWriter): the snapshot, collective, copies weights, optimizer
state, every rank's RNG state and the scheduler state out of the live trainer into CPU tensors
that rank 0 owns; the write puts those copies into the `.tmp` directory. Synchronous saves write
each part as soon as it is gathered (rank 0 holds the weights, then the optimizer state, not both).
Background saves (`TrainerConfig.checkpoint_async`) write from one thread on rank 0 while
training goes on: rank 0 then holds the whole snapshot (for AdamW about 3x the fp32 weights of
host memory) until it is written. Either way the directory becomes visible (tmp renamed into
place) only at `commit()`, which the trainer calls after the step's metrics and data records are
written: a checkpoint never exists without the records of the steps before it.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from async_grpo.trainer.fsdp_setup import DistInfo
from async_grpo.weights.adapter_files import write_adapter_folder
from async_grpo.weights.hf_checkpoint import inference_config, write_hf_folder
from async_grpo.weights.trainer_adapter import adapter_config_json, gather_adapter, is_lora_model
from async_grpo.weights.trainer_gather import gather_full_state_dict

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
    algorithm_state: dict[str, Any] = field(default_factory=dict)
    """The batcher's algorithm state for `step` (the KL-in-reward controller), {} when none."""


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


# trainer_gather.export_hf_checkpoint gathers and writes the HF folder in one collective call; a
# background save needs the gather and the write apart, so this module writes the same files
# (config, weights, tokenizer) under hf_checkpoint's names.
OPTIMIZER_FILE = "optimizer.pt"
# Write steps of one save, in order; each is a no-argument callable that writes one file set.
_Write = Callable[[], None]


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own data of a (possibly DTensor) parameter or optimizer state."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _live_storages(model: nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """Storage addresses of the trainer's live tensors: parameters and optimizer state."""
    live = {_local_tensor(p.detach()).untyped_storage().data_ptr() for p in model.parameters()}
    for state in optimizer.state.values():
        live.update(_local_tensor(v).untyped_storage().data_ptr() for v in state.values()
                    if isinstance(v, torch.Tensor))
    return live


def _owned(value: Any, live: set[int]) -> Any:
    """`value` (nested dicts/lists of tensors) with fresh containers, every tensor that shares
    storage with a live trainer tensor cloned. get_optimizer_state_dict's full, cpu-offloaded
    copy can hand back the live tensor itself (AdamW's `step` scalars; every state on a one-rank
    mesh), which the next optimizer step changes in place, under a background write."""
    if isinstance(value, dict):
        return {k: _owned(v, live) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_owned(v, live) for v in value)
    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in live:
        return value.detach().clone()
    return value


def _write_rng_and_state(rng_states: list[dict[str, torch.Tensor]], state: TrainerState, out: Path) -> None:
    """Every rank's RNG file, then trainer_state.json, the file that marks a checkpoint complete."""
    for rank, rng in enumerate(rng_states):
        torch.save(rng, out / f"rng_rank{rank}.pt")
    (out / _STATE_FILE).write_text(json.dumps(asdict(state), indent=1))


def _commit(tmp: Path, final: Path, run_dir: Path, keep: int) -> None:
    """Rank 0: rename a fully written tmp directory into place and prune old checkpoints."""
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _prune(run_dir, keep)
    logger.info("checkpoint written: %s", final)


class _BackgroundWrite:
    """One save's writes on a thread of rank 0; the rename waits for the trainer's commit."""

    def __init__(self, writes: list[_Write], tmp: Path, final: Path, run_dir: Path, keep: int) -> None:
        self._writes, self._tmp, self._final, self._run_dir, self._keep = writes, tmp, final, run_dir, keep
        self._decided = threading.Event()
        self._commit = False
        self.error: BaseException | None = None
        # A daemon, so that a rank failing before commit() is not held at exit by a thread
        # waiting for a decision; on every normal path the trainer joins it (CheckpointWriter.wait).
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-{final.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while self._writes:  # each part's tensors are dropped once on disk
                self._writes.pop(0)()
            self._decided.wait()
            if self._commit:
                _commit(self._tmp, self._final, self._run_dir, self._keep)
            else:
                logger.warning("checkpoint %s abandoned before commit; left as %s", self._final.name, self._tmp)
        except BaseException as error:  # handed to the training thread by CheckpointWriter.wait
            self.error = error

    def decide(self, commit: bool) -> None:
        """Rename into place (commit) or leave as tmp; only the first decision counts."""
        if not self._decided.is_set():
            self._commit = commit
            self._decided.set()

    def join(self) -> None:
        self._thread.join()


class CheckpointWriter:
    """Saves a run's checkpoints in the training loop (BackgroundCheckpointWriter: on a thread).

    Per checkpoint every rank calls `save` (collective: the snapshot, written as it is gathered),
    the trainer writes the step's records, then every rank calls `commit` (the directory appears;
    every rank returns after it). `close` must run before the process exits.
    """

    def __init__(self, run_dir: Path, source_model_path: str, dist: DistInfo, *, keep: int) -> None:
        self._run_dir = Path(run_dir)
        self._source = source_model_path
        self._dist = dist
        self._keep = keep
        self._pending: tuple[Path, Path] | None = None
        """(tmp, final) of a save written but not committed."""

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
             state: TrainerState) -> float:
        """Collective: snapshot the trainer at `state.step` into the tmp directory (this class
        writes each part as soon as it is gathered; the background writer keeps them for its
        thread). Returns the seconds this call blocked the caller, including any wait for the
        previous save."""
        start = time.perf_counter()
        final = checkpoints_root(self._run_dir) / f"step_{state.step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        main = self._dist.is_main
        if main:
            self.wait()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        writes: list[_Write] = []
        if is_lora_model(model):  # the frozen base is the source model itself: save the adapter only
            weights = gather_adapter(model)  # collective; fresh CPU copies on rank 0
            if main:
                self._take(partial(write_adapter_folder, weights, adapter_config_json(model), tmp), writes)
        else:
            weights = gather_full_state_dict(model)  # collective; fresh CPU copies on rank 0
            if main:
                self._take(partial(write_hf_folder, weights, inference_config(model, weights), tmp, self._source),
                           writes)
        del weights
        optim_state = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if main:
            self._take(partial(torch.save, _owned(optim_state, _live_storages(model, optimizer)), tmp / OPTIMIZER_FILE),
                       writes)
        del optim_state
        rng_states: list[Any] = [None] * self._dist.world_size
        torch_dist.all_gather_object(rng_states, _rng_state())
        if main:
            saved = copy.deepcopy(state)
            saved.scheduler_state = _jsonable(scheduler.state_dict())
            self._take(partial(_write_rng_and_state, rng_states, saved, tmp), writes)
            self._saved(writes, tmp, final)
        return time.perf_counter() - start

    def _take(self, write: _Write, writes: list[_Write]) -> None:
        """One part of a save, gathered: written now, so its tensors are dropped right after."""
        write()

    def _saved(self, writes: list[_Write], tmp: Path, final: Path) -> None:
        """Rank 0, every part taken: the save waits for commit()."""
        self._pending = (tmp, final)

    def commit(self) -> None:
        """Collective: make the last save visible; every rank returns once it is renamed."""
        if self._dist.is_main and self._pending is not None:
            _commit(*self._pending, self._run_dir, self._keep)
            self._pending = None
        torch_dist.barrier()

    def wait(self) -> None:
        """Block until no save is in flight (a no-op here: each save is done when save returns)."""

    def close(self) -> None:
        """Wait for the save in flight; call before exiting (also after an error)."""
        self.wait()


class BackgroundCheckpointWriter(CheckpointWriter):
    """A CheckpointWriter whose rank 0 writes each save on a thread while training goes on.

    The whole snapshot is kept until the thread has written it. At most one save is in flight:
    the next `save` first waits for the previous one. `commit` returns at once (the thread renames
    the directory once written); `close` waits for the save in flight, committing it only if
    `commit` was called.
    """

    def __init__(self, run_dir: Path, source_model_path: str, dist: DistInfo, *, keep: int) -> None:
        super().__init__(run_dir, source_model_path, dist, keep=keep)
        self._in_flight: _BackgroundWrite | None = None

    def _take(self, write: _Write, writes: list[_Write]) -> None:
        writes.append(write)

    def _saved(self, writes: list[_Write], tmp: Path, final: Path) -> None:
        self._in_flight = _BackgroundWrite(writes, tmp, final, self._run_dir, self._keep)

    def commit(self) -> None:
        """Collective: the thread renames the last save once written (wait() to be sure)."""
        if self._dist.is_main and self._in_flight is not None:
            self._in_flight.decide(commit=True)

    def wait(self) -> None:
        """Rank 0: block until the save in flight is on disk (committed, if commit() was called;
        abandoned otherwise); raise the error it failed with. No-op elsewhere."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        in_flight.decide(commit=False)  # no effect once commit() decided
        in_flight.join()
        if in_flight.error is not None:
            raise RuntimeError(f"background checkpoint save failed: {in_flight.error!r}") from in_flight.error


def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
                    state: TrainerState, source_model_path: str, dist: DistInfo, *, keep: int) -> Path:
    """Collective: a synchronous save, committed. Returns the final checkpoint path."""
    writer = CheckpointWriter(run_dir, source_model_path, dist, keep=keep)
    writer.save(model, optimizer, scheduler, state)
    writer.commit()
    return checkpoints_root(run_dir) / f"step_{state.step:06d}"


def _prune(run_dir: Path, keep: int) -> None:
    """Delete all but the `keep` newest complete checkpoints."""
    complete = sorted(
        (int(m.group(1)), p) for p in checkpoints_root(run_dir).iterdir() if (m := _STEP_DIR.match(p.name))
    )
    for _, path in complete[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
                    dist: DistInfo) -> TrainerState:
    """Collective: restore optimizer, scheduler and RNG (weights come from the HF files, or for
    a LoRA policy the adapter files, via build_training_model). Returns the trainer state."""
    state = TrainerState(**json.loads((path / _STATE_FILE).read_text()))
    optim_full = torch.load(path / "optimizer.pt", weights_only=True) if dist.is_main else {}
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
