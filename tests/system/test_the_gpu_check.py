"""The GPU check can fail (issue 56, item 6): benchmarks/gpu_report.py exits 1 on a failed row with
its summary line still last, and its gradient-checkpointing choice follows placement.trainer_bytes;
scripts/gpu_check.sh's part and verdict functions (scripts/gpu_check_parts.sh, the same ones it
sources) fail on a failed part or row and name it; scripts/gpu_system_check.py says in its last
line what it did not run when Ray and vLLM do not import; and its verdicts on the probe's tokens
and on memory against the plan fail where they should. No GPU needed: the smoke report runs on
CPU, and the shell functions are run on parts made to fail.

    .venv/bin/python -m pytest tests/system/test_the_gpu_check.py -q
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from async_grpo.launch.placement import GiB, ModelShape, RunShape, trainer_bytes
from async_grpo.demo_assets.tiny_model import PRESETS, build_tiny_tokenizer, hf_config
from benchmarks.harness import parse_summary_line
from support.paths import REPO_ROOT

RUN_TIMEOUT_S = 300  # each command takes seconds; a busy 2-core machine, many times that
# A part limit no subprocess can meet: the report's trainer_throughput row fails at once.
INSTANT_TIMEOUT_S = "0.01"
SYSTEM_CHECK = REPO_ROOT / "scripts" / "gpu_system_check.py"
HIDDEN = "hidden by the test"


def _report(tmp_path: Path, gpu_memory_gib: str) -> tuple[subprocess.CompletedProcess, Path]:
    """gpu_report's smoke (tiny model, CPU) with its one trainer_throughput row timed out."""
    table = tmp_path / "gpu_report.md"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_report", "--smoke", "true", "--run_tests", "false",
         "--run_logprob_batching", "false", "--part_timeout_s", INSTANT_TIMEOUT_S, "--gpu_memory_gib", gpu_memory_gib,
         "--out", str(table)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return done, table


def _tiny_estimate_gib(tokens: int) -> float:
    shape = ModelShape.from_hf_config(hf_config(PRESETS["tiny"], build_tiny_tokenizer()).to_dict())
    return trainer_bytes(shape, RunShape(trainer_ranks=1, max_tokens_per_gpu=tokens)) / GiB


@pytest.mark.system
@pytest.mark.parametrize(("gpu_memory_gib", "choice"), [("0.5", "on"), ("1000", "off")])
def test_gpu_report_exits_1_on_a_failed_row_and_checkpoints_by_the_estimate(
        tmp_path: Path, gpu_memory_gib: str, choice: str) -> None:
    done, table = _report(tmp_path, gpu_memory_gib)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    name, figures = parse_summary_line(done.stdout.strip().splitlines()[-1])
    assert name == "gpu_report" and figures["failed"] == "1", done.stdout
    (row,) = [line for line in table.read_text().splitlines() if line.startswith("| trainer_throughput tiny")]
    assert f"failed: timed out after {INSTANT_TIMEOUT_S} s" in row, row
    # The smoke's 256 tokens per rank (gpu_report.SMOKE): the estimate placement.py gives now.
    assert f"gradient checkpointing {choice} (estimate {_tiny_estimate_gib(256):.1f} GiB" in row, row


def _parts(tmp_path: Path, script: str) -> subprocess.CompletedProcess:
    """`script` run after sourcing scripts/gpu_check_parts.sh, its summary in tmp_path/summary.md."""
    prelude = f"summary={tmp_path / 'summary.md'}; : > \"$summary\"; source scripts/gpu_check_parts.sh\n"
    return subprocess.run(["bash", "-c", prelude + script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def _verdict(tmp_path: Path) -> str:
    return (tmp_path / "summary.md").read_text().strip().splitlines()[-1]


@pytest.mark.system
def test_the_check_fails_and_names_a_failed_part_a_timed_out_part_and_a_failed_row(tmp_path: Path) -> None:
    _, table = _report(tmp_path, "1000")
    done = _parts(tmp_path, f"part good 60 {tmp_path}/good.log true\n"
                            f"part bad 60 {tmp_path}/bad.log bash -c 'echo boom; exit 3'\n"
                            f"part slow 1 {tmp_path}/slow.log sleep 30\n"
                            f"part report 60 {tmp_path}/report.log true\n"
                            f"failed_rows report {table}\n"
                            "finish")
    assert done.returncode == 1, done.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "- good: ok" in summary and "- bad: failed (exit 3)" in summary and "last line: boom" in summary
    assert "- slow: timed out after 1 s" in summary
    assert f"  - failed row: trainer_throughput tiny, attn default: failed: timed out after {INSTANT_TIMEOUT_S} s" \
        in summary, summary
    assert _verdict(tmp_path) == "gpu_check: FAILED: bad, slow, report row 'trainer_throughput tiny, attn default'"


@pytest.mark.system
def test_a_part_that_ran_in_part_is_named_in_the_last_line_without_failing(tmp_path: Path) -> None:
    done = _parts(tmp_path, f"part good 60 {tmp_path}/good.log true\n"
                            f"part partial 60 {tmp_path}/partial.log echo 'x: not run: the probe (needs vllm)'\n"
                            "finish")
    assert done.returncode == 0, done.stderr
    assert "- partial: ran in part" in (tmp_path / "summary.md").read_text()
    assert _verdict(tmp_path) == "gpu_check: ok: 2 parts, none failed; not run: the probe (needs vllm)"


def test_gpu_check_runs_its_parts_through_the_tested_functions() -> None:
    """gpu_check.sh sources the functions tested here, lists the report's failed rows, and exits
    with the verdict's status (no own copy of them to drift)."""
    text = (REPO_ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "source scripts/gpu_check_parts.sh" in text
    assert "\npart() {" not in text and 'failed_rows "gpu report" "$out/gpu_report.md"' in text
    assert text.rstrip().endswith("finish\nstatus=$?\ncat \"$summary\"\nexit $status")


def _hidden_ray_and_vllm(tmp_path: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes `import ray` and `import vllm` fail."""
    for name in ("ray", "vllm"):
        (tmp_path / "hide" / name).mkdir(parents=True)
        (tmp_path / "hide" / name / "__init__.py").write_text(f"raise ImportError({HIDDEN!r})\n")
    return tmp_path / "hide"


@pytest.mark.system
def test_the_system_check_says_in_its_last_line_what_it_did_not_run(tmp_path: Path) -> None:
    hide = _hidden_ray_and_vllm(tmp_path)
    command = f"env PYTHONPATH={hide} {sys.executable} {SYSTEM_CHECK} --out_dir {tmp_path / 'system'}"
    done = _parts(tmp_path, f"part system 120 {tmp_path}/system.log {command}\nfinish")
    log = (tmp_path / "system.log").read_text()
    assert done.returncode == 0, log
    last = log.strip().splitlines()[-1]
    assert last.startswith("gpu_system_check: not run: the system check (the demo on one GPU"), last
    assert f"needs ray and vllm, not importable here: ray (ImportError: {HIDDEN}), vllm (ImportError: {HIDDEN})" \
        in last, last
    assert _verdict(tmp_path) == f"gpu_check: ok: 1 parts, none failed; not run: {last.split(': not run: ', 1)[1]}"


# ---- the system check's verdicts (pure) ------------------------------------------------------------

@pytest.fixture(scope="module")
def system_check() -> ModuleType:
    """scripts/gpu_system_check.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_system_check", SYSTEM_CHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TRAINED = [[5, 2], [7, 2], [9, 2], [4, 2]]  # greedy tokens per prompt; 2 plays EOS
RANDOM = [[1, 1, 1], [3, 3, 3], [6, 6, 6], [8, 8, 8]]


def _probe(system_check: ModuleType, random: list[list[int]], pushed: list[list[int]]) -> tuple[dict, list[str]]:
    result = system_check.ProbeResult(trained_hf=TRAINED, random_engine=random, pushed_engine=pushed,
                                      answers=["5", "7", "0", "4"],
                                      texts={"trained_hf": ["5", "7", "9", "4"]})
    return system_check.probe_verdicts(result)


def test_the_probe_passes_only_when_the_push_makes_the_engine_answer_as_hf(system_check: ModuleType) -> None:
    figures, failures = _probe(system_check, RANDOM, TRAINED)
    assert failures == [] and figures["probe_pushed_matches"] == 4 and figures["probe_random_differs"] == 4
    assert figures["probe_correct_trained_hf"] == 3
    _, failures = _probe(system_check, RANDOM, RANDOM)  # a push that changed nothing
    assert len(failures) == 1 and "equal HF's on 0 of 4 prompts (first difference, prompt 0" in failures[0]
    _, failures = _probe(system_check, RANDOM, [*TRAINED[:3], [4, 4]])  # one answer off by a token
    assert len(failures) == 1 and "on 3 of 4 prompts (first difference, prompt 3" in failures[0]
    _, failures = _probe(system_check, TRAINED, TRAINED)  # an engine that started on the trained weights
    assert len(failures) == 1 and "cannot tell a push that changed nothing" in failures[0]


def test_memory_above_the_plans_estimate_or_never_seen_fails(system_check: ModuleType) -> None:
    estimates = {"trainer rank": 4 * GiB, "logprob-type worker": 2 * GiB, "engine": 10 * GiB}
    lines, failures = system_check.memory_verdicts(
        {"trainer rank": 3 * GiB, "logprob-type worker": 2 * GiB, "engine": 10 * GiB}, estimates)
    assert failures == [] and len(lines) == 3
    _, failures = system_check.memory_verdicts({"trainer rank": 5 * GiB, "engine": GiB, "other": GiB}, estimates)
    assert failures == ["trainer rank: peak GPU memory 5.00 GiB, above the plan's estimate 4.00 GiB",
                        "logprob-type worker: planned at 2.00 GiB, never seen on the GPU by nvidia-smi"]
