"""A LoRA run through the whole system: Ray, a vLLM generation worker serving adapters, a logprob
worker, the batcher, and `torchrun` with 2 FSDP2 ranks training the adapter of the demo's model.

    .venv/bin/python -m pytest tests/system/test_end_to_end_lora.py -q

Its LocalCluster owns a Ray head of its own: support.cluster.started_cluster sets the session's
`ray_local` connection aside meanwhile, so the module may run after the modules that share it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from async_grpo.trainer.checkpoint import latest_checkpoint
from async_grpo.weights.adapter_files import read_stable_marker
from local_cluster import LocalCluster
from support.cluster import cluster_config, generation_versions, started_cluster, train

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.system]

LORA_RANK = 8
LORA_FLAGS = ["--model.lora.r", str(LORA_RANK), "--model.lora.alpha", "16", "--optim.lr", "5e-3"]
STEPS = 3
# FSDP2 trainer vs HF logprob worker on the same fp32 weights: k3 KL of ~1e-7 per token at most.
KL_AT_START_ATOL = 1e-5


@pytest.fixture(scope="module")
def lora_cluster(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory):
    config = cluster_config(demo_assets / "model", tmp_path_factory.mktemp("lora-worker-logs"),
                            engine={"max_lora_rank": LORA_RANK})
    with started_cluster(config) as running:
        yield running


def _check_run(run_dir: Path, records: list[dict], mode: str) -> None:
    from safetensors.torch import load_file

    assert [r["step"] for r in records] == list(range(STEPS))
    assert any(r["optim/grad_norm"] > 0 for r in records), "no step had a gradient"
    assert generation_versions() == [STEPS]
    marker = read_stable_marker(run_dir / "weights" / "STABLE")
    assert (marker.version, marker.mode) == (STEPS, mode)
    checkpoint = latest_checkpoint(run_dir)
    assert not (checkpoint / "model.safetensors").exists()
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["r"] == LORA_RANK and config["peft_type"] == "LORA"
    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    lora_b = [t for name, t in adapter.items() if ".lora_B." in name]
    assert lora_b and any(t.abs().max() > 0 for t in lora_b), "lora_B starts at 0: training must have moved it"
    assert all(torch.isfinite(t).all() for t in adapter.values())


def test_lora_run_sharded_push_with_reference_kl(lora_cluster: LocalCluster, demo_assets: Path,  # noqa: F811
                                                 tmp_path: Path) -> None:
    """Reference logprobs (KL 0.05, demo.yaml) from the logprob worker's base model; the adapter
    is pushed as every rank's own shards."""
    run_dir = tmp_path / "run"
    records = train(lora_cluster, demo_assets, run_dir, "--num_steps", str(STEPS), "--sampling.n", "8",
                    "--weight_push_mode", "sharded", *LORA_FLAGS)
    _check_run(run_dir, records, "sharded")
    # Step 0's first pass: the adapter is still the identity (B = 0), so policy and reference (the
    # logprob worker's base model, no adapter) agree up to float rounding; later steps moved away.
    assert records[0]["loss/kl"] < KL_AT_START_ATOL
    assert records[-1]["loss/kl"] > records[0]["loss/kl"]


def test_lora_run_files_push_with_old_policy_logprobs(lora_cluster: LocalCluster, demo_assets: Path,  # noqa: F811
                                                      tmp_path: Path) -> None:
    """lora_files push to the generation worker and, in the old_policy role, to the logprob worker."""
    run_dir = tmp_path / "run"
    records = train(lora_cluster, demo_assets, run_dir, "--num_steps", str(STEPS), "--sampling.n", "8",
                    "--weight_push_mode", "lora_files", "--logprob_role", "old_policy", "--loss.kl_coef", "0",
                    *LORA_FLAGS)
    _check_run(run_dir, records, "lora_files")
    folders = sorted(p.name for p in (run_dir / "weights").iterdir() if p.is_dir())
    assert folders == [f"step_{v:06d}" for v in (STEPS - 1, STEPS)]
