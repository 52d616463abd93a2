"""LoRA training under FSDP2 on 2 real gloo ranks, checked against an unsharded PEFT model.

The references are written here with peft directly (get_peft_model, save_pretrained,
PeftModel.from_pretrained) and a plain torch AdamW: none of them goes through the code under
test (fsdp_setup's LoRA wrapping, trainer_adapter's adapter shards, checkpoint.py's adapter files).

    .venv/bin/python -m pytest tests/trainer/test_lora_fsdp.py -q
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from async_grpo.weights.update import TensorBlob, tensor_to_blob
from async_grpo.weights.worker_loader import iter_assembled
from sample_processing_utils import Sample, get_input_for_logprobs
from setup_model import TokenLogprobModel
from support.forked_ranks import run_ranks
from support.lora_adapters import LORA, reference_peft
from support.paths import PROGRAMS

WORKER = PROGRAMS / "lora_fsdp_worker.py"
WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 600  # two ranks building the model three times on 2 shared cores: ~1 min
LR = 1e-2  # large enough that one step moves every adapter tensor far beyond the tolerance
# Same maths in a different reduction order (gloo reduce-scatter, packed halves): ~1e-7 relative.
STEP_RTOL, STEP_ATOL = 1e-4, 1e-6
NUM_SAMPLES = 6


def _samples(vocab: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    return [
        Sample(input_token_ids=torch.randint(2, vocab, (3 + i,), generator=gen).tolist(),
               output_token_ids=torch.randint(2, vocab, (2 + 2 * i,), generator=gen).tolist(),
               gt_answer="", prompt_id=i)
        for i in range(NUM_SAMPLES)
    ]


def _reference_steps(model_dir: Path, adapter_dir: Path, samples: list[Sample], steps: int) -> dict[str, torch.Tensor]:
    """The adapter (PEFT names) after `steps` plain AdamW steps on -mean logprob, one process."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    scorer = TokenLogprobModel(peft_model)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    for _ in range(steps):
        logprobs, _ = scorer.score(get_input_for_logprobs(samples))
        (-logprobs.sum() / len(samples)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}


def _base_parameters(model_dir: Path) -> list[torch.nn.Parameter]:
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).parameters())


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir: Path) -> dict:
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("lora-fsdp")
    reference = reference_peft(tiny_model_dir)
    adapter_dir = root / "start-adapter"
    reference.save_pretrained(str(adapter_dir))
    samples = _samples(reference.config.vocab_size)
    out = root / "out"
    out.mkdir()
    spec = {"model_path": str(tiny_model_dir), "adapter_dir": str(adapter_dir), "lora": LORA,
            "samples": [asdict(s) for s in samples], "lr": LR}
    (out / "spec.json").write_text(json.dumps(spec))
    run_ranks(WORKER, ["--spec", str(out / "spec.json"), "--out_dir", str(out)], WORLD_SIZE, LAUNCH_TIMEOUT_S)
    return {"out": out, "start": load_file(str(adapter_dir / "adapter_model.safetensors")), "samples": samples,
            "model_dir": tiny_model_dir, "adapter_dir": adapter_dir}


@pytest.mark.distributed
def test_only_adapter_parameters_train(lora_run: dict) -> None:
    layout = json.loads((lora_run["out"] / "layout.json").read_text())
    assert layout["trainable"] == sum(t.numel() for t in lora_run["start"].values())
    assert layout["optimizer_params"] == layout["trainable"]
    assert layout["frozen"] == sum(p.numel() for p in _base_parameters(lora_run["model_dir"]))
    assert all(".lora_A." in n or ".lora_B." in n for n in layout["trainable_names"])


@pytest.mark.distributed
def test_adapter_placements_follow_shard_dims(lora_run: dict) -> None:
    """LoRA A ([r, in]) is sharded on dim 1, B ([out, r]) on dim 0: reassembly must read both."""
    layout = json.loads((lora_run["out"] / "layout.json").read_text())["adapter"]
    assert set(layout) == set(lora_run["start"])
    for name, info in layout.items():
        assert info["shard_dims"] == ([1] if ".lora_A." in name else [0]), name


@pytest.mark.distributed
@pytest.mark.parametrize("which", ["shards_before", "gathered_before"])
def test_two_rank_adapter_equals_unsharded(lora_run: dict, which: str) -> None:
    """Every rank's shards reassembled (sharded push), and the gather push, equal the adapter file
    PeftModel.save_pretrained wrote, bit for bit."""
    got = torch.load(lora_run["out"] / f"{which}.pt")
    assert got.keys() == lora_run["start"].keys()
    for name, tensor in lora_run["start"].items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.distributed
def test_one_step_matches_unsharded_peft(lora_run: dict) -> None:
    expected = _reference_steps(lora_run["model_dir"], lora_run["adapter_dir"], lora_run["samples"], steps=1)
    got = torch.load(lora_run["out"] / "after_step1.pt")
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert not torch.allclose(tensor, lora_run["start"][name], atol=STEP_ATOL * 10), f"{name} did not move"
        torch.testing.assert_close(got[name], tensor, rtol=STEP_RTOL, atol=STEP_ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
def test_checkpoint_is_peft_format_and_resume_is_exact(lora_run: dict) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    checkpoint = lora_run["out"] / "run" / "checkpoints" / "step_000001"
    assert (checkpoint / "adapter_config.json").is_file() and (checkpoint / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "model.safetensors").exists(), "a LoRA checkpoint must not copy the base weights"
    base = AutoModelForCausalLM.from_pretrained(str(lora_run["model_dir"]), dtype=torch.float32)
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, str(checkpoint)))
    after1 = torch.load(lora_run["out"] / "after_step1.pt")
    assert loaded.keys() == after1.keys()
    for name, tensor in after1.items():
        assert torch.equal(loaded[name], tensor), name
    continued = torch.load(lora_run["out"] / "after_step2_continued.pt")
    resumed = torch.load(lora_run["out"] / "after_step2_resumed.pt")
    for name, tensor in continued.items():
        assert torch.equal(resumed[name], tensor), f"{name}: resumed step differs from the continued one"
    assert json.loads((lora_run["out"] / "resumed_state.json").read_text())["step"] == 1


def _pieces(tensor: torch.Tensor, dim: int, num_shards: int) -> list[dict[str, TensorBlob]]:
    """torch.chunk pieces of a tensor along dim, one shard dict per rank (empty ones included)."""
    chunks = list(torch.chunk(tensor, num_shards, dim=dim))
    chunks += [tensor.narrow(dim, tensor.shape[dim], 0)] * (num_shards - len(chunks))
    shards, offset = [], 0
    for chunk in chunks:
        shards.append({"w": tensor_to_blob(chunk, global_shape=tuple(tensor.shape), offset=offset, shard_dim=dim)})
        offset += chunk.shape[dim]
    return shards


@pytest.mark.parametrize("dim,num_shards", [(1, 2), (1, 3), (1, 5), (0, 3), (2, 4)])
def test_reassembly_by_shard_dim(dim: int, num_shards: int) -> None:
    """Pieces cut along any dim (uneven, trailing empty pieces) reassemble to the tensor, shuffled."""
    tensor = torch.arange(3 * 7 * 3, dtype=torch.float32).reshape(3, 7, 3)
    shards = _pieces(tensor, dim, num_shards)
    shards.reverse()
    (name, full), = list(iter_assembled(shards))
    assert torch.equal(full, tensor)


def test_reassembly_refuses_a_gap() -> None:
    tensor = torch.ones(4, 6)
    shards = _pieces(tensor, 1, 3)
    del shards[1]
    with pytest.raises(ValueError, match="does not continue"):
        list(iter_assembled(shards))
