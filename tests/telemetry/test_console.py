"""The quiet console (docs/console.md): what a person watching a run sees, and run_dir/run.log.

Unit tests build each piece (the logging setup, the progress text, the evaluation line, the drop
warnings, the summary, the dispatcher-log relay) from hand-written records and compare with
values worked out here. One real run (`python local_cluster.py`, as the demo starts it: a private
Ray head, a vLLM generation worker, a logprob worker, torchrun with 2 ranks) checks the console
of the whole system: no per-step INFO lines and none of Ray's, vLLM's or torchrun's start-up
lines, the progress and evaluation lines and the summary with the figures of its metrics.jsonl,
and the per-step lines in run.log.
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from async_grpo.launch.dispatcher_logs import DispatcherLogRelay, relayed
from async_grpo.telemetry.console import (
    CONSOLE, LOG_FILE, ConsoleFilter, ConsoleProgress, DropWarnings, configure_logging, eval_line, progress_text,
)
from async_grpo.telemetry.metrics import MetricsLogger, read_metrics
from async_grpo.telemetry.run_report import drop_counts, drops_text, run_summary, timing_line
from support.paths import REPO_ROOT


@pytest.fixture
def restore_logging():
    """configure_logging changes process-wide state: put the root and Ray loggers back after."""
    root, ray_logger = logging.getLogger(), logging.getLogger("ray")
    saved = (list(root.handlers), root.level, list(ray_logger.handlers), ray_logger.propagate)
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])
    ray_logger.handlers[:] = saved[2]
    ray_logger.propagate = saved[3]


def _log_the_kinds() -> None:
    logging.getLogger("async_grpo.weights.weight_sync").info("pushed weights v1")
    logging.getLogger("async_grpo.trainer.evaluation").info("an evaluation line", extra=CONSOLE)
    logging.getLogger("async_grpo.telemetry.metrics").warning("a drop warning")
    logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
    logging.getLogger("ray._private.authentication").warning("Token authentication is enabled")
    logging.getLogger("ray.actor").error("an actor died")
    logging.getLogger("vllm.engine").warning("Triton is not installed")


def test_the_default_console_shows_marked_lines_and_warnings_the_file_every_info_line(
        tmp_path: Path, capsys: pytest.CaptureFixture, restore_logging) -> None:
    log_file = tmp_path / LOG_FILE
    configure_logging("warning", log_file=log_file, tag="[rank0] ")
    _log_the_kinds()
    console = capsys.readouterr().err.splitlines()
    # hh:mm:ss, then the message; level and module only on warnings and errors.
    assert [line[9:] for line in console] == [
        "an evaluation line", "WARNING [rank0] metrics: a drop warning", "ERROR [rank0] ray.actor: an actor died"]
    assert all(line[2] == line[5] == ":" for line in console)
    in_file = [line.split(" ", 2)[2] for line in log_file.read_text().splitlines()]  # without the date and time
    assert in_file == [
        "[rank0] INFO async_grpo.weights.weight_sync: pushed weights v1", "[rank0] INFO async_grpo.trainer.evaluation: an evaluation line",
        "[rank0] WARNING async_grpo.telemetry.metrics: a drop warning", "[rank0] INFO ray._private.worker: Started a local Ray instance.",
        "[rank0] WARNING ray._private.authentication: Token authentication is enabled",
        "[rank0] ERROR ray.actor: an actor died", "[rank0] WARNING vllm.engine: Triton is not installed"]


def test_log_level_info_brings_every_line_to_the_console(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         restore_logging) -> None:
    configure_logging("info", log_file=tmp_path / LOG_FILE, tag="[launcher] ")
    _log_the_kinds()
    console = capsys.readouterr().err.splitlines()
    assert [line.split(" ", 2)[2] for line in console] == [
        line.split(" ", 2)[2] for line in (tmp_path / LOG_FILE).read_text().splitlines()]
    assert len(console) == 7


def test_the_run_log_waits_for_its_folder(tmp_path: Path, restore_logging) -> None:
    """A run that fails its input checks leaves no run directory: run.log starts once it exists."""
    run_dir = tmp_path / "run"
    configure_logging("warning", log_file=run_dir / LOG_FILE)
    logging.getLogger("async_grpo.data.dataset").info("loaded 4 prompts")
    assert not run_dir.exists()
    run_dir.mkdir()
    logging.getLogger("async_grpo.weights.weight_sync").info("pushed weights v0")
    assert [line.split(": ", 1)[1] for line in (run_dir / LOG_FILE).read_text().splitlines()] == [
        "loaded 4 prompts", "pushed weights v0"]


def test_other_ranks_show_warnings_only(capsys: pytest.CaptureFixture, restore_logging) -> None:
    configure_logging("warning", log_file=None, tag="[rank1] ", show_marked=False)
    _log_the_kinds()
    assert [line[9:] for line in capsys.readouterr().err.splitlines()] == [
        "WARNING [rank1] metrics: a drop warning", "ERROR [rank1] ray.actor: an actor died"]


def test_configure_logging_takes_over_rays_own_handler(tmp_path: Path, restore_logging) -> None:
    import importlib

    importlib.import_module("ray")  # Ray installs its own handler on the "ray" logger when imported
    configure_logging("warning", log_file=tmp_path / LOG_FILE)
    assert logging.getLogger("ray").handlers == [] and logging.getLogger("ray").propagate


def test_console_filter_levels() -> None:
    def passes(level: int, name: str, record_level: int, marked: bool = False, show_marked: bool = True) -> bool:
        record = logging.LogRecord(name, record_level, "f.py", 1, "m", None, None)
        if marked:
            record.console = True
        return ConsoleFilter(level, show_marked).filter(record)

    assert passes(logging.WARNING, "metrics", logging.INFO, marked=True)
    assert not passes(logging.WARNING, "metrics", logging.INFO, marked=True, show_marked=False)
    assert not passes(logging.WARNING, "raylet_like", logging.INFO)
    assert passes(logging.WARNING, "raylet_like", logging.WARNING)  # only "ray" and "ray.*" are quiet
    assert not passes(logging.WARNING, "ray", logging.WARNING) and passes(logging.WARNING, "ray", logging.ERROR)
    assert passes(logging.INFO, "vllm.config", logging.INFO) and not passes(logging.INFO, "vllm", logging.DEBUG)
    assert passes(logging.DEBUG, "metrics", logging.DEBUG)


def test_progress_text() -> None:
    rewards = [0.0] * 5 + [0.5] * 5 + [1.0] * 2
    # mean10 over the last ten: 3 x 0 + 5 x 0.5 + 2 x 1 = 4.5 -> 0.45
    assert progress_text(rewards, 1.234, None) == "reward 1.000 mean10 0.450 step 1.2s"
    assert progress_text([0.25, 0.5], 0.96, 0.875) == "reward 0.500 mean10 0.375 eval 0.875 step 1.0s"
    assert progress_text([0.25, 0.5, 1.0], 2.0, None, window=2) == "reward 1.000 mean2 0.750 step 2.0s"


def _record(reward: float, step_s: float = 1.0, **extra: float) -> dict[str, float]:
    return {"reward/mean": reward, "timing/step_s": step_s, **extra}


def test_plain_progress_prints_a_line_every_tenth_of_the_run(caplog: pytest.LogCaptureFixture) -> None:
    progress = ConsoleProgress(25, initial=5, interactive=False)  # a resumed run: 20 steps left, a line every 2
    with caplog.at_level(logging.INFO, logger="async_grpo.telemetry.console"):
        for step in range(5, 25):
            extra = {"eval/accuracy": 0.5} if step == 10 else {}
            progress.update(step, _record(step / 100, **extra))
    progress.close()
    lines = [r.getMessage() for r in caplog.records if getattr(r, "console", False)]
    assert [line.split(":")[0] for line in lines] == [f"{n}/25 steps" for n in range(7, 26, 2)]
    assert lines[0] == "7/25 steps: reward 0.060 mean10 0.055 step 1.0s"
    # The last evaluation stays on the line once there is one; mean10 over steps 15-24.
    assert lines[-1] == "25/25 steps: reward 0.240 mean10 0.195 eval 0.500 step 1.0s"


def test_eval_line() -> None:
    record = _record(0.5, **{"eval/accuracy": 0.93, "eval/pass@4": 0.99, "eval/num_prompts": 100.0,
                             "eval/time_s": 1.04, "eval/mean_response_tokens": 3.0})
    assert eval_line(99, record) == "eval after step 99: greedy accuracy 0.930, pass@4 0.990 on 100 prompts (1.0 s)"
    assert eval_line(7, _record(0.5, **{"eval/accuracy": 0.25})) == "eval after step 7: greedy accuracy 0.250"
    assert eval_line(3, _record(0.5)) is None


def test_drop_warnings_come_at_once_then_at_most_every_twenty_steps() -> None:
    drops = DropWarnings(every=20)
    stale = {"counts/dropped_stale": 2.0}
    seen = {}
    for step in range(45):
        extra = stale if step in (1, 5, 7, 30, 44) else {}
        if step == 30:
            extra = {**stale, "counts/timed_out_prompts": 1.0}
        message = drops.observe(step, _record(0.5, **extra))
        if message is not None:
            seen[step] = message
    assert seen == {
        1: "step 1: 2 stale rollouts dropped (per-step counts in metrics.jsonl)",
        21: "steps 5-7 (2 steps): 4 stale rollouts dropped (per-step counts in metrics.jsonl)",
        # 30 drops after the warning at 21: held until 41.
        41: "step 30: 2 stale rollouts dropped, 1 prompts timed out (per-step counts in metrics.jsonl)",
    }
    assert drops.flush() == "step 44: 2 stale rollouts dropped (per-step counts in metrics.jsonl)"
    assert drops.flush() is None


def test_drop_counts_ignore_routine_and_zero_counts() -> None:
    records = [_record(0.5, **{"counts/dropped_stale": 0.0, "counts/reward_failed": 15.0}),
               _record(0.5, **{"counts/redispatched_requests": 3.0, "batcher/missing_rollouts": 1.0}),
               _record(0.5, **{"counts/redispatched_requests": 1.0, "counts/dropped_groups_masked": 2.0})]
    totals = drop_counts(records)
    assert totals == {"batcher/missing_rollouts": 1.0, "counts/redispatched_requests": 4.0,
                      "counts/dropped_groups_masked": 2.0}
    assert drops_text(totals) == ("1 rollouts missing from generation, 4 requests re-sent after their worker failed, "
                                  "2 groups dropped for too few scored samples")


def _write_run(run_dir: Path) -> Path:
    """A 12-step run: rewards 0, .1, ..., 1.1 (step i: i/10), 2 s steps of 0.5 wait + 1 train +
    0.25 push; evaluations after steps 5 (0.5) and 11 (0.75); 3 stale rollouts dropped at step 4."""
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(12):
        record = {"step": step, "time_s": 2.0 * (step + 1), "reward/mean": step / 10, "timing/step_s": 2.0,
                  "timing/wait_s": 0.5, "timing/train_s": 1.0, "timing/push_s": 0.25,
                  "counts/dropped_stale": 3.0 if step == 4 else 0.0}
        if step in (5, 11):
            record.update({"eval/accuracy": 0.5 if step == 5 else 0.75, "eval/time_s": 1.0 if step == 5 else 3.0})
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_run_summary_by_hand(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "hand")
    # 10-step means: steps 0-9 -> 0.45 (first full window, reaches nothing); 10 -> 0.55 (>= 0.5,
    # 22 s = 0.4 min); 11 -> 0.65 (>= 0.6, 24 s); never 0.9. Last 10 steps: 0.65.
    assert run_summary(run).splitlines() == [
        "hand: 10-step mean reward first reached 0.5: step 10 (0.4 min); 0.6: step 11 (0.4 min); 0.9: not reached; "
        "last 10 steps 0.650, best 0.650 at step 11, final greedy eval accuracy 0.750; median step 2.00 s",
        "medians over all steps: step_s=2.000 wait_s=0.500 train_s=1.000 push_s=0.250 rest_s=0.250 eval_time_s=2.000",
        "dropped or re-sent: 3 stale rollouts dropped",
    ]
    assert timing_line([run, run]) == run_summary(run).splitlines()[1]


def test_a_run_that_ended_below_its_best_says_so(tmp_path: Path) -> None:
    """Rewards rise by 0.1 a step to 1.1 at step 11, then fall from 0.9 to 0.2 (steps 12-19). By
    hand: the best 10-step mean is steps 6-15, (0.6 + 0.7 + 0.8 + 0.9 + 1.0 + 1.1 + 0.9 + 0.8 + 0.7
    + 0.6) / 10 = 0.81; the last, steps 10-19, (1.0 + 1.1 + 0.9 + ... + 0.2) / 10 = 0.65: 0.16 below."""
    run = tmp_path / "fell"
    run.mkdir()
    rewards = [s / 10 for s in range(12)] + [1.0 - s / 10 for s in range(1, 9)]
    lines = [json.dumps({"step": i, "time_s": 2.0 * (i + 1), "reward/mean": r, "timing/step_s": 2.0})
             for i, r in enumerate(rewards)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    line = run_summary(run).splitlines()[0]
    assert "last 10 steps 0.650, best 0.810 at step 15 (ENDED 0.16 BELOW ITS BEST)" in line, line


def test_metrics_logger_prints_evaluations_and_drops(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sink = MetricsLogger(tmp_path, tensorboard=False, progress_total=3, progress_bar=False)
    base = {"reward/accuracy": 0.5, "loss/kl": 0.0, "response/length_mean": 3.0, "entropy/first_token": 1.0}
    with caplog.at_level(logging.INFO, logger="async_grpo.telemetry.metrics"):
        sink.log(0, {**_record(0.5), **base, "counts/dropped_stale": 1.0})
        sink.log(1, {**_record(0.5), **base, "eval/accuracy": 0.25})
        sink.log(2, {**_record(0.5), **base, "counts/timed_out_prompts": 2.0})
        sink.close()
    shown = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING
             or getattr(r, "console", False)]
    assert shown == [("WARNING", "step 0: 1 stale rollouts dropped (per-step counts in metrics.jsonl)"),
                     ("INFO", "eval after step 1: greedy accuracy 0.250"),
                     ("WARNING", "step 2: 2 prompts timed out (per-step counts in metrics.jsonl)")]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]


DISPATCHER_LOG = """\
2026-11-25 19:00:59,580\tINFO worker.py:1841 -- Connecting to existing Ray cluster at address: 127.0.0.1:33271...
2026-11-25 19:01:01,477 INFO __main__: starting generation-worker-0 on node 3b2a (gpus=0)
(GenerationWorkerActor pid=26198) (EngineCore pid=26379) WARNING 11-25 19:01:18 [cpu_worker.py:114] libtcmalloc is not found
2026-11-25 19:05:00,001 WARNING __main__: health() of worker generation-worker-0 failed: ActorDiedError: died
worker generation-worker-0 restarting (1 of 3): the actor died
2026-11-25 19:05:00,002 WARNING __main__: starting a replacement for generation-worker-0 in 5 s
worker generation-worker-0 failed: no READY; giving up after 3 restart(s) (--max_restarts 3)
"""


def test_relayed_dispatcher_lines() -> None:
    assert [relayed(line) for line in DISPATCHER_LOG.splitlines()] == [
        None, None, None,
        "health() of worker generation-worker-0 failed: ActorDiedError: died",
        "worker generation-worker-0 restarting (1 of 3): the actor died",
        "starting a replacement for generation-worker-0 in 5 s",
        "worker generation-worker-0 failed: no READY; giving up after 3 restart(s) (--max_restarts 3)",
    ]


def test_the_relay_repeats_complete_new_lines_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = tmp_path / "generation-0_worker.log"
    relay = DispatcherLogRelay([("generation-0", log), ("logprob-0", tmp_path / "not-yet.log")])
    lines = DISPATCHER_LOG.splitlines(keepends=True)
    with caplog.at_level(logging.WARNING, logger="local_cluster"):
        log.write_text("".join(lines[:4]) + lines[4][:10])  # the restart line still being written
        relay.poll()
        relay.poll()
        with log.open("a") as f:
            f.write(lines[4][10:])
        relay.stop()  # never started: stop still relays what is left
    assert [r.getMessage() for r in caplog.records] == [
        "generation-0 worker: health() of worker generation-worker-0 failed: ActorDiedError: died",
        "generation-0 worker: worker generation-worker-0 restarting (1 of 3): the actor died"]


# One real run, as the demo starts it. Small steps (2 ranks x 4 prompts x 8 rollouts, as in
# the 3-step runs of tests/system/test_end_to_end.py); engines uncompiled to start sooner.
STEPS = 3
REAL_RUN_TIMEOUT_S = 1200
_CLOCK = re.compile(r"^\d\d:\d\d:\d\d ")
_INFO_RECORD = re.compile(r"\bINFO ([\w.]+: |[\w.]+\.py:\d+ |\d\d-\d\d )")


@pytest.mark.vllm
@pytest.mark.distributed
@pytest.mark.system
def test_a_real_run_prints_progress_evaluations_and_the_summary_only(demo_assets: Path, tmp_path: Path) -> None:
    from async_grpo.demo_assets.arithmetic_data import write_arithmetic_table

    table = write_arithmetic_table(tmp_path / "eval.jsonl", max_operand=2)  # 9 held-out prompts
    run = tmp_path / "run"
    command = [sys.executable, str(REPO_ROOT / "local_cluster.py"), "--model_path", str(demo_assets / "model"),
               "--run_dir", str(run), "--kv_cache_memory_bytes", str(128 * 2**20), "--max_model_len", "64",
               "--global_num_verifiers", "1", "--enforce_eager", "true", "--",
               "--config", str(REPO_ROOT / "configs" / "demo.yaml"), "--data.path", str(demo_assets / "arithmetic.jsonl"),
               "--eval.data.path", str(table), "--num_steps", str(STEPS), "--prompts_per_rank", "4",
               "--sampling.n", "8", "--sampling.max_tokens", "4", "--max_tokens_per_gpu", "256",
               "--data.max_prompt_tokens", "16", "--eval.every", "2", "--eval.pass_k", "2",
               "--checkpoint_at_end", "false", "--tensorboard", "false"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "RAY_ADDRESS")}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=REAL_RUN_TIMEOUT_S)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-4000:]

    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    rewards = [r["reward/mean"] for r in records]
    evals = {r["step"]: r for r in records if "eval/accuracy" in r}
    assert sorted(evals) == [1, 2]

    # None of the per-step INFO lines, nor Ray's, vLLM's, torchrun's or Hugging Face's start-up lines.
    for absent in ("pushed weights", "metrics: step", "Started a local Ray instance", "Connecting to",
                   "Token authentication", "OMP_NUM_THREADS", "Loading weights", "EngineCore", "[rank1]"):
        assert absent not in console, f"{absent!r} on the console:\n{console[-4000:]}"
    # An INFO record in our format (`INFO async_grpo.telemetry.metrics: `), Ray's (`INFO worker.py:1841 -- `) or vLLM's (`INFO 11-25 `).
    assert not _INFO_RECORD.search(console), console[-4000:]
    shown = [line[9:] for line in console.splitlines() if _CLOCK.match(line)]
    assert len(shown) == len(console.strip().splitlines()), console  # every line is one of ours
    warnings = [line for line in shown if line.startswith(("WARNING", "ERROR"))]

    def step_line(step: int) -> str:
        recent = rewards[max(0, step - 9): step + 1]
        seen = [evals[s]["eval/accuracy"] for s in sorted(evals) if s <= step]
        evaluated = f" eval {seen[-1]:.3f}" if seen else ""
        return (f"{step + 1}/{STEPS} steps: reward {rewards[step]:.3f} mean10 {sum(recent) / len(recent):.3f}"
                f"{evaluated} step {records[step]['timing/step_s']:.1f}s")

    def eval_text(step: int) -> str:
        r = evals[step]
        return (f"eval after step {step}: greedy accuracy {r['eval/accuracy']:.3f}, pass@2 {r['eval/pass@2']:.3f} "
                f"on 9 prompts ({r['eval/time_s']:.1f} s)")

    step_s = [r["timing/step_s"] for r in records]
    dropped = {key: sum(r.get(key, 0.0) for r in records) for key in (
        "counts/dropped_stale", "counts/timed_out_prompts", "batcher/missing_rollouts",
        "batcher/dropped_logprob_version", "counts/redispatched_requests")}
    info = [line for line in shown if line not in warnings]
    # The placement plan first (a CPU machine: one line), and the engine setting the launcher chose.
    assert info[:2] == ["placement: CPU only (no GPU found): every process on the CPU",
                        "engine settings for CPU (flags of the same name change them): dtype float32 (the CPU "
                        "trainer's dtype)"]
    info = info[2:]
    assert info[0] == (f"starting Ray (127.0.0.1 only), 2 workers (1 generation, 1 logprob), then the trainer "
                       f"(2 ranks); logs in {run}")
    assert info[1].startswith("workers ready after ") and info[1].endswith(f"(every INFO line in {run / LOG_FILE})")
    assert info[2:9] == [step_line(0), eval_text(1), step_line(1), eval_text(2), step_line(2),
                         f"training finished at step {STEPS}; metrics in {run / 'metrics.jsonl'}, every INFO line in "
                         f"{run / LOG_FILE}",
                         # fewer steps than the 10-step window: no level is reached
                         f"run: 10-step mean reward first reached 0.5: not reached; 0.6: not reached; 0.9: not "
                         f"reached; last 10 steps {statistics.mean(rewards):.3f}, best {statistics.mean(rewards):.3f} "
                         f"at step {STEPS - 1}, final greedy eval accuracy "
                         f"{evals[2]['eval/accuracy']:.3f}; median step {statistics.median(step_s):.2f} s"]
    assert info[9].startswith(f"medians over all steps: step_s={statistics.median(step_s):.3f} ")
    assert info[10].startswith("dropped or re-sent: ")
    if any(dropped.values()):
        assert all(f"{total:g} " in info[10] for total in dropped.values() if total), info[10]
    else:
        assert info[10] == "dropped or re-sent: nothing"
    assert len(info) == 11
    assert bool([w for w in warnings if "per-step counts in metrics.jsonl" in w]) == any(dropped.values())

    # run.log holds every INFO line: the per-step ones, the pushes, Ray's start-up.
    run_log = (run / LOG_FILE).read_text()
    for step, reward in enumerate(rewards):
        assert f"[rank0] INFO async_grpo.telemetry.metrics: step {step} reward {reward:.3f} " in run_log
    assert f"[rank0] INFO async_grpo.weights.trainer_object_store: pushed weights v{STEPS} " in run_log
    for line in ("[launcher] INFO ray._private.worker: Started a local Ray instance.",
                 "[rank0] INFO ray._private.worker: Connected to Ray cluster.",
                 "[launcher] INFO __main__: generation-0 worker registered"):
        assert line in run_log
    assert "Initializing a V1 LLM engine" in (run / "generation-0_worker.log").read_text()  # vLLM's start-up
