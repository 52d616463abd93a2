"""One rank of the FSDP2 checks in tests/trainer/test_fsdp.py; the test launches it and checks its
files.

    torchrun --nproc_per_node=2 tests/programs/fsdp_worker.py --spec SPEC.json --out_dir OUT
    python tests/programs/fsdp_worker.py --spec SPEC.json --out_dir OUT        # one process, no torchrun
    torchrun --nproc_per_node=2 tests/programs/fsdp_worker.py --stalled_peer --out_dir OUT

--stalled_peer: rank 1 joins the group and then never enters a collective; rank 0's all_reduce
must fail after init_distributed's timeout, and rank 0 writes the error to OUT/stalled_peer.txt.

SPEC.json (written by the test):
    samples: list of Sample fields; grad_model: checkpoint folder for the gradient check;
    rank_microbatches: per rank, a list of microbatches, each a list of sample indices;
    loss: LossConfig fields; export_models: {tag: checkpoint folder}; probe_sample: a sample
    index whose logprobs and logits are recorded; optim: OptimConfig fields.

Rank 0 writes, under OUT:
    grads.pt                    full gradients (HF names) after the trainer's gradient scaling
    <tag>/before.pt, after.pt   probe logits and logprobs before / after one optimizer step
    <tag>/gathered.pt           gather_full_state_dict after the step
    <tag>/gathered_buckets.pt   the same with 4 KiB buckets (several small tensors per all-gather,
                                the bigger ones alone), and bf16 with 4 KiB buckets
    <tag>/per_tensor.pt         each weight's DTensor.full_tensor() (torch's own gather, one by one)
    <tag>/assembled.pt          assemble_state_dict of every rank's local_shard_blobs
    <tag>/checkpoint/           export_hf_checkpoint
    dist_info.json              what init_distributed reported
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from async_grpo.trainer.fsdp_setup import DistInfo, build_training_model, init_distributed
from async_grpo.trainer.optimizer import OptimConfig, build_optimizer, build_scheduler
from async_grpo.weights.hf_checkpoint import hf_tensors
from async_grpo.weights.trainer_gather import export_hf_checkpoint, gather_full_state_dict, local_shard_blobs
from async_grpo.weights.worker_loader import assemble_state_dict  # noqa: E402
from grpo_loss import LossConfig, grpo_loss  # noqa: E402
from sample_processing_utils import Sample, get_input_for_logprobs, post_process_batch  # noqa: E402
from setup_model import ModelConfig

logger = logging.getLogger(__name__)

DIST_TIMEOUT_S = 120.0  # a crashed peer turns into an error well inside the test's own timeout
STALLED_PEER_TIMEOUT_S = 3.0  # short: the stalled-peer check waits this long for its error
STALLED_PEER_WAIT_S = 120.0  # how long the stalled rank waits for rank 0's verdict before leaving
# Small chunks so the FSDP side takes the multi-chunk lm_head path while the reference does not.
GRAD_CHUNK_SIZE = 5
# Small gather buckets: the norms' weights share all-gathers, every matrix goes alone.
SMALL_GATHER_BUCKET_BYTES = 4096


def _rank_samples(spec: dict, rank: int) -> list[list[Sample]]:
    samples = [Sample(**fields) for fields in spec["samples"]]
    return [[samples[i] for i in microbatch] for microbatch in spec["rank_microbatches"][rank]]


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every parameter's whole gradient, HF names (empty dict off rank 0)."""
    grads = {}
    for name, param in model.named_parameters():
        full = param.grad.full_tensor()
        grads[name.removeprefix("causal_lm.")] = full.cpu()
    return grads if dist.get_rank() == 0 else {}


def check_gradients(spec: dict, info: DistInfo, out_dir: Path) -> None:
    """Seed's rule: loss x world_size per microbatch, summed; gradients / total samples."""
    model = build_training_model(
        ModelConfig(model_path=spec["grad_model"], gradient_checkpointing=True, logprob_chunk_size=GRAD_CHUNK_SIZE),
        info,
    )
    loss_config = LossConfig(**spec["loss"])
    total_samples = sum(len(mb) for rank_mbs in spec["rank_microbatches"] for mb in rank_mbs)
    for microbatch in _rank_samples(spec, info.rank):
        batch = post_process_batch(microbatch)
        logprobs, _ = model.score(batch.inputs)
        loss, _ = grpo_loss(logprobs, batch, loss_config)
        (loss * info.world_size).backward()
    for param in model.parameters():
        param.grad.div_(total_samples)
    grads = _full_grads(model)
    if info.is_main:
        torch.save(grads, out_dir / "grads.pt")


def _probe(model: torch.nn.Module, probe: Sample) -> dict[str, torch.Tensor]:
    """Full logits (root unsharded by hand, since causal_lm is not the FSDP root) and logprobs."""
    inputs = get_input_for_logprobs([probe])
    with torch.no_grad():
        logprobs, _ = model.score(inputs)
        model.unshard()
        logits = model.causal_lm(input_ids=inputs.input_ids[None], use_cache=False).logits[0]
        model.reshard()
    return {"logits": logits.cpu(), "logprobs": logprobs.cpu()}


def check_export(tag: str, model_path: str, spec: dict, info: DistInfo, out_dir: Path) -> None:
    """One optimizer step, then gather / shard blobs / export, recording everything on rank 0."""
    model = build_training_model(ModelConfig(model_path=model_path), info)
    optimizer = build_optimizer(model, OptimConfig(**spec["optim"]))
    scheduler = build_scheduler(optimizer, OptimConfig(**spec["optim"]))
    probe = Sample(**spec["samples"][spec["probe_sample"]])
    before = _probe(model, probe)
    for microbatch in _rank_samples(spec, info.rank):
        batch = post_process_batch(microbatch)
        logprobs, _ = model.score(batch.inputs)
        loss, _ = grpo_loss(logprobs, batch, LossConfig(**spec["loss"]))
        (loss * info.world_size).backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    after = _probe(model, probe)

    gathered = gather_full_state_dict(model)
    gathered_buckets = {"float32": gather_full_state_dict(model, bucket_bytes=SMALL_GATHER_BUCKET_BYTES),
                        "bfloat16": gather_full_state_dict(model, dtype=torch.bfloat16,
                                                           bucket_bytes=SMALL_GATHER_BUCKET_BYTES)}
    with torch.no_grad():
        per_tensor = {name: tensor.detach().full_tensor() for name, tensor in hf_tensors(model).items()}
    all_blobs = [None] * info.world_size
    dist.all_gather_object(all_blobs, local_shard_blobs(model))
    tag_dir = out_dir / tag
    export_hf_checkpoint(model, tag_dir / "checkpoint", model_path)
    if info.is_main:
        torch.save(before, tag_dir / "before.pt")
        torch.save(after, tag_dir / "after.pt")
        torch.save(gathered, tag_dir / "gathered.pt")
        torch.save(gathered_buckets, tag_dir / "gathered_buckets.pt")
        torch.save(per_tensor, tag_dir / "per_tensor.pt")
        # Highest rank first: assembly must follow the blobs' offsets, not the order they arrive in.
        torch.save(assemble_state_dict(all_blobs[::-1]), tag_dir / "assembled.pt")


def check_stalled_peer(out_dir: Path) -> None:
    """Rank 0 all-reduces while rank 1 stays alive but silent: the timeout must turn into an error."""
    info = init_distributed(STALLED_PEER_TIMEOUT_S)
    verdict = out_dir / "stalled_peer.txt"
    if info.is_main:
        try:
            dist.all_reduce(torch.ones(1))
            verdict.write_text("no error")
        except Exception as err:  # noqa: BLE001 - the check records whatever the backend raises
            verdict.write_text(f"{type(err).__name__}: {err}")
    else:
        deadline = time.monotonic() + STALLED_PEER_WAIT_S
        while not verdict.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    # The group is broken on purpose; leave without collective teardown.
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec")
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--stalled_peer", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.stalled_peer:
        check_stalled_peer(Path(args.out_dir))
    spec = json.loads(Path(args.spec).read_text())
    out_dir = Path(args.out_dir)
    info = init_distributed(DIST_TIMEOUT_S)
    torch.manual_seed(0)
    if info.is_main:
        info_fields = {k: str(v) if isinstance(v, torch.device) else v for k, v in asdict(info).items()}
        (out_dir / "dist_info.json").write_text(json.dumps(info_fields))
    check_gradients(spec, info, out_dir)
    for tag, model_path in spec["export_models"].items():
        check_export(tag, model_path, spec, info, out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
