"""Per-step training records: metrics accumulated on every rank, reduced once, written by rank 0;
and each rank's data log.

One record per step goes to run_dir/metrics.jsonl (and the trackers of metrics.report_to:
TensorBoard, W&B, MLflow, trackio; trackers.py, docs/trackers.md); keys are namespaced
(`reward/mean`, `timing/generate_s`, ...). Steps that ran an evaluation (evaluation.py) also
carry `eval/...` keys. Draw the reward curve of a run (with evaluation points, if any):

    python metrics.py plot --run_dir runs/demo --out reward.png
    python metrics.py compare runs/a runs/b --out compare.png   # run_report.py: a table + one figure

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

The console (docs/console.md): `configure_logging`, called once by each entry point, sends every
INFO line to run_dir/run.log and shows on the console only warnings and the lines marked CONSOLE;
rank 0's MetricsLogger draws one progress bar (ConsoleProgress), prints a line per evaluation, a
warning when a step drops something (DropWarnings), and `log_run_summary` the summary at the end.
`--log_level info` brings the per-step INFO lines back to the console.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch

from rewards import counts_as_solved
from sample_processing_utils import PackedBatch, Sample
from run_report import (  # noqa: F401 (read_metrics, first_reached: re-exported)
    EVAL_ACCURACY, WINDOW, drop_counts, drops_text, first_reached, moving_average, read_metrics, run_summary,
)
from trackers import Tracker, one_line, start_tracker

logger = logging.getLogger(__name__)

# Evaluation keys drawn on the reward plot (evaluation.py writes them on the steps it ran).
EVAL_PASS_AT_PREFIX = "eval/pass@"
_PASS_AT_COLORS = ("tab:red", "tab:purple", "tab:brown")

# Keys summed across ranks; their order fixes the layout of the all-reduced tensor.
_SUM_KEYS = (
    "samples", "reward_sum", "correct", "response_tokens", "tokens", "truncated", "reward_failed",
    "staleness_sum", "loss_sum", "output_tokens", "kl_sum", "clip_sum", "entropy_sum",
    "first_entropy_sum", "ratio_sum", "wait_s", "train_s", "later_clip_sum", "later_ratio_sum", "later_tokens",
    "zero_advantage", "mismatch_kl_sum", "mismatch_weight_sum", "mismatch_masked_sum", "ray_bytes", "scatter_bytes",
)
# grpo_loss's per-minibatch token means, logged per step as token means: (metric, its sum key).
_TOKEN_MEANS = (
    ("loss/kl", "kl_sum"),
    ("loss/clip_frac", "clip_sum"),
    ("loss/ratio_mean", "ratio_sum"),
    ("mismatch/kl", "mismatch_kl_sum"),
    ("mismatch/is_weight_mean", "mismatch_weight_sum"),
    ("mismatch/masked_frac", "mismatch_masked_sum"),
)
_TOKEN_MEAN_DEFAULTS = {"loss/ratio_mean": 1.0, "mismatch/is_weight_mean": 1.0}


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
        s["response_tokens"] += sum(len(x.output_token_ids) for x in samples)
        s["tokens"] += batch.num_tokens
        s["truncated"] += sum(1 for x in samples if x.truncated)
        s["reward_failed"] += sum(1 for x in samples if x.reward_failed)
        # A group whose rollouts all scored the same has advantage 0: no policy-gradient signal.
        s["zero_advantage"] += sum(1 for x in samples if x.advantage == 0.0)
        staleness = [self.step - x.weight_version for x in samples]
        s["staleness_sum"] += sum(staleness)
        self.max_staleness = max(self.max_staleness, max(staleness))
        s["loss_sum"] += loss_value
        n_out = float(entropy.numel())
        s["output_tokens"] += n_out
        for metric, key in _TOKEN_MEANS:
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
    default) and the console (a progress bar, evaluation lines, drop warnings). No-op elsewhere.

    tensorboard=False turns TensorBoard off whatever report_to says (TrainerConfig.tensorboard).
    resume_step: the step a resumed run continues from. metrics.jsonl is cut back to the records
    of earlier steps (a crashed run may have logged steps after its last checkpoint), `time_s`
    continues from the last kept record, and TensorBoard hides its events of the dropped steps.
    At close, when any tracker is on, the reward plot is drawn to run_dir/reward.png and handed
    to each tracker.
    """

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, progress_total: int,
                 progress_start: int = 0, progress_bar: bool = True, resume_step: int | None = None,
                 report: MetricsConfig | None = None) -> None:
        self._enabled = enabled
        self._run_dir = run_dir
        self._start_time = time.time()
        self._time_offset = 0.0
        self._trackers: list[Tracker] = []
        self._trackers_off = 0
        self._logged = False
        self._progress: ConsoleProgress | None = None
        self._drops = DropWarnings()
        if not enabled:
            return
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
        if not self._enabled:
            return
        now = time.time()
        # time_s counts training time from the run's first start (see the module docstring);
        # unix_time lets a caller measure from elsewhere (the demo reports time from its
        # command's start, Ray and worker start-up included).
        time_s = self._time_offset + now - self._start_time
        if self._trackers_off:
            record = {**record, "counts/trackers_off": float(self._trackers_off)}
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
        if not self._enabled:
            return
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


# ---- The console and the run's log file -------------------------------------------------------

LOG_FILE = "run.log"
"""Every INFO line of a run, the launcher's and trainer rank 0's, goes to run_dir/run.log."""
CONSOLE = {"console": True}
"""`logger.info(..., extra=CONSOLE)`: an INFO line the default console shows too (evaluations,
start-up milestones, the summary). Other INFO lines go to the log file only."""
LogLevel = Literal["warning", "info", "debug"]
_LEVELS: dict[str, int] = {"warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
# Libraries whose lines stay in the log file at the default console level, warnings included
# (Ray's notice that token auth is on, at every start): their start-up chatter is what buried
# the useful lines. Their errors still reach the console.
_QUIET_LIBRARIES = ("ray", "vllm")
_FILE_FORMAT = "%(asctime)s {tag}%(levelname)s %(name)s: %(message)s"
_CONSOLE_TIME = "%H:%M:%S"  # the quiet console's clock: the date and milliseconds are in run.log


class ConsoleFilter(logging.Filter):
    """What the console shows at `level`: records marked CONSOLE (unless show_marked is False),
    and records at `level` or above; at the default (warning), Ray's and vLLM's only from ERROR up."""

    def __init__(self, level: int, show_marked: bool = True) -> None:
        super().__init__()
        self.level = level
        self.show_marked = show_marked

    def filter(self, record: logging.LogRecord) -> bool:
        if self.show_marked and getattr(record, "console", False):
            return True
        quiet = self.level > logging.INFO and record.name.split(".", 1)[0] in _QUIET_LIBRARIES
        return record.levelno >= (logging.ERROR if quiet else self.level)


class ConsoleFormatter(logging.Formatter):
    """Quiet console: `12:00:01 message` for its INFO lines, `12:00:01 WARNING [tag]module: message`
    for the rest. Verbose console (level info or debug): run.log's format for every line."""

    def __init__(self, tag: str, verbose: bool) -> None:
        super().__init__()
        full = logging.Formatter(_FILE_FORMAT.format(tag=tag))
        self._info = full if verbose else logging.Formatter("%(asctime)s %(message)s", _CONSOLE_TIME)
        self._other = full if verbose else logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s",
                                                             _CONSOLE_TIME)

    def format(self, record: logging.LogRecord) -> str:
        return (self._info if record.levelno == logging.INFO else self._other).format(record)


class ConsoleHandler(logging.StreamHandler):
    """Writes through tqdm.write, so that a line logged while this process's progress bar is drawn
    lands above the bar instead of through it. On a terminal each line first blanks the current
    one: the launcher shares the terminal with the trainer's bar, which it cannot move, and the
    bar is drawn again below at the trainer's next step."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            text = self.format(record)
            if self.stream.isatty():
                text = "\r" + " " * (shutil.get_terminal_size().columns - 1) + "\r" + text
            tqdm.write(text, file=self.stream)
        except Exception:  # logging's own policy: a handler failure is reported, never raised
            self.handleError(record)


def configure_logging(level: LogLevel, *, log_file: Path | None, tag: str = "", show_marked: bool = True) -> None:
    """Set up this process's logging; entry points call it once, after importing Ray (Ray installs
    its own handler when imported; this routes Ray's and vLLM's records through the root logger).

    The console (stderr) shows what ConsoleFilter passes at `level`; log_file (None: none) gets
    every INFO line (and DEBUG at level debug) in the format `<time> <tag><LEVEL> <module>: ...`,
    once its folder exists (RunLogHandler).
    show_marked=False: CONSOLE-marked lines are not shown either (trainer ranks other than 0,
    whose lines would repeat rank 0's). At the default level Hugging Face's weight-loading bars
    are hidden too.
    """
    numeric = _LEVELS[level]
    root = logging.getLogger()
    for handler in list(root.handlers):  # an earlier configuration (basicConfig, a test's)
        root.removeHandler(handler)
    root.setLevel(min(numeric, logging.INFO))  # CONSOLE-marked INFO lines must pass at any level
    console = ConsoleHandler(sys.stderr)
    console.addFilter(ConsoleFilter(numeric, show_marked))
    console.setFormatter(ConsoleFormatter(tag, verbose=numeric <= logging.INFO))
    root.addHandler(console)
    if log_file is not None:
        to_file = RunLogHandler(log_file)
        to_file.setLevel(min(numeric, logging.INFO))
        to_file.setFormatter(logging.Formatter(_FILE_FORMAT.format(tag=tag)))
        root.addHandler(to_file)
    for name in _QUIET_LIBRARIES:
        library = logging.getLogger(name)
        for handler in list(library.handlers):
            library.removeHandler(handler)
        library.propagate = True
    if numeric > logging.INFO:
        _hide_weight_loading_bars()


# Lines a RunLogHandler holds while its folder does not exist yet: start-up logs some tens; the
# bound only matters for a process that never makes its run directory.
_RUN_LOG_HELD_LINES = 10_000


class RunLogHandler(logging.Handler):
    """Appends each record to `path` once path's folder exists. Records logged before (the input
    checks, the Ray connection: the trainer makes run_dir only after them, so that a run failing
    its checks leaves no directory behind) wait in memory and are written first."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._held: list[str] = []
        self._file = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            if self._file is None:
                if not self.path.parent.is_dir():
                    if len(self._held) < _RUN_LOG_HELD_LINES:
                        self._held.append(line)
                    return
                self._file = self.path.open("a", encoding="utf-8")
                self._file.writelines(self._held)
                self._held = []
            self._file.write(line)
            self._file.flush()
        except Exception:  # logging's own policy: a handler failure is reported, never raised
            self.handleError(record)

    def close(self) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        super().close()


def _hide_weight_loading_bars() -> None:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a process without transformers draws no such bar
        return
    hf_logging.disable_progress_bar()


# Without a terminal (a pipe, a CI log) the bar's redraws would be one endless line: a plain
# progress line every tenth of the run instead.
_PLAIN_PROGRESS_LINES = 10


def progress_text(rewards: Sequence[float], step_s: float, last_eval: float | None, window: int = WINDOW) -> str:
    """The bar's numbers: the last step's reward, the mean of the last `window` steps' rewards,
    the last evaluation's greedy accuracy (once there is one) and the last step's time."""
    recent = rewards[-window:]
    text = f"reward {rewards[-1]:.3f} mean{window} {sum(recent) / len(recent):.3f}"
    if last_eval is not None:
        text += f" eval {last_eval:.3f}"
    return text + f" step {step_s:.1f}s"


class ConsoleProgress:
    """Rank 0's progress: a tqdm bar on a terminal; otherwise a line every tenth of the run and one
    after the last step (logged as CONSOLE, so run.log has them too). Both show progress_text."""

    def __init__(self, total: int, initial: int = 0, *, interactive: bool | None = None) -> None:
        self._total = total
        self._initial = initial
        self._every = max(1, (total - initial) // _PLAIN_PROGRESS_LINES)
        self._rewards: list[float] = []
        self._last_eval: float | None = None
        self._bar = None
        if sys.stderr.isatty() if interactive is None else interactive:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="grpo", unit="step", dynamic_ncols=True)

    def update(self, step: int, record: dict[str, float]) -> None:
        self._rewards.append(record["reward/mean"])
        self._last_eval = record.get(EVAL_ACCURACY, self._last_eval)
        text = progress_text(self._rewards, record["timing/step_s"], self._last_eval)
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
        elif (step + 1 - self._initial) % self._every == 0 or step + 1 == self._total:
            logger.info("%d/%d steps: %s", step + 1, self._total, text, extra=CONSOLE)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def eval_line(step: int, record: dict[str, float]) -> str | None:
    """The console's line for a step that evaluated (None for one that did not)."""
    if EVAL_ACCURACY not in record:
        return None
    scores = ", ".join(f"{key.removeprefix('eval/')} {record[key]:.3f}" for key in eval_series([record])[1:])
    prompts = f" on {record['eval/num_prompts']:.0f} prompts" if "eval/num_prompts" in record else ""
    took = f" ({record['eval/time_s']:.1f} s)" if "eval/time_s" in record else ""
    return f"eval after step {step}: greedy accuracy {record[EVAL_ACCURACY]:.3f}" + (
        f", {scores}" if scores else "") + prompts + took


# After a drop warning, the next this-many steps' drops are held and reported together: a run
# that drops at every step warns at one step in 20, with totals, instead of at every step.
_DROP_WARNING_EVERY = 20


class DropWarnings:
    """The console's warnings about what steps dropped (run_report.DROP_COUNTS): the first step
    that drops warns at once; later drops wait until _DROP_WARNING_EVERY steps after the last
    warning and are reported with their step range and totals. `flush` reports what is held."""

    def __init__(self, every: int = _DROP_WARNING_EVERY) -> None:
        self._every = every
        self._held: dict[str, float] = {}
        self._steps: list[int] = []
        """Steps that dropped something since the last warning."""
        self._next_at = 0
        """The first step that may warn again."""

    def observe(self, step: int, record: dict[str, float]) -> str | None:
        """A warning to log for this step, or None."""
        counts = drop_counts([record])
        for key, count in counts.items():
            self._held[key] = self._held.get(key, 0.0) + count
        if counts:
            self._steps.append(step)
        if not self._held or step < self._next_at:
            return None
        self._next_at = step + self._every
        return self.flush()

    def flush(self) -> str | None:
        if not self._held:
            return None
        first, last = self._steps[0], self._steps[-1]
        where = f"step {first}" if first == last else f"steps {first}-{last} ({len(self._steps)} steps)"
        text = f"{where}: {drops_text(self._held)} (per-step counts in metrics.jsonl)"
        self._held, self._steps = {}, []
        return text


def log_run_summary(run_dir: Path) -> None:
    """The end-of-run summary (run_report.run_summary) on the console and in run.log."""
    try:
        text = run_summary(run_dir)
    except (OSError, ValueError) as exc:  # no records (stopped before its first step): say so, end cleanly
        logger.warning("no run summary: %s", one_line(exc))
        return
    for line in text.splitlines():
        logger.info("%s", line, extra=CONSOLE)


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


def summarize_reward(records: Sequence[dict[str, Any]], window: int = 10, target: float = 0.6) -> str:
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


def eval_series(records: Sequence[dict[str, Any]]) -> list[str]:
    """Evaluation keys to draw, found in any record: eval/accuracy, then each eval/pass@k by k."""
    keys = {k for r in records for k in r}
    pass_keys = [k for k in keys if k.startswith(EVAL_PASS_AT_PREFIX) and k.removeprefix(EVAL_PASS_AT_PREFIX).isdigit()]
    pass_keys.sort(key=lambda k: int(k.removeprefix(EVAL_PASS_AT_PREFIX)))
    return ([EVAL_ACCURACY] if EVAL_ACCURACY in keys else []) + pass_keys


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
        ax.plot(xs, moving_average(rewards, 10), label="sampled reward, 10-step mean", color="tab:blue")
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="draw the reward curve of a run to PNG")
    plot.add_argument("--run_dir", type=Path, required=True)
    plot.add_argument("--out", type=Path, required=True)
    plot.add_argument("--title", default="")
    compare = sub.add_parser("compare", help="compare runs: a table of when each reached reward levels, its final "
                                             "reward, eval accuracy and step time; all reward curves in one figure")
    compare.add_argument("run_dirs", type=Path, nargs="+", help="run directories (each with a metrics.jsonl)")
    compare.add_argument("--out", type=Path, default=Path("compare.png"), help="the figure (default: compare.png)")
    compare.add_argument("--window", type=int, default=10, help="steps in the reward mean (default: 10)")
    compare.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.6, 0.9],
                         help="reward levels of the table (default: 0.5 0.6 0.9)")
    args = parser.parse_args(argv)
    if args.command == "plot":
        print(f"wrote {plot_reward_curve(args.run_dir, args.out, args.title)}")
        return
    from run_report import compare_runs

    try:
        print(compare_runs(args.run_dirs, args.out, window=args.window, thresholds=args.thresholds))
    except ValueError as err:  # not a run directory, no records, a bad window: one line
        parser.exit(2, f"metrics.py compare: {err}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
