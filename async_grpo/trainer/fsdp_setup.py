"""The trainer's process group and its FSDP2-sharded model.

In order: `init_distributed` (torchrun's environment -> process group and device), then
`build_training_model`: from_pretrained on rank 0 and a meta skeleton elsewhere, PEFT LoRA
adapters when model.lora.r > 0, FSDP2 per decoder layer and at the root, and
`copy_weights_from_rank0` to fill every rank's shards.

With context parallelism (DistInfo.context_parallel = cp > 1) the ranks form a dp x cp mesh, cp
innermost (ranks 0..cp-1 are one group, on one node when cp divides its GPUs): `context_group`
builds this rank's group and its differentiable collectives, which the model's attention and the
loss use (async_grpo/model/context_parallel.py). FSDP2 still shards over every rank: each rank
backwards its share of its group's minibatch, and FSDP's average over all ranks, times the
trainer's world_size factor, adds the shares up to the group's whole minibatch, once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from async_grpo.model.context_parallel import ContextGroup
from async_grpo.weights.adapter_files import ADAPTER_WEIGHTS_FILE
from async_grpo.weights.trainer_gather import local_piece
from setup_model import (
    ModelConfig, TokenLogprobModel, apply_lora, check_attn_dtype, check_context_parallel, default_attn_implementation,
    load_causal_lm, meta_causal_lm, training_compute_dtype,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DistInfo:
    """This process's place in the training job, as init_distributed found it."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    world_size: int
    """Number of training processes."""
    local_rank: int
    """Rank on this node; picks the CUDA device."""
    device: torch.device
    """Device this rank computes on (cuda:local_rank, or cpu)."""
    backend: str
    """Process-group backend: 'nccl' on CUDA, 'gloo' on CPU."""
    timeout_s: float = 600.0
    """The process group's collective timeout (init_distributed's timeout_s). On NCCL its watchdog
    aborts the process when a collective outlives it, so code that must report a dead peer itself
    (data_path) waits a little less."""
    context_parallel: int = 1
    """Ranks per context-parallel group (ModelConfig.context_parallel); divides world_size."""

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that logs and writes files."""
        return self.rank == 0

    @property
    def data_parallel(self) -> int:
        """Groups that train on different minibatches: world_size / context_parallel."""
        return self.world_size // self.context_parallel

    @property
    def leads_group(self) -> bool:
        """True on the first rank of its context-parallel group (every rank when context_parallel
        is 1): the rank that submits the group's prompts and counts its samples."""
        return self.rank % self.context_parallel == 0

    @property
    def data_rank(self) -> int:
        """This rank's group, 0 .. data_parallel - 1 (the ranks of one group share its minibatches)."""
        return self.rank // self.context_parallel


def _env_int(name: str, default: int) -> int:
    """An integer from the environment (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from err


def check_trainer_gpus(local_world_size: int, visible_gpus: int, host_gpus: int) -> None:
    """ValueError (one line) when the GPU layout leaves a trainer rank on this node without a GPU:
    a machine with GPUs whose CUDA_VISIBLE_DEVICES shows the trainer none (it would train on the
    CPU, unnoticed), or fewer visible GPUs than torchrun ranks on the node."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    if host_gpus and not visible_gpus:
        raise ValueError(f"this machine has {host_gpus} GPU(s) but CUDA_VISIBLE_DEVICES={shown} leaves the trainer "
                         f"none: give the trainer the GPUs kept out of Ray (docs/cluster.md)")
    if visible_gpus and visible_gpus < local_world_size:
        raise ValueError(f"torchrun starts {local_world_size} ranks on this node but CUDA_VISIBLE_DEVICES={shown} "
                         f"shows {visible_gpus} GPU(s): one GPU per rank")


def init_distributed(timeout_s: float = 600.0, context_parallel: int = 1) -> DistInfo:
    """Join (or create) the default process group from torchrun's environment.

    Without torchrun (no WORLD_SIZE) this makes a one-process group over an in-memory store, so
    FSDP2 and the collective helpers below work unchanged. timeout_s bounds every collective: a
    rank that died makes the others raise instead of waiting forever. context_parallel: ranks per
    context-parallel group (ValueError unless it divides the world size). Idempotent.
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if context_parallel < 1 or world_size % context_parallel:
        raise ValueError(f"model.context_parallel={context_parallel} must divide the trainer's {world_size} "
                         f"ranks (each group of context_parallel ranks splits one minibatch)")
    local_rank = _env_int("LOCAL_RANK", 0)
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if dist.is_initialized():
        return DistInfo(
            rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
            device=device, backend=dist.get_backend(), timeout_s=timeout_s, context_parallel=context_parallel,
        )
    timeout = timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    logger.info("rank %d/%d (local %d) joined on %s with %s", rank, world_size, local_rank, device, backend)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend,
                    timeout_s=timeout_s, context_parallel=context_parallel)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        received = send.new_empty(sum(recv_splits))
        dist.all_to_all_single(received, send.contiguous(), recv_splits, send_splits, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        send_splits, recv_splits = ctx.splits
        grad_send = grad.new_empty(sum(send_splits))
        dist.all_to_all_single(grad_send, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return grad_send, None, None, None


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) that keeps its input; every rank's output is the sum, so the gradient of
    each input is the sum of every rank's output gradient: all_reduce again."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def context_group(dist_info: DistInfo) -> ContextGroup | None:
    """Collective (every rank): this rank's context-parallel group on the dp x cp mesh, with the
    exchange and the sum its attention and loss need; None when context_parallel is 1.
    all_to_all_single takes uneven splits on gloo and NCCL alike, so shares need no padding."""
    size = dist_info.context_parallel
    if size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dist_info.device.type, (dist_info.data_parallel, size), mesh_dim_names=("dp", "cp"))
    group = mesh.get_group("cp")

    def all_to_all(chunks: list[torch.Tensor], received_rows: Sequence[int]) -> list[torch.Tensor]:
        trailing = chunks[0].shape[1:]
        row = trailing.numel()
        send = torch.cat([chunk.reshape(-1) for chunk in chunks])
        recv_splits = [rows * row for rows in received_rows]
        received = _AllToAll.apply(send, [chunk.numel() for chunk in chunks], recv_splits, group)
        return [piece.view(rows, *trailing) for piece, rows in zip(received.split(recv_splits), received_rows)]

    return ContextGroup(size=size, rank=mesh.get_local_rank("cp"), all_to_all=all_to_all,
                        sum_over_group=lambda tensor: _SumOverGroup.apply(tensor, group))


def build_training_model(model_config: ModelConfig, dist_info: DistInfo,
                         adapter_dir: str | Path | None = None) -> TokenLogprobModel:
    """Load the HF model (rank 0 reads it, the others receive their shards) and shard it with
    FSDP2: one group per decoder layer, then the root; a model under
    model_config.fsdp_per_layer_min_params parameters is the root group alone.

    The root group is the TokenLogprobModel wrapper, not the causal LM: its forward reads
    lm_head's weight directly (chunked logprobs), which is gathered only while the root's
    forward runs. Parameters stay fp32; on CUDA the compute copies are bf16.

    With model_config.lora enabled the causal LM is wrapped with PEFT LoRA adapters before
    sharding (TokenLogprobModel.causal_lm is then the PeftModel): base weights are frozen, only
    adapter parameters require grad. Rank 0 initialises the adapters (or loads them from
    adapter_dir, a PEFT-format folder, when resuming) and every rank receives them with the base
    weights. LoRA A matrices ([r, in_features]) are sharded on dim 1: r is often smaller than the
    number of ranks, and a dim-0 split would leave ranks with empty shards.

    With dist_info.context_parallel > 1 the model carries this rank's context_group (collective)
    and runs an attention that can split a stream (setup_model.CONTEXT_PARALLEL_ATTENTIONS).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compute_dtype = training_compute_dtype(dist_info.device, model_config.mixed_precision)
    check_attn_dtype(model_config.attn_implementation, compute_dtype, "ModelConfig.attn_implementation")
    attn = model_config.attn_implementation or default_attn_implementation(
        dist_info.device, compute_dtype, model_config.share_prompts, dist_info.context_parallel)
    if dist_info.context_parallel > 1:
        check_context_parallel(attn, "ModelConfig.attn_implementation")
    # Only rank 0 reads the checkpoint (on CPU; fully_shard moves each shard to the device); the
    # other ranks build a parameter-less skeleton and receive their shards from it, so host
    # memory holds one full copy per node's rank 0, not one per rank.
    full_weights: dict[str, torch.Tensor] | None = None
    if dist_info.is_main:
        causal_lm = load_causal_lm(model_config.model_path, dtype=torch.float32, attn_implementation=attn)
    else:
        causal_lm = meta_causal_lm(model_config.model_path, attn_implementation=attn)
    causal_lm.config.use_cache = False
    if model_config.gradient_checkpointing:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if model_config.lora.enabled:
        causal_lm = apply_lora(causal_lm, model_config.lora, model_config.model_path)
        if dist_info.is_main and adapter_dir is not None:
            load_adapter_weights(causal_lm, adapter_dir)
    elif adapter_dir is not None:
        raise ValueError(f"build_training_model: adapter_dir {adapter_dir} given but model.lora.r is 0")
    if dist_info.is_main:
        full_weights = {name: p.detach() for name, p in causal_lm.named_parameters()}
    causal_lm.train()
    mesh = init_device_mesh(dist_info.device.type, (dist_info.world_size,))
    if compute_dtype != torch.float32:
        mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    else:
        mp_policy = MixedPrecisionPolicy()
    placement = _lora_a_on_dim1(causal_lm) if model_config.lora.enabled else None
    num_params = sum(p.numel() for p in causal_lm.parameters())
    per_layer = num_params >= model_config.fsdp_per_layer_min_params
    for layer in (causal_lm.get_decoder().layers if per_layer else ()):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=model_config.reshard_after_forward,
                    shard_placement_fn=placement)
    model = TokenLogprobModel(causal_lm, logprob_chunk_size=model_config.logprob_chunk_size,
                              context=context_group(dist_info))
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, shard_placement_fn=placement)
    if dist_info.rank != 0:
        model.to_empty(device=dist_info.device)
    if dist_info.world_size > 1:
        copy_weights_from_rank0(causal_lm, full_weights, dist_info.device)
    del full_weights
    logger.info(
        "FSDP2 model from %s: %d parameters (%d trainable) over %d ranks (context parallel %d), %s",
        model_config.model_path, num_params, sum(p.numel() for p in model.parameters() if p.requires_grad),
        dist_info.world_size, dist_info.context_parallel, "one unit per decoder layer" if per_layer else
        f"one unit (under model.fsdp_per_layer_min_params={model_config.fsdp_per_layer_min_params})",
    )
    return model


# PEFT's parameter-name marker of LoRA A matrices ([r, in_features]).
_LORA_A_MARKER = ".lora_A."


def _lora_a_on_dim1(causal_lm: nn.Module) -> Callable[[nn.Parameter], Any]:
    """FSDP2 shard_placement_fn: Shard(1) for LoRA A matrices, the default Shard(0) otherwise."""
    from torch.distributed.tensor import Shard

    lora_a = {id(p) for name, p in causal_lm.named_parameters() if _LORA_A_MARKER in name}

    def placement(param: nn.Parameter) -> Any:
        return Shard(1) if id(param) in lora_a else None

    return placement


def load_adapter_weights(peft_model: nn.Module, adapter_dir: str | Path) -> None:
    """Copy a PEFT-format adapter (adapter_model.safetensors) into an unsharded PeftModel, in
    place; raises ValueError naming the folder if any of the model's adapter tensors is missing
    or an unexpected one is present."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(adapter_dir) / ADAPTER_WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"adapter folder {adapter_dir} has no {ADAPTER_WEIGHTS_FILE}")
    result = set_peft_model_state_dict(peft_model, load_file(str(path)))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"adapter {path} does not fit model.lora: {len(missing)} adapter tensors missing "
                         f"(e.g. {missing[:2]}), unexpected {sorted(result.unexpected_keys)[:2]}")


def copy_weights_from_rank0(
    causal_lm: nn.Module, full_weights: dict[str, torch.Tensor] | None, device: torch.device
) -> None:
    """Collective: every rank's (FSDP-sharded) model takes rank 0's weights and buffers.

    Rank 0 passes its full, unsharded parameters by name (the dict is emptied as they are sent,
    so each full tensor is freed once broadcast); the others pass None. Each tensor is broadcast
    whole in turn (peak extra memory: one full tensor) and every rank keeps its own piece, cut
    along the dim of the parameter's placement.
    Buffers (rotary frequencies, ...) are replicated, so they are broadcast as is: on a rank that
    built a meta skeleton they hold garbage until then.
    """
    rank = dist.get_rank()
    if (full_weights is not None) != (rank == 0):
        raise ValueError(f"copy_weights_from_rank0: rank {rank} must pass full weights iff it is rank 0")
    with torch.no_grad():
        for name, param in causal_lm.named_parameters():
            local, dim, offset = local_piece(name, param)
            if rank == 0:
                full = full_weights.pop(name)
                if tuple(full.shape) != tuple(param.shape):
                    raise ValueError(f"weight {name}: full shape {tuple(full.shape)} != sharded {tuple(param.shape)}")
                whole = full.to(device=device, dtype=param.dtype)
            else:
                whole = torch.empty(param.shape, dtype=param.dtype, device=device)
            dist.broadcast(whole, src=0)
            if rank != 0:
                local.copy_(whole.narrow(dim, offset, local.shape[dim]))
        for buffer in causal_lm.buffers():
            dist.broadcast(buffer, src=0)
