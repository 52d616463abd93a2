"""local_cluster hands the trainer's transfer.weight_transfer to its generation workers and the
trainer's model.share_prompts to its logprob workers: each option is declared once
(worker_options.EngineTransferConfig, PromptSharingConfig), the trainer's flag is its one source
(the two ends must agree: a worker refuses a transfer by another backend at its first push), and
the launcher takes no flag of its own for either.

    .venv/bin/python -m pytest tests/launch/test_launcher_transfer.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

import local_cluster
from async_grpo.config.run_config import load_config
from local_cluster import LocalCluster, LocalClusterConfig, with_trainer_settings
from trainer_core import load_trainer_config
from worker_dispatcher import DispatcherConfig, generation_worker_config, logprob_worker_config


def _launcher(tmp_path: Path, *flags: str) -> LocalClusterConfig:
    # A CPU host's plan whatever this host lists: these tests follow options, not placement.
    return load_config(LocalClusterConfig, ["--model_path", "m", "--run_dir", str(tmp_path), "--host_gpus", "0", *flags])


def _for_trainer(config: LocalClusterConfig, *trainer_flags: str) -> LocalClusterConfig:
    return with_trainer_settings(config, load_trainer_config(["--model.model_path", "m", "--data.path", "d.jsonl",
                                                              *trainer_flags]))


def _worker_transfer(config: LocalClusterConfig, kind: str = "generation") -> str:
    """The weight_transfer a dispatcher started by this launcher gives its generation worker."""
    parsed = load_config(DispatcherConfig, LocalCluster(config).dispatcher_args(kind))
    return generation_worker_config(parsed).transfer.weight_transfer


@pytest.mark.parametrize("backend", ["nccl", "nccl_m2n", "ipc"])
def test_the_trainers_backend_reaches_the_generation_workers(tmp_path: Path, backend: str) -> None:
    default = _launcher(tmp_path)
    config = _for_trainer(default, "--transfer.weight_transfer", backend)
    assert config.transfer.weight_transfer == backend
    assert _worker_transfer(config) == backend
    # Only the backend changed; the logprob workers take no transfer and are unaffected.
    assert config.engine == default.engine and config.batching == default.batching
    assert "--weight_transfer" not in LocalCluster(config).dispatcher_args("logprob")
    logprob_worker_config(load_config(DispatcherConfig, LocalCluster(config).dispatcher_args("logprob")))


def test_the_default_trainer_changes_nothing(tmp_path: Path) -> None:
    default = _launcher(tmp_path)
    assert _for_trainer(default) == default
    assert _worker_transfer(default) == "object_store" and not _workers_share_prompts(default)


@pytest.mark.parametrize("flag", ["--weight_transfer", "--share_prompts"])
def test_the_launcher_takes_no_flag_of_its_own_for_a_trainer_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str) -> None:
    with pytest.raises(SystemExit) as exited:
        _launcher(tmp_path, flag, "true" if flag == "--share_prompts" else "nccl")
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"unknown flag {flag}" in err


def _workers_share_prompts(config: LocalClusterConfig, kind: str = "logprob") -> bool:
    """The share_prompts a dispatcher started by this launcher gives its logprob worker."""
    return logprob_worker_config(load_config(DispatcherConfig, LocalCluster(config).dispatcher_args(kind))
                                 ).sharing.share_prompts


def test_the_trainers_prompt_sharing_reaches_the_logprob_workers(tmp_path: Path) -> None:
    default = _launcher(tmp_path)
    sharing = _for_trainer(default, "--model.share_prompts", "true")
    assert all(_workers_share_prompts(sharing, kind) for kind in ("logprob", "reference"))
    assert sharing.batching == default.batching and sharing.engine == default.engine
    assert "--share_prompts" not in LocalCluster(sharing).dispatcher_args("generation")


class _RecordingCluster:
    """Stands in for LocalCluster in main(): records the config it was given, starts nothing."""

    configs: list[LocalClusterConfig] = []
    engine_choices: list[str] = []

    def __init__(self, config: LocalClusterConfig, placement: object = None, longest_sample: int | None = None,
                 cuda: bool | None = None, cpu_plan: object = None) -> None:
        self.configs.append(config)

    def __enter__(self) -> "_RecordingCluster":
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def start_workers(self) -> None:
        return None

    def run_trainer(self, trainer_args: list[str], nproc_per_node: int) -> int:
        return 0


def test_main_starts_its_workers_with_the_trainers_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring in main(): the trainer's flag alone sets the workers' backend (no Ray, no
    worker, no trainer start: the cluster and the input checks are stood in for)."""
    _RecordingCluster.configs = []
    monkeypatch.setattr(local_cluster, "LocalCluster", _RecordingCluster)
    monkeypatch.setattr(local_cluster, "check_environment", lambda config: None)
    monkeypatch.setattr(local_cluster, "check_trainer_inputs", lambda config, max_lora_rank=0: None)
    monkeypatch.setattr(local_cluster, "setup_logging", lambda config, trainer_config: None)
    monkeypatch.setattr(local_cluster, "_interrupt_on_sigterm", lambda: None)
    code = local_cluster.main(["--model_path", str(tmp_path / "model"), "--run_dir", str(tmp_path / "run"),
                               "--host_gpus", "0", "--",
                               "--data.path", str(tmp_path / "prompts.jsonl"), "--transfer.weight_transfer", "nccl",
                               "--model.share_prompts", "true"])
    assert code == 0
    (config,) = _RecordingCluster.configs
    assert config.transfer.weight_transfer == "nccl" and _worker_transfer(config) == "nccl"
    assert _workers_share_prompts(config)
