"""The GRPO trainer: one process per GPU (or CPU slot) under torchrun, FSDP2 across ranks.

    torchrun --nproc_per_node=8 trainer_core.py --config configs/my_run.yaml [--optim.lr 1e-6 ...]

Inference workers must already be registered (see worker_dispatcher.py). Per step every rank
submits its prompts to the ExperienceBatcher, trains on the packed minibatches it receives as
they become ready, and after the optimizer step the new weights are pushed to the inference
workers. Generation of the next `max_lag` steps overlaps training of the current one.

One step's policy update (forward/backward per minibatch, further epochs, the gradient step
and its scaling) is async_grpo/trainer/policy_update.py; this file runs the steps.

Context parallelism (model.context_parallel = cp): a group of cp ranks shares each minibatch, each
rank scoring its share of the tokens; the group's first rank submits its prompts and counts its
samples (once, not cp times).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import ray
import torch
import torch.distributed as torch_dist
from ray.actor import ActorHandle
from torch.optim.lr_scheduler import LRScheduler

from async_grpo.batching.batcher_config import BatcherConfig
from async_grpo.config.actor_names import GENERATION, LOGPROB, RAY_NAMESPACE, REFERENCE, registry_name
from async_grpo.config.run_config import CONFIG_ERROR_EXIT, ConfigError, load_config, save_config
from async_grpo.config.versions import TRAINER_REQUIREMENTS, VersionError, check_versions
from async_grpo.config.worker_options import OBJECT_STORE_TRANSFER, check_transfer_packages
from async_grpo.launch.ray_env import actor_runtime_env
from async_grpo.runtime.host_gpus import listed_gpu_count
from async_grpo.runtime.processes import exit_without_teardown
from async_grpo.runtime.ray_access import ClusterJoinError, join_cluster
from async_grpo.telemetry.console import CONSOLE, LOG_FILE, configure_logging, log_run_summary
from async_grpo.telemetry.metrics import (
    DiscardedMetrics, MetricsLogger, StepAccumulator, StepDataLog, open_metrics_sink,
)
from async_grpo.trainer.checkpoint import (
    BackgroundCheckpointWriter, CheckpointWriter, TrainerState, latest_checkpoint, load_checkpoint,
)
from async_grpo.trainer.config import TrainerConfig
from async_grpo.trainer.data_path import PerRankDataPath, Rank0DataPath, make_data_path
from async_grpo.trainer.distributed_sampler import InfiniteDistributedSampler
from async_grpo.trainer.evaluation import Evaluator
from async_grpo.trainer.fsdp_setup import DistInfo, build_training_model, check_trainer_gpus, init_distributed
from async_grpo.trainer.optimizer import build_optimizer, build_scheduler
from async_grpo.trainer.policy_update import KeptMinibatch, gradient_divisor, train_on_step, update_for_step
from async_grpo.trainer.prompt_feeder import PromptFeeder, last_step_to_submit
from async_grpo.trainer.run_inputs import InputError, RunInputs, check_service_pools, load_run_inputs
from async_grpo.weights.adapter_files import weights_dir
from async_grpo.weights.trainer_cuda_transfer import EngineWeightSender, check_transfer_pairing
from async_grpo.weights.trainer_pusher import WeightPusher, resolve_push_dtype
from setup_model import TokenLogprobModel
from vllm_experience_batcher import RayRegistryClient, get_or_create_batcher

logger = logging.getLogger(__name__)


def setup_logging(config: TrainerConfig, rank: int) -> None:
    """Rank 0: the console at config.log_level and every INFO line in run_dir/run.log; other ranks:
    warnings on the console only (their INFO lines would repeat rank 0's)."""
    if rank == 0:
        configure_logging(config.log_level, log_file=Path(config.run_dir) / LOG_FILE, tag="[rank0] ")
    else:
        configure_logging("warning", log_file=None, tag=f"[rank{rank}] ", show_marked=False)


def _connect_ray(config: TrainerConfig) -> None:
    """Join the cluster the workers run in (token auth and loopback handled by ray_access.join_cluster)."""
    join_cluster(config.connection.ray_address, namespace=RAY_NAMESPACE, timeout_s=config.connection.connect_timeout_s,
                 log_to_driver=False, runtime_env=actor_runtime_env())


def _registry(kind: str) -> ActorHandle:
    """The named registry of a worker kind, with an error that says how to start workers."""
    try:
        return ray.get_actor(registry_name(kind), namespace=RAY_NAMESPACE)
    except ValueError:
        raise RuntimeError(
            f"{registry_name(kind)} not found in Ray namespace {RAY_NAMESPACE!r}: start {kind} workers "
            f"with `python worker_dispatcher.py --mode {kind} ...` before the trainer"
        ) from None


class Publisher(Protocol):
    """What the loop needs from a weight pusher (trainer_pusher.WeightPusher; tests of run_step pass
    stand-ins that only push)."""

    def push(self, model: torch.nn.Module, version: int, initial: bool = False) -> float: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class StepParts:
    """What every step works on, built once by `start_run`."""

    model: TokenLogprobModel
    """The FSDP2-sharded policy."""
    optimizer: torch.optim.Optimizer
    """Its AdamW."""
    scheduler: LRScheduler
    """Its learning-rate schedule, advanced once per step."""
    batcher: ActorHandle | None
    """The ExperienceBatcher actor (None on ranks other than 0 with data_path rank0)."""
    data_path: PerRankDataPath | Rank0DataPath
    """How this rank submits prompts and receives its minibatches."""
    pusher: Publisher
    """Publishes new weights to the inference workers."""
    feeder: PromptFeeder
    """Submits each step's prompts to the batcher."""
    data_log: StepDataLog | None = None
    """Where run_step records the prompts each step drew and trained on (None: not recorded)."""


def make_weight_pusher(config: TrainerConfig, dist: DistInfo) -> WeightPusher:
    """The pusher of this rank: rank 0 broadcasts to the registries of every kind that serves
    the policy (generation; logprob too when it computes old-policy logprobs). With a CUDA
    transfer (config.transfer) full weights reach the generation engines through it."""
    old_policy = config.experience.logprob_role == "old_policy"
    kinds = [GENERATION] + ([LOGPROB] if old_policy else [])
    registries = [_registry(kind) for kind in kinds] if dist.is_main else []
    dtype = resolve_push_dtype(config.weight_push_dtype, dist.device, config.model.mixed_precision)
    sender = None
    if config.transfer.weight_transfer != OBJECT_STORE_TRANSFER and not config.model.lora.enabled:
        # The update deadline is the generation registry's (rank 0 is the only rank that waits on workers).
        timeout_s = (ray.get(registries[0].get_config.remote()).weight_update_timeout_s if dist.is_main
                     else config.message_timeout_s)
        sender = EngineWeightSender(config.transfer, dist.rank, dist.world_size, registries[:1], timeout_s,
                                    dtype=dtype, device=dist.device)
    return WeightPusher(config.weight_push_mode, dist.rank, dist.world_size, registries, config.message_timeout_s,
                        dtype=dtype, weights_root=weights_dir(config.run_dir), engine_transfer=sender,
                        object_store_weights=old_policy)


def _restore(config: TrainerConfig, dist: DistInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: LRScheduler, sampler: InfiniteDistributedSampler) -> TrainerState:
    """Load the latest complete checkpoint if resuming; returns its state (step 0 when none)."""
    checkpoint = latest_checkpoint(Path(config.run_dir)) if config.resume else None
    if checkpoint is None:
        if config.resume:
            logger.warning("--resume: no complete checkpoint in %s, starting from step 0", config.run_dir)
        return TrainerState(step=0)
    state = load_checkpoint(checkpoint, model, optimizer, scheduler, dist)
    sampler.load_state_dict(state.sampler_state)
    logger.info("resumed from %s at step %d", checkpoint, state.step, extra=CONSOLE)
    return state


@dataclass(slots=True)
class Run:
    """A started run: what `train`'s loop holds besides each step's parts."""

    dist: DistInfo
    """This rank's place in the process group."""
    parts: StepParts
    """What every step works on."""
    start_step: int
    """The first step to train: 0, or the step a resumed checkpoint continues at."""
    evaluator: Evaluator | None
    """Held-out evaluation (rank 0, when eval is on), of the weights just pushed."""
    metrics: MetricsLogger | DiscardedMetrics
    """Where each step's metrics go (rank 0 writes them; other ranks discard theirs)."""
    checkpoints: CheckpointWriter
    """Saves a checkpoint when due and makes it visible once the step's records are written."""


def train(config: TrainerConfig) -> None:
    """Run the GRPO loop. Each step gets its batches, computes the loss, steps the optimizer and
    pushes the weights (run_step); then it is evaluated and checkpointed when due, and logged."""
    run = start_run(config)
    try:
        for step in range(run.start_step, config.num_steps):
            _check_prompts_submitted(step, run.parts.feeder)
            step_metrics = run_step(step, run.parts, config, run.dist)
            if run.evaluator is not None and config.eval.is_due(step, config.num_steps):
                step_metrics.update(evaluate(run.evaluator, step, config))
            due = _should_checkpoint(step, config)
            blocked_s = save_checkpoint_after(step, run.parts, run.checkpoints) if due else 0.0
            step_metrics["timing/checkpoint_s"] = blocked_s
            run.metrics.log(step, step_metrics)
            if due:  # visible only now, after the records of every step it covers
                run.checkpoints.commit()
        run.checkpoints.close()  # the last background save is on disk before the ranks exit
        run.parts.pusher.close()
    except BaseException:
        _close_after_error(run.checkpoints)
        raise
    finally:
        run.metrics.close()
    _end_run(config, run.dist)


def start_run(config: TrainerConfig) -> Run:
    """Everything before the first step: the policy and its optimizer (restored when resuming), the
    batcher, the data path and the pusher, the first weights published with the prompts they are
    recent enough for, the metrics sink and the checkpoint writer."""
    inputs, dist = _join_run(config)
    run_dir = Path(config.run_dir)
    # The ranks of a context-parallel group draw the same prompts; the group's first rank submits them.
    sampler = InfiniteDistributedSampler(len(inputs.prompts), dist.data_rank, dist.data_parallel, config.seed)
    model, optimizer, scheduler = build_policy(config, dist)
    restored = _restore(config, dist, model, optimizer, scheduler, sampler)
    start_step = restored.step
    # A resumed run trains again from start_step: the records a crashed run wrote for it and
    # later steps are cut from metrics.jsonl and data_rank*.jsonl, so each step has one record.
    resume_step = start_step if config.resume else None

    batcher = _make_batcher(config, dist, restored.algorithm_state)
    data_path = make_data_path(config.data_path, batcher, inputs.prompts, dist)
    pusher = make_weight_pusher(config, dist)
    data_log = StepDataLog(run_dir, dist.rank, resume_step=resume_step) if dist.leads_group else None
    feeder = PromptFeeder(sampler, data_path, config, dist, first_step=start_step, data_log=data_log)
    start_generation(model, pusher, feeder, start_step, config)
    parts = StepParts(model=model, optimizer=optimizer, scheduler=scheduler, batcher=batcher, data_path=data_path,
                      pusher=pusher, feeder=feeder, data_log=data_log)

    metrics = open_metrics_sink(run_dir, is_main=dist.is_main, tensorboard=config.tensorboard,
                                progress_total=config.num_steps, progress_start=start_step,
                                progress_bar=config.progress_bar, resume_step=resume_step, report=config.metrics,
                                collapse=config.collapse)
    writer_class = BackgroundCheckpointWriter if config.checkpoint_async else CheckpointWriter
    checkpoints = writer_class(run_dir, config.model.model_path, dist, keep=config.keep_checkpoints)
    return Run(dist=dist, parts=parts, start_step=start_step, evaluator=inputs.evaluator, metrics=metrics,
               checkpoints=checkpoints)


def _join_run(config: TrainerConfig) -> tuple[RunInputs, DistInfo]:
    """Read the run's inputs, join the Ray cluster and the process group, write config.yaml and
    seed torch. Cheap failures first: a bad input or an unreachable cluster stops in seconds."""
    rank = int(os.environ.get("RANK", "0"))  # torchrun's; init_distributed reads the same variable
    inputs = load_run_inputs(config, with_evaluator=rank == 0)
    algorithm = config.experience.algorithm
    if config.loss.kl_in_reward and algorithm.estimator == "grpo" and algorithm.prepare_batch is None:
        logger.warning("loss.kl_in_reward with the grpo estimator: the std division scales the KL differences "
                       "inside equal-reward groups up to unit advantages, which can swamp the reward signal "
                       "(benchmarks/RESULTS.md, 'Algorithm variants'); dr_grpo or reinforce_pp keep them small")
    _connect_ray(config)  # before the process group: a cluster we cannot join fails in seconds, not at a collective
    dist = init_distributed(config.dist_timeout_s, config.model.context_parallel)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if dist.is_main:
        save_config(config, run_dir / "config.yaml")
    torch.manual_seed(config.seed + dist.rank)
    return inputs, dist


def build_policy(config: TrainerConfig, dist: DistInfo) -> tuple[TokenLogprobModel, torch.optim.Optimizer, LRScheduler]:
    """The FSDP2-sharded policy (from the latest checkpoint when resuming), its optimizer and schedule."""
    checkpoint = latest_checkpoint(Path(config.run_dir)) if config.resume else None
    if config.model.lora.enabled:
        # A LoRA checkpoint holds the adapter only: the base comes from model.model_path again.
        model = build_training_model(config.model, dist, adapter_dir=checkpoint)
    else:
        # A checkpoint is a full HF model directory: resuming loads the policy straight from it.
        model_config = replace(config.model, model_path=str(checkpoint)) if checkpoint else config.model
        model = build_training_model(model_config, dist)
    optimizer = build_optimizer(model, config.optim)
    return model, optimizer, build_scheduler(optimizer, config.optim)


def _check_prompts_submitted(step: int, feeder: PromptFeeder) -> None:
    if feeder.next_step <= step:
        # TrainerConfig's max_lag >= push_every - 1 rules this out; were it to happen, the
        # ranks would wait on the batcher for message_timeout_s instead of failing here.
        raise RuntimeError(f"step {step} would train before its prompts were submitted")


def _end_run(config: TrainerConfig, dist: DistInfo) -> None:
    """Every rank has finished: say where the outputs are, rank 0 sums the run up, leave the group."""
    run_dir = Path(config.run_dir)
    torch_dist.barrier()
    logger.info("training finished at step %d; metrics in %s, every INFO line in %s", config.num_steps,
                run_dir / "metrics.jsonl", run_dir / LOG_FILE, extra=CONSOLE)
    if dist.is_main:
        log_run_summary(run_dir)
    torch_dist.destroy_process_group()


def pushes_after(step: int, config: TrainerConfig) -> bool:
    """Whether weights are published after `step`: every push_every steps, and after the last."""
    version = step + 1
    return version % config.push_every == 0 or version == config.num_steps


def evaluate(evaluator: Evaluator, step: int, config: TrainerConfig) -> dict[str, float]:
    """Rank 0: evaluate the weights the workers serve after this step's push. The other ranks
    meanwhile wait in the next step's first collective (well inside dist_timeout_s)."""
    if not pushes_after(step, config):
        logger.info("step %d: evaluating the last pushed weights (push_every=%d)", step, config.push_every)
    return evaluator.run(RayRegistryClient(_registry(GENERATION))).metrics()


def start_generation(model: torch.nn.Module, pusher: Publisher, feeder: PromptFeeder, start_step: int,
                     config: TrainerConfig) -> None:
    """Publish our weights as version start_step, then submit the steps they are recent enough for.

    Collective (the push). Workers may hold other weights (the base model, or a previous run's):
    the run starts from its own, also when resuming.
    """
    pusher.push(model, version=start_step, initial=True)
    feeder.submit_through(last_step_to_submit(start_step, config))


def save_checkpoint_after(step: int, parts: StepParts, checkpoints: CheckpointWriter) -> float:
    """Collective: start the checkpoint that resumes at step + 1 (the caller commits it once the
    step's records are written). Returns the seconds the loop was blocked."""
    # Only rank 0 writes trainer_state.json (and only it holds the batcher under data_path rank0).
    algorithm_state = ray.get(parts.batcher.algorithm_state.remote(step + 1)) if parts.batcher is not None else {}
    state = TrainerState(step=step + 1, sampler_state=parts.feeder.resume_state(step + 1),
                         algorithm_state=algorithm_state)
    return checkpoints.save(parts.model, parts.optimizer, parts.scheduler, state)


def _close_after_error(checkpoints: CheckpointWriter) -> None:
    """Wait for a background save in flight without hiding the error the run is failing with."""
    try:
        checkpoints.close()
    except Exception:
        logger.exception("the background checkpoint save failed as well")


def _should_checkpoint(step: int, config: TrainerConfig) -> bool:
    if step + 1 == config.num_steps and config.checkpoint_at_end:
        return True
    return config.checkpoint_every > 0 and (step + 1) % config.checkpoint_every == 0


def make_batcher_config(config: TrainerConfig, world_size: int) -> BatcherConfig:
    """The batcher's settings: the trainer's experience section, its KL-in-reward, rank count and
    context-parallel groups."""
    return BatcherConfig(world_size=world_size, experience=config.experience,
                         context_parallel=config.model.context_parallel,
                         kl_in_reward=config.loss if config.loss.kl_in_reward else None)


def _make_batcher(config: TrainerConfig, dist: DistInfo,
                  algorithm_state: dict[str, Any] | None = None) -> ActorHandle | None:
    """Rank 0 creates the batcher (get-if-exists) and restores a checkpoint's algorithm state into
    it; the others find it after a barrier (with data_path rank0 they do not use it: None)."""
    batcher_config = make_batcher_config(config, dist.world_size)
    if dist.is_main:
        _registry(GENERATION)
        if config.experience.logprob_role != "none":
            _registry(LOGPROB)
        if config.experience.reference_pool:
            _registry(REFERENCE)
        check_service_pools(config, _registry)
        batcher = get_or_create_batcher(batcher_config)
        ray.get(batcher.stats.remote())  # wait until it is up
        if algorithm_state:
            ray.get(batcher.load_algorithm_state.remote(algorithm_state))
    torch_dist.barrier()
    if dist.rank != 0:
        batcher = get_or_create_batcher(batcher_config) if config.data_path == "per_rank" else None
    return batcher


def run_step(step: int, parts: StepParts, config: TrainerConfig, dist: DistInfo) -> dict[str, float]:
    """One optimizer step: train on its minibatches, step, push weights, submit the prompts that
    the pushed weights are recent enough for (none when this step does not push)."""
    model, optimizer, scheduler, batcher = parts.model, parts.optimizer, parts.scheduler, parts.batcher
    step_start = time.perf_counter()
    acc = StepAccumulator(step=step)
    epochs = config.epochs_per_step
    kept: list[KeptMinibatch] | None = [] if epochs > 1 else None
    end = train_on_step(model, parts.data_path, step, config, dist, acc, keep=kept, feeder=parts.feeder)
    if end.num_samples > 0:
        grad_norm = update_for_step(model, optimizer, scheduler, kept, gradient_divisor(end, config), config, dist, acc)
    else:
        logger.warning("step %d: no trainable samples (%s); skipping the optimizer step", step, end)
        optimizer.zero_grad(set_to_none=True)
        grad_norm = 0.0
    version = step + 1
    push_s = 0.0
    if pushes_after(step, config):
        push_s = parts.pusher.push(model, version)
        # Right after the push, so generation of the released steps overlaps what follows. Steps
        # up to this one were submitted before they trained.
        last_step = last_step_to_submit(version, config)
        if last_step > step:
            parts.feeder.submit_through(last_step)
    if parts.data_log is not None:
        parts.data_log.trained(step, acc.trained_prompt_ids)
    batcher_stats = ray.get(batcher.stats.remote(step)) if dist.is_main else {}
    record = acc.finalize(
        dist=dist,
        end=end,
        grad_norm=grad_norm,
        lr=scheduler.get_last_lr()[0],
        push_s=push_s,
        step_s=time.perf_counter() - step_start,
        batcher_stats=batcher_stats,
    )
    if push_s > 0:  # where an object-store push's time went, on this rank (rank 0's is logged)
        record.update({f"timing/push_{name}_s": seconds for name, seconds in parts.pusher.phases.items()})
    return record


CONFIG_HINT = ("trainer_core.py needs a config: --config FILE (e.g. configs/demo.yaml) and/or "
               "--model.model_path PATH --data.path FILE; see --help")
CLUSTER_ERROR_EXIT = 1  # the Ray cluster cannot be joined


def config_error_line(error: ConfigError) -> str:
    """One line for a config that did not load: CONFIG_HINT when required fields are missing
    (no config given, or one without model.model_path / data.path), else the error itself."""
    if isinstance(error.__cause__, TypeError) and "missing" in str(error.__cause__):
        return f"{CONFIG_HINT} ({error})"
    return f"trainer_core.py: {error}"


def load_trainer_config(argv: list[str]) -> TrainerConfig:
    """Parse the command line; a config that does not load exits with one line and no traceback,
    printed by each node's first rank (LOCAL_RANK 0) only, before any process group or Ray."""
    try:
        return load_config(TrainerConfig, argv, description=__doc__)
    except ConfigError as error:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(config_error_line(error), file=sys.stderr, flush=True)
        raise SystemExit(CONFIG_ERROR_EXIT) from None


def check_environment(config: TrainerConfig) -> None:
    """Installed versions, this node's GPU layout and the weight transfer it can drive, before any
    input is read: one line each."""
    check_versions(TRAINER_REQUIREMENTS)
    try:
        check_trainer_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count(),
                           listed_gpu_count())
        check_transfer_pairing(config.transfer.weight_transfer, config.weight_push_mode,
                               has_cuda=torch.cuda.is_available(), lora=config.model.lora.enabled)
        if not config.model.lora.enabled:  # LoRA adapters go through the object store whatever the transfer
            check_transfer_packages(config.transfer.weight_transfer, "trainer")
    except ValueError as error:
        raise InputError(str(error)) from None


def main(argv: list[str] | None = None) -> None:
    config = load_trainer_config(sys.argv[1:] if argv is None else argv)
    setup_logging(config, int(os.environ.get("RANK", "0")))  # torchrun's rank; init_distributed reads it too
    try:
        check_environment(config)
        train(config)
    except InputError as error:  # each rank finds it; one line per node, no traceback
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"trainer_core.py: {error}", file=sys.stderr, flush=True)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    except (ClusterJoinError, VersionError) as error:  # likewise: cannot join the cluster, wrong install
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"trainer_core.py: {error}", file=sys.stderr, flush=True)
        raise SystemExit(CLUSTER_ERROR_EXIT) from None
    except Exception:
        logging.getLogger(__name__).exception("rank %s failed", os.environ.get("RANK", "0"))
        raise


if __name__ == "__main__":
    main()
    # train() closed what it opened (checkpoint writer, pusher, metrics and trackers, the process
    # group): the interpreter's own teardown would only cost each rank ~2 s (local_processes).
    exit_without_teardown(0)
