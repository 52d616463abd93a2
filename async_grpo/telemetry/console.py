"""The console and the run's log file (docs/console.md).

`configure_logging`, called once by each entry point, sends every INFO line to run_dir/run.log
and shows on the console only warnings and the lines marked CONSOLE; rank 0's MetricsLogger
draws one progress bar (ConsoleProgress), prints a line per evaluation (eval_line), a warning
when a step drops something (DropWarnings), and `log_run_summary` the summary at the end.
No torch here: the launcher imports it before anything heavy.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Literal, Sequence

from async_grpo.telemetry.run_report import EVAL_ACCURACY, WINDOW, drop_counts, drops_text, eval_series, run_summary
from async_grpo.telemetry.trackers import one_line

logger = logging.getLogger(__name__)

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


_PACKAGE_PREFIX = "async_grpo."


def short_logger_name(name: str) -> str:
    """`name` as the quiet console shows it: a package module by its own name ('metrics' for
    'async_grpo.telemetry.metrics'; module names are unique in the project), others as they are."""
    return name.rsplit(".", 1)[-1] if name.startswith(_PACKAGE_PREFIX) else name


class ConsoleFormatter(logging.Formatter):
    """Quiet console: `12:00:01 message` for its INFO lines, `12:00:01 WARNING [tag]module: message`
    for the rest (a package module by its short name). Verbose console (level info or debug):
    run.log's format for every line."""

    def __init__(self, tag: str, verbose: bool) -> None:
        super().__init__()
        full = logging.Formatter(_FILE_FORMAT.format(tag=tag))
        self._info = full if verbose else logging.Formatter("%(asctime)s %(message)s", _CONSOLE_TIME)
        self._other = full if verbose else logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(short_name)s: %(message)s",
                                                             _CONSOLE_TIME)

    def format(self, record: logging.LogRecord) -> str:
        record.short_name = short_logger_name(record.name)
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
