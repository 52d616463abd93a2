"""One rank of tests/trainer/test_context_parallel.py (gloo) and tests/trainer/test_gpu_context_parallel.py
(NCCL): the GRPO loss and its gradients with each minibatch's tokens split over a context-parallel
group, and the same minibatches unsplit.

    torchrun --nproc_per_node=2 tests/programs/context_parallel_worker.py --spec SPEC.json --out_dir OUT

SPEC.json (written by the test): context_parallel; samples (Sample fields, with sampling, old and
reference logprobs); group_minibatches (per data-parallel group, its minibatches as lists of
sample indices); models (tag, model_path, lora or null, adapter_dir: a PEFT folder or null,
gradient_checkpointing, fsdp_per_layer_min_params); cases (name, model tag, loss: LossConfig fields, policy_version,
max_tokens, sum_over_group: false to leave GSPO's per-sample sums unreduced, as a broken split would).

Per case, both passes on one FSDP2 model over all ranks, the trainer's rules:
    split:   each group's minibatches, each rank its share (local_batch), loss x world_size
    unsplit: every rank every minibatch whole (model.context None), loss x 1, so FSDP's average
             over ranks is that one pass
then gradients / grpo_loss.step_divisor, in fp32 on gloo (CPU) or NCCL (a GPU per rank, when
visible). Rank 0 writes OUT/<case>.pt: both passes' summed loss, group 0's per-minibatch metrics
and whole-minibatch logprobs, every parameter's full gradient, and the backend.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from async_grpo.model.context_parallel import gather_outputs, local_batch, reduce_loss_metrics  # noqa: E402
from async_grpo.trainer.fsdp_setup import DistInfo, build_training_model, init_distributed  # noqa: E402
from grpo_loss import LossConfig, grpo_loss, step_divisor  # noqa: E402
from sample_processing_utils import PackedBatch, Sample, post_process_batch  # noqa: E402
from setup_model import LoraConfig, ModelConfig, TokenLogprobModel  # noqa: E402

DIST_TIMEOUT_S = 120.0  # a crashed peer turns into an error well inside the test's own timeout
# Small lm_head chunks: a rank's share takes the multi-chunk path, and one may score no token.
CHUNK_SIZE = 7


def _build(spec: dict, info: DistInfo) -> TokenLogprobModel:
    lora = LoraConfig(**spec["lora"]) if spec["lora"] else LoraConfig()
    # fp32 on every device (no bf16 mixed precision on CUDA): the parity tolerances are fp32's.
    config = ModelConfig(model_path=spec["model_path"], lora=lora, logprob_chunk_size=CHUNK_SIZE,
                         gradient_checkpointing=spec["gradient_checkpointing"], mixed_precision=False,
                         fsdp_per_layer_min_params=spec["fsdp_per_layer_min_params"])
    return build_training_model(config, info, adapter_dir=spec["adapter_dir"])


def _full_grads(model: torch.nn.Module, divisor: float) -> dict[str, torch.Tensor]:
    """Collective: every trainable parameter's whole gradient / divisor; resets the gradients."""
    grads = {name: param.grad.full_tensor().cpu() / divisor for name, param in model.named_parameters()
             if param.grad is not None}
    for param in model.parameters():
        param.grad = None
    return grads


def _split_pass(model: TokenLogprobModel, batches: list[PackedBatch], case: dict, info: DistInfo) -> dict:
    group = model.context
    config = LossConfig(**case["loss"])
    sums = group.sum_over_group if case["sum_over_group"] else None
    total, metrics, logprobs = 0.0, [], []
    for batch in batches:
        mine = local_batch(batch, group)
        local_logprobs, _ = model.score(batch.inputs)
        loss, local_metrics = grpo_loss(local_logprobs, mine, config, policy_version=case["policy_version"],
                                        sample_sums=sums)
        (loss * info.world_size).backward()
        loss_sum, reduced = reduce_loss_metrics(loss, local_metrics, local_logprobs.numel(), group)
        total += loss_sum
        metrics.append(reduced)
        logprobs.append(gather_outputs(local_logprobs, batch, group).cpu())
    # Each group's total is on each of its ranks: the sum over all ranks counts it size times.
    summed = torch.tensor([total], dtype=torch.float64, device=info.device)  # NCCL reduces CUDA tensors only
    dist.all_reduce(summed)
    return {"loss": summed.item() / group.size, "metrics": metrics, "logprobs": logprobs}


def _unsplit_pass(model: TokenLogprobModel, batches: list[PackedBatch], case: dict) -> dict:
    context, model.context = model.context, None
    try:
        config = LossConfig(**case["loss"])
        total, metrics, logprobs = 0.0, [], []
        for batch in batches:
            batch_logprobs, _ = model.score(batch.inputs)
            loss, batch_metrics = grpo_loss(batch_logprobs, batch, config, policy_version=case["policy_version"])
            loss.backward()
            total += loss.item()
            metrics.append(batch_metrics)
            logprobs.append(batch_logprobs.detach().cpu())
    finally:
        model.context = context
    return {"loss": total, "metrics": metrics, "logprobs": logprobs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out_dir", type=Path, required=True)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    info = init_distributed(DIST_TIMEOUT_S, context_parallel=spec["context_parallel"])
    samples = [Sample(**fields) for fields in spec["samples"]]
    groups = [[post_process_batch([samples[i] for i in minibatch]) for minibatch in minibatches]
              for minibatches in spec["group_minibatches"]]
    every = [sample for minibatches in spec["group_minibatches"] for minibatch in minibatches for sample in minibatch]
    num_outputs = sum(samples[i].num_sampled_tokens for i in every)
    models = {model["tag"]: _build(model, info) for model in spec["models"]}
    for case in spec["cases"]:
        model = models[case["model"]]
        divisor = step_divisor(LossConfig(**case["loss"]).aggregation, len(every), num_outputs, case["max_tokens"])
        split = _split_pass(model, groups[info.data_rank], case, info)
        split["grads"] = _full_grads(model, divisor)
        unsplit = _unsplit_pass(model, [batch for batches in groups for batch in batches], case)
        unsplit["grads"] = _full_grads(model, divisor)
        unsplit["metrics"], unsplit["logprobs"] = unsplit["metrics"][:len(groups[0])], unsplit["logprobs"][:len(groups[0])]
        if info.is_main:
            result = {"split": split, "unsplit": unsplit, "backend": info.backend}
            torch.save(result, args.out_dir / f"{case['name']}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
