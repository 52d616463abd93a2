"""What a run reads and checks before it starts anything costly: the model folder and its
tokenizer, every training and evaluation prompt, a user's prepare function and environment
classes (`load_run_inputs`), and, once the cluster is reachable, what its frozen pools must offer
(`check_service_pools`): a teacher that shares the student's tokenizer, a live judge for a reward
that names the judge. A failure is an InputError: one line naming the
input, exit 2 (trainer_core.main, local_cluster.check_trainer_inputs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import ray
from ray.actor import ActorHandle

from async_grpo.algo.algorithm import load_prepare_fn
from async_grpo.config.model_path import ModelPathError, check_model_dir
from async_grpo.data.dataset import DatasetError, load_prompts
from async_grpo.config.actor_names import JUDGE, RAY_NAMESPACE, TEACHER, registry_name
from async_grpo.trainer.config import TrainerConfig
from async_grpo.trainer.evaluation import Evaluator
from sample_processing_utils import Sample
from setup_model import load_tokenizer, tokenizer_fingerprint

logger = logging.getLogger(__name__)

# How long a run whose reward names the judge waits for a live judge worker: a judge's vLLM engine
# starts in about a minute on CPU, and on a cluster its dispatcher may start beside the trainer.
JUDGE_POOL_WAIT_S = 600.0
_JUDGE_POLL_S = 2.0


@dataclass(frozen=True)
class RunInputs:
    """What a run reads from disk before it starts anything costly."""

    prompts: list[Sample]
    """The training prompts, every record validated."""
    evaluator: Evaluator | None
    """Held-out evaluation over eval.data (None when evaluation is off or not wanted here)."""


class InputError(ValueError):
    """A model folder, prompt file or evaluation file that cannot be used; one line, naming it."""


def load_run_inputs(config: TrainerConfig, *, with_evaluator: bool) -> RunInputs:
    """Check the model folder and load its tokenizer, every prompt and the evaluation prompts.

    Seconds of work, run before any process group, Ray connection or model build (and by
    local_cluster.py before any worker starts), so a bad path or a bad line 7 is reported at
    once instead of after minutes of start-up. Raises InputError with the cause's message.
    """
    sampling = config.experience.sampling
    try:
        load_prepare_fn(config.experience.algorithm)  # a user's prepare function imports now, or the run stops here
        if sampling.environment.enabled:  # the environment class imports and takes its options
            sampling.environment.check()
        if sampling.verifiers.enabled:  # verifiers, the taskset and the Env class import now
            sampling.verifiers.check()
        check_model_dir(config.model.model_path)  # config and weights too, not only the tokenizer
        tokenizer = load_tokenizer(config.model.model_path)
        prompts = load_prompts(config.data, tokenizer)
        evaluator = (Evaluator.load(config.eval, config.data, sampling, tokenizer)
                     if with_evaluator and config.eval.enabled else None)
    except (ModelPathError, DatasetError, ValueError) as err:
        raise InputError(str(err)) from err
    return RunInputs(prompts=prompts, evaluator=evaluator)


def check_teacher_tokenizer(teacher_registry: ActorHandle, student_model_path: str) -> None:
    """Every registered teacher must share the student's tokenizer: it scores the student's token
    ids one by one. Raises InputError (one line, exit 2) naming both models otherwise."""
    student = tokenizer_fingerprint(load_tokenizer(student_model_path))
    infos = ray.get(teacher_registry.broadcast.remote("model_info"))
    if not infos:
        raise RuntimeError(f"{registry_name(TEACHER)} has no workers: start them with "
                           "`python worker_dispatcher.py --mode teacher --model_path <teacher> ...`")
    for name, info in sorted(infos.items()):
        if info["tokenizer_fingerprint"] != student:
            raise InputError(f"teacher {name} ({info['model_path']}) and the student ({student_model_path}) have "
                             "different tokenizers; distillation scores the student's token ids with the teacher, "
                             "so both models must share one tokenizer")
    logger.info("distillation: %d teacher worker(s) share the student's tokenizer", len(infos))


def check_service_pools(config: TrainerConfig, registry: Callable[[str], ActorHandle]) -> None:
    """The frozen pools the run uses, before its first step: teachers that share the student's
    tokenizer (distill.teacher), a live judge (a reward that names the judge: wait_for_judges)."""
    if config.experience.distill.teacher:
        check_teacher_tokenizer(registry(TEACHER), config.model.model_path)
    if config.experience.sampling.reward.uses_judge:
        wait_for_judges()


def wait_for_judges(timeout_s: float = JUDGE_POOL_WAIT_S, poll_s: float = _JUDGE_POLL_S) -> list[str]:
    """The live judge workers once judge-registry has one; RuntimeError (one line, how to start
    one) when none has registered within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            live = ray.get(ray.get_actor(registry_name(JUDGE), namespace=RAY_NAMESPACE).live_workers.remote())
        except ValueError:  # no judge dispatcher has created the registry yet
            live = []
        if live:
            logger.info("reward judge: %d judge worker(s) live: %s", len(live), ", ".join(live))
            return live
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the reward names the judge but {registry_name(JUDGE)} has no live worker after "
                               f"{timeout_s:.0f} s: start one with `python worker_dispatcher.py --mode judge "
                               "--model_path <judge>` (local_cluster.py: --judge_workers N)")
        time.sleep(poll_s)
