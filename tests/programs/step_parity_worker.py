"""One rank of tests/trainer/test_step_parity.py: the system's optimizer step on samples the test
wrote.

    torchrun --nproc_per_node=2 tests/programs/step_parity_worker.py --spec SPEC.json --out_dir OUT

SPEC.json (written by the test):
    model_path          HF checkpoint folder both this worker and the test's reference load
    model               ModelConfig fields other than model_path
    samples             Sample fields of every rollout of the step (rewards, advantages,
                        ref_logprobs and sampling_logprobs filled in)
    max_tokens_per_gpu  the packer's token budget (small, so each rank gets several minibatches)
    reorder_window      the packer's best-fit window
    cases               {name: {"epochs_per_step": int, "loss": LossConfig fields,
                                "optim": OptimConfig fields, "data_path": "per_rank" | "rank0",
                                "share_prompts": bool, "per_layer_units": bool}}

For each case every rank builds the FSDP2 model, AdamW and schedule afresh with fsdp_setup's and optimizer's
builders, packs the samples with the real MinibatchPacker (every rank runs it over the same
samples in the same order; it is deterministic, so each rank keeps exactly the minibatches the
ExperienceBatcher would have sent it), and runs trainer_core.run_step for step 0 of a one-step run.
Only the transport is stood in for: a batcher double replays the rank's minibatches and the
step's EndOfStep (with data_path rank0, rank 0's double replays every rank's, round by round,
and the real Rank0DataPath scatters them to the ranks), and a pusher double takes gather_full_state_dict of the weights the real
WeightPusher would publish. Rank 0 writes OUT/<case>.pt, a dict of
    params       HF name -> full tensor after the step (what the pusher received)
    grads        one dict per optimizer step (HF name -> full gradient as AdamW received it:
                 after the division by the step's sample count and after clipping), recorded by
                 an optimizer step pre-hook
    metrics      run_step's metrics record ("optim/grad_norm": the first pass's pre-clip norm)
    minibatches  per rank, per minibatch: {"samples": sample indices, "loss_weight": float}
    layer_units  whether the decoder layers were FSDP units of their own
    num_samples  EndOfStep.num_samples
    lr_steps     scheduler.last_epoch after the step (1: the schedule advanced once)
    pushed       versions the pusher double was asked to publish
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import ray
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

import trainer_core  # noqa: E402
from async_grpo.batching.batcher_config import ExperienceConfig  # noqa: E402
from async_grpo.batching.minibatch_packer import MinibatchPacker  # noqa: E402
from async_grpo.data.dataset import DatasetConfig  # noqa: E402
from async_grpo.config.sampling import SamplingConfig
from async_grpo.trainer.config import TrainerConfig  # noqa: E402
from async_grpo.trainer.data_path import PerRankDataPath, Rank0DataPath, RayBatcherClient  # noqa: E402
from async_grpo.trainer.fsdp_setup import DistInfo, build_training_model, init_distributed
from async_grpo.trainer.optimizer import OptimConfig, build_optimizer, build_scheduler
from async_grpo.weights.trainer_gather import gather_full_state_dict
from grpo_loss import LossConfig  # noqa: E402
from sample_processing_utils import Sample  # noqa: E402
from setup_model import ModelConfig
from vllm_experience_batcher import EndOfStep, Minibatch  # noqa: E402

logger = logging.getLogger(__name__)

DIST_TIMEOUT_S = 120.0  # a crashed peer turns into an error well inside the test's own timeout
STEP = 0  # the one step each case runs: a one-step run, so run_step submits no further prompts
# run_step reads no data (the prompts come with the spec), but TrainerConfig requires a section.
UNUSED_DATA_PATH = "unused-by-run_step.jsonl"
_WRAPPER_PREFIX = "causal_lm."  # TokenLogprobModel's attribute; HF names lack it


class _RemoteMethod:
    """`handle.method.remote(*args)` of a Ray actor, answered in-process."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


class ReplayBatcher:
    """Stands in for the ExperienceBatcher actor: one rank's minibatches of a step, then EndOfStep."""

    def __init__(self, messages: list[Minibatch | EndOfStep], rank: int) -> None:
        self._messages = iter(messages)
        self._rank = rank
        self.next_message = _RemoteMethod(self._next_message)
        self.stats = _RemoteMethod(lambda step=None: {})

    def _next_message(self, rank: int, step: int) -> Minibatch | EndOfStep:
        if (rank, step) != (self._rank, STEP):
            raise AssertionError(f"next_message({rank}, {step}) on the stand-in for rank {self._rank}, step {STEP}")
        return next(self._messages)


class ReplayRounds:
    """Rank 0's batcher double for data_path rank0 (a data_path.BatcherClient): every rank's
    messages of the step, one round (the next message of each rank) per read, in order."""

    def __init__(self, per_rank: list[list[Minibatch | EndOfStep]]) -> None:
        self._rounds = list(zip(*per_rank, strict=True))
        self.acked: list[int] = []

    def next_round(self, step: int, index: int, timeout_s: float) -> list[Minibatch | EndOfStep]:
        assert step == STEP and index == len(self.acked), (step, index, self.acked)
        return list(self._rounds[index])

    def ack_round(self, step: int, index: int) -> None:
        self.acked.append(index)


@dataclass
class RecordingPusher:
    """Stands in for WeightPusher (gather mode): keeps what rank 0 would publish."""

    versions: list[int] = field(default_factory=list)
    state: dict[str, torch.Tensor] | None = None

    def push(self, model: torch.nn.Module, version: int, initial: bool = False) -> float:
        self.versions.append(version)
        self.state = gather_full_state_dict(model)  # collective, as in WeightPusher.push
        return 0.0


class NoFeeder:
    """A one-step run submits no further prompts: any use would mean run_step's bounds changed."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"run_step used the prompt feeder ({name}) in a one-step run")


@contextlib.contextmanager
def ray_get_passthrough() -> Iterator[None]:
    """The doubles answer `.remote()` with the value itself, so `ray.get` hands it through."""
    original = ray.get
    ray.get = lambda value, timeout=None: value
    try:
        yield
    finally:
        ray.get = original


def pack_step(samples: list[Sample], world_size: int, max_tokens: int,
              reorder_window: int) -> tuple[list[Minibatch], MinibatchPacker]:
    """All minibatches of the step, in dispatch order, as the batcher's packer cuts them."""
    packer = MinibatchPacker(step=STEP, world_size=world_size, max_tokens_per_gpu=max_tokens,
                             reorder_window=reorder_window)
    minibatches = [mb for sample in samples for mb in packer.add(sample)]
    return minibatches + packer.finish(), packer


def end_of_step(packer: MinibatchPacker, num_prompts: int) -> EndOfStep:
    """The step's EndOfStep with the packer's totals, as the batcher builds it."""
    return EndOfStep(step=STEP, num_samples=packer.num_samples, num_tokens=packer.num_tokens,
                     num_minibatches=max(packer.minibatches_per_rank), num_prompts=num_prompts,
                     timed_out_prompts=0, dropped_stale=0, oversized_samples=packer.oversized_samples,
                     padding_minibatches=packer.padding_minibatches, missing_rollouts=0,
                     num_output_tokens=packer.num_output_tokens)


def record_grads_before_each_step(model: torch.nn.Module,
                                  optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """Collective hook: before every optimizer.step, all-gather each gradient; rank 0 keeps them."""
    recorded: list[dict[str, torch.Tensor]] = []

    def hook(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        grads = {name.removeprefix(_WRAPPER_PREFIX): p.grad.full_tensor().detach().clone()
                 for name, p in model.named_parameters()}
        if dist.get_rank() == 0:
            recorded.append(grads)

    optimizer.register_step_pre_hook(hook)
    return recorded


def trainer_config(spec: dict, case: dict) -> TrainerConfig:
    """A one-step, synchronous run's config (JSON turned OptimConfig.betas into a list)."""
    return TrainerConfig(
        model=ModelConfig(model_path=spec["model_path"], **spec["model"], share_prompts=case["share_prompts"],
                          **({"fsdp_per_layer_min_params": 0} if case["per_layer_units"] else {})),
        data=DatasetConfig(path=UNUSED_DATA_PATH, max_prompt_tokens=spec["max_prompt_tokens"]),
        experience=ExperienceConfig(sampling=SamplingConfig(max_tokens=spec["max_output_tokens"]), max_lag=0,
                                    max_tokens_per_gpu=spec["max_tokens_per_gpu"]),
        optim=OptimConfig(**{**case["optim"], "betas": tuple(case["optim"]["betas"])}),
        loss=LossConfig(**case["loss"]),
        num_steps=1,
        epochs_per_step=case["epochs_per_step"],
        message_timeout_s=DIST_TIMEOUT_S,
        tensorboard=False,
        progress_bar=False,
    )


def run_case(name: str, case: dict, spec: dict, info: DistInfo, out_dir: Path) -> None:
    """Build everything afresh, run one step of the system, rank 0 saves the outcome."""
    config = trainer_config(spec, case)
    samples = [Sample(**fields) for fields in spec["samples"]]
    index_of = {id(s): i for i, s in enumerate(samples)}
    budget = config.experience.max_tokens_per_gpu
    minibatches, packer = pack_step(samples, info.world_size, budget, spec["reorder_window"])
    end = end_of_step(packer, num_prompts=len({s.prompt_id for s in samples}))
    per_rank = [[mb for mb in minibatches if mb.rank == rank] + [end] for rank in range(info.world_size)]
    if case.get("data_path", "per_rank") == "rank0":
        data_path = Rank0DataPath(ReplayRounds(per_rank) if info.is_main else None, [], info)
    else:
        data_path = PerRankDataPath(RayBatcherClient(ReplayBatcher(per_rank[info.rank], info.rank)), [], info)

    model = build_training_model(config.model, info)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim)
    grads = record_grads_before_each_step(model, optimizer)
    pusher = RecordingPusher()
    with ray_get_passthrough():
        parts = trainer_core.StepParts(model=model, optimizer=optimizer, scheduler=scheduler,
                                       batcher=ReplayBatcher([], info.rank), data_path=data_path, pusher=pusher,
                                       feeder=NoFeeder())
        metrics = trainer_core.run_step(STEP, parts, config, info)
    if info.is_main:
        per_rank = [[{"samples": [index_of[id(s)] for s in mb.samples], "loss_weight": mb.loss_weight}
                     for mb in minibatches if mb.rank == rank] for rank in range(info.world_size)]
        torch.save({"params": pusher.state, "grads": grads, "metrics": metrics, "minibatches": per_rank,
                    "num_samples": packer.num_samples, "lr_steps": scheduler.last_epoch,
                    "pushed": pusher.versions, "layer_units": isinstance(model.causal_lm.get_decoder().layers[0],
                                                                         FSDPModule)}, out_dir / f"{name}.pt")
        logger.info("case %s: %d optimizer steps, minibatches per rank %s", name, len(grads),
                    [len(r) for r in per_rank])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out_dir", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(args.spec).read_text())
    info = init_distributed(DIST_TIMEOUT_S)
    for name, case in spec["cases"].items():
        run_case(name, case, spec, info, Path(args.out_dir))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
