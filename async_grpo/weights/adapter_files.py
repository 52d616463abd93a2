"""LoRA adapters on disk and the STABLE marker that makes a pushed adapter loadable.

A PEFT folder (adapter_config.json + adapter_model.safetensors) is what vLLM's LoRARequest and
PeftModel.from_pretrained read: the trainer writes one per version in lora_files mode, a
generation worker one per object-store adapter update. Every LoRA push is made loadable by the
STABLE marker (<run_dir>/weights/STABLE, written atomically by trainer rank 0 once every part is
in place): workers load only a version it names (`check_stable`). Shared by both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from async_grpo.weights.hf_checkpoint import write_safetensors
from async_grpo.weights.update import WeightUpdate

if TYPE_CHECKING:
    import torch

# PEFT's file names (peft.utils.constants): what PeftModel.from_pretrained and vLLM's LoRA loader read.
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# The readiness marker under <run_dir>/weights/, and the folders of lora_files mode beside it.
STABLE_MARKER_FILE = "STABLE"
WEIGHTS_SUBDIR = "weights"
_ADAPTER_STEP_DIR = "step_{version:06d}"


def write_adapter_folder(tensors: Mapping[str, torch.Tensor], config_json: str, out: Path) -> Path:
    """A PEFT-format adapter folder: adapter_config.json + adapter_model.safetensors (each file
    written atomically), loadable with PeftModel.from_pretrained and by vLLM's LoRARequest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(dict(tensors), out / ADAPTER_WEIGHTS_FILE)
    tmp = out / (ADAPTER_CONFIG_FILE + ".tmp")
    tmp.write_text(config_json)
    tmp.replace(out / ADAPTER_CONFIG_FILE)
    return out


def read_adapter_folder(folder: str | None) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT folder (a lora_files update's adapter_path): write_adapter_folder's inverse."""
    from safetensors.torch import load_file

    if folder is None:
        raise ValueError("lora_files update without adapter_path")
    return load_file(str(Path(folder) / ADAPTER_WEIGHTS_FILE))


def weights_dir(run_dir: str | Path) -> Path:
    """<run_dir>/weights: the STABLE marker and (lora_files mode) the adapter folders."""
    return Path(run_dir) / WEIGHTS_SUBDIR


def adapter_step_dir(weights_root: Path, version: int) -> Path:
    """The lora_files folder of one version: <run_dir>/weights/step_000012."""
    return Path(weights_root) / _ADAPTER_STEP_DIR.format(version=version)


@dataclass(frozen=True, slots=True)
class StableMarker:
    """What <run_dir>/weights/STABLE says: the one version workers may load, and its parts."""

    version: int
    """The fully published weight version."""
    mode: str
    """The push mode that published it ('gather', 'sharded' or 'lora_files')."""
    shards: tuple[str, ...]
    """Its parts: the Ray object ids (hex) of every rank's shard, or the adapter folder's path."""


class UnstableVersionError(RuntimeError):
    """An update the STABLE marker does not name (missing, another version, other shards)."""


def update_parts(update: WeightUpdate) -> tuple[str, ...]:
    """The parts of an update as its STABLE marker lists them."""
    if update.mode == "lora_files":
        return (str(update.adapter_path),)
    return tuple(ref.hex() for ref in update.shard_refs)


def write_stable_marker(path: Path, marker: StableMarker) -> None:
    """Replace the marker atomically (write a temp file, fsync, rename): a reader sees the old
    marker or the new one, never a partial file."""
    import json
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": marker.version, "mode": marker.mode, "shards": list(marker.shards)}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_stable_marker(path: Path) -> StableMarker | None:
    """The marker at path, or None when there is none yet."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    return StableMarker(version=int(data["version"]), mode=str(data["mode"]), shards=tuple(data["shards"]))


def check_stable(update: WeightUpdate) -> None:
    """Raise UnstableVersionError unless the update's STABLE marker names exactly this update
    (version and parts): a version still being published, or one replaced since, is never loaded."""
    if update.marker_path is None:
        raise UnstableVersionError(f"adapter update v{update.version} carries no STABLE marker path")
    marker = read_stable_marker(Path(update.marker_path))
    if marker is None:
        raise UnstableVersionError(f"adapter update v{update.version}: no STABLE marker at {update.marker_path}")
    if marker.version != update.version or marker.shards != update_parts(update):
        raise UnstableVersionError(
            f"adapter update v{update.version}: STABLE marker {update.marker_path} names v{marker.version} "
            f"({marker.mode}, {len(marker.shards)} parts), not this update"
        )
