"""The one answer to "which GPUs may this run use" (async_grpo/runtime/host_gpus.py): the driver's
listing, the ASYNC_GRPO_HOST_GPUS override, and a scheduler's CUDA_VISIBLE_DEVICES, each faked."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.runtime.host_gpus import HostGpuError, host_gpus, listed_gpu_count, main


def _listing(tmp_path: Path, gpus: int) -> dict[str, str]:
    """An environment whose driver listing shows `gpus` GPUs."""
    listing = tmp_path / "gpus"
    listing.mkdir(exist_ok=True)
    for i in range(gpus):
        (listing / f"0000:{i:02x}:00.0").mkdir()
    return {"ASYNC_GRPO_NVIDIA_GPUS_DIR": str(listing)}


def test_the_driver_listing_counts_and_names_by_index(tmp_path: Path) -> None:
    assert listed_gpu_count({"ASYNC_GRPO_NVIDIA_GPUS_DIR": str(tmp_path / "absent")}) == 0
    gpus = host_gpus(_listing(tmp_path, 3))
    assert gpus.count == 3 and gpus.names == ("0", "1", "2")


def test_the_override_wins_over_the_listing(tmp_path: Path) -> None:
    env = _listing(tmp_path, 3)
    assert host_gpus(env | {"ASYNC_GRPO_HOST_GPUS": "8"}).count == 8
    assert host_gpus(env | {"ASYNC_GRPO_HOST_GPUS": "0"}).count == 0
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(HostGpuError, match=f"ASYNC_GRPO_HOST_GPUS must be an integer >= 0, got '{bad}'"):
            host_gpus(env | {"ASYNC_GRPO_HOST_GPUS": bad})


def test_a_schedulers_visible_devices_are_the_set_placed_on(tmp_path: Path) -> None:
    """A job given GPUs 4 and 6 of an 8-GPU node plans for two GPUs, and plan position 1 is GPU 6."""
    env = _listing(tmp_path, 8) | {"CUDA_VISIBLE_DEVICES": "4,6"}
    gpus = host_gpus(env)
    assert gpus.count == 2
    assert gpus.child_visible_devices((1,)) == "6" and gpus.child_visible_devices([0, 1]) == "4,6"
    with pytest.raises(HostGpuError, match="position 2 is outside the 2 GPU"):
        gpus.child_visible_devices((2,))
    uuids = host_gpus(env | {"CUDA_VISIBLE_DEVICES": "GPU-aa11,GPU-bb22"})
    assert uuids.child_visible_devices((1, 0)) == "GPU-bb22,GPU-aa11"


def test_visible_devices_follow_cuda_rules(tmp_path: Path) -> None:
    """Empty hides every GPU, an index past the machine's ends the list (as CUDA does), a repeat is refused."""
    env = _listing(tmp_path, 4)
    assert host_gpus(env | {"CUDA_VISIBLE_DEVICES": ""}).count == 0
    assert host_gpus(env | {"CUDA_VISIBLE_DEVICES": "-1"}).count == 0
    assert host_gpus(env | {"CUDA_VISIBLE_DEVICES": "1,7,2"}).names == ("1",)
    with pytest.raises(HostGpuError, match="names a GPU twice"):
        host_gpus(env | {"CUDA_VISIBLE_DEVICES": "1,1"})
    assert host_gpus({"ASYNC_GRPO_HOST_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"}).count == 0


def test_the_module_prints_the_count_for_shell_scripts(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ASYNC_GRPO_HOST_GPUS", "8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    main()
    assert capsys.readouterr().out.strip() == "3"
