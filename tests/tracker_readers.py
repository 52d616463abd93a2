"""Read back a W&B offline run: its run-<id>.wandb transaction log, with W&B's own protobufs.

W&B 0.31 ships no Python reader for the file (its Go core writes and syncs it), so this follows
the format: a LevelDB-style log with a 7-byte header (":W&B", a 2-byte magic, a version byte),
then 32 KiB blocks of chunks, each with a 7-byte header (CRC32, length, type: 1 a whole record,
2 first, 3 middle, 4 last piece), each record a wandb_internal_pb2.Record.
"""

from __future__ import annotations

import json
import struct
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
