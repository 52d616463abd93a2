"""Logprob workers in the old_policy role apply a LoRA policy's pushed adapter to their base
model; checked against Hugging Face PeftModel loaded from the same files.

    .venv/bin/python -m pytest tests/inference/test_lora_logprob.py -q
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from async_grpo.config.worker_options import LogprobBatchingConfig
from async_grpo.demo_assets.tiny_model import write_random_adapter as _write_adapter
from async_grpo.weights.adapter_files import UnstableVersionError
from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs
from logprob_worker import LogprobWorker, LogprobWorkerConfig
from sample_processing_utils import Sample
from setup_model import load_causal_lm
from support.lora_adapters import files_update, mark_stable
from support.reference_logprobs import hf_model, reference_logprobs

# Same weights and kernels family (packed sdpa vs eager), one process each: float rounding only.
LOGPROB_ATOL = 1e-5
SAMPLES = [([5, 6, 7, 8], [9, 10, 11]), ([20, 21], [22, 23, 24, 25, 26]), ([40, 3, 9], [17])]


def _samples() -> list[Sample]:
    return [Sample(input_token_ids=p, output_token_ids=o, gt_answer="", prompt_id=i) for i, (p, o) in enumerate(SAMPLES)]


async def _scenario(model_dir: Path, root: Path) -> dict:
    marker = root / "weights" / "STABLE"
    a1 = _write_adapter(model_dir, root / "a1", 8, seed=1)
    a2 = _write_adapter(model_dir, root / "a2", 8, seed=2)
    worker = LogprobWorker("lora-logprob-test", LogprobWorkerConfig(model_path=str(model_dir), device="cpu",
                                                                     batching=LogprobBatchingConfig(max_wait_ms=0)))
    await worker.start()
    got: dict = {"base": await worker.compute_group_logprobs(_samples())}
    update = files_update(a1, 1, marker)
    mark_stable(update)
    got["version"] = await worker.update_weights(update)
    got["a1"] = await worker.compute_group_logprobs(_samples())
    try:
        await worker.update_weights(files_update(a2, 2, marker))  # the marker still names v1
        got["unstable"] = None
    except UnstableVersionError as exc:
        got["unstable"] = str(exc)
    got["after_unstable"] = await worker.compute_group_logprobs(_samples())
    update = files_update(a2, 3, marker)
    mark_stable(update)
    await worker.update_weights(update)
    got["a2"] = await worker.compute_group_logprobs(_samples())
    await worker.shutdown()
    got["adapters"] = {"a1": a1, "a2": a2}
    return got


@pytest.fixture(scope="module")
def scenario(tiny_model_dir: Path, tmp_path_factory) -> dict:
    return asyncio.run(_scenario(tiny_model_dir, tmp_path_factory.mktemp("lora-logprob")))


@pytest.mark.parametrize("name", ["a1", "a2"])
def test_old_policy_logprobs_with_adapter_equal_hf_peft(scenario: dict, tiny_model_dir: Path, name: str) -> None:
    model = hf_model(tiny_model_dir, scenario["adapters"][name])
    for (prompt, output), got in zip(SAMPLES, scenario[name]):
        torch.testing.assert_close(torch.tensor(got.values), reference_logprobs(model, prompt, output),
                                   atol=LOGPROB_ATOL, rtol=0)
    assert [g.values for g in scenario[name]] != [g.values for g in scenario["base"]]


def test_unmarked_adapter_is_refused_and_the_served_one_kept(scenario: dict) -> None:
    assert scenario["version"] == 1
    assert "names v1" in scenario["unstable"]
    assert [g.values for g in scenario["after_unstable"]] == [g.values for g in scenario["a1"]]
    assert {g.weight_version for g in scenario["after_unstable"]} == {1}



def test_adapter_after_other_full_weights_is_applied_to_the_checkpoint(ray_local, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    """A worker a full fine-tuning run pushed its weights to, then a LoRA run's adapter: the
    adapter goes on the checkpoint's own weights (equal to HF PeftModel on the checkpoint)."""
    async def scenario() -> tuple[list, list]:
        a1 = _write_adapter(tiny_model_dir, tmp_path / "a1", 8, seed=1)
        worker = LogprobWorker("lora-logprob-reset", LogprobWorkerConfig(
            model_path=str(tiny_model_dir), device="cpu", batching=LogprobBatchingConfig(max_wait_ms=0)))
        await worker.start()
        noise = torch.Generator().manual_seed(7)
        other = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=noise) if v.numel() > 1 else v
                 for k, v in load_causal_lm(tiny_model_dir).state_dict().items()}
        await worker.update_weights(WeightUpdate(version=5, shard_refs=[ray_local.put(state_dict_to_blobs(other))],
                                                 mode="gather"))
        pushed = await worker.compute_group_logprobs(_samples())
        update = files_update(a1, 6, tmp_path / "weights" / "STABLE")
        mark_stable(update)
        await worker.update_weights(update)
        adapted = await worker.compute_group_logprobs(_samples())
        await worker.shutdown()
        return pushed, adapted

    pushed, adapted = asyncio.run(scenario())
    model = hf_model(tiny_model_dir, tmp_path / "a1")
    for (prompt, output), got, other in zip(SAMPLES, adapted, pushed):
        want = reference_logprobs(model, prompt, output)
        torch.testing.assert_close(torch.tensor(got.values), want, atol=LOGPROB_ATOL, rtol=0)
        assert (torch.tensor(other.values) - want).abs().max() > 100 * LOGPROB_ATOL  # the push did change them
