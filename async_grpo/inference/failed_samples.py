"""The samples a generation worker could not finish: generation or scoring failed, one JSON line
each (the sample's fields, the worker, the error, the time) under FailedSamplesConfig.path.

Plain: no vLLM, no Ray.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from sample_processing_utils import Sample


class FailedSampleLog:
    """Appends (sample, error) records to a JSONL file; `path` None: records nothing."""

    def __init__(self, path: str | None, worker_name: str) -> None:
        self.path = path
        self.worker_name = worker_name

    def record(self, failures: list[tuple[Sample, str]]) -> None:
        if self.path is None or not failures:
            return
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for sample, error in failures:
                record = dataclasses.asdict(sample)
                record.update(worker=self.worker_name, error=error, time=time.time())
                f.write(json.dumps(record) + "\n")
