"""The cluster's one verifier pool on Ray: a named pool actor shared by every generation worker,
its processes spread over the nodes that offer verifier capacity, and the client the workers
score through.

On a Ray cluster all generation workers share one pool actor, created by the first call to
`get_or_create_verifier_pool`; that first caller's `num_processes` (the dispatcher's
--global_num_verifiers; None: from the cores, math_verify_pool.VerifierPoolConfig) and `timeout_s`
size it, later callers get the existing actor whatever they pass. Each process uses about one CPU
core. Nodes offer that capacity through the `verification_slot` custom resource
(`ray start --resources='{"verification_slot": 100}'`): the processes are then spread over those
nodes, one slot reserved per process (VerifierPoolActor). Without it they all run in the pool
actor's process, outside Ray's accounting, as is logged.

    client = connect_verifier_pool()          # in a generation worker
    results = await client.score(["so the sum is \\boxed{7}"], gt_answer="7")
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping, Sequence

from async_grpo.rewards.math_verifier import RewardResult
from async_grpo.rewards.reward_functions import FunctionScore
from async_grpo.rewards.math_verify_pool import DEFAULT_TIMEOUT_S, VerifierPool, VerifierPoolConfig, default_num_processes
from async_grpo.rewards.math_verify_process import STARTUP_TIMEOUT_S, WorkerStartError

logger = logging.getLogger(__name__)

# Ray restarts the shared pool actor if its process dies (e.g. OOM), with its creation arguments,
# so the generation workers regain a verifier instead of failing every reward from then on.
_ACTOR_MAX_RESTARTS = -1
# The custom resource through which nodes offer verifier capacity, one slot per process:
# `ray start ... --resources='{"verification_slot": 100}'`.
VERIFICATION_SLOT = "verification_slot"
# How long the pool actor waits for its shards: each starts its processes (a few seconds, up to
# STARTUP_TIMEOUT_S on a loaded node); far longer means their slots are held by someone else.
_SHARD_START_TIMEOUT_S = 2 * STARTUP_TIMEOUT_S


class VerifierShardActor:
    """Ray actor shell over the VerifierPool of one node, reserving one verification slot per process.

    Created by VerifierPoolActor, pinned to its node; generation workers call it directly
    through a VerifierPoolClient. An async actor: concurrent `score` calls interleave on its
    event loop while the pool's processes do the work.
    """

    def __init__(self, num_processes: int, timeout_s: float | None) -> None:
        self._pool = VerifierPool(_pool_config(num_processes, timeout_s))

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        """See VerifierPool.score."""
        return await self._pool.score(completions, gt_answer)

    async def score_function(self, ref: str, calls: list[dict[str, Any]],
                             timeout_s: float | None = None) -> list[FunctionScore]:
        """See VerifierPool.score_function."""
        return await self._pool.score_function(ref, calls, timeout_s)

    def stats(self) -> dict[str, int]:
        """See VerifierPool.stats."""
        return self._pool.stats()

    def node_id(self) -> str:
        """The Ray node this shard's processes run on."""
        import ray

        return ray.get_runtime_context().get_node_id()


def _pool_config(num_processes: int | None, timeout_s: float | None) -> VerifierPoolConfig:
    """A VerifierPoolConfig from the actors' arguments, None meaning the config's default."""
    return VerifierPoolConfig(num_processes=num_processes, timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)


def plan_verifier_shards(node_slots: Mapping[str, float], num_processes: int) -> dict[str, int]:
    """Verifier processes per node: dealt one at a time, round robin over the nodes (by id) that
    still have a free whole `verification_slot`, so they spread evenly. Nodes without a slot get
    none; when the slots run out first, the plan holds fewer than num_processes."""
    capacity = {node: int(slots) for node, slots in sorted(node_slots.items()) if slots >= 1}
    plan = dict.fromkeys(capacity, 0)
    remaining = num_processes
    while remaining > 0 and any(plan[node] < capacity[node] for node in plan):
        for node in plan:
            if remaining > 0 and plan[node] < capacity[node]:
                plan[node] += 1
                remaining -= 1
    return {node: count for node, count in plan.items() if count}


def _node_slots() -> dict[str, float]:
    """VERIFICATION_SLOT capacity of every live node of the connected cluster, by node id."""
    import ray

    return {
        node["NodeID"]: float(node["Resources"].get(VERIFICATION_SLOT, 0.0))
        for node in ray.nodes()
        if node["Alive"]
    }


def shard_actor_name(index: int) -> str:
    """Name of the pool's index-th shard actor ("math-verifier-pool-0", ...)."""
    from async_grpo.config.actor_names import VERIFIER_POOL_ACTOR_NAME

    return f"{VERIFIER_POOL_ACTOR_NAME}-{index}"


class _Router:
    """Sends each score call to the target with the fewest of this router's calls in flight; on a
    dead or unreachable target, tries the others once each. For one event loop (no locking)."""

    def __init__(self, targets: Sequence[Any], what: str) -> None:
        if not targets:
            raise ValueError("_Router needs at least one target")
        self._targets = list(targets)
        self._what = what
        self._inflight = [0] * len(self._targets)
        self._dead: set[int] = set()

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        return await self.call("score", completions, gt_answer)

    async def call(self, method: str, *args: Any) -> Any:
        """`method` of the least busy live target (score or score_function), failing over once per target."""
        from ray.exceptions import ActorDiedError, RayActorError

        tried: set[int] = set()
        if not self._candidates(tried):
            raise RuntimeError(f"every {self._what} ({len(self._targets)}) has died")
        while True:
            index = min(self._candidates(tried), key=self._inflight.__getitem__)
            tried.add(index)
            self._inflight[index] += 1
            try:
                return await getattr(self._targets[index], method).remote(*args)
            except RayActorError as exc:
                if isinstance(exc, ActorDiedError):
                    self._dead.add(index)
                if not self._candidates(tried):
                    raise
                logger.error("%s %d failed (%s); trying another", self._what, index, type(exc).__name__)
            finally:
                self._inflight[index] -= 1

    def _candidates(self, tried: set[int]) -> list[int]:
        return [i for i in range(len(self._targets)) if i not in tried and i not in self._dead]


class VerifierPoolActor:
    """The cluster's one verifier pool ("math-verifier-pool"), shared by every generation worker.

    Where its processes run depends on the cluster (decided once, when the actor starts):
    - Some nodes advertise the `verification_slot` custom resource (`ray start
      --resources='{"verification_slot": 100}'`): the processes are dealt over those nodes
      (plan_verifier_shards), and each node gets one VerifierShardActor that runs its share and
      reserves one slot per process, so Ray accounts for them and never over-commits a node.
      Generation workers score on the shards directly (VerifierPoolClient); `score` here
      forwards to them, for other callers.
    - No node does: the processes run in this actor's own process, wherever Ray placed it,
      outside Ray's resource accounting (num_cpus=0), which is logged once, here.

    Shards are detached like this actor and named shard_actor_name(i), so a restarted pool
    actor finds them again; `shutdown_verifier_pool` stops the lot. A node that joins later
    gets no share, and the share of a node that dies is lost until the pool is recreated.
    """

    def __init__(self, num_processes: int | None, timeout_s: float | None) -> None:
        # None: sized from this actor's node (default_num_processes), before the shards are planned.
        num_processes = num_processes or default_num_processes()
        self.num_processes = num_processes
        self._pool: VerifierPool | None = None
        self._shards: list[Any] = []
        self._plan: dict[str, int] = {}
        self._shard_nodes: list[Any] = []  # ObjectRefs of each shard's node id: resolved once it is up
        self._placement: dict[str, int] = {}
        plan = plan_verifier_shards(_node_slots(), num_processes)
        if not plan:
            self._start_unaccounted(num_processes, timeout_s)
            return
        if sum(plan.values()) < num_processes:
            logger.warning(
                "%d verifier processes asked for, but the cluster offers only %d %r slots: starting %d",
                num_processes, sum(plan.values()), VERIFICATION_SLOT, sum(plan.values()),
            )
        self._start_shards(plan, timeout_s)
        self._router = _Router(self._shards, "verifier shard")

    def _start_unaccounted(self, num_processes: int, timeout_s: float | None) -> None:
        import ray

        node = ray.get_runtime_context().get_node_id()
        logger.warning(
            "no node advertises the %r resource: all %d verifier processes run in the pool actor's "
            "process on node %s, outside Ray's CPU accounting (num_cpus=0). Give the nodes that should "
            "verify `ray start --resources='{\"%s\": N}'` to reserve and spread them.",
            VERIFICATION_SLOT, num_processes, node, VERIFICATION_SLOT,
        )
        self._pool = VerifierPool(_pool_config(num_processes, timeout_s))
        self._placement = {node: num_processes}

    def _start_shards(self, plan: dict[str, int], timeout_s: float | None) -> None:
        """One shard per planned node, all starting at once (`_started` waits for them)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from async_grpo.config.actor_names import RAY_NAMESPACE

        shard_cls = ray.remote(VerifierShardActor)
        for index, (node, count) in enumerate(plan.items()):
            self._shards.append(shard_cls.options(
                name=shard_actor_name(index),
                namespace=RAY_NAMESPACE,
                get_if_exists=True,
                lifetime="detached",
                num_cpus=0,
                resources={VERIFICATION_SLOT: count},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
                max_restarts=_ACTOR_MAX_RESTARTS,
            ).remote(count, timeout_s))
        self._plan = plan
        self._shard_nodes = [shard.node_id.remote() for shard in self._shards]

    async def _started(self) -> None:
        """Wait (once) until every shard has its processes up; WorkerStartError after
        _SHARD_START_TIMEOUT_S, which almost always means their slots are held elsewhere."""
        if self._placement:
            return
        try:
            nodes = await asyncio.wait_for(asyncio.gather(*self._shard_nodes), _SHARD_START_TIMEOUT_S)
        except TimeoutError:
            raise WorkerStartError(
                f"verifier shards not started within {_SHARD_START_TIMEOUT_S:.0f} s: are their nodes' "
                f"{VERIFICATION_SLOT!r} slots taken by other actors? plan {self._plan}"
            ) from None
        if not self._placement:
            self._placement = dict(zip(nodes, self._plan.values()))
            logger.info(
                "verifier pool: %d processes over %d nodes %s", sum(self._plan.values()), len(nodes), self._placement
            )

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        """See VerifierPool.score (forwarded to the least busy shard when there are shards)."""
        if self._pool is not None:
            return await self._pool.score(completions, gt_answer)
        await self._started()
        return await self._router.score(completions, gt_answer)

    async def score_function(self, ref: str, calls: list[dict[str, Any]],
                             timeout_s: float | None = None) -> list[FunctionScore]:
        """See VerifierPool.score_function (forwarded to the least busy shard when there are shards)."""
        if self._pool is not None:
            return await self._pool.score_function(ref, calls, timeout_s)
        await self._started()
        return await self._router.call("score_function", ref, calls, timeout_s)

    async def stats(self) -> dict[str, int]:
        """VerifierPool.stats, summed over the shards, plus `shards` (0: processes run here)."""
        if self._pool is not None:
            return {**self._pool.stats(), "shards": 0}
        await self._started()
        totals: dict[str, int] = {}
        for shard_stats in await asyncio.gather(*(shard.stats.remote() for shard in self._shards)):
            for key, value in shard_stats.items():
                totals[key] = totals.get(key, 0) + value
        return {**totals, "shards": len(self._shards)}

    async def shards(self) -> list[Any]:
        """Handles of the shard actors, once started; [] when the processes run in this actor."""
        if self._shards:
            await self._started()
        return list(self._shards)

    async def placement(self) -> dict[str, int]:
        """Verifier processes per Ray node id."""
        if self._shards:
            await self._started()
        return dict(self._placement)

    def close(self) -> None:
        """Stop the processes that run in this actor (shards are stopped by shutdown_verifier_pool)."""
        if self._pool is not None:
            self._pool.close()


class VerifierPoolClient:
    """What a generation worker scores through (vllm_worker.RewardScorer): the shards of the
    cluster's pool directly, each call to the one with the fewest of this client's calls in
    flight, or the pool actor itself when it has no shards. A call's completions stay together
    (one shard dedupes and caches them); many prompts in flight spread over the shards."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._router: _Router | None = None

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        return await (await self._connected()).score(completions, gt_answer)

    async def score_function(self, ref: str, calls: list[dict[str, Any]],
                             timeout_s: float | None = None) -> list[FunctionScore]:
        return await (await self._connected()).call("score_function", ref, calls, timeout_s)

    async def _connected(self) -> _Router:
        if self._router is None:
            shards = await self._pool.shards.remote()
            if self._router is None:  # another call may have connected meanwhile
                self._router = _Router(shards or [self._pool], "verifier shard" if shards else "verifier pool")
        return self._router


def get_or_create_verifier_pool(num_processes: int | None = None, timeout_s: float | None = None):
    """The cluster's one verifier pool actor ("math-verifier-pool" in the project namespace).
    None for either argument means VerifierPoolConfig's default (the pool's size then comes from
    the cores of the node the actor starts on).

    The first caller creates it with its arguments (detached: it outlives its creator); every later
    caller gets that same actor and its arguments are ignored, so start the component that should
    size it (a dispatcher's --global_num_verifiers) first, or pass the same values everywhere.
    `stats()["num_processes"]` tells a caller what it got, `placement()` where the processes run
    (VerifierPoolActor: on the nodes offering `verification_slot`, else in the actor's process).
    num_cpus=0: the actor itself only waits and routes.
    """
    import ray

    from async_grpo.config.actor_names import ON_HEAD_NODE, RAY_NAMESPACE, VERIFIER_POOL_ACTOR_NAME

    actor_cls = ray.remote(VerifierPoolActor)
    return actor_cls.options(
        name=VERIFIER_POOL_ACTOR_NAME,
        namespace=RAY_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        resources=ON_HEAD_NODE,  # never on a worker node that can be lost mid-run
        max_restarts=_ACTOR_MAX_RESTARTS,
    ).remote(num_processes, timeout_s)


def connect_verifier_pool(num_processes: int | None = None, timeout_s: float | None = None) -> VerifierPoolClient:
    """A VerifierPoolClient over the cluster's pool (created with these arguments if it does not exist)."""
    return VerifierPoolClient(get_or_create_verifier_pool(num_processes, timeout_s))


def shutdown_verifier_pool() -> None:
    """Kill the cluster's pool actor and its shards (releasing their slots); a no-op without them."""
    import ray

    from async_grpo.config.actor_names import RAY_NAMESPACE, VERIFIER_POOL_ACTOR_NAME

    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] == RAY_NAMESPACE and (
            name == VERIFIER_POOL_ACTOR_NAME or name.startswith(f"{VERIFIER_POOL_ACTOR_NAME}-")
        ):
            try:
                ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE))
            except ValueError:  # gone meanwhile
                pass
