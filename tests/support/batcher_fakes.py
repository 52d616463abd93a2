"""In-process stand-ins for the batcher's two registries, and the small samples, prompts and config
they work with: the plain ExperienceBatcher tests (tests/batching/test_experience_batcher.py) and
the rank-0 data path's (tests/trainer/test_data_path.py, tests/programs/data_path_worker.py) run the
batcher on them. No Ray here: a Ray test that ships these to workers registers this module for
pickling by value (workers cannot import tests/)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, fields
from typing import Any

from async_grpo.batching.batcher_config import BatcherConfig, ExperienceConfig
from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import Sample, TokenLogprobs

# Upper bound on how long a test waits for something that should happen at once; it keeps a
# broken batcher from hanging the suite and is never what decides a pass.
WAIT_BOUND_S = 60.0
ROLLOUTS_PER_PROMPT = 3  # batcher_config's sampling.n


def fake_sample(prompt_id: int, prompt_len: int, out_len: int = 0, version: int = 0) -> Sample:
    return Sample(
        input_token_ids=[1] * prompt_len,
        gt_answer="4",
        prompt_id=prompt_id,
        output_token_ids=[2] * out_len,
        sampling_logprobs=[-0.5] * out_len,
        weight_version=version,
    )


def fake_output_length(prompt_id: int, index: int) -> int:
    """Output length of rollout `index` of a prompt in the stand-ins (1..11 tokens, varied)."""
    return 1 + (prompt_id * 7 + index * 3) % 11


def fake_logprobs(rollout: Sample) -> list[float]:
    """What the logprob stand-ins answer: a value the test can recompute per token."""
    return [-(rollout.prompt_id + 1) / (k + 1) for k in range(len(rollout.output_token_ids))]


def fake_rollouts(prompt: Sample, n: int, version: int) -> list[Sample]:
    return [
        Sample(
            input_token_ids=list(prompt.input_token_ids),
            gt_answer=prompt.gt_answer,
            prompt_id=prompt.prompt_id,
            output_token_ids=[2] * fake_output_length(prompt.prompt_id, i),
            sampling_logprobs=[-0.5] * fake_output_length(prompt.prompt_id, i),
            advantage=float(i),
            weight_version=version,
        )
        for i in range(n)
    ]


def fake_prompts(ids: range | list[int], prompt_len: int = 4) -> list[Sample]:
    return [fake_sample(pid, prompt_len) for pid in ids]


def batcher_config(**overrides: Any) -> BatcherConfig:
    values: dict[str, Any] = dict(
        world_size=2,
        max_tokens_per_gpu=40,
        prompt_deadline_s=WAIT_BOUND_S,
        sampling=SamplingConfig(n=ROLLOUTS_PER_PROMPT),
        logprob_role="reference",
        max_lag=1,
        reorder_window=0,
    )
    values.update(overrides)
    shared = {f.name for f in fields(ExperienceConfig)}  # the rest are the batcher's own
    experience = ExperienceConfig(**{k: v for k, v in values.items() if k in shared})
    return BatcherConfig(experience=experience, **{k: v for k, v in values.items() if k not in shared})


@dataclass
class FakeGeneration:
    """Generation stand-in: n rollouts per prompt at a chosen weight version, or a failure."""

    version_of: dict[int, int]
    """prompt_id -> weight_version of its rollouts (default 0)."""
    errors: dict[int, BaseException]
    """prompt_id -> exception raised instead of answering."""
    short_by: int = 0
    """Rollouts left out of every answer (a worker returning fewer than n)."""
    pushed_after_first_token: dict[int, int] = field(default_factory=dict)
    """prompt_id -> a version pushed after its rollouts' first token (keep mode): the rest of each
    rollout's tokens carry it (Sample.token_versions)."""

    def __post_init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def submit(self, method: str, *args: Any, cost: int) -> Any:
        assert method == "generate"
        prompt, sampling = args
        self.calls.append((prompt.prompt_id, cost))
        await self.release.wait()
        if prompt.prompt_id in self.errors:
            raise self.errors[prompt.prompt_id]
        rollouts = fake_rollouts(prompt, sampling.n - self.short_by, self.version_of.get(prompt.prompt_id, 0))
        if (pushed := self.pushed_after_first_token.get(prompt.prompt_id)) is not None:
            for r in rollouts:
                rest = len(r.output_token_ids) - 1
                r.token_versions = [(r.weight_version, 1), (pushed, rest)] if rest else None
        return rollouts


class FakeLogprob:
    """Logprob stand-in: `fake_logprobs`, or a wrong-length answer for chosen prompts."""

    def __init__(self, wrong_length_for: set[int] | None = None, reference: bool = True,
                 claimed_version: int | None = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self._wrong = wrong_length_for or set()
        self.reference = reference
        self.claimed_version = claimed_version  # every answer claims these weights (a stale worker)

    async def submit(self, method: str, *args: Any, cost: int) -> list[TokenLogprobs]:
        assert method == "compute_group_logprobs"
        (rollouts,) = args
        assert len({r.prompt_id for r in rollouts}) == 1, "one call per prompt group"
        self.calls.append((rollouts[0].prompt_id, cost))
        values = [fake_logprobs(r) for r in rollouts]
        if rollouts[0].prompt_id in self._wrong:
            values = [v + [0.0] for v in values]
        return [TokenLogprobs(weight_version=self.version_for(r), values=v) for r, v in zip(rollouts, values)]

    def version_for(self, rollout: Sample) -> int:
        """The weights the answer claims: the reference checkpoint's, or the sampler's own."""
        if self.claimed_version is not None:
            return self.claimed_version
        return -1 if self.reference else rollout.weight_version
