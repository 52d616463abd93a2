"""Per-step training records: metrics accumulated on every rank, reduced once, written by rank 0;
and each rank's data log.

One record per step goes to run_dir/metrics.jsonl (and the trackers of metrics.report_to:
TensorBoard, W&B, MLflow, trackio; trackers.py, docs/trackers.md); keys are namespaced
(`reward/mean`, `timing/generate_s`, ...). Steps that ran an evaluation (evaluation.py) also
carry `eval/...` keys. Draw the reward curve of a run (with evaluation points, if any):

    python -m async_grpo.telemetry.metrics plot --run_dir runs/demo --out reward.png
    python -m async_grpo.telemetry.metrics compare runs/a runs/b --out compare.png   # run_report.py: a table + one figure
    python -m async_grpo.telemetry.metrics compare --help   # a command's flags (PlotConfig, CompareConfig)

Both JSONL files hold one record per trained step, identified by its `step` field (the 0-based
optimizer step, as in checkpoints/step_N: a checkpoint step_N was taken after step N - 1 and
resumes at step N):
- metrics.jsonl: `step`, `time_s` (seconds of training since the run's first start: a resumed
  run continues from the last kept record, so the time between the crash and the resumed
  trainer's start-up is not counted), `unix_time`, then the step's metrics.
- data_rank{r}.jsonl (StepDataLog), written by rank r once the step has trained: `step`,
  `prompt_ids` (the dataset indices rank r drew from its shard for the step, in sampler order:
  the data order) and `trained_prompt_ids` (the prompt id of every sample rank r trained on in
  the step, one entry per sample, sorted; the batcher balances samples across ranks, so it is
  the union over all ranks, not one rank's list, that holds the step's prompts n times each, less
  the stale and timed-out rollouts the step counts).
A resumed run first cuts both files back to the checkpoint's step (truncate_step_records), so
the steps it trains again appear once, as it trains them.

Rank 0's MetricsLogger also drives the console (console.py, docs/console.md): one progress bar,
a line per evaluation, a warning when a step drops something.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch

from async_grpo.config.run_config import ConfigError, exit_config_error, load_command, positional
from async_grpo.rewards.shaping import counts_as_solved
from async_grpo.telemetry.collapse import CollapseConfig, CollapseWatch
from async_grpo.telemetry.console import CONSOLE, ConsoleProgress, DropWarnings, eval_line
from async_grpo.telemetry.run_report import (  # noqa: F401 (read_metrics, first_reached: re-exported)
    EVAL_ACCURACY, THRESHOLDS, WINDOW, compare_runs, eval_series, first_reached, moving_average, read_metrics,
)
from async_grpo.telemetry.trackers import Tracker, one_line, start_tracker
from sample_processing_utils import PackedBatch, Sample

logger = logging.getLogger(__name__)

# Evaluation keys drawn on the reward plot (evaluation.py writes them on the steps it ran).
_PASS_AT_COLORS = ("tab:red", "tab:purple", "tab:brown")

# Keys summed across ranks; their order fixes the layout of the all-reduced tensor.
_SUM_KEYS = (
    "samples", "reward_sum", "correct", "response_tokens", "tokens", "truncated", "reward_failed",
    "staleness_sum", "loss_sum", "output_tokens", "kl_sum", "clip_sum", "entropy_sum",
    "first_entropy_sum", "ratio_sum", "wait_s", "train_s", "later_clip_sum", "later_ratio_sum", "later_tokens",
    "zero_advantage", "mismatch_kl_sum", "mismatch_weight_sum", "mismatch_masked_sum", "ray_bytes", "scatter_bytes",
    "token_staleness_sum", "sampled_tokens", "observation_tokens", "observed",
    "stale_sum", "behaviour_weight_sum", "behaviour_weight_sq_sum", "behaviour_capped_sum",
)
# grpo_loss's per-minibatch token means, logged per step as token means: (metric, its sum key).
_TOKEN_MEANS = (
    ("loss/kl", "kl_sum"),
    ("loss/clip_frac", "clip_sum"),
    ("loss/ratio_mean", "ratio_sum"),
    ("mismatch/kl", "mismatch_kl_sum"),
    ("mismatch/is_weight_mean", "mismatch_weight_sum"),
    ("mismatch/masked_frac", "mismatch_masked_sum"),
    ("behaviour/stale_frac", "stale_sum"),
    ("behaviour/weight_mean", "behaviour_weight_sum"),
    ("behaviour/capped_frac", "behaviour_capped_sum"),
)
# Summed like _TOKEN_MEANS but logged through another metric (behaviour/weight_std).
_TOKEN_SUMS_ONLY = (("behaviour/weight_sq_mean", "behaviour_weight_sq_sum"),)
_TOKEN_MEAN_DEFAULTS = {"loss/ratio_mean": 1.0, "mismatch/is_weight_mean": 1.0, "behaviour/weight_mean": 1.0,
                        "behaviour/weight_sq_mean": 1.0}


def _std(total: float, total_sq: float, count: float) -> float:
    """Standard deviation from a sum and a sum of squares over count values."""
    mean = total / count
    return math.sqrt(max(total_sq / count - mean * mean, 0.0))


@dataclass
class StepAccumulator:
    """Running sums of one step on one rank (only loss-carrying minibatches)."""

    step: int
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_SUM_KEYS, 0.0))
    max_staleness: int = 0
    trained_prompt_ids: list[int] = field(default_factory=list)
    """prompt_id of every loss-carrying sample this rank trained on (StepDataLog records them)."""

    def add_time(self, key: str, seconds: float) -> None:
        self.sums[key] += seconds

    def add_data_bytes(self, *, ray_bytes: int, scatter_bytes: int) -> None:
        """Payload bytes of one received message (data_path.payload_nbytes): over Ray into this
        process, and through the trainer's process group."""
        self.sums["ray_bytes"] += ray_bytes
        self.sums["scatter_bytes"] += scatter_bytes

    def add_minibatch(
        self, samples: Sequence[Sample], batch: PackedBatch, entropy: torch.Tensor, loss_value: float, loss_metrics: dict[str, float]
    ) -> None:
        s = self.sums
        self.trained_prompt_ids.extend(x.prompt_id for x in samples)
        s["samples"] += len(samples)
        s["reward_sum"] += sum(x.reward for x in samples)
        # The verdict's solved, never a format bonus (rewards.counts_as_solved).
        s["correct"] += sum(1 for x in samples if counts_as_solved(x.solved, x.reward))
        # What the model wrote; a multi-turn rollout's observation tokens are counted apart.
        s["response_tokens"] += sum(x.num_sampled_tokens for x in samples)
        s["observation_tokens"] += sum(len(x.output_token_ids) - x.num_sampled_tokens for x in samples)
        s["observed"] += sum(1 for x in samples if len(x.output_token_ids) > x.num_sampled_tokens)
        # Every sample's prompt + output, however the minibatch was laid out (model.share_prompts
        # streams fewer), so counts/tokens and perf/tokens_per_s compare across settings.
        s["tokens"] += sum(x.num_tokens for x in samples)
        s["truncated"] += sum(1 for x in samples if x.truncated)
        s["reward_failed"] += sum(1 for x in samples if x.reward_failed)
        # A group whose rollouts all scored the same has advantage 0: no policy-gradient signal.
        s["zero_advantage"] += sum(1 for x in samples if x.advantage == 0.0)
        # A rollout that straddles a weight push is as stale as its oldest token; the token mean
        # weighs each token by the version that sampled it.
        staleness = [self.step - x.oldest_version() for x in samples]
        s["staleness_sum"] += sum(staleness)
        self.max_staleness = max(self.max_staleness, max(staleness))
        for x in samples:
            lag_sum, num_sampled = x.token_staleness(self.step)
            s["token_staleness_sum"] += lag_sum
            s["sampled_tokens"] += num_sampled
        s["loss_sum"] += loss_value
        n_out = float(entropy.numel())
        s["output_tokens"] += n_out
        for metric, key in _TOKEN_MEANS + _TOKEN_SUMS_ONLY:
            s[key] += loss_metrics.get(metric, _TOKEN_MEAN_DEFAULTS.get(metric, 0.0)) * n_out
        s["entropy_sum"] += float(entropy.sum())
        first_positions = torch.cumsum(torch.tensor([0] + batch.inputs.output_lengths[:-1]), 0)
        s["first_entropy_sum"] += float(entropy.cpu()[first_positions].sum())

    def add_later_epoch(self, loss_metrics: dict[str, float], num_tokens: int) -> None:
        """Clip statistics of a pass after the first (epochs_per_step > 1), token-weighted."""
        s = self.sums
        s["later_clip_sum"] += loss_metrics.get("loss/clip_frac", 0.0) * num_tokens
        s["later_ratio_sum"] += loss_metrics.get("loss/ratio_mean", 1.0) * num_tokens
        s["later_tokens"] += num_tokens

    def _reduced(self, device: torch.device) -> tuple[dict[str, float], int, float]:
        """Sum across ranks (max for staleness and wait: the slowest rank sets the pace)."""
        import torch.distributed as dist

        sums = torch.tensor([self.sums[k] for k in _SUM_KEYS], dtype=torch.float64, device=device)
        maxes = torch.tensor([float(self.max_staleness), self.sums["wait_s"]], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        return dict(zip(_SUM_KEYS, sums.tolist())), int(maxes[0].item()), float(maxes[1].item())

    def finalize(self, *, dist, end, grad_norm: float, lr: float, push_s: float, step_s: float,
                 batcher_stats: dict[str, Any]) -> dict[str, float]:
        """Collective: reduce across ranks and build the step's metrics record."""
        s, max_staleness, wait_max = self._reduced(dist.device)
        n = max(s["samples"], 1.0)
        out_tokens = max(s["output_tokens"], 1.0)
        world = dist.world_size
        record = {
            "reward/mean": s["reward_sum"] / n,
            "reward/accuracy": s["correct"] / n,
            "response/length_mean": s["response_tokens"] / n,
            "response/observation_tokens_mean": s["observation_tokens"] / n,
            # Share of rollouts that got an observation (in the tool demo: that called the tool).
            "multi_turn/observed_frac": s["observed"] / n,
            "response/truncated_frac": s["truncated"] / n,
            "loss/total": s["loss_sum"] / n,
            **{metric: s[key] / out_tokens for metric, key in _TOKEN_MEANS},
            "entropy/mean": s["entropy_sum"] / out_tokens,
            "entropy/first_token": s["first_entropy_sum"] / n,
            "optim/grad_norm": grad_norm,
            "optim/lr": lr,
            "perf/samples_per_s": s["samples"] / step_s,
            "perf/tokens_per_s": s["tokens"] / step_s,
            "timing/step_s": step_s,
            "timing/wait_s": wait_max,
            "timing/train_s": s["train_s"] / world,
            "timing/push_s": push_s,
            "data/ray_bytes": s["ray_bytes"],
            "data/scatter_bytes": s["scatter_bytes"],
            "staleness/mean": s["staleness_sum"] / n,
            "staleness/max": float(max_staleness),
            "staleness/token_mean": s["token_staleness_sum"] / max(s["sampled_tokens"], 1.0),
            # The decoupled objective's importance weights over the step's tokens (fresh ones 1).
            "behaviour/weight_std": _std(s["behaviour_weight_sum"], s["behaviour_weight_sq_sum"], out_tokens),
            "counts/samples": s["samples"],
            "counts/tokens": s["tokens"],
            "counts/dropped_stale": float(end.dropped_stale),
            "counts/timed_out_prompts": float(end.timed_out_prompts),
            "counts/oversized_samples": float(end.oversized_samples),
            "counts/reward_failed": s["reward_failed"],
            "counts/zero_advantage_samples": s["zero_advantage"],
            "counts/minibatches_per_rank": float(end.num_minibatches),
        }
        if s["later_tokens"] > 0:  # passes 2.. of epochs_per_step: how far pi moved from pi_old
            record["loss/clip_frac_later_epochs"] = s["later_clip_sum"] / s["later_tokens"]
            record["loss/ratio_mean_later_epochs"] = s["later_ratio_sum"] / s["later_tokens"]
        # The batcher's keys are namespaced already (batcher/..., timing/generate_s, ...).
        record.update({k: float(v) for k, v in batcher_stats.items() if isinstance(v, (int, float))})
        return record


@dataclass(kw_only=True, frozen=True)
class MetricsConfig:
    """Where rank 0 reports each step's metrics besides run_dir/metrics.jsonl (docs/trackers.md)."""

    report_to: tuple[Literal["jsonl", "tensorboard", "wandb", "mlflow", "trackio"], ...] = ("jsonl", "tensorboard")
    """Trackers to report to. metrics.jsonl is always written, listed or not; a tracker that fails
    to start (not installed, bad settings) or later is reported in one line and dropped, and the
    run goes on with the others (counted as counts/trackers_off in later records)."""
    project: str = "grpo"
    """W&B project, MLflow experiment and trackio project the run is filed under."""
    run_name: str = ""
    """The run's name in the trackers; "" uses run_dir's folder name. A resumed run appends
    `-resumed-at-N` (each trainer start is its own tracker run)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: W&B writes to run_dir/wandb only (upload later with `wandb sync`); online needs
    the network and a W&B login."""
    mlflow_tracking_uri: str = ""
    """MLflow backend; "" means an SQLite file at run_dir/mlflow/mlflow.db with artifacts in
    run_dir/mlflow/artifacts (MLflow's default backend kind, kept inside the run)."""

    def __post_init__(self) -> None:
        duplicates = sorted({name for name in self.report_to if self.report_to.count(name) > 1})
        if duplicates:
            raise ValueError(f"MetricsConfig.report_to names {duplicates} more than once")
        if not self.project:
            raise ValueError("MetricsConfig.project must not be empty")


class MetricsLogger:
    """Rank 0's sink: metrics.jsonl, the trackers of MetricsConfig.report_to (TensorBoard by
    default) and the console (a progress bar, evaluation lines, drop warnings, collapse warnings:
    collapse.py). Other ranks hold a DiscardedMetrics instead (open_metrics_sink picks).

    tensorboard=False turns TensorBoard off whatever report_to says (TrainerConfig.tensorboard).
    resume_step: the step a resumed run continues from. metrics.jsonl is cut back to the records
    of earlier steps (a crashed run may have logged steps after its last checkpoint), `time_s`
    continues from the last kept record, and TensorBoard hides its events of the dropped steps.
    At close, when any tracker is on, the reward plot is drawn to run_dir/reward.png and handed
    to each tracker.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool, progress_total: int, progress_start: int = 0,
                 progress_bar: bool = True, resume_step: int | None = None,
                 report: MetricsConfig | None = None, collapse: CollapseConfig | None = None) -> None:
        self._run_dir = run_dir
        self._start_time = time.time()
        self._time_offset = 0.0
        self._trackers: list[Tracker] = []
        self._trackers_off = 0
        self._logged = False
        self._progress: ConsoleProgress | None = None
        self._drops = DropWarnings()
        self._collapse = CollapseWatch(collapse or CollapseConfig())
        path = run_dir / "metrics.jsonl"
        if resume_step is not None:
            last = truncate_step_records(path, resume_step)
            self._time_offset = float(last["time_s"]) if last is not None else 0.0
        self._file = path.open("a")
        report = report or MetricsConfig()
        names = [n for n in report.report_to if n != "jsonl" and (tensorboard or n != "tensorboard")]
        self._start_trackers(names, report, resume_step)
        if progress_bar:
            self._progress = ConsoleProgress(progress_total, progress_start)

    def _start_trackers(self, names: Sequence[str], report: MetricsConfig, resume_step: int | None) -> None:
        run_name = report.run_name or self._run_dir.resolve().name
        if resume_step is not None:
            run_name += f"-resumed-at-{resume_step}"
        for name in names:
            try:
                tracker = start_tracker(name, self._run_dir, project=report.project, run_name=run_name,
                                        wandb_mode=report.wandb_mode, mlflow_tracking_uri=report.mlflow_tracking_uri,
                                        resume_step=resume_step)
            except Exception as exc:  # any failure of an optional sink: report it, keep the run
                self._trackers_off += 1
                hint = " (pip install -r requirements_fsdp.txt)" if isinstance(exc, ImportError) else ""
                logger.warning("metrics.report_to: %s did not start (%s)%s; the run goes on without it", name,
                               one_line(exc), hint)
                continue
            self._trackers.append(tracker)
        if names:
            logger.info("reporting to jsonl%s", "".join(f", {t.name}" for t in self._trackers))

    def _call_trackers(self, what: str, call: Callable[[Tracker], None]) -> None:
        """call(tracker) for every tracker; one that raises is reported in one line and dropped."""
        for tracker in list(self._trackers):
            try:
                call(tracker)
            except Exception as exc:  # a tracker's failure must not cost the run
                self._trackers.remove(tracker)
                self._trackers_off += 1
                logger.warning("metrics: %s failed at %s (%s); it is off for the rest of the run", tracker.name, what,
                               one_line(exc))

    def log(self, step: int, record: dict[str, float]) -> None:
        """Write one step's record. Keys may differ between steps (evaluation keys appear only on
        steps that evaluated): each JSONL line and tracker entry carries the keys it has."""
        now = time.time()
        # time_s counts training time from the run's first start (see the module docstring);
        # unix_time lets a caller measure from elsewhere (the demo reports time from its
        # command's start, Ray and worker start-up included).
        time_s = self._time_offset + now - self._start_time
        if self._trackers_off:
            record = {**record, "counts/trackers_off": float(self._trackers_off)}
        record = {**record, **self._collapse.observe(step, record)}
        line = {"step": step, "time_s": round(time_s, 3), "unix_time": round(now, 3), **record}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        self._logged = True
        self._call_trackers(f"step {step}", lambda tracker: tracker.log(step, record))
        summary = (f"step {step} reward {record['reward/mean']:.3f} acc {record['reward/accuracy']:.3f} "
                   f"kl {record['loss/kl']:.4f} len {record['response/length_mean']:.1f} "
                   f"ent0 {record['entropy/first_token']:.2f} {record['timing/step_s']:.1f}s")
        if EVAL_ACCURACY in record:
            summary += f" eval_acc {record[EVAL_ACCURACY]:.3f}"
        logger.info(summary)
        self._to_console(step, record)

    def _to_console(self, step: int, record: dict[str, float]) -> None:
        """The step's evaluation line and drop warning (if any), then the progress bar."""
        evaluated = eval_line(step, record)
        if evaluated is not None:
            logger.info("%s", evaluated, extra=CONSOLE)
        dropped = self._drops.observe(step, record)
        if dropped is not None:
            logger.warning("%s", dropped)
        if self._progress is not None:
            self._progress.update(step, record)

    def close(self) -> None:
        self._file.close()
        if self._trackers and self._logged:  # a run that stopped before its first step has no curve
            self._hand_over_plot()
        self._call_trackers("close", lambda tracker: tracker.close())
        self._trackers = []
        if self._progress is not None:
            self._progress.close()
        dropped = self._drops.flush()
        if dropped is not None:
            logger.warning("%s", dropped)

    def _hand_over_plot(self) -> None:
        """Draw run_dir/reward.png and give it to every tracker."""
        try:
            plot = plot_reward_curve(self._run_dir, self._run_dir / "reward.png")
        except Exception as exc:  # the plot is a courtesy: the records are what the run keeps
            logger.warning("metrics: no reward plot for the trackers (%s)", one_line(exc))
            return
        self._call_trackers("the reward plot", lambda tracker: tracker.log_plot(plot))


class DiscardedMetrics:
    """Every rank but 0: a step's record is rank 0's to write, so the others' go nowhere."""

    def log(self, step: int, record: dict[str, float]) -> None:
        """Nothing: rank 0 logs the step."""

    def close(self) -> None:
        """Nothing to close."""


def open_metrics_sink(run_dir: Path, *, is_main: bool, **logger_options: Any) -> MetricsLogger | DiscardedMetrics:
    """Rank 0 (`is_main`): a MetricsLogger with `logger_options`; any other rank: DiscardedMetrics."""
    return MetricsLogger(run_dir, **logger_options) if is_main else DiscardedMetrics()


class StepDataLog:
    """One rank's data_rank{rank}.jsonl: which prompts each trained step drew and trained on
    (fields in the module docstring). A step's record is written once it has trained, not when
    its prompts are submitted, so a step in flight at a crash leaves no record (the resumed run
    generates and records it again). With resume_step, records of that step and later are
    removed first."""

    def __init__(self, run_dir: Path, rank: int, *, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / f"data_rank{rank}.jsonl"
        self._drawn: dict[int, list[int]] = {}
        """Prompt ids drawn for each submitted step that has not trained yet."""
        if resume_step is not None:
            truncate_step_records(self.path, resume_step)

    def drawn(self, step: int, prompt_ids: Sequence[int]) -> None:
        """Remember the prompts drawn for a step as it is submitted."""
        self._drawn[step] = list(prompt_ids)

    def drawn_more(self, step: int, prompt_ids: Sequence[int]) -> None:
        """Remember extra prompts drawn for a submitted step (dynamic sampling's resampling)."""
        self._drawn[step].extend(prompt_ids)

    def trained(self, step: int, trained_prompt_ids: Sequence[int]) -> None:
        """Append the record of a step that has trained (its prompts must have been `drawn`)."""
        record = {"step": step, "prompt_ids": self._drawn.pop(step), "trained_prompt_ids": sorted(trained_prompt_ids)}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def truncate_step_records(path: Path, first_removed_step: int) -> dict[str, Any] | None:
    """Remove the records of steps >= first_removed_step from a JSONL file of step records
    (metrics.jsonl, data_rank*.jsonl), atomically: the kept lines go to a temporary file that
    replaces the original, so a crash here leaves the old file or the new one, never a mix.

    A last line that is not JSON (a write cut off by a kill) is dropped with a warning; one
    earlier in the file is an error. Returns the last kept record (None if none, or no file).
    """
    path = Path(path)
    if not path.is_file():
        return None
    lines = path.read_text().splitlines()
    kept: list[str] = []
    last: dict[str, Any] | None = None
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if line_no == len(lines):
                logger.warning("%s: dropping a cut-off last line (%s)", path, exc)
                continue
            raise ValueError(f"{path}:{line_no}: not JSON ({exc})") from None
        if record["step"] < first_removed_step:
            kept.append(line)
            last = record
    removed = sum(1 for line in lines if line.strip()) - len(kept)
    if removed:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
        logger.info("%s: removed %d records of steps >= %d (resuming there)", path, removed, first_removed_step)
    return last


def summarize_reward(records: Sequence[dict[str, Any]], target: float, window: int = WINDOW) -> str:
    """One line: reward at the start and end (window-step means) and when the mean first reached target."""
    rewards = [r["reward/mean"] for r in records]
    smoothed = moving_average(rewards, window)
    span = min(window, len(rewards))
    line = (f"reward {smoothed[span - 1]:.3f} (mean of steps 0-{span - 1}) -> {smoothed[-1]:.3f} "
            f"(mean of the last {span} steps, step {records[-1]['step']}, "
            f"{records[-1]['time_s'] / 60:.1f} min)")
    reached = first_reached(records, target, window)
    if reached is None:
        return line + f"; the {window}-step mean never reached {target}"
    r = records[reached]
    return line + f"; the {window}-step mean first reached {target} at step {r['step']} ({r['time_s'] / 60:.1f} min)"


def plot_eval_points(ax: Any, xs: Sequence[float], records: Sequence[dict[str, Any]]) -> None:
    """Evaluation points (only the steps that evaluated carry them), joined by lines."""
    pass_colors = itertools.cycle(_PASS_AT_COLORS)
    for key in eval_series(records):
        points = [(x, r[key]) for x, r in zip(xs, records) if key in r]
        if key == EVAL_ACCURACY:
            label, color, marker, style = "eval greedy accuracy", "tab:green", "o", "-"
        else:
            label, color, marker, style = f"eval {key.removeprefix('eval/')}", next(pass_colors), "s", "--"
        ax.plot([x for x, _ in points], [y for _, y in points], label=label, color=color, marker=marker,
                markersize=4, linestyle=style)


def plot_reward_curve(run_dir: Path, out: Path, title: str = "") -> Path:
    """Draw reward mean (and evaluation accuracy / pass@k, where logged) against step and wall time to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no records")
    steps = [r["step"] for r in records]
    minutes = [r["time_s"] / 60 for r in records]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, xs, label in ((axes[0], steps, "step"), (axes[1], minutes, "wall time (min)")):
        rewards = [r["reward/mean"] for r in records]
        ax.plot(xs, rewards, label="sampled reward (mean)", alpha=0.35, color="tab:blue")
        ax.plot(xs, moving_average(rewards, WINDOW), label=f"sampled reward, {WINDOW}-step mean", color="tab:blue")
        if "entropy/first_token" in records[0]:
            ax.plot(xs, [r["entropy/first_token"] for r in records], label="first-token entropy", alpha=0.6, color="tab:orange")
        plot_eval_points(ax, xs, records)
        ax.set_xlabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title or f"GRPO run {run_dir}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


@dataclass(kw_only=True, frozen=True)
class PlotConfig:
    """Draw a run's reward curve (and evaluation points) against step and wall time to a PNG."""

    run_dir: str
    """Run directory (with the trainer's metrics.jsonl)."""
    out: str
    """The PNG to write."""
    title: str = ""
    """The figure's title; "" names the run directory."""


@dataclass(kw_only=True, frozen=True)
class CompareConfig:
    """Compare runs: a table of when each reached reward levels, its final reward, eval accuracy and step
    time; all reward curves in one figure (run_report.compare_runs)."""

    run_dirs: list[str] = positional()
    """Run directories (each with a metrics.jsonl), one or more."""
    out: str = "compare.png"
    """The figure."""
    window: int = WINDOW
    """Steps in the trailing mean reward that the levels are read on (run_report.WINDOW)."""
    thresholds: list[float] = field(default_factory=lambda: list(THRESHOLDS))
    """Reward levels of the table (run_report.THRESHOLDS)."""

    def __post_init__(self) -> None:
        if not self.run_dirs:
            raise ValueError("CompareConfig.run_dirs needs at least one run directory")
        if self.window < 1:
            raise ValueError(f"CompareConfig.window must be >= 1, got {self.window}")
        if not self.thresholds:
            raise ValueError("CompareConfig.thresholds needs at least one level")


_COMMANDS = {"plot": PlotConfig, "compare": CompareConfig}
_PROG = "python -m async_grpo.telemetry.metrics"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        command, config = load_command(_COMMANDS, args, _PROG)
    except ConfigError as err:  # a bad value: one line
        exit_config_error(f"metrics.py {args[0]}", err)
    if isinstance(config, PlotConfig):
        print(f"wrote {plot_reward_curve(Path(config.run_dir), Path(config.out), config.title)}")
        return
    try:
        print(compare_runs([Path(run) for run in config.run_dirs], Path(config.out), window=config.window,
                           thresholds=config.thresholds))
    except ValueError as err:  # not a run directory, no records: one line
        exit_config_error(f"metrics.py {command}", err)
    print(f"wrote {config.out}")


if __name__ == "__main__":
    main()
