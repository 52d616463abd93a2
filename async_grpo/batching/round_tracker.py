"""The rank-0 data path's two-phase rounds (data_path.Rank0DataPath), as the batcher checks them.

Per step, rounds 0, 1, ... are read in order, each only after the previous one was acknowledged:
a round is released only to a reader that holds the previous one whole.
"""

from __future__ import annotations

from async_grpo.batching.batcher_messages import BatcherMessage, ExperienceBatcherError


class RoundTracker:
    """Per step: the index of the last round read and whether it was acknowledged."""

    def __init__(self) -> None:
        self._rounds: dict[int, tuple[int, bool]] = {}

    def open(self, step: int, index: int) -> None:
        """Round `index` of `step` is about to be read; raises unless it is the next one and the
        previous one was acknowledged."""
        last, acked = self._rounds.get(step, (-1, True))
        if index != last + 1 or not acked:
            raise ExperienceBatcherError(
                f"step {step}: round {index} requested, but the last round read was {last} "
                f"({'acknowledged' if acked else 'not acknowledged'}); rounds are read in order, each after "
                "the previous one's ack_round")
        self._rounds[step] = (index, False)

    @staticmethod
    def check_kinds(step: int, index: int, messages: list[BatcherMessage]) -> None:
        """Every rank's message of a round has the same kind; raises otherwise."""
        kinds = {type(m).__name__ for m in messages}
        if len(kinds) != 1:
            raise ExperienceBatcherError(f"step {step}: round {index} mixes message kinds {sorted(kinds)} across ranks")

    def ack(self, step: int, index: int, step_retired: bool) -> None:
        """The reader holds round `index` of `step` whole; with `step_retired` (the EndOfStep
        round) the step has nothing more to read and is forgotten."""
        last, acked = self._rounds.get(step, (-1, True))
        if index != last or acked:
            raise ExperienceBatcherError(f"step {step}: ack of round {index}, but the round awaiting one is "
                                         f"{last if not acked else 'none'}")
        if step_retired:
            del self._rounds[step]
        else:
            self._rounds[step] = (index, True)
