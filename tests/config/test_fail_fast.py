"""Bad input is reported in one line, naming what is wrong and where, before anything costly starts:
no process group, no Ray head, no worker (issue 11, part 3)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from async_grpo.config.model_path import ModelPathError, check_model_dir
from setup_model import load_tokenizer
from support.paths import REPO_ROOT
from trainer_core import CONFIG_ERROR_EXIT

START_TIMEOUT_S = 180  # importing torch, Ray and transformers takes ~10-20 s on 2 busy cores
# A port nothing listens on: reaching Ray at all would fail with a different error than the one checked.
UNREACHABLE_RAY = "127.0.0.1:9"


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "RAY_ADDRESS")}
    return subprocess.run([sys.executable, str(REPO_ROOT / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=START_TIMEOUT_S)


def _one_line(done: subprocess.CompletedProcess) -> str:
    """The error line: the last of stderr, the only one that is not an INFO progress log record."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == CONFIG_ERROR_EXIT, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert all(" INFO " in line for line in lines[:-1]), done.stderr
    return lines[-1]


def _good_lines(count: int) -> list[str]:
    return [json.dumps({"prompt": f"{i}+1=", "gt_answer": str(i + 1)}) for i in range(count)]


def test_check_model_dir_names_the_path_and_what_is_missing(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert check_model_dir(tiny_model_dir) == tiny_model_dir
    with pytest.raises(ModelPathError, match=r"model path '.*/absent' does not exist \(a local Hugging Face"):
        check_model_dir(tmp_path / "absent")
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"")
    with pytest.raises(ModelPathError, match="is a file; a Hugging Face model folder is expected"):
        check_model_dir(a_file)
    no_config = tmp_path / "no-config"
    shutil.copytree(tiny_model_dir, no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(ModelPathError, match="has no config.json, so it is not a Hugging Face model folder"):
        check_model_dir(no_config)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, no_weights)
    for weights in no_weights.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelPathError, match=r"has no \*\.safetensors weights"):
        check_model_dir(no_weights)
    # A missing local folder is not mistaken for a hub repo id (transformers' "Repo id must be ...").
    with pytest.raises(ModelPathError, match="does not exist"):
        load_tokenizer("/nonexistent/Qwen2.5-0.5B")


@pytest.mark.system
def test_trainer_reports_a_missing_model_path_before_any_start_up(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(_good_lines(4)) + "\n")
    line = _one_line(_run("trainer_core.py", "--model.model_path", str(tmp_path / "nope"), "--data.path", str(data),
                          "--run_dir", str(tmp_path / "run"), "--ray_address", UNREACHABLE_RAY, cwd=tmp_path))
    assert line.startswith(f"trainer_core.py: model path '{tmp_path / 'nope'}' does not exist"), line
    assert not (tmp_path / "run").exists()  # stopped before making its run directory


@pytest.mark.system
def test_trainer_reports_a_bad_line_with_file_and_line_before_any_start_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "data.jsonl"
    lines = _good_lines(6) + ['{"prompt": "7+1=", "gt_answer": 8}']  # line 7: the answer is not a string
    data.write_text("\n".join(lines) + "\n")
    line = _one_line(_run("trainer_core.py", "--model.model_path", str(tiny_model_dir), "--data.path", str(data),
                          "--run_dir", str(tmp_path / "run"), "--ray_address", UNREACHABLE_RAY, cwd=tmp_path))
    assert line.startswith(f"trainer_core.py: {data}:7: "), line
    assert not (tmp_path / "run").exists()


@pytest.mark.system
def test_local_cluster_reports_its_own_bad_flags_in_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The launcher's own flags (before `--`): a missing run directory or a value its field refuses is
    one line naming the field, exit 2, no traceback (it once raised ConfigError's traceback)."""
    no_run_dir = _run("local_cluster.py", "--model_path", str(tiny_model_dir), cwd=tmp_path)
    assert _one_line(no_run_dir) == ("local_cluster.py: LocalClusterConfig: LocalClusterConfig needs run_dir "
                                     "(--run_dir) or log_dir"), no_run_dir.stderr
    log_dir_only = _run("local_cluster.py", "--model_path", str(tiny_model_dir), "--log_dir", str(tmp_path / "logs"),
                        cwd=tmp_path)
    assert _one_line(log_dir_only) == "local_cluster.py: --run_dir is required (the trainer's run directory)"
    bad_count = _run("local_cluster.py", "--model_path", str(tiny_model_dir), "--run_dir", str(tmp_path / "run"),
                     "--generation_workers", "-1", cwd=tmp_path)
    assert _one_line(bad_count).startswith("local_cluster.py: "), bad_count.stderr
    assert "generation_workers" in _one_line(bad_count), bad_count.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.system
def test_local_cluster_checks_the_trainer_inputs_before_starting_ray_or_workers(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(_good_lines(6) + ["{not json"]) + "\n")
    logs = tmp_path / "logs"
    done = _run("local_cluster.py", "--model_path", str(tiny_model_dir), "--run_dir", str(tmp_path / "run"),
                "--log_dir", str(logs), "--", "--data.path", str(data), cwd=tmp_path)
    line = _one_line(done)
    assert line.startswith(f"local_cluster.py: {data}:7: "), line
    assert "Ray head at" not in done.stderr + done.stdout
    assert not logs.exists() or not any(logs.iterdir())  # no dispatcher was started

    # A config error of the trainer's own flags is caught there too, in the trainer's words.
    bad_budget = _run("local_cluster.py", "--model_path", str(tiny_model_dir), "--run_dir", str(tmp_path / "run"),
                      "--", "--data.path", str(data), "--max_tokens_per_gpu", "3", cwd=tmp_path)
    assert "TrainerConfig.max_tokens_per_gpu=3 is below" in _one_line(bad_budget)


@pytest.mark.system
def test_dispatcher_reports_a_folder_that_is_not_a_model_before_joining_ray(tmp_path: Path) -> None:
    folder = tmp_path / "weights-only"
    folder.mkdir()
    line = _one_line(_run("worker_dispatcher.py", "--mode", "generation", "--model_path", str(folder),
                          "--ray_address", UNREACHABLE_RAY, cwd=tmp_path))
    assert line == (f"worker_dispatcher.py: model path '{folder}' has no config.json, so it is not a Hugging Face "
                    f"model folder (save one with save_pretrained, or point at the folder holding it)")


@pytest.mark.parametrize("flag, value, field", [
    ("--global_num_verifiers", "0", "VerificationConfig.global_num_verifiers must be >= 1 or None, got 0"),
    ("--verifier_timeout_s", "-1", "VerificationConfig.verifier_timeout_s must be > 0 or None, got -1.0"),
    ("--health_timeout_s", "0", "HealthCheckConfig.health_timeout_s must be > 0, got 0.0"),
    ("--restart_backoff_s", "-2", "RestartConfig.restart_backoff_s must be >= 0, got -2.0"),
    ("--connect_timeout_s", "0", "RayConnectionConfig.connect_timeout_s must be > 0, got 0.0"),
])
def test_dispatcher_checks_every_section_it_hands_the_worker_before_joining_ray(
        flag: str, value: str, field: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """In process, in the fast tier: a Ray start here would fail the test (tests/conftest.py)."""
    from worker_dispatcher import main

    rc = main(["--mode", "generation", "--model_path", str(tiny_model_dir), flag, value,
               "--ray_address", UNREACHABLE_RAY])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == CONFIG_ERROR_EXIT and len(err) == 1, err
    assert err[0].startswith("worker_dispatcher.py: ") and field in err[0], err


@pytest.mark.parametrize("cuda, line", [
    (False, "weight_transfer 'nccl_m2n' is one of vLLM's CUDA engines and this node has no CUDA"),
    (True, "weight_transfer 'nccl_m2n' needs nccl.m2n importable in the generation worker's node, and it is not "
           "(nccl.m2n: NVIDIA's nccl-extensions"),
])
def test_dispatcher_refuses_a_weight_transfer_its_node_cannot_serve_before_joining_ray(
        cuda: bool, line: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """nccl_m2n without CUDA, and (CUDA faked: this machine has no nccl.m2n either way) without
    NVIDIA's nccl.m2n package: one line, exit 2, no Ray."""
    import worker_dispatcher

    monkeypatch.setattr(worker_dispatcher, "node_runs_cuda", lambda: cuda)
    rc = worker_dispatcher.main(["--mode", "generation", "--model_path", str(tiny_model_dir),
                                 "--weight_transfer", "nccl_m2n", "--ray_address", UNREACHABLE_RAY])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == CONFIG_ERROR_EXIT and len(err) == 1, err
    assert err[0].startswith(f"worker_dispatcher.py: {line}"), err
