"""Sample records and the packed (padding-free) batch layout shared by trainer and logprob worker.

A *sample* is one prompt together with (after generation) one rollout. Minibatches of samples
are packed into a single 1-D token stream: no padding, position ids restarting at 0 for each
sample, so attention never crosses sample boundaries (given `use_cache=False`, see setup_model).

    prompt A | output A | prompt B | output B | ...       input_ids     [T]
    0 1 2 ...  k ...      0 1 2 ...                       position_ids  [T]

Each *sampled* output token is scored by the position before it: `output_indices[i]` is the
stream position whose next-token prediction scores `targets[i]`, listed sample after sample, so
per-output-token tensors line up with the concatenation of every sample's sampled output tokens
(all of `output_token_ids` unless `output_mask` marks some as observation tokens: those are
context, never targets). Every per-output-token tensor below (advantages, logprobs, lengths)
therefore counts sampled tokens, while `num_tokens` (the packed stream) counts every token.

With `share_prompts` the samples of one prompt share it (async_grpo.model.prompt_sharing): the
prompt once, then each answer without its last token (which predicts nothing), positions
continuing the prompt's; the prompt's last position then scores every answer's first token.

    prompt A | a1 a2 | a1' | prompt B | b1 ...            input_ids     [T']
    0 1 2 3    4  5    4     0 1 2 3    4                 position_ids  [T']

The trainer and the logprob worker read the same targets either way; only the stream is shorter.
The batcher's token budgets count samples whole (`Sample.num_tokens`): a shared stream is
never longer than that.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

    from async_grpo.model.prompt_sharing import SharedPromptLayout

IGNORE_INDEX = -100  # the ignore_index of torch's cross-entropy: these positions score nothing


@dataclass(slots=True, frozen=True)
class JudgeUsage:
    """The judge pool's work for one rollout. A group-wise request judges a whole group: each of
    its answers carries an equal share of it, so summing over a step's rollouts gives the step's
    totals whatever the mode."""

    requests: float = 0.0
    """Requests sent, retries included."""
    retries: float = 0.0
    """Of those, requests sent again after a failed attempt."""
    tokens_in: float = 0.0
    """Tokens of the requests, as the judge's tokenizer encoded them (answered attempts only)."""
    tokens_out: float = 0.0
    """Tokens of the judge's replies."""
    latency_s: float = 0.0
    """Seconds from sending the first attempt to the final outcome."""

    def share(self, parts: int) -> JudgeUsage:
        """This usage split evenly over `parts` rollouts (a group-wise request's answers)."""
        return JudgeUsage(*(getattr(self, f.name) / parts for f in fields(self)))

    def plus(self, other: JudgeUsage) -> JudgeUsage:
        return JudgeUsage(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(slots=True)
class Sample:
    """One prompt, and after generation one rollout of it, with everything the trainer needs.

    Built by the dataset (prompt fields only), completed by the generation worker (output,
    reward, advantage, version), then by the logprob worker (ref/old logprobs).
    """

    input_token_ids: list[int]
    """Prompt token ids, length P >= 1."""
    gt_answer: str
    """Ground-truth answer that math-verify compares the completion against."""
    prompt_id: int = -1
    """Index of the prompt in its dataset; rollouts of one prompt share it."""
    group_id: int | None = None
    """The prompt's group: advantages normalise within each (group_id, run_id) pair of a step.
    None means prompt_id (see `group_key`); a dataset may give variants of one problem (e.g. two
    system prompts) one group_id."""
    run_id: int = 0
    """Which run (e.g. sampling variant) of its group the sample belongs to; see group_id."""
    output_token_ids: list[int] = field(default_factory=list)
    """Generated token ids, length O (0 before generation)."""
    output_mask: list[bool] | None = None
    """Multi-turn rollouts: one flag per output token, True where the engine sampled the token,
    False where an environment appended it (observation tokens, exactly as they were appended).
    Only sampled tokens are trained and scored, so every other per-output-token field below
    (sampling/ref/old/teacher logprobs, token_advantages, token_versions) holds one entry per
    *sampled* token (`num_sampled_tokens`). None: every output token was sampled."""
    output_text: str = ""
    """Detokenised completion, kept for logging and failed-sample dumps."""
    sampling_logprobs: list[float] = field(default_factory=list)
    """Log-probability of each output token under the policy that sampled it (vLLM), length O."""
    ref_logprobs: list[float] | None = None
    """Per-output-token logprobs under the reference policy (logprob worker), length O."""
    old_logprobs: list[float] | None = None
    """Per-output-token logprobs under the old policy recomputed by the logprob worker, length O."""
    teacher_logprobs: list[float] | None = None
    """Per-output-token logprobs under the distillation teacher (teacher pool), length O."""
    finish_reason: str = ""
    """'stop' (EOS or stop string) or 'length' (cut off at max_tokens)."""
    truncated: bool = False
    """True when the completion hit max_tokens without finishing."""
    reward: float = 0.0
    """Scalar reward from the verifier."""
    advantage: float = 0.0
    """Advantage of the rollout, set by the batcher's prepare function (algorithm.py)."""
    token_advantages: list[float] | None = None
    """Per-output-token advantages (length O) from a prepare function that gives dense credit;
    when set they replace `advantage` in the loss."""
    weight_version: int = -1
    """Weight version of the generation engine when this rollout started (-1: not generated)."""
    token_versions: list[tuple[int, int]] | None = None
    """Run-length weight versions of the sampled tokens: (version, count) pairs in token order,
    counts summing to `num_sampled_tokens`; a rollout that straddles a weight push has several.
    None: every sampled token came from `weight_version`."""
    reward_failed: bool = False
    """True when verification timed out or could not parse; reward is then 0."""
    reward_masked: bool = False
    """True when scoring failed under a masking policy (RewardConfig.on_function_failure, the
    judge's on_failure): `reward` is then no score, and the batcher leaves the sample out of its
    group's baseline and the loss (counted: reward/masked_samples)."""
    solved: bool | None = None
    """The verdict's own "solved" (math-verify's match, or every reward function's; never the
    format bonus), set by the generation worker; None: not scored (accuracy then reads reward >= 1)."""
    record: dict | None = None
    """The dataset record the prompt came from (all its fields, JSON values), for reward functions."""
    reward_parts: dict[str, float] | None = None
    """Per-reward-function rewards (and named parts) of this rollout, by metric name
    (rewards.combine_scores); None under the default math-verify reward."""
    reward_failure_reasons: list[str] | None = None
    """Why scoring failed: one "<function>/<reason>" per failed reward function (reason: raised,
    bad_return, timeout, crash, rejected), or "math_verify/<reason>" under the default reward
    (timeout, parse_error, verify_error, rejected); None when nothing failed. The batcher counts
    them per step (counts/reward_failures/<function>/<reason>)."""
    judge_usage: JudgeUsage | None = None
    """What judging this rollout cost the judge pool (the batcher sums it per step: judge/*);
    None when the reward names no judge."""

    @property
    def group_key(self) -> tuple[int, int]:
        """(group_id, run_id): the samples whose advantages are computed together."""
        return (self.prompt_id if self.group_id is None else self.group_id, self.run_id)

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens the engine sampled (all of them unless `output_mask` says otherwise)."""
        if self.output_mask is None:
            return len(self.output_token_ids)
        return sum(1 for sampled in self.output_mask if sampled)

    def version_runs(self) -> list[tuple[int, int]]:
        """The sampled tokens as (version, count) runs: token_versions, else one run of weight_version."""
        if self.token_versions is not None:
            return list(self.token_versions)
        n = self.num_sampled_tokens
        return [(self.weight_version, n)] if n else []

    def oldest_version(self) -> int:
        """The oldest weight version that sampled any of its tokens (weight_version without tokens):
        what staleness, max_lag and the drop rules count from."""
        return min((version for version, _ in self.version_runs()), default=self.weight_version)

    def newest_version(self) -> int:
        """The newest weight version that sampled any of its tokens (weight_version without tokens)."""
        return max((version for version, _ in self.version_runs()), default=self.weight_version)

    def token_staleness(self, current_version: int) -> tuple[int, int]:
        """(sum over sampled tokens of current_version - token's version, number of sampled tokens)."""
        runs = self.version_runs()
        return sum((current_version - version) * count for version, count in runs), sum(count for _, count in runs)

    @property
    def num_tokens(self) -> int:
        """Tokens this sample occupies in a packed batch (prompt + output)."""
        return len(self.input_token_ids) + len(self.output_token_ids)

    def validate_generated(self) -> None:
        """Raise ValueError if the per-output-token fields disagree in length."""
        if not self.output_token_ids:
            raise ValueError(f"sample prompt_id={self.prompt_id} has no output tokens")
        if self.output_mask is not None and len(self.output_mask) != len(self.output_token_ids):
            raise ValueError(
                f"sample prompt_id={self.prompt_id}: output_mask has {len(self.output_mask)} entries "
                f"for {len(self.output_token_ids)} output tokens"
            )
        n = self.num_sampled_tokens
        if n == 0:
            raise ValueError(f"sample prompt_id={self.prompt_id} has no sampled output tokens")
        for name in ("sampling_logprobs", "ref_logprobs", "old_logprobs", "teacher_logprobs", "token_advantages"):
            values = getattr(self, name)
            if values is not None and len(values) not in (0, n):
                raise ValueError(
                    f"sample prompt_id={self.prompt_id}: {name} has {len(values)} entries "
                    f"for {n} sampled output tokens"
                )
        if self.token_versions is not None and sum(count for _, count in self.token_versions) != n:
            raise ValueError(
                f"sample prompt_id={self.prompt_id}: token_versions cover "
                f"{sum(count for _, count in self.token_versions)} tokens for {n} sampled output tokens"
            )


INITIAL_WEIGHT_VERSION = -1
"""Weight version of a worker that still serves the checkpoint it loaded (no push applied)."""


@dataclass(slots=True)
class TokenLogprobs:
    """A logprob worker's answer for one sample: per-output-token logprobs, and the weight version
    of the model that computed them, which the batcher checks as it checks rollouts' versions."""

    weight_version: int
    """INITIAL_WEIGHT_VERSION for the loaded checkpoint (reference logprobs), else a pushed version."""
    values: list[float]
    """One logprob per sampled output token (Sample.num_sampled_tokens), in order."""


@dataclass(slots=True)
class LogprobInput:
    """The model inputs that score one or more packed samples (see module docstring)."""

    input_ids: torch.Tensor
    """[T] int64 packed token ids."""
    position_ids: torch.Tensor
    """[T] int64 positions: restarting at 0 for each sample, or (shared_prompts) for each prompt,
    an answer's continuing its prompt's."""
    output_indices: torch.Tensor
    """[O] int64: for each sampled output token, in sample order, the stream position that predicts it
    (with shared_prompts, a prompt's last position once per answer)."""
    targets: torch.Tensor
    """[O] int64: the sampled output tokens, in the same order."""
    output_lengths: list[int]
    """Sampled output token count of each sample (Sample.num_sampled_tokens), in order; sums to O."""
    shared_prompts: SharedPromptLayout | None = None
    """How the stream's answers share their prompts; None: every sample packed whole."""


@dataclass(slots=True)
class PackedBatch:
    """A packed minibatch ready for the GRPO loss. O = total sampled output tokens in the batch."""

    inputs: LogprobInput
    advantages: torch.Tensor
    """[O] float32, each sample's advantage broadcast over its output tokens (or its
    token_advantages where it has them)."""
    output_lengths: torch.Tensor
    """[O] float32, each sample's sampled output length broadcast over its sampled tokens."""
    output_lengths_per_sample: torch.Tensor
    """[num_samples] float32, each sample's sampled output length."""
    sample_index: torch.Tensor
    """[O] int64, the index (within this batch) of the sample each output token belongs to."""
    sampling_logprobs: torch.Tensor
    """[O] float32 logprobs from the sampling engine."""
    ref_logprobs: torch.Tensor | None
    """[O] float32 reference-policy logprobs, or None when no sample carries them."""
    old_logprobs: torch.Tensor | None
    """[O] float32 old-policy logprobs, or None when no sample carries them."""
    token_versions: torch.Tensor
    """[O] int64, the weight version that sampled each output token (Sample.token_versions, else
    its weight_version): the loss weighs tokens older than the trainer's weights (grpo_loss)."""
    num_samples: int
    num_tokens: int
    """T, real tokens in the packed stream (there is no padding)."""


def _scored_positions(sample: Sample, prompt_end: int, answer_start: int) -> list[tuple[int, int]]:
    """(stream position that predicts it, token) for each sampled output token of `sample`.

    prompt_end: the stream position of the prompt's last token, which predicts the first output
    token; answer_start: where the output's tokens begin, each predicting the next. Observation
    tokens (output_mask False) stay in the stream as context for the tokens after them, but the
    policy did not choose them, so they are never a target."""
    mask = sample.output_mask
    return [(prompt_end if j == 0 else answer_start + j - 1, token)
            for j, token in enumerate(sample.output_token_ids) if mask is None or mask[j]]


def get_input_for_logprobs(samples: Sequence[Sample], share_prompts: bool = False) -> LogprobInput:
    """Pack samples into one token stream (see the module docstring), each sample whole with its
    positions restarting at 0, or with share_prompts each distinct prompt once before its answers.

    The trainer and the logprob worker both call this, so both score exactly the same tokens.
    """
    if not samples:
        raise ValueError("get_input_for_logprobs needs at least one sample")
    for sample in samples:
        if not sample.input_token_ids:
            raise ValueError(f"sample prompt_id={sample.prompt_id} has an empty prompt")
    if share_prompts:
        return _shared_prompt_input(samples)
    ids: list[int] = []
    positions: list[int] = []
    scored: list[tuple[int, int]] = []
    for sample in samples:
        sequence = list(sample.input_token_ids) + list(sample.output_token_ids)
        answer_start = len(ids) + len(sample.input_token_ids)
        scored.extend(_scored_positions(sample, answer_start - 1, answer_start))
        ids.extend(sequence)
        positions.extend(range(len(sequence)))
    return _logprob_input(ids, positions, scored, samples, None)


def _shared_prompt_input(samples: Sequence[Sample]) -> LogprobInput:
    """get_input_for_logprobs with share_prompts: one block per distinct prompt (in order of first
    appearance), its answers after it in sample order; targets still in sample order."""
    from async_grpo.model.prompt_sharing import PromptBlock, SharedPromptLayout

    members: dict[tuple[int, ...], list[int]] = {}
    for index, sample in enumerate(samples):
        members.setdefault(tuple(sample.input_token_ids), []).append(index)
    ids: list[int] = []
    positions: list[int] = []
    scored_by_sample: list[list[tuple[int, int]]] = [[] for _ in samples]
    blocks = []
    for prompt, indices in members.items():
        start, prompt_length = len(ids), len(prompt)
        ids.extend(prompt)
        positions.extend(range(prompt_length))
        branch_lengths = []
        for index in indices:
            branch = samples[index].output_token_ids[:-1]  # the last output token predicts nothing
            scored_by_sample[index] = _scored_positions(samples[index], start + prompt_length - 1, len(ids))
            ids.extend(branch)
            positions.extend(range(prompt_length, prompt_length + len(branch)))
            branch_lengths.append(len(branch))
        blocks.append(PromptBlock(start=start, prompt_length=prompt_length, branch_lengths=tuple(branch_lengths)))
    scored = [pair for pairs in scored_by_sample for pair in pairs]
    return _logprob_input(ids, positions, scored, samples, SharedPromptLayout(blocks=tuple(blocks)))


def _logprob_input(ids: list[int], positions: list[int], scored: list[tuple[int, int]], samples: Sequence[Sample],
                   layout: SharedPromptLayout | None) -> LogprobInput:
    import torch

    return LogprobInput(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
        output_indices=torch.tensor([position for position, _ in scored], dtype=torch.long),
        targets=torch.tensor([token for _, token in scored], dtype=torch.long),
        output_lengths=[sample.num_sampled_tokens for sample in samples],
        shared_prompts=layout,
    )


def _concat_optional(samples: Sequence[Sample], name: str) -> torch.Tensor | None:
    """Concatenate a per-output-token list field, or None if no sample has it.

    Mixing samples with and without the field is an error: a silent partial tensor would
    misalign every token after the gap.
    """
    import torch

    values = [getattr(s, name) for s in samples]
    present = [v is not None and len(v) > 0 for v in values]
    if not any(present):
        return None
    if not all(present):
        missing = [s.prompt_id for s, p in zip(samples, present) if not p]
        raise ValueError(f"{name} missing for samples with prompt_id {missing} but set for others")
    return torch.tensor([x for v in values for x in v], dtype=torch.float32)


def _token_advantages(samples: Sequence[Sample]) -> torch.Tensor:
    """[O]: each sample's token_advantages, or its scalar advantage repeated over its tokens."""
    import torch

    values: list[float] = []
    for s in samples:
        if s.token_advantages is not None:
            values.extend(s.token_advantages)
        else:
            values.extend([s.advantage] * s.num_sampled_tokens)
    return torch.tensor(values, dtype=torch.float32)


def _token_versions(samples: Sequence[Sample]) -> torch.Tensor:
    """[O] int64: each sampled token's weight version, expanded from the samples' (version, count) runs."""
    import torch

    versions: list[int] = []
    for s in samples:
        for version, count in s.version_runs():
            versions.extend([version] * count)
    return torch.tensor(versions, dtype=torch.long)


def post_process_batch(samples: Sequence[Sample], share_prompts: bool = False) -> PackedBatch:
    """Build the packed GRPO minibatch: inputs (get_input_for_logprobs) plus per-output-token
    broadcasts of constants."""
    import torch

    for sample in samples:
        sample.validate_generated()
    inputs = get_input_for_logprobs(samples, share_prompts)
    lengths = torch.tensor(inputs.output_lengths, dtype=torch.long)
    sample_index = torch.repeat_interleave(torch.arange(len(samples)), lengths)
    sampling = _concat_optional(samples, "sampling_logprobs")
    if sampling is None:
        raise ValueError("post_process_batch: samples carry no sampling_logprobs")
    return PackedBatch(
        inputs=inputs,
        advantages=_token_advantages(samples),
        output_lengths=lengths.to(torch.float32)[sample_index],
        output_lengths_per_sample=lengths.to(torch.float32),
        sample_index=sample_index,
        sampling_logprobs=sampling,
        ref_logprobs=_concat_optional(samples, "ref_logprobs"),
        old_logprobs=_concat_optional(samples, "old_logprobs"),
        token_versions=_token_versions(samples),
        num_samples=len(samples),
        num_tokens=int(inputs.input_ids.numel()),
    )


def split_per_sample(values: torch.Tensor, output_lengths: Sequence[int]) -> list[list[float]]:
    """Split a [O] per-output-token tensor back into one list per sample."""
    import torch

    return [chunk.tolist() for chunk in torch.split(values.detach().float().cpu(), list(output_lengths))]
