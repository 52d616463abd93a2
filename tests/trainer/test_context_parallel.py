"""Context parallelism (async_grpo/model/context_parallel.py) on real gloo ranks: each minibatch's
tokens split over a group of 2 ranks (Ulysses attention, zigzag shares) against the same
minibatches unsplit, fp32: the loss within 1e-6 relative, every parameter's gradient within 1e-5
of its largest entry, for GRPO, GSPO, Dr. GRPO, token- and sample-level aggregation, with KL,
importance weights and stale tokens, with LoRA, on a model with fewer key/value heads than ranks.
The split logprobs are also checked against a hand-written per-sample forward, and GSPO's loss
against a hand-written per-sample GSPO; GSPO with its per-sample sums left unreduced must fail.

    .venv/bin/python -m pytest tests/trainer/test_context_parallel.py -q

The ranks are forked from the rank server (support.forked_ranks); the worker is
tests/programs/context_parallel_worker.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from async_grpo.model.context_parallel import kv_repeat, zigzag_positions
from sample_processing_utils import Sample
from support.context_parallel_parity import (
    CASES, GRAD_RTOL, GSPO, LOGPROB_ATOL, LOSS_RTOL, PASSING, SHAPES, SHAPES_FLAT, WORKER, case_result,
    check_loss_and_gradients, grad_error, minibatches, parity_samples, per_sample_logprobs, relative, write_gqa_model,
    write_spec,
)
from support.forked_ranks import run_ranks
from support.lora_adapters import reference_peft

LAUNCH_TIMEOUT_S = 600
DP_CASES = ("grpo", "gspo")


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory) -> Path:
    return write_gqa_model(tmp_path_factory.mktemp("tiny-qwen2-mqa"))


def _launch(root: Path, models: dict[str, Path], samples: list[Sample], group_minibatches: list, cases: list[dict],
            context_parallel: int, world_size: int) -> Path:
    out = root / f"out-{world_size}"
    args = write_spec(out, models, samples, group_minibatches, cases, context_parallel)
    run_ranks(WORKER, args, world_size, LAUNCH_TIMEOUT_S)
    return out


@pytest.fixture(scope="module")
def samples(gqa_model_dir: Path) -> list[Sample]:
    return parity_samples(gqa_model_dir, copies=2)


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory, gqa_model_dir: Path, sliding_model_dir: Path, samples: list[Sample]) -> dict:
    """2 ranks, one group of 2: every case."""
    root = tmp_path_factory.mktemp("context-parallel")
    adapter = root / "adapter"  # nonzero: a fresh adapter's zero lora_B would leave lora_A without gradient
    reference_peft(gqa_model_dir).save_pretrained(str(adapter))
    models = {"gqa": gqa_model_dir, "sliding": sliding_model_dir, "adapter": adapter}
    out = _launch(root, models, samples, [minibatches()], CASES, context_parallel=2, world_size=2)
    return {"out": out, "samples": samples[:len(SHAPES_FLAT)], "model_dir": gqa_model_dir}


@pytest.fixture(scope="module")
def dp_cp_run(tmp_path_factory, gqa_model_dir: Path, samples: list[Sample]) -> dict:
    """4 ranks, 2 groups of 2 on different minibatches: FSDP over all 4 adds each group's once."""
    root = tmp_path_factory.mktemp("context-parallel-dp")
    groups = [minibatches(), minibatches(offset=len(SHAPES_FLAT))]
    cases = [case for case in CASES if case["name"] in DP_CASES]
    return {"out": _launch(root, {"gqa": gqa_model_dir}, samples, groups, cases, context_parallel=2, world_size=4)}


def _result(run: dict, name: str) -> dict:
    return case_result(run["out"], name)


@pytest.mark.distributed
@pytest.mark.parametrize("name", PASSING)
def test_split_loss_and_gradients_equal_unsplit(cp_run: dict, name: str) -> None:
    check_loss_and_gradients(_result(cp_run, name), name)


@pytest.mark.distributed
@pytest.mark.parametrize("name", DP_CASES)
def test_two_groups_loss_and_gradients_equal_unsplit(dp_cp_run: dict, name: str) -> None:
    check_loss_and_gradients(_result(dp_cp_run, name), name)


@pytest.mark.distributed
@pytest.mark.parametrize("name", PASSING)
def test_split_metrics_equal_unsplit(cp_run: dict, name: str) -> None:
    result = _result(cp_run, name)
    for split, unsplit in zip(result["split"]["metrics"], result["unsplit"]["metrics"], strict=True):
        assert split.keys() == unsplit.keys()
        for key, value in unsplit.items():
            assert math.isclose(split[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, split[key], value)


@pytest.mark.distributed
def test_split_logprobs_equal_a_per_sample_forward(cp_run: dict) -> None:
    got = torch.cat(_result(cp_run, "grpo")["split"]["logprobs"])  # the minibatches hold the samples in order
    expected = torch.cat(per_sample_logprobs(cp_run["model_dir"], cp_run["samples"]))
    assert (got - expected).abs().max() <= LOGPROB_ATOL


def _hand_gspo_loss(samples: list[Sample], logprobs: list[torch.Tensor]) -> float:
    """GSPO by hand, sample by sample: s = exp(mean(log pi - log pi_old)), -min(s A, clip(s) A) and
    the k3 KL per token, each sample's token mean, summed."""
    total = 0.0
    for sample, lp in zip(samples, logprobs):
        old, ref = torch.tensor(sample.old_logprobs), torch.tensor(sample.ref_logprobs)
        ratio = torch.exp((lp - old).mean())
        clipped = ratio.clamp(1 - GSPO["seq_clip_low"], 1 + GSPO["seq_clip_high"])
        pg = -torch.minimum(ratio * sample.advantage, clipped * sample.advantage)
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        total += float((pg + GSPO["kl_coef"] * kl).mean())
    return total


@pytest.mark.distributed
def test_split_gspo_loss_equals_a_hand_written_one(cp_run: dict) -> None:
    split = _result(cp_run, "gspo")["split"]
    logprobs = torch.cat(split["logprobs"]).split([len(s.output_token_ids) for s in cp_run["samples"]])
    assert relative(split["loss"], _hand_gspo_loss(cp_run["samples"], list(logprobs))) <= LOSS_RTOL


@pytest.mark.distributed
def test_gspo_without_the_groups_sums_is_caught(cp_run: dict) -> None:
    """The check can fail: GSPO's sequence ratio from one rank's tokens alone is another loss."""
    result = _result(cp_run, "gspo_unreduced")
    error, _ = grad_error(result["split"]["grads"], result["unsplit"]["grads"])
    assert error > 100 * GRAD_RTOL


def test_zigzag_shares_and_head_repeats() -> None:
    shares = zigzag_positions(10, 2)  # chunks of 3, 3, 2, 2
    assert [s.tolist() for s in shares] == [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]
    assert sorted(torch.cat(zigzag_positions(37, 4)).tolist()) == list(range(37))
    assert (kv_repeat(14, 2, 2), kv_repeat(4, 1, 2), kv_repeat(14, 2, 7), kv_repeat(8, 8, 4)) == (1, 2, 7, 1)
    with pytest.raises(ValueError, match="not divisible"):
        kv_repeat(14, 2, 4)


def test_context_parallel_at_load_the_group_budget_and_what_is_refused() -> None:
    from async_grpo.batching.batcher_config import ExperienceConfig
    from async_grpo.data.dataset import DatasetConfig
    from async_grpo.config.sampling import SamplingConfig
    from async_grpo.trainer.config import TrainerConfig
    from setup_model import LoraConfig, ModelConfig
    from trainer_core import make_batcher_config

    assert ModelConfig(model_path="m").context_parallel == 1
    with pytest.raises(ValueError, match="share_prompts cannot run with context_parallel > 1"):
        ModelConfig(model_path="m", context_parallel=2, share_prompts=True)
    with pytest.raises(ValueError, match="context parallelism needs ModelConfig.attn_implementation"):
        ModelConfig(model_path="m", context_parallel=2, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="must be >= 1"):
        ModelConfig(model_path="m", context_parallel=0)

    def config(cp: int, budget: int = 64, **overrides) -> TrainerConfig:
        sampling = SamplingConfig(max_tokens=80, drop_zero_variance_groups=overrides.pop("dynamic", False))
        experience = ExperienceConfig(max_tokens_per_gpu=budget, sampling=sampling)
        model = ModelConfig(model_path="m", context_parallel=cp, lora=overrides.pop("lora", LoraConfig()))
        return TrainerConfig(model=model, data=DatasetConfig(path="d.jsonl", max_prompt_tokens=20),
                             experience=experience, **overrides)

    # A 100-token sample: over one rank's 64, within a group of two's 128.
    with pytest.raises(ValueError, match=r"max_tokens_per_gpu=64 is below .* = 100"):
        config(1)
    batcher = make_batcher_config(config(2), world_size=4)
    assert (batcher.context_parallel, batcher.groups, batcher.group_tokens) == (2, 2, 128)
    with pytest.raises(ValueError, match=r"max_tokens_per_gpu x model.context_parallel = 40 x 2 = 80 is below .*"
                                         r"raise max_tokens_per_gpu to at least 50"):
        config(2, budget=40)
    refused = {"data_path=rank0": dict(data_path="rank0"), "resume": dict(resume=True),
               "model.lora": dict(lora=LoraConfig(r=4)),
               "sampling.drop_zero_variance_groups": dict(dynamic=True)}
    for name, overrides in refused.items():
        with pytest.raises(ValueError, match=f"TrainerConfig.{name} does not run with model.context_parallel=2 yet"):
            config(2, **overrides)
        config(1, budget=100, **overrides)  # each is fine without context parallelism


def test_world_size_must_be_a_multiple_of_context_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    from async_grpo.trainer.fsdp_setup import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="context_parallel=2 must divide the trainer's 3 ranks"):
        init_distributed(context_parallel=2)


def test_each_output_token_is_scored_by_exactly_one_rank_in_output_order() -> None:
    """local_batch (the loss's tensors) and ContextShard.scored_here (the model's rows) agree,
    and the group's shares partition the minibatch's output tokens."""
    from async_grpo.model.context_parallel import ContextGroup, local_batch, shard_stream
    from sample_processing_utils import post_process_batch

    samples = [Sample(input_token_ids=[1] * prompt, output_token_ids=list(range(2, 2 + output)), gt_answer="",
                      sampling_logprobs=[0.0] * output, advantage=1.0)
               for prompt, output in SHAPES[0] + SHAPES[2]]
    batch = post_process_batch(samples)
    order = torch.arange(batch.advantages.numel(), dtype=torch.float32)
    batch.advantages = order  # each output token's index, to follow it through the split
    seen = []
    for rank in range(2):
        group = ContextGroup(size=2, rank=rank, all_to_all=lambda chunks, rows: chunks, sum_over_group=lambda t: t)
        mine = local_batch(batch, group)
        scored, rows = shard_stream(batch.inputs.position_ids, group, {}).scored_here(batch.inputs.output_indices)
        assert torch.equal(mine.advantages, order[scored])
        assert torch.equal(shard_stream(batch.inputs.position_ids, group, {}).positions[rows],
                           batch.inputs.output_indices[scored])
        seen.append(mine.advantages)
    assert sorted(torch.cat(seen).tolist()) == order.tolist() and all(part.numel() for part in seen)
