"""One trainer rank of tests/trainer/test_lora_fsdp.py: LoRA under FSDP2, its adapter shards, a PEFT
checkpoint and an exact resume.

    torchrun --nproc_per_node=2 tests/programs/lora_fsdp_worker.py --spec SPEC.json --out_dir OUT

SPEC.json (written by the test): model_path (base), adapter_dir (a PEFT folder the test wrote
with PeftModel.save_pretrained: the starting adapter), lora (LoraConfig fields), samples (Sample
fields), lr.

Every rank builds the policy with build_training_model(adapter_dir=...), the trainer's path.
Rank 0 writes under OUT:
    layout.json         per adapter parameter: its Shard dims, global shape; trainable and frozen
                        parameter counts; parameters in the optimizer
    shards_before.pt    iter_assembled over every rank's local_adapter_blobs (the sharded push)
    gathered_before.pt  gather_adapter (the gather push)
    after_step1.pt      the adapter after one AdamW step on all samples (split over the ranks)
    after_step2_continued.pt / after_step2_resumed.pt
                        a second step, by this run and by a fresh model resumed from the
                        checkpoint written after step 1 (OUT/run/checkpoints/step_000001)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from async_grpo.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint  # noqa: E402
from async_grpo.trainer.fsdp_setup import DistInfo, build_training_model, init_distributed  # noqa: E402
from async_grpo.trainer.optimizer import OptimConfig, build_optimizer, build_scheduler  # noqa: E402
from async_grpo.weights.trainer_adapter import adapter_named_tensors, gather_adapter, local_adapter_blobs
from async_grpo.weights.worker_loader import iter_assembled  # noqa: E402
from sample_processing_utils import Sample, get_input_for_logprobs  # noqa: E402
from setup_model import LoraConfig, ModelConfig  # noqa: E402

DIST_TIMEOUT_S = 120.0  # a crashed peer turns into an error well inside the test's own timeout


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, samples: list[Sample],
          info: DistInfo) -> None:
    """One AdamW step on the mean logprob loss of all samples, this rank scoring its own half.

    FSDP averages gradients over ranks, so each rank's sum is scaled by world_size / total: the
    average is then the gradient of -sum(all logprobs) / total, the unsharded reference's loss.
    """
    mine = samples[info.rank::info.world_size]
    logprobs, _ = model.score(get_input_for_logprobs(mine))
    (-logprobs.sum() * info.world_size / len(samples)).backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _build(spec: dict, info: DistInfo, adapter_dir: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model_config = ModelConfig(model_path=spec["model_path"], lora=LoraConfig(**spec["lora"]))
    model = build_training_model(model_config, info, adapter_dir=adapter_dir)
    optim_config = OptimConfig(lr=spec["lr"])
    optimizer = build_optimizer(model, optim_config)
    return model, optimizer, build_scheduler(optimizer, optim_config)


def _layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "adapter": {name: {"shard_dims": [p.dim for p in t.placements], "shape": list(t.shape)}
                    for name, t in adapter_named_tensors(model).items()},
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "optimizer_params": sum(p.numel() for group in optimizer.param_groups for p in group["params"]),
        "trainable_names": [n for n, p in model.named_parameters() if p.requires_grad],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out_dir", type=Path, required=True)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    info = init_distributed(DIST_TIMEOUT_S)
    out = args.out_dir
    main_rank = info.rank == 0
    samples = [Sample(**fields) for fields in spec["samples"]]

    model, optimizer, scheduler = _build(spec, info, spec["adapter_dir"])
    if main_rank:
        (out / "layout.json").write_text(json.dumps(_layout(model, optimizer)))
    shards: list = [None] * info.world_size
    dist.all_gather_object(shards, local_adapter_blobs(model))
    gathered = gather_adapter(model)
    if main_rank:
        torch.save(dict(iter_assembled(shards)), out / "shards_before.pt")
        torch.save(gathered, out / "gathered_before.pt")

    _step(model, optimizer, scheduler, samples, info)
    after1 = gather_adapter(model)
    if main_rank:
        torch.save(after1, out / "after_step1.pt")
    run_dir = out / "run"
    checkpoint = save_checkpoint(run_dir, model, optimizer, scheduler, TrainerState(step=1), spec["model_path"],
                                 info, keep=2)

    _step(model, optimizer, scheduler, samples, info)
    continued = gather_adapter(model)

    resumed, resumed_optimizer, resumed_scheduler = _build(spec, info, str(checkpoint))
    state = load_checkpoint(checkpoint, resumed, resumed_optimizer, resumed_scheduler, info)
    _step(resumed, resumed_optimizer, resumed_scheduler, samples, info)
    resumed_adapter = gather_adapter(resumed)
    if main_rank:
        torch.save(continued, out / "after_step2_continued.pt")
        torch.save(resumed_adapter, out / "after_step2_resumed.pt")
        (out / "resumed_state.json").write_text(json.dumps({"step": state.step}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
