"""Context parallelism in the launcher's plan: whether the run's degree splits the model's heads
and the trainer's ranks, and, when one trainer rank cannot hold the run's longest sample, the
smallest degree that can.

A context-parallel group of cp ranks takes minibatches of up to cp x max_tokens_per_gpu tokens and
each of its ranks holds max_tokens_per_gpu of them (placement.RunShape.tokens_per_rank), so a
longest sample of L tokens needs a rank to hold ceil(L / cp). Ulysses splits the attention heads
over the group (model/context_parallel.py): cp must divide the heads, with the key/value heads
repeated to a multiple of cp. `check_context_plan` decides all of it from config.json and the run's
options, before anything starts (local_cluster.plan_for); each refusal is one line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from async_grpo.launch.placement import GiB, ModelShape, PlacementError, RunShape, trainer_bytes, ulysses_kv_repeat

# On one or two GPUs the trainer runs one rank (plan_placement): the workers need a GPU too.
SINGLE_RANK_GPUS = 2


def context_parallel_refusal(model: ModelShape, context_parallel: int) -> str | None:
    """Why the model's heads cannot be split over `context_parallel` ranks (one line), or None."""
    heads, kv_heads = model.num_heads, model.num_kv_heads
    if heads % context_parallel:
        return f"{heads} attention heads are not divisible by model.context_parallel {context_parallel}"
    if heads % (kv_heads * ulysses_kv_repeat(model, context_parallel)):
        return (f"{kv_heads} key/value heads cannot be repeated to a multiple of model.context_parallel "
                f"{context_parallel} that divides {heads} attention heads")
    return None


def context_degrees(model: ModelShape, most: int) -> list[int]:
    """The degrees up to `most` that the model's heads allow, ascending (1 always)."""
    return [cp for cp in range(1, most + 1) if context_parallel_refusal(model, cp) is None]


def most_trainer_ranks(host_gpus: int) -> int:
    """Trainer ranks this host can hold: one on one or two GPUs, else every GPU but one (the workers')."""
    return 1 if host_gpus <= SINGLE_RANK_GPUS else host_gpus - 1


def longest_sample(run: RunShape) -> int:
    """The run's longest sample in tokens; unknown (no trainer config), the group minibatch's budget."""
    return run.max_model_len or run.max_tokens_per_gpu * run.context_parallel


@dataclass(kw_only=True, frozen=True)
class ContextFit:
    """A context-parallel degree at which one rank holds its share of the longest sample."""

    context_parallel: int
    trainer_ranks: int
    """The run's ranks, raised to a multiple of context_parallel if they were not one."""
    max_tokens_per_gpu: int
    """The longest sample's share of one rank: ceil(longest / context_parallel)."""
    rank_bytes: int
    """One trainer rank's estimated peak at that share (placement.trainer_bytes)."""


def fit_at(model: ModelShape, run: RunShape, context_parallel: int, most_ranks: int) -> ContextFit:
    """One rank's share of the run's longest sample at `context_parallel`, on the run's ranks rounded
    up to a multiple of it (down, if the host holds fewer), and what that rank needs."""
    ranks = -(-run.trainer_ranks // context_parallel) * context_parallel
    if ranks > most_ranks:
        ranks = most_ranks // context_parallel * context_parallel
    tokens = -(-longest_sample(run) // context_parallel)
    trial = replace(run, trainer_ranks=ranks, context_parallel=context_parallel, max_tokens_per_gpu=tokens)
    return ContextFit(context_parallel=context_parallel, trainer_ranks=ranks, max_tokens_per_gpu=tokens,
                      rank_bytes=trainer_bytes(model, trial))


def smallest_fit(model: ModelShape, run: RunShape, host_gpus: int, gpu_memory_bytes: int) -> ContextFit | None:
    """The smallest degree at which a rank's share of the longest sample fits one GPU, or None."""
    most = most_trainer_ranks(host_gpus)
    for cp in context_degrees(model, most):
        fit = fit_at(model, run, cp, most)
        if fit.rank_bytes <= gpu_memory_bytes:
            return fit
    return None


def check_context_plan(host_gpus: int, gpu_memory_bytes: int, model: ModelShape, run: RunShape) -> None:
    """PlacementError (one line) for a degree the heads, the ranks or the host cannot take, and,
    where the trainer has GPUs of its own, for a rank that would not fit: naming the smallest
    degree that fits the longest sample, or saying that none does."""
    cp = run.context_parallel
    if cp > 1 and 0 < host_gpus <= SINGLE_RANK_GPUS:
        raise PlacementError(f"model.context_parallel {cp} needs {cp} trainer ranks, and on {host_gpus} GPU(s) the "
                             f"trainer runs one (the workers need a GPU): use 3 or more GPUs")
    if run.trainer_ranks % cp:
        raise PlacementError(f"model.context_parallel {cp} must divide the trainer's {run.trainer_ranks} ranks: "
                             f"set --nproc_per_node to a multiple of {cp}")
    refusal = context_parallel_refusal(model, cp)
    if refusal is not None:
        raise PlacementError(f"{refusal} (Ulysses splits the heads over the group): this model allows "
                             f"{', '.join(map(str, context_degrees(model, model.num_heads)))}")
    if host_gpus > 1:  # the trainer's GPUs are its own (on one GPU the colocated plan decides)
        check_trainer_fits(host_gpus, gpu_memory_bytes, model, run)


def check_trainer_fits(host_gpus: int, gpu_memory_bytes: int, model: ModelShape, run: RunShape) -> None:
    """PlacementError when a trainer rank's estimate exceeds a GPU: the smallest degree (with its
    token budget) that fits the run's longest sample, or why none does."""
    need = trainer_bytes(model, run)
    if need <= gpu_memory_bytes:
        return
    longest, have = longest_sample(run), gpu_memory_bytes / GiB
    head = (f"a trainer rank needs about {need / GiB:.1f} GiB (estimate) for {run.tokens_per_rank} tokens and a "
            f"GPU has {have:.1f} GiB")
    fit = smallest_fit(model, run, host_gpus, gpu_memory_bytes)
    if fit is not None:
        ranks = f" and --nproc_per_node {fit.trainer_ranks}" if fit.trainer_ranks != run.trainer_ranks else ""
        raise PlacementError(f"{head}: the longest sample ({longest} tokens) fits at model.context_parallel "
                             f"{fit.context_parallel} with max_tokens_per_gpu {fit.max_tokens_per_gpu}{ranks} "
                             f"(about {fit.rank_bytes / GiB:.1f} GiB per rank)")
    most = most_trainer_ranks(host_gpus)
    widest = fit_at(model, run, context_degrees(model, most)[-1], most)
    where = ("context parallelism needs two trainer ranks beside the workers: 3 or more GPUs" if most == 1 else
             f"at model.context_parallel {widest.context_parallel}, the most that {model.num_heads} heads and "
             f"{most} trainer GPUs allow, a rank holds {widest.max_tokens_per_gpu} tokens and needs about "
             f"{widest.rank_bytes / GiB:.1f} GiB")
    remedy = "" if run.gradient_checkpointing else "turn on model.gradient_checkpointing, "
    raise PlacementError(f"{head}, and no context-parallel degree fits the longest sample ({longest} tokens): "
                         f"{where}; {remedy}shorten the samples or use GPUs with more memory")
