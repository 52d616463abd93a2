"""token_versions: the engine's weight-version spans -> a completion's run-length versions, and the
oldest-token / per-token staleness helpers the batcher and the trainer's metrics use.

    .venv/bin/python -m pytest tests/rollouts/test_token_versions.py -q
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from async_grpo.rollouts.token_versions import (
    CompletionVersions, TokenVersionError, TokenVersionTracker, engine_label, label_version, spans_to_runs,
    version_runs,
)
from sample_processing_utils import INITIAL_WEIGHT_VERSION, Sample


@dataclass
class Span:
    """vllm.outputs.WeightVersionSpan's fields (the module reads them by attribute)."""

    version: str
    start: int
    end: int


def _spans(*runs: tuple[int, int]) -> list[Span]:
    """Spans as the engine reports them for (version, count) runs."""
    out, position = [], 0
    for version, count in runs:
        out.append(Span(engine_label(version), position, position + count))
        position += count
    return out


def _sample(n: int, weight_version: int, token_versions: list[tuple[int, int]] | None = None) -> Sample:
    return Sample(input_token_ids=[1, 2], gt_answer="", output_token_ids=list(range(n)), sampling_logprobs=[-1.0] * n,
                  weight_version=weight_version, token_versions=token_versions)


def test_labels_round_trip_and_the_engine_default_is_the_checkpoint() -> None:
    assert [label_version(engine_label(v)) for v in (-1, 0, 7)] == [-1, 0, 7]
    assert label_version("default") == INITIAL_WEIGHT_VERSION
    with pytest.raises(TokenVersionError, match="'v3'"):
        label_version("v3")


def test_spans_become_runs_and_adjacent_equal_versions_merge() -> None:
    spans = [Span("default", 0, 3), Span("0", 3, 3), Span("0", 3, 5), Span("0", 5, 6), Span("1", 6, 10)]
    assert spans_to_runs(spans, 10, "r") == [(-1, 3), (0, 3), (1, 4)]
    assert spans_to_runs([], 0, "r") == []


@pytest.mark.parametrize(("spans", "num_tokens", "match"), [
    ([Span("0", 1, 4)], 4, "continue at token 0"),
    ([Span("0", 0, 2), Span("1", 3, 4)], 4, "continue at token 2"),
    ([Span("0", 0, 3)], 4, "cover 3 of 4"),
    ([Span("0", 0, 5)], 4, "cover 5 of 4"),
])
def test_spans_that_do_not_tile_the_tokens_are_refused(spans: list[Span], num_tokens: int, match: str) -> None:
    with pytest.raises(TokenVersionError, match=match):
        spans_to_runs(spans, num_tokens, "r")


def test_a_request_straddling_a_push_gets_per_completion_runs() -> None:
    """n = 3: each completion has its own count; one finished before the push, one had not started
    sampling when it landed."""
    tracker = TokenVersionTracker()
    tracker.begin("a", 4)
    tracker.pushed(5)
    got = tracker.finish("a", [(_spans((4, 7), (5, 3)), 10), (_spans((4, 2)), 2), (_spans((5, 6)), 6)])
    assert got == [
        CompletionVersions(weight_version=4, token_versions=[(4, 7), (5, 3)]),
        CompletionVersions(weight_version=4, token_versions=None),
        # Its first token came from v5: weight_version says when the rollout really started.
        CompletionVersions(weight_version=5, token_versions=None),
    ]
    assert len(tracker) == 0


def test_two_pushes_in_one_request() -> None:
    tracker = TokenVersionTracker()
    tracker.begin("a", 0)
    tracker.pushed(1)
    tracker.pushed(1)  # the same version twice (a re-push) is one version seen
    tracker.pushed(2)
    (got,) = tracker.finish("a", [(_spans((0, 1), (1, 4), (2, 2)), 7)])
    assert got.token_versions == [(0, 1), (1, 4), (2, 2)] and got.weight_version == 0


def test_pushes_reach_only_requests_in_flight() -> None:
    tracker = TokenVersionTracker()
    tracker.begin("early", 0)
    tracker.pushed(1)
    tracker.begin("late", 1)
    with pytest.raises(TokenVersionError, match=r"versions \[0\].*served \[1\]"):
        tracker.finish("late", [(_spans((0, 2), (1, 2)), 4)])
    assert tracker.finish("early", [(_spans((0, 2), (1, 2)), 4)])[0].token_versions == [(0, 2), (1, 2)]


def test_labels_the_worker_never_served_are_an_error() -> None:
    """An engine that was not relabelled (or labelled ahead) must not pass silently."""
    tracker = TokenVersionTracker()
    tracker.begin("a", 3)
    with pytest.raises(TokenVersionError, match=r"request a completion 0: .*\[4\]"):
        tracker.finish("a", [(_spans((3, 1), (4, 1)), 2)])


def test_without_spans_only_an_undisturbed_request_is_exact() -> None:
    tracker = TokenVersionTracker()
    tracker.begin("quiet", 2)
    assert tracker.finish("quiet", [(None, 5)]) == [CompletionVersions(weight_version=2, token_versions=None)]
    tracker.begin("pushed", 2)
    tracker.pushed(3)
    assert tracker.finish("pushed", [(None, 5), (None, 0)]) == [
        CompletionVersions(weight_version=2, token_versions=None, attributed=False),
        CompletionVersions(weight_version=2, token_versions=None),  # no tokens: nothing to attribute
    ]


def test_begin_twice_finish_unknown_and_discard() -> None:
    tracker = TokenVersionTracker()
    tracker.begin("a", 0)
    with pytest.raises(ValueError, match="tracked already"):
        tracker.begin("a", 0)
    tracker.discard("a")
    tracker.discard("a")
    with pytest.raises(ValueError, match="never begun"):
        tracker.finish("a", [])


def test_oldest_newest_and_runs_of_samples() -> None:
    plain = _sample(4, 3)
    assert version_runs(plain) == [(3, 4)] and plain.oldest_version() == plain.newest_version() == 3
    straddling = _sample(6, 2, [(2, 1), (3, 2), (5, 3)])
    assert (straddling.oldest_version(), straddling.newest_version()) == (2, 5)
    # A later initial push may go backwards (a new run): the oldest is the smallest, not the first.
    backwards = _sample(3, 7, [(7, 1), (0, 2)])
    assert backwards.oldest_version() == 0
    empty = _sample(0, 4)
    assert version_runs(empty) == [] and empty.oldest_version() == 4


def test_token_staleness_is_per_token() -> None:
    # Step 6 trains on 1 token of v2 (lag 4), 2 of v3 (lag 3) and 3 of v5 (lag 1): 4 + 6 + 3 = 13 over 6.
    assert _sample(6, 2, [(2, 1), (3, 2), (5, 3)]).token_staleness(6) == (13, 6)
    assert _sample(4, 5).token_staleness(6) == (4, 4)
    assert _sample(0, 5).token_staleness(6) == (0, 0)


def test_observation_tokens_carry_no_version() -> None:
    """Multi-turn: token_versions counts sampled tokens only (Sample.output_mask)."""
    sample = Sample(input_token_ids=[1], gt_answer="", output_token_ids=[5, 6, 7, 8, 9],
                    output_mask=[True, True, False, False, True], sampling_logprobs=[-1.0] * 3, weight_version=1)
    assert version_runs(sample) == [(1, 3)] and sample.token_staleness(2) == (3, 3)
