"""Which process runs on which GPU, with how much of its memory: the local launcher's plan.

One pure function, `plan_placement`, decides from the host's GPUs (count and memory) and the
run (the model's shape, trainer ranks and token budget, the workers) where everything goes:

- no GPU: everything on the CPU (the CPU engine settings apply; local_cluster.py);
- one GPU: everything shares GPU 0. The trainer (one rank) takes what it needs (estimated
  below), each logprob-type worker its bf16 weights and one forward's activations, and the
  generation engines split the rest: vLLM's `gpu_memory_utilization` is computed from those
  needs, not its fixed default, and an engine whose run's load is known takes only the KV cache
  that load needs (launch/kv_cache_plan.py), on any number of GPUs. Ray gives each worker a fraction of the GPU, so all land on it.
  All of them are sized to be resident at once: the trainer trains each minibatch as soon as it
  fills, while the rest of the step is still being generated (even at max_lag 0), so the
  engines' KV cache is in use while the trainer computes, and vLLM's sleep mode (which frees the
  KV cache only between generation phases) would not lower the peak;
- two GPUs: inference (every worker, sharing GPU 0) | trainer (one rank, GPU 1);
- more: one GPU per trainer rank (the last ones), the rest to the workers, a whole GPU each
  when there are enough (as before), else shared as on GPU 0 above.

A plan that cannot fit raises PlacementError in one line that names the numbers. Memory figures
are estimates from the model's config.json (parameters, width, MLP width, heads, depth,
vocabulary); the plan's printed block says so. The trainer's activations are counted tensor by
tensor from what autograd keeps in a Qwen2/Llama decoder layer (`layer_activation_bytes`);
benchmarks/memory.py (`--against plan`) measures a real training step against the estimate
(benchmarks/RESULTS.md, "Trainer memory estimate against a measured step"). Under context
parallelism (RunShape.context_parallel) a rank holds its share of its group's minibatch,
max_tokens_per_gpu tokens, with the key/value heads repeated as Ulysses repeats them;
launch/context_plan.py checks the degree and, when a rank cannot hold the run's longest sample,
names the smallest degree that can. The launcher prints the plan before anything starts
(`--dry_run`: only the plan); docs/real_models.md shows the plans for one, two and eight GPUs,
docs/training.md a context-parallel one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from async_grpo.launch.kv_cache_plan import EngineSizing, RunLoad, kv_bytes_per_token, size_engine

GiB = 2**30
FP32_BYTES = 4
BF16_BYTES = 2
# FSDP2 with fp32 master weights and AdamW: parameters, gradients and the two moments in fp32.
TRAIN_STATE_BYTES_PER_PARAM = 4 * FP32_BYTES
# gate_proj's and up_proj's outputs, the SiLU of the first and the product, each [tokens, intermediate]:
# what a gated MLP keeps for backward.
MLP_SAVED_TENSORS = 4
# sdpa's backward keeps its query and output and packed_sdpa's o_proj input is a third [tokens,
# heads * head_dim] copy (the [T, H, D] regrouping); keys and values are kept at the KV heads' width.
ATTENTION_QUERY_WIDTH_TENSORS = 3
# RMSNorm keeps two compute-dtype tensors: the normalised input of its gain and its output, the
# next projections' input (and its input in fp32: _norm_bytes).
NORM_COMPUTE_DTYPE_TENSORS = 2
# A context-parallel layer's exchange (model/context_parallel.ulysses_attention) holds at once its
# q/k/v share's send buffer, the pieces received and their concatenation in stream order, and the
# same three copies of the attention output on the way back; transient, so counted at a layer's
# moment, not per layer (the MLP's backward is larger for Qwen2/Llama shapes).
EXCHANGE_COPIES = 3
# Freshly built models (and hand-built shapes) without these in their config: the classic
# transformer's 4 x hidden MLP and 64-wide heads, without grouped KV heads.
DEFAULT_MLP_RATIO = 4
DEFAULT_HEAD_DIM = 64
# The logprob pass works on chunks of logits: the fp32 logits, their log-softmax and its gradient.
LOGIT_COPIES = 3
# A forward-only pass (logprob workers) holds about one layer's intermediates at a time; two leave
# room for the residual stream and the allocator's reuse.
FORWARD_ONLY_LAYERS = 2
# CUDA context, cuBLAS workspaces and allocator slack per process on a GPU: measured contexts are
# 0.3-0.6 GiB; 1 GiB leaves room for fragmentation.
PROCESS_OVERHEAD_BYTES = 1 * GiB
# Left unplanned on every shared GPU, so that estimates that run short do not crash a run.
SAFETY_FRACTION = 0.05
# An engine needs its bf16 weights plus a KV cache worth having; below this it is refused.
MIN_KV_CACHE_BYTES = 1 * GiB
# Below this share an engine is not worth starting; above vLLM's own default (0.92 in vLLM 0.32)
# it would leave less room than vLLM itself leaves for everything outside its accounting.
MIN_ENGINE_FRACTION = 0.05
MAX_ENGINE_FRACTION = 0.92


class PlacementError(ValueError):
    """The run does not fit on this host's GPUs (one line, naming the numbers)."""


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """What the memory estimates read from a Hugging Face config.json."""

    num_params: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int = 0
    """MLP width; 0: DEFAULT_MLP_RATIO x hidden_size (shapes built by hand)."""
    num_heads: int = 0
    """Attention (query) heads; 0: hidden_size // DEFAULT_HEAD_DIM."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: num_heads."""
    head_dim: int = 0
    """Width of one head; 0: hidden_size // num_heads."""

    def __post_init__(self) -> None:
        for name in ("num_params", "hidden_size", "num_layers", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelShape.{name} must be >= 0 (0: derived), got {getattr(self, name)}")
        heads = self.num_heads or max(1, self.hidden_size // DEFAULT_HEAD_DIM)
        derived = {"intermediate_size": DEFAULT_MLP_RATIO * self.hidden_size, "num_heads": heads,
                   "num_kv_heads": heads, "head_dim": self.hidden_size // heads}
        for name, value in derived.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)  # frozen: the defaults are filled in once, here

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """Parameters counted from a decoder-only config (Qwen2/Llama shapes: attention with
        grouped KV heads and biases on q/k/v, a gated MLP, two norms per layer, embeddings and an
        lm_head unless tied)."""
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        vocab, inter = int(config["vocab_size"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
        attention += heads * head_dim + 2 * kv_heads * head_dim  # q/k/v biases (Qwen2)
        per_layer = attention + 3 * hidden * inter + 2 * hidden
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
        return cls(num_params=layers * per_layer + embeddings + hidden, hidden_size=hidden, num_layers=layers,
                   vocab_size=vocab, intermediate_size=inter, num_heads=heads, num_kv_heads=kv_heads,
                   head_dim=head_dim)


@dataclass(kw_only=True, frozen=True)
class RunShape:
    """What the run asks of the host: its ranks, budgets and workers."""

    trainer_ranks: int
    max_tokens_per_gpu: int
    logprob_chunk_size: int = 1024
    gradient_checkpointing: bool = False
    generation_workers: int = 1
    tensor_parallel_size: int = 1
    logprob_workers: int = 0
    """Every other worker, each placed as a logprob worker is: logprob, reference, teacher and judge workers."""
    judge_workers: int = 0
    """Of logprob_workers, the judges (the plan names them apart)."""
    max_tokens_per_forward: int = 16384
    compute_dtype_bytes: int = BF16_BYTES
    """Bytes per element the trainer computes in: 2 for bf16 (mixed precision, the GPU default), 4
    for fp32 (model.mixed_precision off, or the CPU)."""
    sequences_in_flight: int = 0
    """Samples generated at once at most ((max_lag + 1) x ranks x prompts per rank x n); 0: not
    known, and each engine takes the plan's whole share for its KV cache."""
    max_model_len: int = 0
    """The run's longest sample in tokens (with sequences_in_flight, sizes the engines' KV cache; a
    sample over the group's budget, under oversized_sample_policy train_alone, sets tokens_per_rank)."""
    context_parallel: int = 1
    """Ranks that split each minibatch (model.context_parallel): a group takes up to
    context_parallel x max_tokens_per_gpu tokens, each rank holds max_tokens_per_gpu of them."""

    def __post_init__(self) -> None:
        if self.context_parallel < 1:
            raise ValueError(f"RunShape.context_parallel must be >= 1, got {self.context_parallel}")
        if self.compute_dtype_bytes not in (BF16_BYTES, FP32_BYTES):
            raise ValueError(f"RunShape.compute_dtype_bytes must be {BF16_BYTES} or {FP32_BYTES}, "
                             f"got {self.compute_dtype_bytes}")

    @property
    def workers(self) -> int:
        return self.generation_workers + self.logprob_workers

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank's activations hold at most: its share of a full group minibatch (the zigzag
        split gives every rank max_tokens_per_gpu of cp x max_tokens_per_gpu), or of a longer lone sample."""
        return max(self.max_tokens_per_gpu, -(-self.max_model_len // self.context_parallel))


def ulysses_kv_repeat(model: ModelShape, context_parallel: int) -> int:
    """How many times a context-parallel rank repeats each key/value head (the rule of
    model/context_parallel.kv_repeat, which this layer cannot import): 1 without context parallelism."""
    return context_parallel // math.gcd(model.num_kv_heads, context_parallel)


def _norm_bytes(hidden_size: int, dtype_bytes: int) -> int:
    """Bytes per token an RMSNorm keeps: its input in fp32 (a new upcast when computing in bf16, the
    input itself in fp32) and its fp32 inverse RMS, then the normalised input of its gain and its
    output (the next projections' input) in the compute dtype."""
    return FP32_BYTES * (hidden_size + 1) + NORM_COMPUTE_DTYPE_TENSORS * dtype_bytes * hidden_size


def layer_activation_bytes(model: ModelShape, dtype_bytes: int, context_parallel: int = 1) -> int:
    """Bytes per token that autograd keeps for one Qwen2/Llama decoder layer's backward, computed
    in `dtype_bytes` (what a training forward saves; the trainer's packed_sdpa path). Under context
    parallelism a rank keeps its heads' share of the whole stream, the same bytes per token it
    holds, with the key/value heads repeated as Ulysses repeats them (ulysses_kv_repeat)."""
    h, b = model.hidden_size, dtype_bytes
    query_width = model.num_heads * model.head_dim
    kv_width = model.num_kv_heads * ulysses_kv_repeat(model, context_parallel) * model.head_dim
    norms = 2 * _norm_bytes(h, b)
    # Attention: the rotated queries, sdpa's output and o_proj's input copy, at the query width...
    attention = ATTENTION_QUERY_WIDTH_TENSORS * b * query_width
    attention += 2 * b * kv_width  # ...the rotated keys and the values, at the KV heads' width...
    attention += FP32_BYTES * model.num_heads  # ...and sdpa's fp32 log-sum-exp per head
    # The gated MLP: gate and up outputs, the SiLU, their product (down_proj's input).
    mlp = MLP_SAVED_TENSORS * b * model.intermediate_size
    return norms + attention + mlp


def layer_backward_bytes(model: ModelShape, dtype_bytes: int) -> int:
    """Bytes per token a decoder layer's backward holds beyond what the layer keeps: the gradients
    of the residual stream and of the norm's output, and at the MLP's widest, down_proj's input
    gradient and the two it splits into while their factors are still held (the product's own
    copy is freed by then)."""
    return dtype_bytes * (2 * model.hidden_size + 2 * model.intermediate_size)


def exchange_bytes(model: ModelShape, dtype_bytes: int, context_parallel: int) -> int:
    """Bytes per token a context-parallel layer's all-to-alls hold at once (EXCHANGE_COPIES of its
    q/k/v share and of its output); 0 without context parallelism."""
    if context_parallel == 1:
        return 0
    kv_width = model.num_kv_heads * ulysses_kv_repeat(model, context_parallel) * model.head_dim
    return EXCHANGE_COPIES * dtype_bytes * (2 * model.num_heads * model.head_dim + 2 * kv_width)


def head_activation_bytes(model: ModelShape, dtype_bytes: int) -> int:
    """Bytes per token kept outside the decoder layers: the final RMSNorm's, with the hidden states
    of the scored positions (at most every token, the logit chunks' input) in place of its output,
    and the rotary cos/sin tables."""
    return _norm_bytes(model.hidden_size, dtype_bytes) + 2 * dtype_bytes * model.head_dim


def logit_chunk_bytes(model: ModelShape, chunk_size: int, tokens: int) -> int:
    """The fp32 logit chunks of grpo_loss.chunked_token_logprobs (LOGIT_COPIES at once)."""
    return min(chunk_size, tokens) * model.vocab_size * FP32_BYTES * LOGIT_COPIES


@dataclass(kw_only=True, frozen=True)
class TrainerMemory:
    """One trainer rank's estimated peak, by part (bytes)."""

    state: int
    """Sharded fp32 weights, gradients and AdamW's two moments."""
    gathered: int
    """Compute-dtype copies FSDP2 gathers: the embeddings and two layers' weights and gradients."""
    activations: int
    """A training pass's peak over the weights and gradients (trainer_activation_bytes)."""
    overhead: int
    """CUDA context, workspaces and allocator slack (PROCESS_OVERHEAD_BYTES)."""

    @property
    def total(self) -> int:
        return self.state + self.gathered + self.activations + self.overhead


def trainer_activation_bytes(model: ModelShape, run: RunShape) -> int:
    """Peak bytes of a training pass over a rank's tokens (RunShape.tokens_per_rank) beyond the
    weights and their gradients: what every layer keeps (with checkpointing, each layer's input),
    plus the larger of two moments: backward's start (the head's tensors and the logit chunks) and a
    layer's backward (that layer recomputed first when checkpointing; under context parallelism the
    larger of its backward and its exchange), by when the head's tensors are freed."""
    tokens, b, cp = run.tokens_per_rank, run.compute_dtype_bytes, run.context_parallel
    layer = layer_activation_bytes(model, b, cp)
    in_layer = max(layer_backward_bytes(model, b), exchange_bytes(model, b, cp))
    if run.gradient_checkpointing:
        kept = tokens * model.num_layers * b * model.hidden_size
        in_a_layer = tokens * (layer + in_layer)
    else:
        kept = tokens * model.num_layers * layer
        in_a_layer = tokens * in_layer
    at_start = tokens * head_activation_bytes(model, b) + logit_chunk_bytes(model, run.logprob_chunk_size, tokens)
    return kept + max(at_start, in_a_layer)


def trainer_memory(model: ModelShape, run: RunShape) -> TrainerMemory:
    """Estimated peak memory of one trainer rank, by part (TrainerMemory)."""
    embedding = model.vocab_size * model.hidden_size
    layer = (model.num_params - 2 * embedding) // model.num_layers
    return TrainerMemory(
        state=TRAIN_STATE_BYTES_PER_PARAM * model.num_params // run.trainer_ranks,
        gathered=run.compute_dtype_bytes * (2 * embedding + 2 * max(layer, 0)),
        activations=trainer_activation_bytes(model, run),
        overhead=PROCESS_OVERHEAD_BYTES,
    )


def trainer_bytes(model: ModelShape, run: RunShape) -> int:
    """Estimated peak memory of one trainer rank: sharded training state, the weights FSDP2
    gathers for the layers in flight and the embeddings, activations of a full token budget, the
    logit chunks, and the process overhead (trainer_memory's parts)."""
    return trainer_memory(model, run).total


def logprob_worker_bytes(model: ModelShape, run: RunShape) -> int:
    """Estimated peak memory of one logprob-type worker: bf16 weights, a forward's activations over
    its token budget for about FORWARD_ONLY_LAYERS layers, its logit chunks, the overhead."""
    weights = BF16_BYTES * model.num_params
    activations = run.max_tokens_per_forward * FORWARD_ONLY_LAYERS * layer_activation_bytes(model, BF16_BYTES)
    logits = logit_chunk_bytes(model, run.logprob_chunk_size, run.max_tokens_per_forward)
    return weights + activations + logits + PROCESS_OVERHEAD_BYTES


def engine_min_bytes(model: ModelShape) -> int:
    """The least an engine is given: its bf16 weights, a minimal KV cache and the overhead."""
    return BF16_BYTES * model.num_params + MIN_KV_CACHE_BYTES + PROCESS_OVERHEAD_BYTES


@dataclass(kw_only=True, frozen=True)
class Placement:
    """Where a local run's processes go (an empty plan on a CPU host)."""

    host_gpus: int = 0
    gpu_memory_bytes: int = 0
    worker_gpus: tuple[int, ...] = ()
    """The GPUs Ray hands out (the Ray head's CUDA_VISIBLE_DEVICES)."""
    trainer_gpus: tuple[int, ...] = ()
    """The trainer's CUDA_VISIBLE_DEVICES: one per rank, or GPU 0 shared with the workers."""
    worker_gpu_share: float = 0.0
    """Ray's num_gpus of each worker: 1 for a whole GPU, a fraction when workers share one."""
    engine_memory_fraction: float | None = None
    """Each generation engine's gpu_memory_utilization; None: vLLM's default (a whole GPU each)."""
    engine_sizing: EngineSizing | None = None
    """Each engine's KV cache and max_num_seqs sized to the run (None: the run's load is unknown)."""
    estimates: dict[str, int] = field(default_factory=dict)
    """Bytes per process kind that the plan assumed."""

    @property
    def on_gpu(self) -> bool:
        return self.host_gpus > 0

    @property
    def colocated(self) -> bool:
        """Trainer and engines share a GPU (the one-GPU plan)."""
        return bool(set(self.trainer_gpus) & set(self.worker_gpus))

    def lines(self, run: RunShape) -> list[str]:
        """The plan as the launcher prints it, one block."""
        if not self.on_gpu:
            return ["placement: CPU only (no GPU found): every process on the CPU"] + (
                [f"  trainer  {trainer_ranks_text(run)}"] if run.context_parallel > 1 else [])
        gib = self.gpu_memory_bytes / GiB
        lines = [f"placement: {self.host_gpus} GPU(s) of {gib:.1f} GiB "
                 f"({'colocated: trainer and workers share GPU 0' if self.colocated else 'trainer and workers apart'})"]
        share = ("a whole GPU each" if self.worker_gpu_share >= 1
                 else f"{self.worker_gpu_share:g} of a GPU each in Ray")
        judges = f", {run.judge_workers} judge" if run.judge_workers else ""
        lines.append(f"  workers  GPU(s) {_ids(self.worker_gpus)}: {run.generation_workers} generation, "
                     f"{run.logprob_workers - run.judge_workers} logprob-type{judges}; {share}")
        if self.engine_memory_fraction is not None:
            lines.append(f"  vLLM     gpu_memory_utilization {self.engine_memory_fraction:.3f} per engine "
                         f"({self.engine_memory_fraction * gib:.1f} GiB: weights, activations, KV cache)")
        if self.engine_sizing is not None:
            lines.append(self.engine_sizing.line())
        lines.append(f"  trainer  GPU(s) {_ids(self.trainer_gpus)}: {trainer_ranks_text(run)}")
        if self.estimates:
            lines.append("  estimated peak memory: " + ", ".join(
                f"{name} {value / GiB:.1f} GiB" for name, value in self.estimates.items()))
        return lines


def trainer_ranks_text(run: RunShape) -> str:
    """The trainer's ranks as the plan prints them: with context parallelism, its dp x cp mesh and
    the tokens each rank holds."""
    cp = run.context_parallel
    if cp == 1:
        return f"{run.trainer_ranks} rank(s)"
    return (f"{run.trainer_ranks} ranks = {run.trainer_ranks // cp} data-parallel x {cp} context-parallel, "
            f"{run.tokens_per_rank} tokens per rank ({cp * run.max_tokens_per_gpu} per group minibatch)")


def _ids(gpus: tuple[int, ...]) -> str:
    return ",".join(str(g) for g in gpus)


def plan_placement(host_gpus: int, gpu_memory_bytes: int, model: ModelShape, run: RunShape) -> Placement:
    """The plan for this host and run (module docstring); PlacementError when it cannot fit."""
    if host_gpus == 0:
        return Placement()
    if host_gpus < 0 or gpu_memory_bytes <= 0:
        raise PlacementError(f"host_gpus must be >= 0 and GPU memory > 0, got {host_gpus} and {gpu_memory_bytes}")
    if host_gpus <= 2 and run.trainer_ranks != 1:
        raise PlacementError(f"{host_gpus} GPU(s): the trainer runs one rank (one GPU per rank, and the workers "
                             f"need a GPU too), got --nproc_per_node {run.trainer_ranks}")
    if host_gpus == 1:
        return _colocated(gpu_memory_bytes, model, run)
    inference = host_gpus - run.trainer_ranks
    if inference < 1:
        raise PlacementError(f"{host_gpus} GPU(s) cannot hold {run.trainer_ranks} trainer ranks (one GPU each) and "
                             f"the workers: lower --nproc_per_node to {host_gpus - 1} or less")
    trainer = tuple(range(inference, host_gpus))
    estimates = {"trainer rank": trainer_bytes(model, run)}
    if estimates["trainer rank"] > gpu_memory_bytes:
        raise PlacementError(_too_big("a trainer rank", estimates["trainer rank"], gpu_memory_bytes))
    whole_gpus_needed = run.generation_workers * run.tensor_parallel_size + run.logprob_workers
    if inference >= whole_gpus_needed:
        fraction, sizing = _sized_share(model, run, MAX_ENGINE_FRACTION, gpu_memory_bytes)
        if sizing is None:
            fraction = None  # the run's load unknown: vLLM's own default on a whole GPU
        else:
            estimates["engine"] = sizing.engine_bytes
        return Placement(host_gpus=host_gpus, gpu_memory_bytes=gpu_memory_bytes,
                         worker_gpus=tuple(range(whole_gpus_needed)), trainer_gpus=trainer, worker_gpu_share=1.0,
                         engine_memory_fraction=fraction, engine_sizing=sizing, estimates=estimates)
    return _shared_inference(host_gpus, gpu_memory_bytes, model, run, tuple(range(inference)), trainer, estimates)


def _colocated(gpu_memory_bytes: int, model: ModelShape, run: RunShape) -> Placement:
    """Everything on GPU 0: the trainer's and logprob workers' needs first, the engines the rest."""
    if run.tensor_parallel_size != 1:
        raise PlacementError(f"one GPU cannot hold a tensor_parallel_size {run.tensor_parallel_size} engine")
    estimates = {"trainer rank": trainer_bytes(model, run)}
    if run.logprob_workers:
        estimates["logprob-type worker"] = logprob_worker_bytes(model, run)
    others = estimates["trainer rank"] + run.logprob_workers * estimates.get("logprob-type worker", 0)
    return _fit_engines(1, gpu_memory_bytes, model, run, (0,), (0,), others, estimates,
                        where="GPU 0 (shared with the trainer)")


def _shared_inference(host_gpus: int, gpu_memory_bytes: int, model: ModelShape, run: RunShape,
                      inference: tuple[int, ...], trainer: tuple[int, ...], estimates: dict[str, int]) -> Placement:
    """Workers share the inference GPUs: a fraction of a GPU each in Ray, packed GPU by GPU."""
    if run.tensor_parallel_size != 1:
        raise PlacementError(f"{len(inference)} inference GPU(s) are too few for {run.generation_workers} engines of "
                             f"tensor_parallel_size {run.tensor_parallel_size} plus {run.logprob_workers} "
                             f"logprob-type workers: start fewer workers or trainer ranks")
    per_gpu = math.ceil(run.workers / len(inference))
    # The worst-packed GPU holds per_gpu workers; Ray fills GPUs in turn, so the logprob-type
    # workers may all land beside one engine: size for that GPU.
    logprob_here = min(run.logprob_workers, per_gpu - 1) if run.generation_workers else min(run.logprob_workers, per_gpu)
    engines_here = max(per_gpu - logprob_here, 1) if run.generation_workers else 0
    if logprob_here:
        estimates["logprob-type worker"] = logprob_worker_bytes(model, run)
    others = logprob_here * estimates.get("logprob-type worker", 0)
    plan = _fit_engines(engines_here, gpu_memory_bytes, model, run, inference, trainer, others, estimates,
                        where=f"each inference GPU ({per_gpu} workers)", host_gpus=host_gpus)
    return plan


def _fit_engines(engines: int, gpu_memory_bytes: int, model: ModelShape, run: RunShape, worker_gpus: tuple[int, ...],
                 trainer_gpus: tuple[int, ...], others: int, estimates: dict[str, int], where: str,
                 host_gpus: int = 1) -> Placement:
    """Split what `others` leave of one GPU (less the safety margin) among `engines` engines."""
    usable = int(gpu_memory_bytes * (1 - SAFETY_FRACTION))
    left = usable - others
    per_engine = left // max(engines, 1)
    need = engine_min_bytes(model)
    if engines and per_engine < need:
        parts = ", ".join(f"{name} {value / GiB:.1f} GiB" for name, value in estimates.items())
        raise PlacementError(
            f"the plan does not fit {where}: {gpu_memory_bytes / GiB:.1f} GiB, {usable / GiB:.1f} GiB usable; "
            f"{parts} leave {max(per_engine, 0) / GiB:.1f} GiB per engine, below its bf16 weights + 1 GiB KV cache + "
            f"overhead = {need / GiB:.1f} GiB (estimates: lower max_tokens_per_gpu or max_tokens_per_forward, "
            f"turn on model.gradient_checkpointing, or use more GPUs)")
    fraction = per_engine / gpu_memory_bytes if engines else None
    sizing = None
    if fraction is not None:
        cap = round(max(min(fraction, MAX_ENGINE_FRACTION), MIN_ENGINE_FRACTION), 3)
        fraction, sizing = _sized_share(model, run, cap, gpu_memory_bytes)
        estimates["engine"] = sizing.engine_bytes if sizing is not None else int(fraction * gpu_memory_bytes)
    workers_on_a_gpu = math.ceil(run.workers / len(worker_gpus))
    return Placement(host_gpus=host_gpus, gpu_memory_bytes=gpu_memory_bytes, worker_gpus=worker_gpus,
                     trainer_gpus=trainer_gpus, worker_gpu_share=_ray_share(workers_on_a_gpu),
                     engine_memory_fraction=fraction, engine_sizing=sizing, estimates=estimates)


def _sized_share(model: ModelShape, run: RunShape, cap: float,
                 gpu_memory_bytes: int) -> tuple[float, EngineSizing | None]:
    """An engine's gpu_memory_utilization within `cap` of a GPU, and its KV cache sized to the
    run's sequences in flight (kv_cache_plan): the share that cache needs, rounded up to vLLM-readable
    thousandths; `cap` itself, and no sizing, when the run's load is unknown."""
    if not (run.sequences_in_flight and run.max_model_len):
        return cap, None
    load = RunLoad(sequences_in_flight=run.sequences_in_flight, max_model_len=run.max_model_len,
                   generation_workers=run.generation_workers)
    token_bytes = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, BF16_BYTES)
    sizing = size_engine(load, kv_token_bytes=token_bytes, weight_bytes=BF16_BYTES * model.num_params,
                         vocab_size=model.vocab_size, share_bytes=int(cap * gpu_memory_bytes))
    return min(cap, math.ceil(sizing.engine_bytes / gpu_memory_bytes * 1000) / 1000), sizing


def _ray_share(workers_on_a_gpu: int) -> float:
    """Ray's num_gpus per worker so that `workers_on_a_gpu` of them fit one GPU (rounded down to
    1/1000, Ray's resolution for fractional GPUs is finer, but a share that sums to just over 1
    would leave the last worker unplaced)."""
    return math.floor(1000 / workers_on_a_gpu) / 1000


def _too_big(what: str, need: int, have: int) -> str:
    return (f"{what} needs about {need / GiB:.1f} GiB (estimate) and a GPU has {have / GiB:.1f} GiB: lower "
            f"max_tokens_per_gpu, turn on model.gradient_checkpointing, or add trainer ranks to shard it further")


def default_trainer_ranks(host_gpus: int, whole_gpu_workers: int) -> int:
    """Trainer ranks when --nproc_per_node is not given: 2 on a CPU host; with GPUs, one per GPU
    the workers leave when each takes a whole one, and 1 on one or two GPUs."""
    if host_gpus == 0:
        return 2
    return 1 if host_gpus <= 2 else max(1, host_gpus - whole_gpu_workers)


def check_transfer_placement(weight_transfer: str, placement: Placement) -> None:
    """ValueError (one line) for a CUDA weight transfer the plan cannot carry: NCCL between the
    trainer and an engine on one GPU, or CUDA IPC between processes on different GPUs."""
    if not placement.on_gpu or weight_transfer == "object_store":
        return
    if weight_transfer in ("nccl", "nccl_m2n") and placement.colocated:
        raise ValueError(f"weight_transfer {weight_transfer!r} runs NCCL between the trainer and the engines, and the "
                         f"plan puts them on one GPU, where NCCL refuses two ranks ('Duplicate GPU detected'): "
                         f"use 'ipc' or 'object_store' on one GPU")
    if weight_transfer == "ipc" and not placement.colocated:
        raise ValueError(f"weight_transfer 'ipc' shares CUDA memory between processes on one GPU, and the plan puts "
                         f"the trainer on GPU(s) {','.join(map(str, placement.trainer_gpus))} and the engines on "
                         f"GPU(s) {','.join(map(str, placement.worker_gpus))}: use 'nccl' or 'object_store'")
