"""Experience batcher: prompts in from every trainer rank, token-budgeted minibatches out.

One batcher actor serves all trainer ranks. Each rank hands over its prompts for a step, then
pulls messages until that step's `EndOfStep`:

    batcher = get_or_create_batcher(config)
    ray.get(batcher.submit_prompts.remote(rank, step, prompts))
    while isinstance(msg := ray.get(batcher.next_message.remote(rank, step)), Minibatch):
        loss, _ = grpo_loss(logprobs, post_process_batch(msg.samples), loss_config)
        (loss * msg.loss_weight).backward()  # padding minibatches have loss_weight 0
    # msg is EndOfStep: divide gradients by msg.num_samples (the step total over all ranks)

Inside, every prompt runs as its own task the moment its rank submits it: n rollouts from the
generation registry, then (optionally) one logprob request per rollout, all concurrent
(rollout_fetcher.py). Finished groups are prepared (group_preparer.py: advantages) and packed by
`MinibatchPacker` (minibatch_packer.py), and a minibatch is sent to its rank as soon as it is
closed, so trainers start on a step while its slowest prompts are still generating. A step ends
when every rank has submitted and every prompt has finished or hit its deadline; then the open
minibatches are flushed, all ranks are padded to the same number of minibatches (FSDP ranks must
run the same number of forward/backward passes, or their collectives deadlock) and each rank gets
the step's `EndOfStep` (batcher_messages.py). Rollouts never disappear without a count: stale,
timed-out, oversized and missing rollouts are all reported in `EndOfStep` and `stats()`
(step_stats.py).

With context parallelism (BatcherConfig.context_parallel = cp > 1) a group of cp consecutive
ranks is one consumer: its first rank submits the group's prompts, the packer cuts minibatches of
up to cp x max_tokens_per_gpu tokens per group, and each rank of the group receives the same
message stream (the ranks then split each minibatch's tokens among themselves).

Benchmark of the packing alone: `python -m benchmarks.batcher`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.actor import ActorHandle

from async_grpo.algo.algorithm import KLSchedule
from async_grpo.batching.batcher_config import BatcherConfig
from async_grpo.batching.batcher_messages import (
    BatcherMessage, EndOfStep, ExperienceBatcherError, Minibatch, PromptRequest, RankMailboxes,
)
from async_grpo.batching.group_preparer import GroupPreparer
from async_grpo.batching.minibatch_packer import MinibatchPacker, record_packing
# RayRegistryClient is not used here: trainer_core and benchmarks/scale.py import it from this module.
from async_grpo.batching.rollout_fetcher import (  # noqa: F401
    LogprobField, PromptRollouts, RayRegistryClient, RequestClient, RolloutFetcher,
)
from async_grpo.batching.round_tracker import RoundTracker
from async_grpo.batching.step_stats import StepStats, mean
from async_grpo.config.actor_names import (
    BATCHER_ACTOR_NAME, GENERATION, LOGPROB, ON_HEAD_NODE, RAY_NAMESPACE, REFERENCE, TEACHER,
)
from async_grpo.launch.ray_env import actor_runtime_env
from async_grpo.config.sampling import SamplingConfig, derive_seed
from sample_processing_utils import Sample
from vllm_registry import BatchedRegistryClient, get_or_create_registry

logger = logging.getLogger(__name__)

# Every rank may be blocked in next_message for several steps at once (async training keeps up to
# max_lag steps open), plus submits and stats calls; a low cap would deadlock those waits.
_ACTOR_MAX_CONCURRENCY = 1024
# stats() keeps this many most recent steps, so a long run does not grow the actor's memory.
_STATS_HISTORY_STEPS = 256

# The Sample field each logprob role's results fill ('none' sends no logprob requests).
_LOGPROB_FIELDS: dict[str, LogprobField] = {"reference": "ref_logprobs", "old_policy": "old_logprobs"}


def step_sampling(sampling: SamplingConfig, step: int) -> SamplingConfig:
    """The sampling settings of one step's requests.

    A seeded config gets the step's own seed, derive_seed(seed, step): the worker derives each
    request's seed from it and the prompt id, so a prompt drawn again at a later step gets fresh
    randomness, and a rerun (or a resumed run) of a step repeats it. Unseeded configs pass as is.
    """
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=derive_seed(sampling.seed, step))


# ---------------------------------------------------------------------------------------------
# The batcher (plain async class) and its Ray shell
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _StepState:
    """Everything the batcher tracks for one open step."""

    packer: MinibatchPacker
    sampling: SamplingConfig
    """What the step's generate requests carry (step_sampling: the step's own seed)."""
    mailboxes: RankMailboxes
    stats: StepStats
    kl_beta: float | None = None
    """beta of the KL in the reward for this step (None: not in the reward)."""
    submitted: set[int] = field(default_factory=set)
    """Groups (consumers: ranks when context_parallel is 1) that have submitted their prompts."""
    round_index: int = 0
    """Resampling round (dynamic sampling): 0 until the step first asks the ranks for more prompts."""
    round_submitted: set[int] = field(default_factory=set)
    """Groups that have submitted their prompts of the current resampling round."""
    target_prompts: int = 0
    """Prompts submitted in round 0: how many informative prompts dynamic sampling aims for."""
    informative_prompts: int = 0
    """Prompts whose groups were kept for training (not all rewards equal)."""
    groups: dict[tuple[int, int], list[Sample]] = field(default_factory=dict)
    """Finished rollouts of each (group_id, run_id) group not released yet."""
    pending_by_key: dict[tuple[int, int], int] = field(default_factory=dict)
    """Prompts still running per group key."""
    prompts_by_key: dict[tuple[int, int], int] = field(default_factory=dict)
    """Prompts submitted per group key (since its last release)."""
    held: list[Sample] = field(default_factory=list)
    """Released groups waiting for a step-scoped prepare function."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    """Running prompt tasks (held so they are not garbage-collected, and cancelled on failure)."""
    pending_prompts: int = 0
    error: ExperienceBatcherError | None = None
    finished: bool = False
    """EndOfStep has been queued for every rank."""
    ended_ranks: set[int] = field(default_factory=set)
    """Ranks that have received EndOfStep; when all have, the step is retired."""

    def record_submit(self, rank: int, count: int, round_index: int, groups: int) -> None:
        """Check and count one submit_prompts call of `count` prompts by a group (its index)."""
        now = time.monotonic()
        if round_index == 0:
            if rank in self.submitted:
                raise ValueError(f"rank {rank} already submitted prompts for step {self.packer.step}")
            if not self.submitted:
                self.stats.first_submit_s = now
            self.submitted.add(rank)
            if len(self.submitted) == groups:
                self.stats.last_submit_s = now
            self.target_prompts += count
        else:
            if round_index != self.round_index or rank in self.round_submitted:
                raise ValueError(f"rank {rank}: unexpected prompts of resampling round {round_index} for step "
                                 f"{self.packer.step} (the step is in round {self.round_index})")
            self.round_submitted.add(rank)
            self.stats.resampled_prompts += count
        self.stats.num_prompts += count

    def all_submitted(self, groups: int) -> bool:
        """Every group has submitted the step's prompts (and those of its current resampling round)."""
        return len(self.submitted) == groups and (self.round_index == 0 or len(self.round_submitted) == groups)

    def record_result(self, key: tuple[int, int], result: PromptRollouts) -> None:
        """Count one finished prompt's rollouts (stale, missing, dropped, timings) and keep its
        fresh ones for its group."""
        stats = self.stats
        stats.finished_prompts += 1
        stats.dropped_stale += result.stale
        stats.dropped_logprob_version += result.dropped_logprob_version
        stats.generate_s += result.generate_s
        stats.logprob_s += result.logprob_s
        stats.teacher_s += result.teacher_s
        stats.missing_rollouts += result.missing
        self.groups.setdefault(key, []).extend(result.fresh)

    def error_copy(self) -> ExperienceBatcherError:
        """A fresh copy of the step's error (re-raising one object would pile up tracebacks)."""
        assert self.error is not None
        error = ExperienceBatcherError(str(self.error))
        error.__cause__ = self.error.__cause__
        return error

    def needs_more_prompts(self, sampling: SamplingConfig) -> bool:
        """Dynamic sampling: fewer informative prompts than submitted, and rounds left."""
        return (sampling.drop_zero_variance_groups and self.informative_prompts < self.target_prompts
                and self.round_index < sampling.max_resample_rounds)


class ExperienceBatcher:
    """Turns prompts from all ranks into per-rank minibatch streams; see the module docstring.

    The step bookkeeping lives here; fetching (RolloutFetcher), preparing (GroupPreparer),
    counting (StepStats) and the rank-0 rounds (RoundTracker) are delegated. Single event loop,
    no locks: state changes happen between awaits only.
    """

    def __init__(self, config: BatcherConfig, generation: RequestClient, logprob: RequestClient | None,
                 reference: RequestClient | None = None, teacher: RequestClient | None = None) -> None:
        experience = config.experience
        if (experience.logprob_role == "none") != (logprob is None):
            raise ValueError(
                f"ExperienceBatcher: logprob_role={experience.logprob_role!r} needs a logprob client exactly "
                "when it is not 'none'"
            )
        if experience.reference_pool != (reference is not None):
            raise ValueError("ExperienceBatcher: reference_pool needs a reference client exactly when it is set")
        if experience.distill.teacher != (teacher is not None):
            raise ValueError("ExperienceBatcher: distill.teacher needs a teacher client exactly when it is set")
        self.config = config
        self._experience = experience
        self._fetcher = RolloutFetcher(
            generation=generation, max_lag=experience.max_lag, logprob=logprob,
            logprob_field=_LOGPROB_FIELDS.get(experience.logprob_role),
            reference=reference, teacher=teacher,
        )
        self._preparer = GroupPreparer(algorithm=experience.algorithm, sampling=experience.sampling,
                                       kl_in_reward=config.kl_in_reward, distill=experience.distill)
        self._kl_schedule = KLSchedule(config.kl_in_reward, experience.max_lag) if config.kl_in_reward else None
        self._steps: dict[int, _StepState] = {}
        self._retired_steps: set[int] = set()
        self._stats: dict[int, StepStats] = {}
        self._rounds = RoundTracker()

    async def submit_prompts(self, rank: int, step: int, samples: list[Sample], round_index: int = 0) -> None:
        """Start generating `rank`'s prompts for `step` (once per rank and step; again once per
        resampling round, with the round a PromptRequest named). With context_parallel > 1 only
        the first rank of each group submits, for its group."""
        state = self._state(rank, step)
        cp = self.config.context_parallel
        if rank % cp:
            raise ValueError(f"rank {rank} submitted prompts, but with context_parallel={cp} only the first rank of "
                             f"each group does ({rank - rank % cp} for this one)")
        state.record_submit(rank // cp, len(samples), round_index, self.config.groups)
        deadline = asyncio.get_running_loop().time() + self._experience.prompt_deadline_s
        for sample in samples:
            key = sample.group_key
            state.pending_by_key[key] = state.pending_by_key.get(key, 0) + 1
            state.prompts_by_key[key] = state.prompts_by_key.get(key, 0) + 1
            state.pending_prompts += 1
            task = asyncio.create_task(self._run_prompt(state, sample, deadline))
            state.tasks.add(task)
            task.add_done_callback(state.tasks.discard)
        if state.all_submitted(self.config.groups):
            for key in [k for k, pending in state.pending_by_key.items() if pending == 0]:
                self._release_group(state, key)
        self._maybe_finish(state)

    def algorithm_state(self, step: int) -> dict[str, Any]:
        """What a run resuming at `step` restores with load_algorithm_state (the KL controller)."""
        return {"kl_schedule": self._kl_schedule.state_for(step)} if self._kl_schedule is not None else {}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        """Restore algorithm_state() of a checkpoint, before the resumed run submits anything."""
        if self._steps:
            raise RuntimeError("load_algorithm_state after steps were submitted")
        if self._kl_schedule is not None and "kl_schedule" in state:
            self._kl_schedule.load_state_dict(state["kl_schedule"])

    async def next_message(self, rank: int, step: int) -> BatcherMessage:
        """Wait for `rank`'s next minibatch of `step`, a PromptRequest (dynamic sampling), or the
        step's EndOfStep after the last minibatch.

        Raises ExperienceBatcherError (carrying the cause) once the step has failed.
        """
        state = self._state(rank, step)
        started = time.monotonic()
        try:
            message = await state.mailboxes.get(rank)
        finally:
            state.stats.rank_wait_s += time.monotonic() - started
        if message is None:
            raise state.error_copy()
        if isinstance(message, EndOfStep):
            state.ended_ranks.add(rank)
            if len(state.ended_ranks) == self.config.world_size:
                del self._steps[step]
                self._retired_steps.add(step)
        return message

    async def next_round(self, step: int, index: int) -> list[BatcherMessage]:
        """The rank-0 data path's read (data_path.Rank0DataPath): the next message of every rank for
        `step`, one per rank in rank order, as round `index` (0, 1, ... per step).

        Two-phase: round index + 1 is refused until round `index` was acknowledged (ack_round), so
        a round is only released to a reader that holds the previous one whole, and a step's
        EndOfStep round comes after every data round of the step was acknowledged. Every rank's
        messages have the same kind in each round (minibatch counts are equal per rank and
        PromptRequests go to all ranks after flush); a round that mixes kinds fails.
        """
        self._rounds.open(step, index)
        messages = list(await asyncio.gather(*(self.next_message(rank, step) for rank in range(self.config.world_size))))
        self._rounds.check_kinds(step, index, messages)
        return messages

    def ack_round(self, step: int, index: int) -> None:
        """The rank-0 reader holds round `index` of `step` whole (see next_round)."""
        self._rounds.ack(step, index, step_retired=step in self._retired_steps)

    def stats(self, step: int | None = None) -> dict[str, float]:
        """Metrics of `step` (an open step reports its progress so far), or with None of the most
        recently completed step; {} when there is no such step (stats keep the last
        _STATS_HISTORY_STEPS steps)."""
        if step is None:
            completed = [s for s in self._stats.values() if s.completed_s]
            if not completed:
                return {}
            stats = max(completed, key=lambda s: s.completed_s)
        elif step in self._stats:
            stats = self._stats[step]
        else:
            return {}
        return {"batcher/step": float(stats.step), **stats.as_metrics(self.config.group_tokens)}

    def _state(self, rank: int, step: int) -> _StepState:
        """The step's state, created on first use; raises if the step cannot be used."""
        if not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank must be in [0, {self.config.world_size}), got {rank}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step in self._retired_steps:
            raise ValueError(f"step {step} is already finished: every rank received its EndOfStep")
        state = self._steps.get(step)
        if state is None:
            state = self._new_state(step)
        if state.error is not None:
            raise state.error_copy()
        return state

    def _new_state(self, step: int) -> _StepState:
        packer = MinibatchPacker(
            step=step,
            world_size=self.config.groups,
            max_tokens_per_gpu=self.config.group_tokens,
            reorder_window=self.config.reorder_window,
        )
        beta = self._kl_schedule.beta_for(step) if self._kl_schedule is not None else None
        state = _StepState(
            packer=packer,
            sampling=step_sampling(self._experience.sampling, step),
            mailboxes=RankMailboxes(self.config.world_size),
            stats=StepStats(step=step, kl_beta=beta),
            kl_beta=beta,
        )
        self._steps[step] = state
        self._stats[step] = state.stats
        while len(self._stats) > _STATS_HISTORY_STEPS:
            del self._stats[min(self._stats)]
        return state

    async def _run_prompt(self, state: _StepState, sample: Sample, deadline: float) -> None:
        """One prompt, start to end: its rollouts reach the packer, or it is counted as timed out,
        or its error fails the step."""
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                result = await self._fetcher.fetch(state.packer.step, sample, state.sampling)
        except TimeoutError as exc:
            # A TimeoutError raised by a registry is an error like any other; only our own
            # deadline (scope.expired()) counts as a timed-out prompt.
            if scope.expired():
                self._count_timeout(state, sample)
            else:
                self._fail(state, sample, exc)
        except Exception as exc:
            self._fail(state, sample, exc)
        else:
            self._accept(state, sample.group_key, result)
        finally:
            state.pending_prompts -= 1
            state.pending_by_key[sample.group_key] -= 1
        try:
            if state.all_submitted(self.config.groups) and state.pending_by_key[sample.group_key] == 0:
                self._release_group(state, sample.group_key)
            self._maybe_finish(state)
        except Exception as exc:  # a prepare function's error fails the step, naming it
            self._fail(state, sample, exc)

    def _accept(self, state: _StepState, key: tuple[int, int], result: PromptRollouts) -> None:
        state.record_result(key, result)
        if result.missing:
            logger.warning(
                "step %d: generate returned %d rollouts short of n=%d for a prompt",
                state.packer.step, result.missing, self._experience.sampling.n,
            )

    def _release_group(self, state: _StepState, key: tuple[int, int]) -> None:
        """A group whose prompts have all finished: drop it (too few scored samples after masking,
        or no reward variance under dynamic sampling: GroupPreparer.admit), hold it (step-scoped
        prepare) or prepare and pack it now."""
        if state.error is not None or state.finished:
            return
        del state.pending_by_key[key]
        prompts = state.prompts_by_key.pop(key)
        samples = state.groups.pop(key, [])
        if not samples:  # every rollout stale, missing or timed out: counted where that happened
            return
        state.stats.record_released(samples)
        if not self._preparer.admit(samples, state.stats):  # too few scored samples, or no reward variance
            return
        state.informative_prompts += prompts
        if self._experience.algorithm.scope == "step":
            state.held.extend(samples)
        else:
            self._prepare_and_pack(state, samples)

    def _prepare_and_pack(self, state: _StepState, samples: list[Sample]) -> None:
        for sample in self._preparer.prepare(samples, state.packer.step, state.kl_beta, state.stats):
            for minibatch in state.packer.add(sample):
                self._deliver(state, minibatch)

    def _deliver(self, state: _StepState, minibatch: Minibatch) -> None:
        if not state.stats.first_minibatch_s:
            state.stats.first_minibatch_s = time.monotonic()
        cp = self.config.context_parallel
        for rank in range(minibatch.rank * cp, (minibatch.rank + 1) * cp):  # minibatch.rank is the group
            state.mailboxes.put(rank, minibatch)

    def _count_timeout(self, state: _StepState, sample: Sample) -> None:
        state.stats.timed_out_prompts += 1
        logger.warning(
            "step %d: prompt_id=%d not finished within prompt_deadline_s=%.1f; cancelled, its rollouts are dropped",
            state.packer.step, sample.prompt_id, self._experience.prompt_deadline_s,
        )

    def _fail(self, state: _StepState, sample: Sample, cause: BaseException) -> None:
        """Record the step's first error, cancel its other prompts and wake every waiting rank."""
        step = state.packer.step
        if state.error is not None:
            logger.warning("step %d: prompt_id=%d also failed: %s: %s", step, sample.prompt_id,
                           type(cause).__name__, cause)
            return
        # The message carries the cause itself: Ray does not pickle __cause__ across processes.
        state.error = ExperienceBatcherError(
            f"step {step} failed: prompt_id={sample.prompt_id}: {type(cause).__name__}: {cause}"
        )
        state.error.__cause__ = cause
        state.stats.failed = True
        logger.error("%s", state.error)
        current = asyncio.current_task()
        for task in state.tasks:
            if task is not current:
                task.cancel()
        state.mailboxes.fail()

    def _request_prompts(self, state: _StepState) -> None:
        """Ask every group for an equal share of the missing informative prompts (rounded up, so
        all groups draw alike and their data orders stay in step)."""
        missing = state.target_prompts - state.informative_prompts
        per_rank = -(-missing // self.config.groups)
        state.round_index += 1
        state.round_submitted = set()
        # Equal minibatch counts first: a rank blocked in a collective of a minibatch its peer
        # does not have yet would never read the request, and the round would never complete.
        for minibatch in state.packer.flush():
            self._deliver(state, minibatch)
        logger.info("step %d: %d of %d prompts informative; resampling round %d asks each rank for %d more",
                    state.packer.step, state.informative_prompts, state.target_prompts, state.round_index, per_rank)
        state.mailboxes.broadcast(PromptRequest(step=state.packer.step, count=per_rank, round_index=state.round_index))

    def _maybe_finish(self, state: _StepState) -> None:
        """Close the step once every rank has submitted and no prompt is running."""
        if state.finished or state.error is not None or state.pending_prompts:
            return
        if not state.all_submitted(self.config.groups):
            return
        if state.needs_more_prompts(self._experience.sampling):
            self._request_prompts(state)
            return
        if state.held:
            held, state.held = state.held, []
            self._prepare_and_pack(state, held)
        state.finished = True
        packer, stats = state.packer, state.stats
        for minibatch in packer.finish():
            self._deliver(state, minibatch)
        record_packing(stats, packer)
        stats.completed_s = time.monotonic()
        end = EndOfStep(**stats.counts())
        if self._kl_schedule is not None:
            self._kl_schedule.record(end.step, mean(stats.kl_sum, stats.kl_samples), stats.kl_samples)
        state.mailboxes.broadcast(end)
        logger.info(
            "step %d complete: %d samples, %d tokens, %d minibatches per rank (%d padding), %d timed-out prompts, "
            "%d stale rollouts dropped",
            end.step, end.num_samples, end.num_tokens, end.num_minibatches, end.padding_minibatches,
            end.timed_out_prompts, end.dropped_stale,
        )



class ExperienceBatcherActor:
    """Thin Ray shell over ExperienceBatcher (async actor; see get_or_create_batcher).

    Registry handles default to the real registries; tests pass stand-ins.
    """

    def __init__(
        self,
        config: BatcherConfig,
        generation_registry: ActorHandle | None = None,
        logprob_registry: ActorHandle | None = None,
        reference_registry: ActorHandle | None = None,
        teacher_registry: ActorHandle | None = None,
    ) -> None:
        if generation_registry is None:
            generation_registry = get_or_create_registry(GENERATION)
        logprob_client: RequestClient | None = None
        if config.experience.logprob_role != "none":
            if logprob_registry is None:
                logprob_registry = get_or_create_registry(LOGPROB)
            logprob_client = BatchedRegistryClient(logprob_registry)
        reference_client: RequestClient | None = None
        if config.experience.reference_pool:
            if reference_registry is None:
                reference_registry = get_or_create_registry(REFERENCE)
            reference_client = BatchedRegistryClient(reference_registry)
        teacher_client: RequestClient | None = None
        if config.experience.distill.teacher:
            if teacher_registry is None:
                teacher_registry = get_or_create_registry(TEACHER)
            teacher_client = BatchedRegistryClient(teacher_registry)
        self._batcher = ExperienceBatcher(config, BatchedRegistryClient(generation_registry), logprob_client,
                                          reference_client, teacher_client)
        self._registries = [r for r in (generation_registry, logprob_registry, reference_registry, teacher_registry)
                            if r is not None]
        self._redispatched_reported = 0

    async def submit_prompts(self, rank: int, step: int, samples: list[Sample], round_index: int = 0) -> None:
        await self._batcher.submit_prompts(rank, step, samples, round_index)

    async def next_message(self, rank: int, step: int) -> Minibatch | EndOfStep | PromptRequest:
        return await self._batcher.next_message(rank, step)

    async def next_round(self, step: int, index: int) -> list[Minibatch | EndOfStep | PromptRequest]:
        return await self._batcher.next_round(step, index)

    async def ack_round(self, step: int, index: int) -> None:
        self._batcher.ack_round(step, index)

    async def algorithm_state(self, step: int) -> dict[str, Any]:
        return self._batcher.algorithm_state(step)

    async def load_algorithm_state(self, state: dict[str, Any]) -> None:
        self._batcher.load_algorithm_state(state)

    async def stats(self, step: int | None = None) -> dict[str, float]:
        """The batcher's step metrics, plus `counts/redispatched_requests`: requests the registries
        re-sent to another worker after theirs died or FAILED, since the previous non-empty stats
        call (the trainer makes one per step)."""
        metrics = self._batcher.stats(step)
        if metrics:
            total = await self._redispatched_total()
            metrics["counts/redispatched_requests"] = float(total - self._redispatched_reported)
            self._redispatched_reported = total
        return metrics

    async def _redispatched_total(self) -> int:
        total = 0
        for registry in self._registries:
            counters = await registry.counters.remote()
            total += counters.get("redispatched_requests", 0)
        return total

    async def config(self) -> BatcherConfig:
        return self._batcher.config


def get_or_create_batcher(
    config: BatcherConfig,
    *,
    generation_registry: ActorHandle | None = None,
    logprob_registry: ActorHandle | None = None,
    reference_registry: ActorHandle | None = None,
    teacher_registry: ActorHandle | None = None,
) -> ActorHandle:
    """The cluster's batcher actor ("experience-batcher" in RAY_NAMESPACE), created on first call.

    Not detached: it lives as long as the trainer process that created it, so a restarted run
    never inherits a previous run's half-finished steps. Raises ValueError if a batcher with a
    different config already exists.
    """
    handle = (
        ray.remote(ExperienceBatcherActor)
        .options(
            name=BATCHER_ACTOR_NAME,
            namespace=RAY_NAMESPACE,
            get_if_exists=True,
            max_concurrency=_ACTOR_MAX_CONCURRENCY,
            num_cpus=0,  # it only awaits other actors; packing costs microseconds per sample
            resources=ON_HEAD_NODE,  # never on a worker node that can be lost mid-run
            runtime_env=actor_runtime_env(),
        )
        .remote(config, generation_registry, logprob_registry, reference_registry, teacher_registry)
    )
    existing = ray.get(handle.config.remote())
    if existing != config:
        raise ValueError(f"{BATCHER_ACTOR_NAME} already exists with a different config: {existing} != {config}")
    return handle
