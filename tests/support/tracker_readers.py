"""Read back what the trackers stored, with each tool's own code.

W&B: an offline run's run-<id>.wandb transaction log, parsed into W&B's own protobufs. W&B 0.31
ships no Python reader for the file (its Go core writes and syncs it), so this follows
the format: a LevelDB-style log with a 7-byte header (":W&B", a 2-byte magic, a version byte),
then 32 KiB blocks of chunks, each with a 7-byte header (CRC32, length, type: 1 a whole record,
2 first, 3 middle, 4 last piece), each record a wandb_internal_pb2.Record.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

_BLOCK = 32 * 1024
_FILE_HEADER = 7
_CHUNK_HEADER = struct.Struct("<IHB")


def wandb_records(path: Path) -> Iterator[Any]:
    """Every Record of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pieces = _FILE_HEADER, b""
    while pos + _CHUNK_HEADER.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER.size:  # block trailer padding
            pos += left_in_block
            continue
        _, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        pos += _CHUNK_HEADER.size
        chunk, pos = data[pos:pos + length], pos + length
        if kind in (1, 2):
            pieces = chunk
        elif kind in (3, 4):
            pieces += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record


def _items(updates: Any) -> dict[str, Any]:
    """W&B's (nested_)key/value_json pairs as a dict; our keys (`reward/mean`) are one key each."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}


def wandb_offline_runs(run_dir: Path) -> list[dict[str, Any]]:
    """Each offline W&B run under run_dir/wandb: its history {step: {key: value}} (W&B's own `_`
    keys left out), config and artifact records."""
    runs = []
    for path in sorted((run_dir / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")):
        history, config, artifacts = {}, {}, []
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = _items(record.history.item)
                history[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "run":
                config = {k: v for k, v in _items(record.run.config.update).items() if not k.startswith("_")}
            elif kind == "artifact":
                artifacts.append(record.artifact)
        runs.append({"history": history, "config": config, "artifacts": artifacts})
    return runs


_TRACKIO_READER = """
import json, sys
from trackio import SQLiteStorage
print(json.dumps({"logs": SQLiteStorage.get_logs(sys.argv[1], sys.argv[2]),
                  "config": SQLiteStorage.get_run_config(sys.argv[1], sys.argv[2])}, default=str))
"""


def trackio_run(trackio_dir: Path, project: str, run: str) -> dict[str, Any]:
    """A trackio run's history {step: {key: value}} (the reward plot's image entries included),
    config (trackio's own `_` keys left out) and images {step: file path}. Read in a child
    process: trackio reads TRACKIO_DIR once, when first imported."""
    env = {**os.environ, "TRACKIO_DIR": str(trackio_dir)}
    read = subprocess.run([sys.executable, "-c", _TRACKIO_READER, project, run], env=env, check=True,
                          capture_output=True, text=True)
    stored = json.loads(read.stdout)
    history: dict[int, dict[str, Any]] = {}
    for entry in stored["logs"]:
        history.setdefault(entry["step"], {}).update({k: v for k, v in entry.items() if k not in ("step", "timestamp")})
    images = {step: trackio_dir / "media" / history[step].pop("reward_plot")["file_path"]
              for step in list(history) if "reward_plot" in history[step]}
    config = {k: v for k, v in stored["config"].items() if not k.startswith("_")}
    return {"history": history, "config": config, "images": images}
