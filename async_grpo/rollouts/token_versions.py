"""Per-token weight versions: which weights sampled each token of a rollout.

Under `weight_update_pause_mode: keep` a push freezes the running requests, swaps the weights and
lets them finish on the new ones, so one completion's tokens can come from several versions.
Sample.token_versions carries them run-length encoded: (version, count) pairs in token order.

Where the versions come from. vLLM 0.32's engine core stamps every step's outputs with its weight
label (`AsyncLLM.update_weight_version`; the label changes only while generation is paused), and
the output processor turns the stamps into `CompletionOutput.weight_versions`, spans
`[start, end)` over each completion's output tokens, on the final output (FINAL_ONLY included,
one list per completion of an n > 1 request). The label is attached in the engine process in the
step that sampled the tokens, so a token sampled in the step that raced with the pause carries
the old label however late its output reaches the worker. Counting streamed tokens in the worker
could not be exact: `pause_generation` returns once the engine is idle, but the outputs of its
last step may still be on their way through the output handler (vLLM only sleeps 20 ms to make
that unlikely).

`TokenVersionTracker` (worker side) keeps, per in-flight request, the version it started on and
the versions pushed while it ran; `finish` checks each completion's spans against them and gives
its `CompletionVersions`. The consumers read a Sample's own (`Sample.version_runs`, `oldest_version`,
`token_staleness`): staleness, max_lag and the drop rules use the oldest token's version.

Pure: no vLLM import (spans are read by attribute: version, start, end).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from sample_processing_utils import INITIAL_WEIGHT_VERSION, Sample

logger = logging.getLogger(__name__)

ENGINE_INITIAL_LABEL = "default"
"""The weight label vLLM's engine core reports before update_weight_version is first called:
the checkpoint the engine loaded, INITIAL_WEIGHT_VERSION to us."""

VersionRuns = list[tuple[int, int]]
"""(version, count) pairs in token order, adjacent versions distinct, counts > 0."""


class WeightVersionSpan(Protocol):
    """vllm.outputs.WeightVersionSpan: output tokens [start, end) were sampled by `version`."""

    version: str
    start: int
    end: int


class TokenVersionError(ValueError):
    """The engine's version spans do not describe a completion's tokens (one line, naming the request)."""


def engine_label(version: int) -> str:
    """The label the worker gives the engine for `version` (update_weight_version's argument)."""
    return str(version)


def label_version(label: str) -> int:
    """The weight version an engine label names; TokenVersionError for a label we never set."""
    if label == ENGINE_INITIAL_LABEL:
        return INITIAL_WEIGHT_VERSION
    try:
        return int(label)
    except ValueError:
        raise TokenVersionError(f"engine weight label {label!r} is neither {ENGINE_INITIAL_LABEL!r} nor a version "
                                "number") from None


def spans_to_runs(spans: Sequence[WeightVersionSpan], num_tokens: int, where: str) -> VersionRuns:
    """Run-length versions of a completion from the engine's spans: they must tile
    [0, num_tokens) in order; adjacent spans of one version merge."""
    runs: VersionRuns = []
    position = 0
    for span in spans:
        if span.start != position or span.end < span.start:
            raise TokenVersionError(f"{where}: weight-version span [{span.start}, {span.end}) does not continue at "
                                    f"token {position}")
        count = span.end - span.start
        version = label_version(span.version)
        if count == 0:
            continue
        if runs and runs[-1][0] == version:
            runs[-1] = (version, runs[-1][1] + count)
        else:
            runs.append((version, count))
        position = span.end
    if position != num_tokens:
        raise TokenVersionError(f"{where}: weight-version spans cover {position} of {num_tokens} output tokens")
    return runs


@dataclass(frozen=True, slots=True)
class CompletionVersions:
    """The versions of one finished completion, as Sample fields."""

    weight_version: int
    """Sample.weight_version: the version of its first token (the request's start version when
    it has none)."""
    token_versions: VersionRuns | None
    """Sample.token_versions: None when every token came from weight_version."""
    attributed: bool = True
    """False when the engine gave no spans although a push happened while the request ran: the
    split is unknown, so all tokens are attributed to the start version (the oldest possible,
    what staleness rules must assume). The worker counts these."""


@dataclass(slots=True)
class _Request:
    start_version: int
    seen: list[int] = field(default_factory=list)
    """Versions served while the request ran: its start version, then each push."""


class TokenVersionTracker:
    """Per in-flight request of one generation worker: the version it started on and the full
    weight pushes that landed while it ran. Told by the worker; not thread-safe (one event loop).

    LoRA requests are not tracked: each keeps its adapter to the end (one version), and adapter
    loads do not relabel the engine.
    """

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def begin(self, request_id: str, version: int) -> None:
        """A request was submitted while the worker served `version`."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is tracked already")
        self._requests[request_id] = _Request(start_version=version, seen=[version])

    def pushed(self, version: int) -> None:
        """Full weights of `version` are loaded and labelled (before generation resumes): every
        request in flight may have tokens from it."""
        for request in self._requests.values():
            if request.seen[-1] != version:
                request.seen.append(version)

    def discard(self, request_id: str) -> None:
        """Forget a request that failed or was cancelled (no error if unknown)."""
        self._requests.pop(request_id, None)

    def finish(self, request_id: str, completions: Sequence[tuple[Sequence[WeightVersionSpan] | None, int]]
               ) -> list[CompletionVersions]:
        """Each completion's versions from its (spans, number of output tokens), in order; the
        request is forgotten. TokenVersionError when spans name a version the worker did not
        serve while the request ran (the engine was labelled wrongly)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            raise ValueError(f"request {request_id} was never begun")
        return [self._completion(request, request_id, index, spans, num_tokens)
                for index, (spans, num_tokens) in enumerate(completions)]

    @staticmethod
    def _completion(request: _Request, request_id: str, index: int, spans: Sequence[WeightVersionSpan] | None,
                    num_tokens: int) -> CompletionVersions:
        where = f"request {request_id} completion {index}"
        if spans is None or num_tokens == 0:
            # No spans (an engine that reports none): exact only if nothing was pushed meanwhile.
            single = len(request.seen) == 1 or num_tokens == 0
            return CompletionVersions(weight_version=request.start_version, token_versions=None, attributed=single)
        runs = spans_to_runs(spans, num_tokens, where)
        # A request submitted just before a push's pause may first be scheduled after it: its
        # labels start at a later version than it started with, which is fine.
        unknown = sorted({version for version, _ in runs} - set(request.seen))
        if unknown:
            raise TokenVersionError(f"{where}: engine labels name weight versions {unknown}, but the worker served "
                                    f"{request.seen} while it ran")
        if len(runs) == 1:
            return CompletionVersions(weight_version=runs[0][0], token_versions=None)
        return CompletionVersions(weight_version=runs[0][0], token_versions=runs)


def version_runs(sample: Sample) -> VersionRuns:
    """The sample's sampled tokens as (version, count) runs (one run when token_versions is None)."""
    return sample.version_runs()
