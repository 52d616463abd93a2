"""What the benchmark scripts share: logging set-up, the smoke mode, the one-line summary, the
demo's assets and trainer flags, and one trainer run on a local cluster with its metrics read back.

Every script runs from the repository root as `python -m benchmarks.NAME` (the root is then on
sys.path, so the project's modules import as they are) and has a smoke mode (`--smoke true`: a few
steps at tiny sizes) that tests/system/test_benchmarks_smoke.py runs. Library modules here (this
one, process_monitor.py, packed_samples.py, *_parts.py) have no `__main__` entry; no benchmark
script imports another one (tests/project/test_benchmarks_layout.py checks both).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"
SUITE_TIMELINE_ENV = "GRPO_TEST_TIMELINE"
"""When set (scripts/suite_profile.py sets it), a file each tier's pytest appends its tests' starts
and ends to (tests/conftest.py): `<unix time> start|end <node id>` lines."""
DEFAULT_DEMO_ASSETS = REPO_ROOT / "runs" / "demo-assets"
PREPARE_DEMO = REPO_ROOT / "scripts" / "prepare_demo.py"
T = TypeVar("T")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TRAINER_LOG_TAIL_LINES = 30  # enough to show the traceback of a failed trainer run

logger = logging.getLogger(__name__)


def setup_logging(level: int = logging.INFO) -> None:
    """The scripts' one logging set-up (called once, in main)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)


def interrupt_on_sigterm() -> None:
    """A kill unwinds like Ctrl-C, so the `with LocalCluster(...)` blocks stop what they started."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def load_bench_config(cls: type[T], argv: list[str] | None, description: str = "") -> T:
    """`cls` from a benchmark's command line (`argv`, or sys.argv[1:] when None) through
    run_config.load_config. A value the config refuses exits 2 with one line naming the script
    and the field, before anything starts (argparse already does so for unknown flags): no
    traceback."""
    from async_grpo.config.run_config import ConfigError, exit_config_error, load_config

    try:
        return load_config(cls, sys.argv[1:] if argv is None else argv, description=description)
    except ConfigError as error:
        exit_config_error(Path(sys.argv[0]).name, error)


def apply_smoke(config: Any, sizes: dict[str, Any]) -> Any:
    """`config` with its script's smoke sizes (a few steps, tiny shapes) when `config.smoke` is set:
    the run checks that the recorded command still works (tests/system/test_benchmarks_smoke.py);
    its figures mean nothing."""
    return dataclasses.replace(config, **sizes) if config.smoke else config


# A smoke run's vLLM engines start uncompiled (enforce_eager): a smoke checks that the command
# works, and the torch.compile warm-up is a large part of every compiled engine's start, paid each
# time because vLLM 0.32's AOT compile cache fails to load here ("'function' object has no
# attribute 'finalize_loading'").
SMOKE_ENGINE = {"enforce_eager": True}


def run_engine(smoke: bool, **changes: Any) -> Any:
    """The local cluster's engine (local_cluster.local_engine) with `changes`, uncompiled
    (SMOKE_ENGINE) in smoke mode; for LocalClusterConfig(engine=...)."""
    from local_cluster import local_engine

    return local_engine(**changes, **(SMOKE_ENGINE if smoke else {}))


def launcher_engine_flags(smoke: bool) -> list[str]:
    """local_cluster.py flags for SMOKE_ENGINE in smoke mode (none otherwise), for scripts that run
    local_cluster.py as a command."""
    return [word for key, value in SMOKE_ENGINE.items() for word in (f"--{key}", str(value).lower())] if smoke else []


def summary_line(name: str, figures: dict[str, Any]) -> str:
    """`name: key=value key=value ...`: a script's summary line, printed last (tests read it)."""
    return f"{name}: " + " ".join(f"{key}={value}" for key, value in figures.items())


def parse_summary_line(line: str) -> tuple[str, dict[str, str]]:
    """The name ('' for a line of key=value pairs alone) and the key=value figures of a summary
    line (a value holding spaces keeps only its first word; the scripts print none such)."""
    name, sep, rest = line.partition(": ")
    if not sep or "=" in name:
        name, rest = "", line
    return name, dict(pair.split("=", 1) for pair in rest.split() if "=" in pair)


# ---- the demo's assets and trainer flags ------------------------------------------------------------

@dataclass(frozen=True)
class DemoAssets:
    """The files configs/demo.yaml needs beside it (scripts/prepare_demo.py writes all three)."""

    root: Path
    """The assets folder."""

    @property
    def model(self) -> Path:
        """The starting model (tiny Qwen2, format warm-up only)."""
        return self.root / "model"

    @property
    def prompts(self) -> Path:
        """The training prompts (data.path)."""
        return self.root / "arithmetic.jsonl"

    @property
    def eval_table(self) -> Path:
        """The evaluation table (eval.data.path: every single-digit sum once)."""
        return self.root / "arithmetic_eval.jsonl"

    def complete(self) -> bool:
        """Whether all three are there (as scripts/demo.sh checks)."""
        return all(p.is_file() for p in (self.model / "model.safetensors", self.prompts, self.eval_table))


def demo_assets(root: str | Path = DEFAULT_DEMO_ASSETS, prepare_args: tuple[str, ...] = ()) -> DemoAssets:
    """The demo's model, prompts and evaluation table in `root`, written together by
    scripts/prepare_demo.py (in a child process) unless all three are there already."""
    assets = DemoAssets(root=Path(root))
    if not assets.complete():
        logger.info("preparing the demo's model, prompts and evaluation table in %s", assets.root)
        subprocess.run([sys.executable, str(PREPARE_DEMO), "--out_dir", str(assets.root), *prepare_args],
                       cwd=REPO_ROOT, check=True)
    return assets


def load_prepare_demo() -> ModuleType:
    """scripts/prepare_demo.py as a module (its warm-up is reused by learnability.py); scripts/ is
    not a package, so it is loaded from its file."""
    spec = importlib.util.spec_from_file_location("prepare_demo", PREPARE_DEMO)
    assert spec is not None and spec.loader is not None
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def demo_trainer_flags(assets: DemoAssets, run_dir: Path, *, num_steps: int, seed: int = 0,
                       eval_every: int = 0, total_steps: int | None = None) -> list[str]:
    """trainer_core.py flags for the demo (configs/demo.yaml with its data and evaluation files)
    for `num_steps` steps: no checkpoints, progress bar or TensorBoard; evaluation every
    `eval_every` steps (0: none); the cosine schedule ends at `total_steps` (default num_steps, or
    just after the demo's lr warm-up for a shorter run: the schedule needs total_steps above it)."""
    if total_steps is None:
        total_steps = max(num_steps, _demo_warmup_steps() + 1)
    return ["--config", str(DEMO_CONFIG), "--run_dir", str(run_dir),
            "--model.model_path", str(assets.model), "--data.path", str(assets.prompts),
            "--eval.data.path", str(assets.eval_table), "--eval.every", str(eval_every),
            "--seed", str(seed), "--num_steps", str(num_steps),
            "--optim.total_steps", str(total_steps),
            "--checkpoint_every", "0", "--checkpoint_at_end", "false",
            "--progress_bar", "false", "--tensorboard", "false"]


def _demo_warmup_steps() -> int:
    """configs/demo.yaml's optim.warmup_steps."""
    import yaml

    return int(yaml.safe_load(DEMO_CONFIG.read_text())["optim"]["warmup_steps"])


# ---- one trainer run on a local cluster ---------------------------------------------------------

def for_trainer(cluster_config: Any, trainer_args: list[str]) -> Any:
    """`cluster_config` (a LocalClusterConfig) with what local_cluster.py hands from the trainer's
    config to the workers (local_cluster.with_trainer_settings), for scripts that start a
    LocalCluster themselves; trainer_args: the trainer's flags (with --run_dir and --model.model_path)."""
    from local_cluster import with_trainer_settings
    from trainer_core import load_trainer_config

    return with_trainer_settings(cluster_config, load_trainer_config(trainer_args))


@dataclass(frozen=True)
class TrainerRun:
    """What a trainer run left behind."""

    exit_code: int
    """torchrun's exit code."""
    records: list[dict[str, Any]]
    """metrics.jsonl's records (empty when it was not written)."""
    wall_s: float
    """Seconds from launch to exit."""
    log: Path
    """The trainer's log."""

    def log_tail(self, lines: int = TRAINER_LOG_TAIL_LINES) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def require(self, num_steps: int) -> list[dict[str, Any]]:
        """The records, or RuntimeError (with the log's tail) unless the run exited 0 with num_steps."""
        if self.exit_code != 0 or len(self.records) < num_steps:
            raise RuntimeError(f"trainer run exited {self.exit_code} after {len(self.records)} of {num_steps} "
                               f"steps; last lines of {self.log}:\n{self.log_tail()}")
        return self.records


def fresh_run_dir(run_dir: Path) -> Path:
    """`run_dir`, made, without the files a trainer appends to (metrics.jsonl, data_rank*.jsonl)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", *(p.name for p in run_dir.glob("data_rank*.jsonl"))):
        (run_dir / stale).unlink(missing_ok=True)
    return run_dir


def run_trainer(cluster: Any, args: list[str], run_dir: Path, *, nproc_per_node: int = 2,
                timeout_s: float | None = None, log: Path | None = None) -> TrainerRun:
    """`torchrun trainer_core.py args` on a started LocalCluster; its metrics read back. A failed run
    is logged with its log's tail (the caller decides whether that fails the benchmark, or calls
    TrainerRun.require). The log defaults to <run_dir>/trainer.log."""
    from async_grpo.telemetry.metrics import read_metrics

    log = log or run_dir / "trainer.log"
    started = time.monotonic()
    code = cluster.run_trainer(args, nproc_per_node=nproc_per_node, timeout_s=timeout_s, log_path=log)
    metrics = run_dir / "metrics.jsonl"
    run = TrainerRun(exit_code=code, records=read_metrics(metrics) if metrics.is_file() else [],
                     wall_s=time.monotonic() - started, log=log)
    if code != 0:
        logger.error("trainer run in %s failed (exit %d); last lines of %s:\n%s", run_dir, code, log, run.log_tail())
    return run


def reward_at(records: list[dict], step: int, window: int) -> float | None:
    """Mean reward over every generated rollout (reward/mean_generated; reward/mean, the trained
    samples', in records without it) over the `window` steps ending at `step` (1-based count).
    Dynamic sampling trains only the informative groups, so its reward/mean is not comparable."""
    key = "reward/mean_generated" if records and "reward/mean_generated" in records[0] else "reward/mean"
    values = [r[key] for r in records if step - window <= r["step"] < step]
    return statistics.fmean(values) if len(values) == window else None


# ---- a run's checkpoints -------------------------------------------------------------------------

def checkpoint_steps(num_steps: int, every: int) -> list[int]:
    """Steps after which the trainer checkpoints (trainer_core._should_checkpoint, at_end on)."""
    return [s for s in range(num_steps) if (s + 1) % every == 0 or s + 1 == num_steps]


def summarize_checkpoint_run(records: list[dict[str, Any]], every: int, skip_steps: int) -> dict[str, Any]:
    """A run's checkpoint times and step-time medians (see the module docstring)."""
    steps = [r["step"] for r in records]
    if steps != list(range(len(records))):
        raise ValueError(f"expected steps 0..{len(records) - 1} once each, got {steps}")
    saved = checkpoint_steps(len(records), every)
    after = {s + 1 for s in saved}
    after_steps = [r["timing/step_s"] for r in records if r["step"] in after and r["step"] >= skip_steps]
    other_steps = [r["timing/step_s"] for r in records if r["step"] not in after and r["step"] >= skip_steps]
    return {
        "checkpoint_s": [records[s]["timing/checkpoint_s"] for s in saved],
        "step_after_checkpoint_s": after_steps,
        "other_step_s": other_steps,
        "time_s": records[-1]["time_s"],
    }


# ---- timing two ways of one computation ---------------------------------------------------------

@dataclass(slots=True)
class Timing:
    """Median cost of one step."""

    wall_s: float
    """Wall-clock seconds."""
    cpu_s: float
    """CPU seconds of this process (all threads): robust to other jobs sharing the cores."""


def interleaved_medians(steps: dict[str, Any], model: Any, *, warmup: int, reps: int,
                        cuda: bool = False) -> dict[str, Timing]:
    """Warm up each step (a callable), then time them alternately `reps` times; medians per step.

    model: the torch module every step puts gradients on (zeroed after each step); cuda: wait for
    the queued kernels before each clock reading. Alternating (a, b, a, b, ...) exposes every
    step to the same background load.
    """
    import torch

    for step in steps.values():
        for _ in range(warmup):
            step()
            model.zero_grad(set_to_none=True)
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            if cuda:
                torch.cuda.synchronize()
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            step()
            if cuda:  # the step's kernels are queued: its time ends when they have run
                torch.cuda.synchronize()
            wall[name].append(time.perf_counter() - wall_start)
            cpu[name].append(time.process_time() - cpu_start)
            model.zero_grad(set_to_none=True)
    return {name: Timing(statistics.median(wall[name]), statistics.median(cpu[name])) for name in steps}
