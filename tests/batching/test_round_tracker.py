"""RoundTracker: the rank-0 data path's rounds are read in order, each after the previous ack."""

from __future__ import annotations

import pytest

from async_grpo.batching.batcher_messages import ExperienceBatcherError, PromptRequest
from async_grpo.batching.round_tracker import RoundTracker


def test_rounds_open_in_order_each_after_the_previous_ack() -> None:
    rounds = RoundTracker()
    with pytest.raises(ExperienceBatcherError, match="round 1 requested, but the last round read was -1"):
        rounds.open(3, 1)
    rounds.open(3, 0)
    with pytest.raises(ExperienceBatcherError, match="not acknowledged"):
        rounds.open(3, 1)
    with pytest.raises(ExperienceBatcherError, match="ack of round 1"):
        rounds.ack(3, 1, step_retired=False)
    rounds.ack(3, 0, step_retired=False)
    with pytest.raises(ExperienceBatcherError, match="awaiting one is none"):
        rounds.ack(3, 0, step_retired=False)
    rounds.open(3, 1)
    rounds.open(4, 0)  # steps are independent
    rounds.ack(3, 1, step_retired=True)
    rounds.open(3, 0)  # a retired step is forgotten (the batcher refuses its reads itself)


def test_a_round_that_mixes_message_kinds_fails() -> None:
    request = PromptRequest(step=0, count=1, round_index=1)
    RoundTracker.check_kinds(0, 0, [request, request])
    with pytest.raises(ExperienceBatcherError, match="mixes message kinds"):
        RoundTracker.check_kinds(0, 0, [request, object()])  # type: ignore[list-item]
