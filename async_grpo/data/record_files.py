"""Prompt files as records: JSON Lines or Parquet, by the file's suffix, each record with the
location an error names.

    records = RecordFile(Path("data.jsonl"))
    for where, record in records:    # ("data.jsonl:3", {...}) or ("train.parquet: row 0", {...})
        ...
    records.blank_lines              # blank JSONL lines passed over, counted

What a record means (its format, prompt and answer fields) is prompt_record.py's and dataset.py's;
this module only reads the container and says where each record came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from async_grpo.data.prompt_record import DatasetError, quote

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIX = ".parquet"
# Parquet rows converted to Python per batch: bounds memory on multi-GB files.
_PARQUET_BATCH_ROWS = 4096


class RecordFile:
    """The records of one prompt file, read as it is iterated: (location, record) pairs; a file
    type this module does not read is a DatasetError at once, a broken line or file one when
    reached (an unreadable file: OSError, for the caller to name)."""

    def __init__(self, path: Path) -> None:
        suffix = path.suffix.lower()
        if suffix != PARQUET_SUFFIX and suffix not in JSONL_SUFFIXES:
            raise DatasetError(
                f"{path}: unknown prompt file type {suffix or '(no suffix)'!r}: expected JSON Lines "
                f"({', '.join(JSONL_SUFFIXES)}) or Parquet ({PARQUET_SUFFIX})"
            )
        self.path = path
        self.blank_lines = 0
        """Empty or whitespace-only JSONL lines passed over so far."""

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        if self.path.suffix.lower() == PARQUET_SUFFIX:
            return _parquet_records(self.path)
        return self._jsonl_records()

    def _jsonl_records(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(file:line, record) per non-blank line; blank lines are counted."""
        with self.path.open("rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    self.blank_lines += 1
                    continue
                where = f"{self.path}:{line_no}"
                try:
                    record = _decode_record(raw)
                except ValueError as exc:
                    raise DatasetError(f"{where}: {exc}") from None
                yield where, record


def _decode_record(raw: bytes) -> dict[str, Any]:
    """One line's JSON object; raises ValueError describing what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno}): {quote(text.strip())}") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


def _parquet_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file: row N, record) per row, N 0-based; a null value counts as a missing field."""
    import pyarrow
    import pyarrow.parquet

    try:
        parquet = pyarrow.parquet.ParquetFile(path)
    except pyarrow.ArrowException as exc:
        raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for record in batch.to_pylist():
            yield f"{path}: row {row}", {name: value for name, value in record.items() if value is not None}
            row += 1
