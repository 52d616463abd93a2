"""The trainer side of vLLM's CUDA weight-transfer engines (EngineTransferConfig.weight_transfer 'nccl',
'nccl_m2n', 'ipc'): full weights go from the trainer's GPUs straight into the generation
engines, not through Ray's object store.

Each backend pairs with one weight_push_mode (`TRANSFER_PUSH_MODE`, checked at start-up by
`check_transfer_pairing`): 'nccl' with 'gather' (rank 0 broadcasts every tensor; the other ranks
take part in each tensor's all-gather), 'nccl_m2n' with 'sharded' (every rank sends its own FSDP
shard; NCCL reshards it into each engine's layout, nothing is gathered), 'ipc' with 'gather'
(every rank materialises the full tensors on its own GPU and rank 0 ships their CUDA IPC
handles: the engines must sit on the trainer's GPUs). LoRA adapters keep the object store.

One push (`EngineWeightSender.send`, collective over the trainer ranks):
1. rank 0 lists the live generation workers of its registries and asks each how many ranks its
   engine has; when that set changed since the last push, the transfer group is rebuilt on a
   fresh port (`plan_group`: the trainer holds ranks [0, trainer_ranks), each engine the next
   contiguous block, at its own rank offset), and rank 0 shares the plan's numbers with the
   other ranks as one int tensor (nothing is unpickled);
2. vLLM's trainer engine (`WeightTransferTrainerFactory`) runs `trainer_init` on every rank; its
   client, `EngineWorkersClient`, hands each worker its own rank offset (vLLM's engine knows one
   offset for all engines) while rank 0 opens its end of the group;
3. `send_weights`: start (workers pause), update (workers receive while the trainer
   broadcasts or reshards), finish(version): each worker answers the version it now serves,
   which must be this push's (the version handshake).
What goes on the wire (the weight sources, each rank's share) is trainer_cuda_sources.py's.

Every call to the workers must answer within the update deadline (the registries'
weight_update_timeout_s). A worker that fails or misses it is killed, so its dispatcher restarts
it (the registry's replace-on-failure rule), and the group is torn down, its NCCL communicator
aborted: the next push rebuilds it with whoever is live then. A restarted worker joins at its
checkpoint's version and gets the next push (its rollouts meanwhile carry that version, and
max_lag decides whether they train). As for object-store pushes, the push raises only when
every worker failed with an error of its own (a bad update, not a bad worker).

Import cost: torch only; vLLM (and Ray) are imported when a transfer is built, so a machine
without vLLM (the lent GPU machine) can plan and test everything up to the wire.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from async_grpo.config.worker_options import OBJECT_STORE_TRANSFER, WEIGHT_TRANSFER_BACKENDS, EngineTransferConfig
from async_grpo.weights.trainer_cuda_sources import HFWeightSource, local_shard_bytes, send_plan, shard_source

logger = logging.getLogger(__name__)

CUDA_TRANSFERS = tuple(name for name in WEIGHT_TRANSFER_BACKENDS if name != OBJECT_STORE_TRANSFER)
"""EngineTransferConfig.weight_transfer values that are vLLM's CUDA engines (the trainer drives them)."""
TRANSFER_PUSH_MODE = {"nccl": "gather", "nccl_m2n": "sharded", "ipc": "gather"}
"""The weight_push_mode each CUDA transfer needs: what every trainer rank must hold to send."""

# The generation worker's pass-through methods (GenerationWorkerActor), named apart from its
# own update_weights (which takes an object-store WeightUpdate).
DESCRIBE_METHOD = "transfer_describe"
INIT_METHOD = "transfer_init"
START_METHOD = "transfer_start"
UPDATE_METHOD = "transfer_update"
FINISH_METHOD = "transfer_finish"

# One push is three rounds of calls to the workers (start, update alongside the broadcast,
# finish), each within the deadline: the push as a whole gets that many deadlines.
_PUSH_ROUNDS = 3
# The plan rank 0 shares with the other trainer ranks, as int64s: [group epoch (0: nothing to
# send), world size, port, engines, ranks per engine].
_PLAN_FIELDS = 5


def free_port(address: str) -> int:
    """A TCP port free on `address` now (vLLM's rendezvous store binds it moments later)."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def check_transfer_pairing(weight_transfer: str, push_mode: str, *, has_cuda: bool, lora: bool) -> None:
    """ValueError (one line naming the fields) when the trainer cannot drive `weight_transfer`
    with `push_mode`: a CUDA transfer on a machine without CUDA, or the wrong push mode for it.
    LoRA policies push adapters through the object store whatever the transfer, so only the
    device is checked for them. Call it before anything expensive starts."""
    if weight_transfer == OBJECT_STORE_TRANSFER:
        return
    if weight_transfer not in CUDA_TRANSFERS:
        raise ValueError(f"weight_transfer must be 'object_store' or one of {CUDA_TRANSFERS}, got {weight_transfer!r}")
    if not has_cuda:
        raise ValueError(f"weight_transfer {weight_transfer!r} is one of vLLM's CUDA engines and the trainer has no "
                         f"CUDA: use 'object_store'")
    if lora:
        return
    needed = TRANSFER_PUSH_MODE[weight_transfer]
    if push_mode != needed:
        raise ValueError(f"weight_transfer {weight_transfer!r} needs weight_push_mode {needed!r}, got {push_mode!r} "
                         f"({_PAIRING_WHY[weight_transfer]})")


_PAIRING_WHY = {
    "nccl": "rank 0 broadcasts the gathered weights",
    "nccl_m2n": "every rank sends its own FSDP shards",
    "ipc": "every rank shares the full tensors on its own GPU",
}


@dataclass(kw_only=True, frozen=True)
class TrainerTransferConfig(EngineTransferConfig):
    """How the trainer sends full weights to the generation engines: the backend
    (`weight_transfer`, declared in worker_options.EngineTransferConfig, which the generation
    workers read too) and the trainer's own settings for it."""

    rendezvous_address: str = "127.0.0.1"
    """Address of trainer rank 0's NCCL rendezvous (vLLM's TCPStore), which every engine must
    reach. 127.0.0.1 serves engines on the trainer's node; another address exposes the store to
    that network: trusted networks only."""
    packed: bool = True
    """nccl/ipc: send tensors packed into fixed-size buffers (vLLM's packed_tensor: fewer, larger
    transfers) rather than one by one."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.rendezvous_address:
            raise ValueError("TrainerTransferConfig.rendezvous_address must be a host address, got ''")


@dataclass(frozen=True, slots=True)
class EngineRanks:
    """One generation worker's engine as a member of a transfer group."""

    name: str
    """The worker's actor name."""
    ranks: int
    """Ranks its engine puts into the group (tensor x pipeline parallel size)."""


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """Who holds which ranks of one transfer group."""

    backend: str
    """vLLM's backend name: 'nccl', 'nccl_m2n' or 'ipc'."""
    trainer_ranks: int
    """Ranks the trainer holds, [0, trainer_ranks): 1 for nccl (rank 0 alone sends), every
    trainer rank for nccl_m2n; ipc has no group (0)."""
    engines: tuple[EngineRanks, ...]
    """The engines, in rank order."""
    world_size: int
    """trainer_ranks plus every engine's ranks."""
    extra_offsets: tuple[int, ...]
    """Per engine: ranks of the engines before it, added to the rank_offset vLLM's trainer
    engine sends (it assumes one engine, so it sends the first engine's offset to all)."""

    @property
    def dst_mesh_dims(self) -> tuple[int, int]:
        """nccl_m2n's destination mesh: engines replicate (axis 0), each engine's ranks shard."""
        return (len(self.engines), self.engines[0].ranks)


def plan_group(backend: str, trainer_world_size: int, engines: Sequence[EngineRanks]) -> GroupPlan:
    """The group one push uses; ValueError on engines nccl_m2n cannot lay out as one mesh."""
    if backend not in CUDA_TRANSFERS:
        raise ValueError(f"plan_group: backend must be one of {CUDA_TRANSFERS}, got {backend!r}")
    if not engines:
        raise ValueError("plan_group: no engines to send to")
    if backend == "nccl_m2n" and len({e.ranks for e in engines}) > 1:
        raise ValueError(f"nccl_m2n needs every engine to have the same ranks (one destination mesh), got "
                         f"{ {e.name: e.ranks for e in engines} }")
    trainer_ranks = {"nccl": 1, "nccl_m2n": trainer_world_size, "ipc": 0}[backend]
    offsets, before = [], 0
    for engine in engines:
        offsets.append(before)
        before += engine.ranks
    return GroupPlan(backend=backend, trainer_ranks=trainer_ranks, engines=tuple(engines),
                     world_size=trainer_ranks + before, extra_offsets=tuple(offsets))


def init_payloads(plan: GroupPlan, init_info: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each engine's copy of the worker-side init info vLLM's trainer engine built: its own
    rank_offset (the first engine's, as vLLM sent it, plus the ranks before it)."""
    payloads = {}
    for engine, extra in zip(plan.engines, plan.extra_offsets):
        payload = dict(init_info)
        if "rank_offset" in payload:  # ipc has no group, hence no offset
            payload["rank_offset"] = int(payload["rank_offset"]) + extra
        payloads[engine.name] = payload
    return payloads


class WorkerCalls(Protocol):
    """Calls one pass-through method on several workers at once, within a deadline."""

    def call(self, method: str, args: Mapping[str, tuple], timeout_s: float) -> dict[str, Any]:
        """Call `method(*args[name])` on each named worker; return name -> result, or raise
        WorkerCallError naming every worker that failed or did not answer in time."""
        ...

    def kill(self, names: Sequence[str]) -> None:
        """Kill these workers so that their dispatchers restart them."""
        ...


class WorkerCallError(RuntimeError):
    """Workers that failed a transfer call (name -> why) and whether each failed by an error of
    its own (False: no answer in time, or the worker died)."""

    def __init__(self, method: str, failures: Mapping[str, str], own_errors: Mapping[str, bool]) -> None:
        self.method = method
        self.failures = dict(failures)
        self.own_errors = dict(own_errors)
        super().__init__(f"{method} failed on {len(self.failures)} worker(s): "
                         + "; ".join(f"{name}: {why}" for name, why in sorted(self.failures.items())))


class RayWorkerCalls:
    """WorkerCalls over the generation workers' Ray actor handles."""

    def __init__(self, handles: Mapping[str, Any]) -> None:
        self._handles = dict(handles)

    def call(self, method: str, args: Mapping[str, tuple], timeout_s: float) -> dict[str, Any]:
        import ray

        refs = {name: getattr(self._handles[name], method).remote(*a) for name, a in args.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        results: dict[str, Any] = {}
        failures: dict[str, str] = {}
        own: dict[str, bool] = {}
        for name, ref in refs.items():
            if ref not in done:
                failures[name], own[name] = f"no answer within {timeout_s:.0f} s", False
                continue
            try:
                results[name] = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                failures[name], own[name] = f"died: {type(err).__name__}", False
            except Exception as err:  # the worker's own error, raised through Ray
                failures[name], own[name] = f"{type(err).__name__}: {err}", True
        if failures:
            raise WorkerCallError(method, failures, own)
        return results

    def kill(self, names: Sequence[str]) -> None:
        import ray

        for name in names:
            ray.kill(self._handles[name], no_restart=True)


class EngineWorkersClient:
    """vLLM's VLLMWeightSyncClient over the generation workers of one transfer group: each of
    vLLM's four calls goes to every worker's pass-through method, within the update deadline.

    Also the version handshake: `finish_weight_update` labels the update `version` (set before
    each push) and checks that every worker answers that it serves it.
    """

    def __init__(self, plan: GroupPlan, calls: WorkerCalls, timeout_s: float) -> None:
        self.plan = plan
        self._calls = calls
        self._timeout_s = timeout_s
        self.version: int | None = None
        """The version the current push carries (EngineWeightSender sets it before send_weights)."""
        self.served: dict[str, int] = {}
        """name -> version each worker reported at the last finish."""

    def _all(self, method: str, *args: Any) -> dict[str, Any]:
        return self._calls.call(method, {e.name: args for e in self.plan.engines}, self._timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        payloads = init_payloads(self.plan, init_info)
        self._calls.call(INIT_METHOD, {name: (self.plan.backend, p) for name, p in payloads.items()}, self._timeout_s)

    def start_weight_update(self) -> None:
        self._all(START_METHOD)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all(UPDATE_METHOD, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self.version is None:
            raise RuntimeError("EngineWorkersClient: finish_weight_update before a version was set")
        served = {name: int(v) for name, v in self._all(FINISH_METHOD, self.version).items()}
        wrong = {name: v for name, v in served.items() if v != self.version}
        if wrong:
            raise WorkerCallError(FINISH_METHOD, {n: f"serves v{v}, not v{self.version}" for n, v in wrong.items()},
                                  {n: True for n in wrong})
        self.served = served


class _NoClient:
    """The client of trainer ranks other than 0: vLLM's engines never call it there."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("only trainer rank 0 talks to the generation workers")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _refuse


@dataclass(slots=True)
class _Group:
    """The live transfer group of this rank."""

    epoch: int
    members: tuple[EngineRanks, ...]
    engine: Any
    """vLLM's TrainerWeightTransferEngine."""
    client: EngineWorkersClient | None = None
    """Rank 0's client (None elsewhere)."""


@dataclass(slots=True)
class PushOutcome:
    """What one push did (rank 0; other ranks get an empty one)."""

    served: dict[str, int] = field(default_factory=dict)
    """name -> version served, for every worker that took the update."""
    replaced: list[str] = field(default_factory=list)
    """Workers killed for failing or missing the deadline."""
    rebuilt: bool = False
    """The transfer group was (re)built for this push."""


class EngineWeightSender:
    """Sends full weights to the generation engines through one of vLLM's CUDA transfers (the
    trainer's end of that transport, a transport.WeightPublisher).

    Collective: every trainer rank builds one and calls `send` together. Rank 0 holds the
    generation registries (their live workers are the group) and drives the workers; the other
    ranks take part in the gathers (nccl, ipc) or send their shards too (nccl_m2n).
    """

    def __init__(self, config: TrainerTransferConfig, rank: int, world_size: int, registries: Sequence[Any],
                 timeout_s: float, *, dtype: torch.dtype, device: torch.device,
                 discover: Callable[[], tuple[list[EngineRanks], WorkerCalls]] | None = None) -> None:
        """registries: Ray handles of the generation registries (rank 0; [] elsewhere);
        timeout_s: the deadline of each call to the workers (the registries'
        weight_update_timeout_s); discover: rank 0's way to list the live engines (default: ask
        the registries and the workers)."""
        if config.weight_transfer not in CUDA_TRANSFERS:
            raise ValueError(f"EngineWeightSender drives {CUDA_TRANSFERS}, got {config.weight_transfer!r}")
        self.config = config
        self._rank, self._world_size = rank, world_size
        self._registries = list(registries)
        self._timeout_s = timeout_s
        self._dtype, self._device = dtype, device
        self._discover = discover or self._discover_from_registries
        self._group: _Group | None = None
        self._epoch = 0

    def owns(self, registry: Any) -> bool:
        """True for one of the registries whose workers this sender serves (the same handle)."""
        return any(registry is own for own in self._registries)

    def send(self, model: nn.Module, version: int) -> PushOutcome:
        """Collective: every rank calls it. Returns rank 0's outcome (empty elsewhere)."""
        outcome = PushOutcome()
        members, calls = self._discover() if self._rank == 0 else ([], None)
        plan_numbers = self._share_plan(members)
        epoch, world_size, port, engines = plan_numbers[:4]
        if epoch == 0:
            if self._rank == 0:
                logger.warning("weights v%d: no live generation worker to send to", version)
            return outcome
        try:
            if self._group is None or self._group.epoch != epoch:
                self._teardown()
                self._group = self._build(epoch, members, calls, world_size, port, engines, plan_numbers[4], model)
                outcome.rebuilt = True
            else:  # the group outlives a push; the weights are whatever `model` holds now
                self._group.engine.source = self._source(model)
            self._send_once(version)
        except WorkerCallError as err:
            self._after_failure(err, outcome, version, members, calls)
            return outcome
        if self._group.client is not None:
            outcome.served = dict(self._group.client.served)
        return outcome

    def _share_plan(self, members: list[EngineRanks]) -> list[int]:
        """Rank 0's plan numbers on every rank: [epoch (0: no engines), world size, port, engines,
        ranks per engine]. A new epoch (and port) whenever the members changed."""
        numbers = [0] * _PLAN_FIELDS
        if self._rank == 0 and members:
            if self._group is not None and self._group.members == tuple(members):
                numbers = [self._group.epoch, 0, 0, len(members), members[0].ranks]
            else:
                self._epoch += 1
                plan = plan_group(self.config.weight_transfer, self._world_size, members)
                port = free_port(self.config.rendezvous_address)
                numbers = [self._epoch, plan.world_size, port, len(members), members[0].ranks]
        if self._world_size > 1:
            shared = torch.tensor(numbers, dtype=torch.int64, device=self._device)
            dist.broadcast(shared, src=0)
            numbers = [int(x) for x in shared.tolist()]
        return numbers

    def _build(self, epoch: int, members: list[EngineRanks], calls: WorkerCalls | None, world_size: int, port: int,
               engines: int, ranks_per_engine: int, model: nn.Module) -> _Group:
        """vLLM's trainer engine for this rank, joined to a new group (rank 0 drives the workers'
        init, with each engine's own offset, while it opens its end)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        client: EngineWorkersClient | None = None
        if self._rank == 0:
            plan = plan_group(self.config.weight_transfer, self._world_size, members)
            client = EngineWorkersClient(plan, calls, self._timeout_s)
        info = self._trainer_init_info(world_size, port, (engines, ranks_per_engine))
        source = self._source(model)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client or _NoClient(), source=source)
        sends = send_plan(self.config.weight_transfer, self._rank, HFWeightSource(model, self._dtype).metadata(),
                          local_shard_bytes(model, self._dtype))
        logger.info("rank %d: weight transfer group %d (%s) ready: world size %d, %d engine(s); this rank sends "
                    "%d tensors, %.1f MiB, per push", self._rank, epoch, self.config.weight_transfer, world_size,
                    engines, len(sends), sum(n for _, n in sends) / 2**20)
        return _Group(epoch=epoch, members=tuple(members), engine=engine, client=client)

    def _trainer_init_info(self, world_size: int, port: int, dst_mesh_dims: tuple[int, int]) -> Any:
        backend = self.config.weight_transfer
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            return NCCLTrainerInitInfo(master_address=self.config.rendezvous_address, master_port=port,
                                       world_size=world_size, packed=self.config.packed, rank=self._rank)
        if backend == "nccl_m2n":
            from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo

            return M2NTrainerInitInfo(master_address=self.config.rendezvous_address, master_port=port,
                                      world_size=world_size, num_trainer_ranks=self._world_size,
                                      dst_mesh_dims=dst_mesh_dims, rank=self._rank)
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=self.config.packed, rank=self._rank)

    def _source(self, model: nn.Module) -> Any:
        if self.config.weight_transfer == "nccl_m2n":
            return shard_source(model, self._dtype, self._world_size)
        return HFWeightSource(model, self._dtype)

    def _send_once(self, version: int) -> None:
        """One send_weights on this rank; rank 0 labels it `version` and bounds it by the
        deadline (a worker that never joins a broadcast would otherwise hang it forever)."""
        group = self._group
        if group.client is None:
            group.engine.send_weights()
            return
        group.client.version = version
        began = time.perf_counter()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-transfer")
        try:
            future = pool.submit(group.engine.send_weights)
            future.result(timeout=self._timeout_s * _PUSH_ROUNDS)
        except concurrent.futures.TimeoutError:
            raise WorkerCallError("send_weights", {e.name: f"push v{version} not done within "
                                                   f"{self._timeout_s * _PUSH_ROUNDS:.0f} s" for e in group.members},
                                  {e.name: False for e in group.members}) from None
        finally:
            pool.shutdown(wait=False)  # a hung broadcast's thread is released by the abort in _teardown
        logger.info("weights v%d sent by %s to %d engine(s) in %.2f s", version, self.config.weight_transfer,
                    len(group.members), time.perf_counter() - began)

    def _after_failure(self, err: WorkerCallError, outcome: PushOutcome, version: int,
                       members: Sequence[EngineRanks], calls: WorkerCalls | None) -> None:
        """Rank 0: kill the workers that failed (their dispatchers restart them), tear the group
        down (the next push rebuilds it), raise only when every worker failed by an error of its own."""
        logger.warning("weights v%d: %s; replacing %s", version, err, sorted(err.failures))
        outcome.replaced = sorted(err.failures)
        if calls is not None:
            calls.kill(outcome.replaced)
        self._teardown()
        if set(err.failures) == {e.name for e in members} and all(err.own_errors.values()):
            raise RuntimeError(f"weights v{version} failed on every generation worker: {err}") from err

    def _teardown(self) -> None:
        """Shut the group down (vLLM's shutdown aborts the NCCL communicator, which also frees a
        broadcast hung on a dead peer)."""
        if self._group is not None:
            group, self._group = self._group, None
            group.engine.shutdown()

    def shutdown(self) -> None:
        """Release the group at the end of training."""
        self._teardown()

    def publish(self, model: nn.Module, version: int, initial: bool = False) -> None:
        """transport.WeightPublisher: `send` (a first push goes to the live engines like any other)."""
        self.send(model, version)

    def close(self) -> None:
        """transport.WeightPublisher: `shutdown`."""
        self.shutdown()

    def _discover_from_registries(self) -> tuple[list[EngineRanks], WorkerCalls]:
        """Rank 0: the registries' live workers, in name order, with their engines' ranks."""
        import ray

        handles: dict[str, Any] = {}
        for registry in self._registries:
            names = ray.get(registry.live_workers.remote())
            handles.update(ray.get(registry.worker_handles.remote(sorted(names))))
        calls = RayWorkerCalls(handles)
        if not handles:
            return [], calls
        try:
            answers = calls.call(DESCRIBE_METHOD, {name: () for name in handles}, self._timeout_s)
        except WorkerCallError as err:  # such a worker cannot join: replace it, send to the others
            logger.warning("%s; replacing %s", err, sorted(err.failures))
            calls.kill(sorted(err.failures))
            answers = {}
        return engines_from_answers(answers, self.config.weight_transfer), calls


def engines_from_answers(answers: Mapping[str, Mapping[str, Any]], backend: str) -> list[EngineRanks]:
    """The group's engines, in name order, from each worker's describe answer ({'backend',
    'ranks'}); ValueError naming the workers whose engine runs another backend. Checked before
    any rendezvous: an engine that refuses to join would leave the trainer waiting in it."""
    wrong = {name: a["backend"] for name, a in answers.items() if a["backend"] != backend}
    if wrong:
        raise ValueError(f"the trainer sends weights by {backend!r} (TrainerTransferConfig.weight_transfer), but "
                         f"these generation workers' EngineTransferConfig.weight_transfer differs: {wrong}")
    return [EngineRanks(name=name, ranks=int(answers[name]["ranks"])) for name in sorted(answers)]
