"""PromptFeeder: each step's prompts, drawn from this rank's shard of the data and submitted to
the batcher in step order, each step once, as soon as published weights are recent enough for it
(`last_step_to_submit`: step s needs weights of version >= s - max_lag).

trainer_core submits through it after every push (and the first steps at start), and answers the
batcher's PromptRequests (dynamic sampling) with `submit_extra`; a checkpoint saves
`resume_state`, where a resumed run's sampler starts.

With context parallelism every rank of a group draws the group's prompts (so their samplers stay
in step), and only the group's first rank submits and records them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_grpo.batching.batcher_messages import PromptRequest
from async_grpo.telemetry.metrics import StepDataLog
from async_grpo.trainer.config import TrainerConfig
from async_grpo.trainer.data_path import PerRankDataPath, Rank0DataPath
from async_grpo.trainer.distributed_sampler import InfiniteDistributedSampler
from async_grpo.trainer.fsdp_setup import DistInfo


def last_step_to_submit(published_version: int, config: TrainerConfig) -> int:
    """The last step whose prompts may be generated once weights `published_version` are
    published: step s needs a version >= s - max_lag (capped at the run's last step)."""
    return min(published_version + config.experience.max_lag, config.num_steps - 1)


class PromptFeeder:
    """Draws each step's prompts from this rank's shard (its group's, under context parallelism)
    and submits them to the batcher, in step order, each step once."""

    def __init__(self, sampler: InfiniteDistributedSampler, data_path: PerRankDataPath | Rank0DataPath,
                 config: TrainerConfig, dist: DistInfo, first_step: int, data_log: StepDataLog | None = None) -> None:
        self._sampler = sampler
        self._data_path = data_path
        self._per_rank = config.prompts_per_rank
        self._submits = dist.leads_group
        self._data_log = data_log if data_log is not None else StepDataLog(Path(config.run_dir), dist.rank)
        """Told the prompts of each submitted step; run_step records them once the step trains."""
        self.sampler_state_at_step: dict[int, dict[str, Any]] = {}
        self._extra_draws: list[tuple[int, tuple[int, int]]] = []
        """(step, (epoch, position)) of every extra prompt drawn for dynamic sampling."""
        self.next_step = first_step
        """The first step whose prompts are not submitted yet."""

    def submit_through(self, last_step: int) -> None:
        """Submit the prompts of every step not submitted yet, up to and including last_step."""
        while self.next_step <= last_step:
            self._submit(self.next_step)
            self.next_step += 1

    def _submit(self, step: int) -> None:
        self.sampler_state_at_step[step] = self._sampler.state_dict()
        indices = self._sampler.next_batch(self._per_rank)
        if self._submits:
            self._data_path.submit_prompts(step, indices)
            self._data_log.drawn(step, indices)

    def submit_extra(self, request: PromptRequest) -> None:
        """Draw and submit the extra prompts a step asks for (dynamic sampling). They come from the
        data order now, possibly after later steps' prompts: `resume_state` accounts for that."""
        drawn = self._sampler.next_drawn(request.count)
        self._extra_draws.extend((request.step, where) for _, where in drawn)
        indices = [index for index, _ in drawn]
        if self._submits:
            self._data_path.submit_prompts(request.step, indices, request.round_index)
            self._data_log.drawn_more(request.step, indices)

    def resume_state(self, step: int) -> dict[str, Any]:
        """Sampler state for a run resuming at `step`: where step's prompts were drawn from, passing
        over the extra prompts that steps before it drew later (they have trained)."""
        base = self.sampler_state_at_step.get(step, self._sampler.state_dict())
        trained_extras = [where for extra_step, where in self._extra_draws if extra_step < step]
        return InfiniteDistributedSampler.with_skipped(base, trained_extras)
