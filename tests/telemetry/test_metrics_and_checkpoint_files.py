"""Checkpoint discovery ignores half-written directories; metrics files read and plot; step counts;
metrics and data logs cut back to a resumed step."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from async_grpo.telemetry.metrics import (
    MetricsLogger, StepAccumulator, StepDataLog, eval_series, moving_average, plot_eval_points, plot_reward_curve,
    read_metrics, summarize_reward, truncate_step_records,
)
from async_grpo.trainer.checkpoint import latest_checkpoint
from async_grpo.trainer.fsdp_setup import DistInfo
from sample_processing_utils import Sample, post_process_batch


def _complete(root: Path, step: int) -> Path:
    path = root / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def test_latest_checkpoint_skips_tmp_and_incomplete(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    _complete(tmp_path, 2)
    newest = _complete(tmp_path, 4)
    half_written = tmp_path / "checkpoints" / "step_000006.tmp"
    half_written.mkdir()
    (half_written / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_000008").mkdir()  # no trainer_state.json: never completed
    assert latest_checkpoint(tmp_path) == newest


def test_read_metrics_last_record_per_step_wins_and_plots(tmp_path: Path) -> None:
    lines = [
        {"step": 0, "time_s": 1.0, "reward/mean": 0.1},
        {"step": 1, "time_s": 2.0, "reward/mean": 0.2},
        {"step": 1, "time_s": 9.0, "reward/mean": 0.3},  # a resumed run re-logged step 1
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["reward/mean"] for r in records] == [0.1, 0.3]
    out = plot_reward_curve(tmp_path, tmp_path / "reward.png")
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_moving_average_and_reward_summary_by_hand() -> None:
    assert moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert moving_average([3.0], 10) == [3.0]
    records = [{"step": i, "time_s": 30.0 * i, "reward/mean": r} for i, r in enumerate([0.0, 0.1, 0.5, 0.7, 0.6, 0.9])]
    # 3-step means: 0, .05, .2, .433, .6, .733 -> first >= 0.6 at step 4 (2.0 min).
    line = summarize_reward(records, window=3, target=0.6)
    assert line.startswith("reward 0.200 (mean of steps 0-2) -> 0.733 (mean of the last 3 steps, step 5, 2.5 min)")
    assert line.endswith("first reached 0.6 at step 4 (2.0 min)")
    assert summarize_reward(records, window=3, target=0.95).endswith("never reached 0.95")


def _finalized(acc: StepAccumulator) -> dict[str, float]:
    """The step record of one rank alone (world size 1, one minibatch, nothing dropped)."""
    end = SimpleNamespace(dropped_stale=0, timed_out_prompts=0, oversized_samples=0, num_minibatches=1)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return acc.finalize(dist=dist, end=end, grad_norm=1.0, lr=1e-3, push_s=0.0, step_s=2.0, batcher_stats={})


@pytest.mark.parametrize("share_prompts", [False, True])
def test_step_record_counts_equal_reward_groups_and_samples(share_prompts: bool) -> None:
    # Two groups as the batcher's grpo estimator scores them: one all-wrong (advantage 0),
    # one mixed. Only the mixed group carries a policy-gradient signal.
    rewards_adv = [(0.0, 0.0), (0.0, 0.0), (1.0, 1.0), (0.0, -1.0)]
    samples = [Sample(input_token_ids=[5, 6], output_token_ids=[7] * (i + 1), gt_answer="1", prompt_id=i // 2,
                      sampling_logprobs=[-0.5] * (i + 1), reward=r, advantage=a, weight_version=0)
               for i, (r, a) in enumerate(rewards_adv)]
    batch = post_process_batch(samples, share_prompts)
    acc = StepAccumulator(step=1)
    acc.add_minibatch(samples, batch, torch.zeros(batch.advantages.numel()), 0.5, {})
    record = _finalized(acc)
    assert record["counts/samples"] == 4
    assert record["counts/zero_advantage_samples"] == 2
    assert record["reward/mean"] == 0.25 and record["reward/accuracy"] == 0.25
    assert record["response/length_mean"] == (1 + 2 + 3 + 4) / 4
    # Every sample's prompt and output, also when the stream laid the shared prompt out once.
    assert record["staleness/max"] == 1.0 and record["counts/tokens"] == 4 * 2 + 10


def test_multi_turn_samples_count_written_and_observation_tokens_apart() -> None:
    # Sample 0: 3 sampled + 2 observation + 1 sampled tokens; sample 1: single-turn, 2 tokens.
    samples = [Sample(input_token_ids=[5], output_token_ids=[7, 7, 7, 8, 8, 7], gt_answer="1", prompt_id=0,
                      output_mask=[True, True, True, False, False, True], sampling_logprobs=[-0.5] * 4,
                      reward=1.0, advantage=0.5, weight_version=0),
               Sample(input_token_ids=[5], output_token_ids=[7, 7], gt_answer="1", prompt_id=0,
                      sampling_logprobs=[-0.5] * 2, reward=0.0, advantage=-0.5, weight_version=0)]
    batch = post_process_batch(samples)
    acc = StepAccumulator(step=0)
    acc.add_minibatch(samples, batch, torch.zeros(batch.advantages.numel()), 0.5, {})
    record = _finalized(acc)
    assert record["response/length_mean"] == (4 + 2) / 2
    assert record["response/observation_tokens_mean"] == (2 + 0) / 2
    assert record["multi_turn/observed_frac"] == 1 / 2


def _step_record(reward: float) -> dict[str, float]:
    """The keys MetricsLogger's summary line reads, as every training step has them."""
    return {"reward/mean": reward, "reward/accuracy": reward, "loss/kl": 0.0, "response/length_mean": 2.0,
            "entropy/first_token": 1.0, "timing/step_s": 1.0}


def test_eval_keys_of_some_steps_reach_jsonl_tensorboard_and_the_plot(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    evals = {1: {"eval/accuracy": 0.25, "eval/pass@4": 0.5},
             3: {"eval/accuracy": 0.75, "eval/pass@16": 1.0, "eval/pass@4": 0.875}}
    sink = MetricsLogger(tmp_path, tensorboard=True, progress_total=4, progress_bar=False)
    for step in range(4):
        sink.log(step, {**_step_record(0.1 * step), **evals.get(step, {})})
    sink.close()

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r.get("eval/accuracy") for r in records] == [None, 0.25, None, 0.75]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["eval/accuracy"] == [(1, 0.25), (3, 0.75)]
    assert scalars["eval/pass@4"] == [(1, 0.5), (3, 0.875)] and scalars["eval/pass@16"] == [(3, 1.0)]
    assert [step for step, _ in scalars["reward/mean"]] == [0, 1, 2, 3]

    assert eval_series(records) == ["eval/accuracy", "eval/pass@4", "eval/pass@16"]
    fig, ax = plt.subplots()
    plot_eval_points(ax, [r["step"] for r in records], records)
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    plt.close(fig)
    assert lines == {"eval greedy accuracy": ([1, 3], [0.25, 0.75]), "eval pass@4": ([1, 3], [0.5, 0.875]),
                     "eval pass@16": ([3], [1.0])}
    out = plot_reward_curve(tmp_path, tmp_path / "reward.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert eval_series(records[:1]) == []  # a run without evaluation draws what it drew before


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_truncate_step_records_keeps_earlier_steps_and_drops_a_cut_off_line(tmp_path: Path) -> None:
    path = tmp_path / "data_rank0.jsonl"
    assert truncate_step_records(path, 3) is None  # no file yet: nothing to cut
    records = [{"step": s, "prompt_ids": [s]} for s in (0, 1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 5, "promp')  # killed mid-write
    assert truncate_step_records(path, 3) == records[2]
    assert _lines(path) == records[:3]
    assert not (tmp_path / "data_rank0.jsonl.tmp").exists()
    before = path.read_bytes()
    assert truncate_step_records(path, 10) == records[2] and path.read_bytes() == before
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match="data_rank0.jsonl:2"):
        truncate_step_records(path, 1)


def test_resumed_metrics_logger_cuts_later_steps_and_continues_time(tmp_path: Path) -> None:
    first = MetricsLogger(tmp_path, tensorboard=False, progress_total=6, progress_bar=False)
    for step in range(5):
        first.log(step, _step_record(0.1))
    first.close()
    path = tmp_path / "metrics.jsonl"
    # The crashed run logged steps 0-4; its checkpoint resumes at step 3. Pretend it had run for
    # 100 s, so that a restart of time_s at 0 cannot pass for a continuation.
    crashed = [{**r, "time_s": 100.0 + r["step"]} for r in _lines(path)]
    path.write_text("".join(json.dumps(r) + "\n" for r in crashed))

    resumed = MetricsLogger(tmp_path, tensorboard=False, progress_total=6, progress_start=3,
                            progress_bar=False, resume_step=3)
    for step in (3, 4, 5):
        resumed.log(step, _step_record(0.5))
    resumed.close()
    records = _lines(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["reward/mean"] for r in records] == [0.1] * 3 + [0.5] * 3
    times = [r["time_s"] for r in records]
    assert times[:3] == [100.0, 101.0, 102.0]
    assert 102.0 <= times[3] <= times[4] <= times[5] < 102.0 + 60.0


def test_step_data_log_records_drawn_and_trained_prompts_and_resumes(tmp_path: Path) -> None:
    log = StepDataLog(tmp_path, rank=1)
    log.drawn(0, [7, 3])
    log.drawn(1, [5, 2])  # submitted before step 0 trained (max_lag 1)
    assert not log.path.exists()  # nothing is recorded before a step trains
    log.trained(0, [3, 9, 7, 3])
    log.trained(1, [2, 5])
    assert _lines(log.path) == [{"step": 0, "prompt_ids": [7, 3], "trained_prompt_ids": [3, 3, 7, 9]},
                                {"step": 1, "prompt_ids": [5, 2], "trained_prompt_ids": [2, 5]}]
    assert log.path.name == "data_rank1.jsonl"
    with pytest.raises(KeyError):
        log.trained(1, [2, 5])  # a step is recorded once
    resumed = StepDataLog(tmp_path, rank=1, resume_step=1)
    assert len(_lines(log.path)) == 1
    resumed.drawn(1, [5, 2])
    resumed.trained(1, [5])
    assert [r["trained_prompt_ids"] for r in _lines(log.path)] == [[3, 3, 7, 9], [5]]


def test_step_accumulator_lists_the_trained_prompt_ids() -> None:
    samples = [Sample(input_token_ids=[5, 6], output_token_ids=[7], gt_answer="1", prompt_id=p,
                      sampling_logprobs=[-0.5], reward=0.0, advantage=0.0, weight_version=0) for p in (4, 2, 4)]
    batch = post_process_batch(samples)
    acc = StepAccumulator(step=0)
    acc.add_minibatch(samples, batch, torch.zeros(batch.advantages.numel()), 0.0, {})
    acc.add_minibatch(samples[:1], post_process_batch(samples[:1]), torch.zeros(1), 0.0, {})
    assert acc.trained_prompt_ids == [4, 2, 4, 4]


def test_step_record_token_means_of_the_loss_and_mismatch_metrics() -> None:
    """Two minibatches of 2 and 6 output tokens: the step's value is the token-weighted mean."""
    def minibatch(n_out: int) -> tuple[list[Sample], object]:
        samples = [Sample(input_token_ids=[5], output_token_ids=[7] * n_out, gt_answer="1",
                          sampling_logprobs=[-0.5] * n_out, weight_version=0)]
        return samples, post_process_batch(samples)

    acc = StepAccumulator(step=0)
    for n_out, weight, masked, kl in ((2, 1.0, 0.0, 0.2), (6, 0.5, 0.5, 0.6)):
        samples, batch = minibatch(n_out)
        acc.add_minibatch(samples, batch, torch.zeros(n_out), 0.0,
                          {"mismatch/is_weight_mean": weight, "mismatch/masked_frac": masked, "mismatch/kl": kl})
    end = SimpleNamespace(dropped_stale=0, timed_out_prompts=0, oversized_samples=0, num_minibatches=2)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    record = acc.finalize(dist=dist, end=end, grad_norm=1.0, lr=1e-3, push_s=0.0, step_s=1.0, batcher_stats={})
    assert record["mismatch/is_weight_mean"] == pytest.approx((2 * 1.0 + 6 * 0.5) / 8)
    assert record["mismatch/masked_frac"] == pytest.approx(6 * 0.5 / 8)
    assert record["mismatch/kl"] == pytest.approx((2 * 0.2 + 6 * 0.6) / 8)
    assert record["loss/ratio_mean"] == 1.0  # absent from both minibatches' metrics: the default
