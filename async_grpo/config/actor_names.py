"""The names every process finds the others by in Ray: one namespace, the worker kinds, and the
actors' names, so `ray list actors` reads the same everywhere:

    generation-registry, logprob-registry, ...   one per worker kind (vllm_registry.py; judge-registry too)
    generation-worker-0, logprob-worker-0, ...   one per worker (worker_dispatcher.py)
    experience-batcher                           one per run (vllm_experience_batcher.py)
    math-verifier-pool                           one per cluster (math_verify_cluster.py)
    weight-shard-stager                          "sharded" weight pushes (weights/trainer_object_store.py)

Records every side shares (the trainer, the workers, the launcher): imports nothing.
"""

from __future__ import annotations

RAY_NAMESPACE = "async-grpo"
GENERATION = "generation"
LOGPROB = "logprob"
REFERENCE = "reference"
"""A logprob service on the frozen reference model that never receives weight pushes, for runs
whose logprob workers compute old-policy logprobs and that also need reference logprobs."""
TEACHER = "teacher"
"""A logprob service on a teacher model (another model sharing the student's tokenizer) that
never receives weight pushes: on-policy distillation (algorithm.DistillConfig)."""
JUDGE = "judge"
"""A model judge (a vLLM engine or a reward-model head) that answers judge requests for the reward
named `judge` (inference/judge_worker.py); frozen: it never receives the policy's weight pushes."""
WORKER_KINDS = (GENERATION, LOGPROB, REFERENCE, TEACHER, JUDGE)
LOGPROB_SERVICE_KINDS = (LOGPROB, REFERENCE, TEACHER)
"""Kinds served by the logprob worker class (logprob_worker.py)."""
FROZEN_KINDS = (REFERENCE, TEACHER, JUDGE)
"""Services whose weights never change: they refuse weight pushes."""
# The resource only Ray's head node offers (Ray Train pins its state actor with it too). The
# cluster's bookkeeping actors (registries, the batcher, the verifier pool, the shard stager) ask
# for a sliver of it: they must live where the cluster itself lives, not on a worker node that
# can be lost mid-run (its dispatchers' workers are replaceable; a registry or batcher is not).
HEAD_NODE_RESOURCE = "node:__internal_head__"
ON_HEAD_NODE = {HEAD_NODE_RESOURCE: 0.001}
BATCHER_ACTOR_NAME = "experience-batcher"
VERIFIER_POOL_ACTOR_NAME = "math-verifier-pool"
SHARD_STAGER_NAME = "weight-shard-stager"


def check_kind(kind: str) -> str:
    """`kind` itself if it is a worker kind, else a ValueError that lists the kinds."""
    if kind not in WORKER_KINDS:
        raise ValueError(f"unknown worker kind {kind!r}; expected one of {WORKER_KINDS}")
    return kind


def registry_name(kind: str) -> str:
    """Ray actor name of the registry of one worker kind, e.g. 'generation-registry'."""
    return f"{check_kind(kind)}-registry"


def worker_actor_name(kind: str, index: int) -> str:
    """Ray actor name of one worker, e.g. 'generation-worker-0' (what `ray list actors` shows)."""
    if index < 0:
        raise ValueError(f"worker index must be >= 0, got {index}")
    return f"{check_kind(kind)}-worker-{index}"
