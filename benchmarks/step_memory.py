"""Memory of a trainer step on the CPU, measured two ways, for benchmarks/memory.py (`--against
plan`) and the placement tests to hold the plan's estimate (async_grpo/launch/placement.py) to.

- `measure_step`, in a fresh process (`in_fresh_process`): the peak RSS of one training step as the
  trainer runs it (TokenLogprobModel's chunked forward, grpo_loss, backward, gradient clipping,
  AdamW), after a warm-up step, as growth over the weights and moments in memory before it; the
  weights and moments themselves are counted from the tensors. The process runs on glibc's fixed
  mmap and trim thresholds (process_tuning.FIXED_MALLOC_ENV), so every large block is returned to
  the kernel when freed and the resident set follows the bytes in use rather than the heap's
  high-water mark.
- `saved_bytes_per_token`, in this process: the bytes autograd keeps for backward, per token, in
  one decoder layer and outside the layers (unique storages through saved_tensors_hooks), at any
  compute dtype the CPU runs (bf16 included): what placement.layer_activation_bytes counts.

The peak RSS helpers (`rss_kib`, `reset_cpu_peak`) are shared with memory.py's other modes.
"""

from __future__ import annotations

import gc
import multiprocessing
import resource
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from async_grpo.runtime.processes import environ
from async_grpo.launch.process_tuning import FIXED_MALLOC_ENV
from async_grpo.trainer.optimizer import OptimConfig, build_optimizer
from benchmarks.packed_samples import draw_packed_samples
from grpo_loss import LossConfig, grpo_loss
from sample_processing_utils import LogprobInput, PackedBatch, post_process_batch
from setup_model import TokenLogprobModel, load_causal_lm

_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"  # written to clear_refs: reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
KIB = 1024
WARM_UP_TOKENS = 256  # the warm-up step's packed tokens: enough for a few samples, cheap at any width
STEP_LOSS = LossConfig(kl_coef=0.05)
"""The loss of a measured step: GRPO with its KL term on (reference logprobs in the batch)."""
_OUTSIDE_LAYERS = "outside"
"""saved_bytes_per_token's key for what is saved before the first decoder layer or after the last."""


def rss_kib(key: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: peak since start or reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def reset_cpu_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
    except OSError:
        return False
    return True


def in_fresh_process(fn: Callable, *args, env: dict[str, str] | None = None) -> object:
    """Run fn(*args) in a newly spawned interpreter (nothing inherited, nothing left behind), with
    `env` added to its environment."""
    with environ(env or {}), ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


@dataclass(frozen=True, slots=True)
class StepPeak:
    """What measure_step saw, in bytes."""

    pass_bytes: int
    """Peak RSS during the step over the RSS just before it (weights and AdamW's moments in memory):
    gradients, activations, logit chunks, and whatever else the step holds at its peak."""
    state_bytes: int
    """Weights and AdamW's moments, counted from the tensors (what stays resident between steps)."""
    num_params: int
    """Parameters of the model (all trained)."""
    output_tokens: int
    """Scored tokens of the batch."""
    method: str
    """How the peak was read: 'rss_peak_clear_refs' (VmHWM reset before the step) or 'ru_maxrss'."""

    @property
    def step_bytes(self) -> int:
        """The step's peak over the process without the model: its state plus the pass's growth."""
        return self.state_bytes + self.pass_bytes


def _train_step(model: TokenLogprobModel, optimizer: torch.optim.Optimizer, batch: PackedBatch,
                max_grad_norm: float) -> None:
    """The trainer's step on one minibatch: forward, GRPO loss, backward, clip, AdamW."""
    inputs = batch.inputs
    logprobs, _ = model(inputs.input_ids, inputs.position_ids, inputs.targets, inputs.output_indices)
    loss, _ = grpo_loss(logprobs, batch, STEP_LOSS)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _warm_up_batch(vocab_size: int) -> PackedBatch:
    """A few short rollouts: a step on them makes AdamW's moments and runs every code path once
    (modules imported on first use, thread pools), so the measured step's growth is its own."""
    return post_process_batch(draw_packed_samples(
        WARM_UP_TOKENS, vocab_size, min_prompt=8, max_prompt=32, output_median=32.0, output_sigma=0.5,
        max_output=64, seed=0))


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the weights and of the optimizer's state tensors."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                  if isinstance(t, torch.Tensor))
    return weights + moments


def _measure_step(model_dir: str, batch: PackedBatch, chunk_size: int, gradient_checkpointing: bool,
                  threads: int) -> StepPeak:
    """In the child: load the model (fp32, the CPU trainer's packed_sdpa), one warm-up step, then
    one measured step."""
    if threads:
        torch.set_num_threads(threads)
    causal_lm = load_causal_lm(model_dir)
    causal_lm.config.use_cache = False
    if gradient_checkpointing:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = TokenLogprobModel(causal_lm, logprob_chunk_size=chunk_size).train()
    optim_config = OptimConfig()
    optimizer = build_optimizer(model, optim_config)
    _train_step(model, optimizer, _warm_up_batch(causal_lm.config.vocab_size), optim_config.max_grad_norm)
    gc.collect()
    before_kib = rss_kib("VmRSS")
    if reset_cpu_peak():
        _train_step(model, optimizer, batch, optim_config.max_grad_norm)
        peak_kib, method = rss_kib("VmHWM"), "rss_peak_clear_refs"
    else:  # the process's peak since start: the warm-up must not have peaked above the step
        _train_step(model, optimizer, batch, optim_config.max_grad_norm)
        peak_kib, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    return StepPeak(pass_bytes=(peak_kib - before_kib) * KIB, state_bytes=_state_bytes(model, optimizer),
                    num_params=sum(p.numel() for p in model.parameters()),
                    output_tokens=int(batch.inputs.output_indices.numel()), method=method)


def measure_step(model_dir: str, batch: PackedBatch, chunk_size: int, gradient_checkpointing: bool,
                 threads: int = 0) -> StepPeak:
    """One trainer step's peak memory on the CPU, in a fresh process on the fixed glibc thresholds
    (module docstring). threads: torch's intra-op threads there (0: its default)."""
    return in_fresh_process(_measure_step, model_dir, batch, chunk_size, gradient_checkpointing, threads,
                            env=FIXED_MALLOC_ENV)


def _storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for tensors without one."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr(), storage.nbytes()


def saved_bytes_per_token(causal_lm: nn.Module, inputs: LogprobInput, chunk_size: int) -> dict[str, float]:
    """Bytes per packed token that one training forward of TokenLogprobModel(causal_lm) leaves for
    backward, by where they were first saved: 'layer<i>' for decoder layer i, 'outside' for the
    rest (embeddings, rotary tables, final norm, the logit chunks' inputs). Parameters (and their
    compute-dtype casts' storages, if any are the parameters') are not counted; each storage once."""
    where = [_OUTSIDE_LAYERS]
    first_seen: dict[tuple[int, int], str] = {}
    handles = []
    for index, layer in enumerate(causal_lm.get_decoder().layers):
        handles.append(layer.register_forward_pre_hook(
            lambda module, args, name=f"layer{index}": where.__setitem__(0, name)))
        handles.append(layer.register_forward_hook(lambda module, args, output: where.__setitem__(0, _OUTSIDE_LAYERS)))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key is not None:
            first_seen.setdefault(key, where[0])
        return tensor

    model = TokenLogprobModel(causal_lm, logprob_chunk_size=chunk_size).train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logprobs, _ = model(inputs.input_ids, inputs.position_ids, inputs.targets, inputs.output_indices)
    finally:
        for handle in handles:
            handle.remove()
    params = {_storage_key(p) for p in model.parameters()}
    totals: dict[str, float] = {}
    for key, name in first_seen.items():
        if key not in params:
            totals[name] = totals.get(name, 0.0) + key[1] / inputs.input_ids.numel()
    del logprobs
    return totals
