"""The trainer side of vLLM's CUDA weight transfers (trainer_cuda_transfer.py) on CPU: the push
mode each transfer pairs with, the group plan (world size, each engine's rank offset), what each
rank sends, the weight source's names/dtypes/shapes, and a whole push driven by vLLM's own NCCL
trainer engine (NCCLTrainerWeightTransferEngine: its call order, its update messages) with only
the wire stubbed, into real EngineTransferReceivers over recording AsyncLLM stand-ins. The
NCCL wire itself needs CUDA: tests/weights/test_gpu_weight_transfer.py.
`.venv/bin/python -m pytest tests/weights/test_weight_sync_transfer.py -q`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from async_grpo.weights.trainer_cuda_sources import HFWeightSource, WireMeta, send_plan
from async_grpo.weights.trainer_cuda_transfer import (
    DESCRIBE_METHOD, FINISH_METHOD, INIT_METHOD, START_METHOD, UPDATE_METHOD, EngineRanks, EngineWeightSender,
    EngineWorkersClient, GroupPlan, TrainerTransferConfig, WorkerCallError, check_transfer_pairing,
    engines_from_answers, init_payloads, plan_group,
)
from async_grpo.weights.trainer_gather import gather_full_state_dict
from async_grpo.weights.trainer_pusher import WeightPusher
from async_grpo.weights.worker_cuda_transfer import EngineTransferReceiver
from setup_model import TokenLogprobModel, load_causal_lm
from support.recording_engine import INIT, UPDATE, RecordingEngine

# ---------------------------------------------------------------- pairing and plan


@pytest.mark.parametrize("transfer, mode", [("nccl", "gather"), ("nccl_m2n", "sharded"), ("ipc", "gather")])
def test_each_cuda_transfer_pairs_with_one_push_mode(transfer: str, mode: str) -> None:
    check_transfer_pairing(transfer, mode, has_cuda=True, lora=False)
    for other in {"gather", "sharded", "lora_files"} - {mode}:
        with pytest.raises(ValueError, match=f"weight_transfer '{transfer}' needs weight_push_mode '{mode}', "
                                             f"got '{other}'"):
            check_transfer_pairing(transfer, other, has_cuda=True, lora=False)
    # A LoRA policy pushes adapters through the object store: any mode, but still CUDA only.
    check_transfer_pairing(transfer, "lora_files", has_cuda=True, lora=True)
    with pytest.raises(ValueError, match=f"weight_transfer '{transfer}' is one of vLLM's CUDA engines.*no CUDA"):
        check_transfer_pairing(transfer, mode, has_cuda=False, lora=True)


def test_the_object_store_pairs_with_anything_anywhere() -> None:
    for mode in ("gather", "sharded", "lora_files"):
        check_transfer_pairing("object_store", mode, has_cuda=False, lora=False)
    with pytest.raises(ValueError, match="weight_transfer must be"):
        check_transfer_pairing("rdma", "gather", has_cuda=True, lora=False)


def test_trainer_transfer_config_names_its_fields() -> None:
    with pytest.raises(ValueError, match="TrainerTransferConfig.weight_transfer"):
        TrainerTransferConfig(weight_transfer="rdma")
    with pytest.raises(ValueError, match="TrainerTransferConfig.rendezvous_address"):
        TrainerTransferConfig(weight_transfer="nccl", rendezvous_address="")


def test_a_pusher_refuses_a_transfer_its_mode_cannot_drive() -> None:
    sender = EngineWeightSender(TrainerTransferConfig(weight_transfer="nccl_m2n"), 0, 1, [], 1.0,
                                dtype=torch.bfloat16, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="'nccl_m2n' needs weight_push_mode 'sharded', got 'gather'"):
        WeightPusher("gather", 0, 1, [], 1.0, engine_transfer=sender)


ENGINES = [EngineRanks(name="generation-worker-0", ranks=2), EngineRanks(name="generation-worker-1", ranks=2)]


@pytest.mark.parametrize("backend, trainer_ranks, world_size", [("nccl", 1, 5), ("nccl_m2n", 4, 8), ("ipc", 0, 4)])
def test_the_group_plan_stacks_engines_after_the_trainer(backend: str, trainer_ranks: int, world_size: int) -> None:
    plan = plan_group(backend, trainer_world_size=4, engines=ENGINES)
    assert (plan.trainer_ranks, plan.world_size, plan.extra_offsets) == (trainer_ranks, world_size, (0, 2))
    assert plan.dst_mesh_dims == (2, 2)  # two replicas of a 2-way sharded engine


def test_each_engine_gets_its_own_rank_offset() -> None:
    plan = plan_group("nccl", 1, [*ENGINES, EngineRanks(name="generation-worker-2", ranks=1)])
    # vLLM's NCCL trainer engine sends one worker init info, rank_offset 1 (right after rank 0).
    sent = {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": plan.world_size}
    offsets = {name: p["rank_offset"] for name, p in init_payloads(plan, sent).items()}
    assert offsets == {"generation-worker-0": 1, "generation-worker-1": 3, "generation-worker-2": 5}
    assert plan.world_size == 6  # ranks 1-2, 3-4 and 5 after the trainer's 0
    assert init_payloads(plan_group("ipc", 1, ENGINES), {"packed": False})["generation-worker-1"] == {"packed": False}


def test_nccl_m2n_refuses_engines_of_different_sizes() -> None:
    with pytest.raises(ValueError, match="nccl_m2n needs every engine to have the same ranks"):
        plan_group("nccl_m2n", 2, [ENGINES[0], EngineRanks(name="generation-worker-9", ranks=1)])


def test_what_each_rank_sends() -> None:
    metas = [WireMeta("model.embed_tokens.weight", torch.bfloat16, (8, 4)), WireMeta("model.norm.weight",
                                                                                     torch.bfloat16, (4,))]
    whole = [("model.embed_tokens.weight", 64), ("model.norm.weight", 8)]
    assert send_plan("nccl", 0, metas, lambda name: None) == whole
    assert send_plan("nccl", 1, metas, lambda name: None) == []  # only takes part in the gathers
    assert send_plan("ipc", 0, metas, lambda name: None) == whole
    # m2n: rank r sends its own half of the sharded embedding, and the unsharded norm.
    half = {"model.embed_tokens.weight": 32}
    assert send_plan("nccl_m2n", 1, metas, half.get) == [("model.embed_tokens.weight", 32), ("model.norm.weight", 8)]


# ---------------------------------------------------------------- the weight source


def _policy(model_dir: Path) -> TokenLogprobModel:
    return TokenLogprobModel(load_causal_lm(model_dir, device=torch.device("cpu"), dtype=torch.float32,
                                            attn_implementation="sdpa"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_source_sends_the_object_stores_names_in_the_push_dtype(
        tiny_model_dir: Path, tiny_tied_model_dir: Path, tied: bool) -> None:
    policy = _policy(tiny_tied_model_dir if tied else tiny_model_dir)
    reference = gather_full_state_dict(policy, dtype=torch.bfloat16)  # what the object store carries
    source = HFWeightSource(policy, torch.bfloat16)
    metas = source.metadata()
    assert [m.name for m in metas] == list(reference)
    assert ("lm_head.weight" in reference) is not tied  # a tied tensor travels once
    sent = list(source)
    assert [name for name, _ in sent] == list(reference)
    for meta, (name, tensor) in zip(metas, sent):
        assert (tensor.dtype, tuple(tensor.shape)) == (meta.dtype, meta.shape) == (reference[name].dtype,
                                                                                   tuple(reference[name].shape))
        assert torch.equal(tensor, reference[name]), name
        assert tensor.is_contiguous()


def test_the_m2n_source_sends_hf_names_in_the_push_dtype(tiny_model_dir: Path) -> None:
    """nccl_m2n's source (vLLM's DTensorModuleSource over the HF model): HF names, the push dtype
    announced and sent; an unsharded model is one replicated piece per tensor."""
    from async_grpo.weights.trainer_cuda_sources import shard_source

    policy = _policy(tiny_model_dir)
    source = shard_source(policy, torch.bfloat16, trainer_ranks=1)
    metas = source.metadata()
    reference = gather_full_state_dict(policy, dtype=torch.bfloat16)
    assert [m.name for m in metas] == list(reference)
    assert all(m.dtype == torch.bfloat16 and m.placements is None for m in metas)
    assert source.mesh().dims == (1, 1)
    for name, shard in source:
        assert shard.dtype == torch.bfloat16 and torch.equal(shard, reference[name]), name


# ---------------------------------------------------------------- a whole push, CPU


class ReceiverCalls:
    """WorkerCalls into real EngineTransferReceivers over recording engines, in this process: the
    generation worker's pass-through methods as vllm_worker.py defines them."""

    def __init__(self, names: Sequence[str], backend: str = "nccl", fail_on: Mapping[str, str] | None = None) -> None:
        self.engines = {name: RecordingEngine(world_size=2) for name in names}
        self.receivers = {name: EngineTransferReceiver(e, backend, "keep") for name, e in self.engines.items()}
        self.log: list[tuple[str, str]] = []
        self.killed: list[str] = []
        self._fail_on = dict(fail_on or {})  # name -> method it fails

    async def _dispatch(self, name: str, method: str, args: tuple) -> Any:
        receiver = self.receivers[name]
        if self._fail_on.get(name) == method:
            raise RuntimeError(f"{name} fails {method}")
        if method == DESCRIBE_METHOD:
            return receiver.describe()
        if method == INIT_METHOD:
            return await receiver.init(*args)
        if method == START_METHOD:
            return await receiver.start()
        if method == UPDATE_METHOD:
            return await receiver.update(*args)
        await receiver.finish(*args)
        return args[0]

    def call(self, method: str, args: Mapping[str, tuple], timeout_s: float) -> dict[str, Any]:
        results, failures = {}, {}
        for name, call_args in args.items():
            self.log.append((name, method))
            try:
                results[name] = asyncio.run(self._dispatch(name, method, call_args))
            except Exception as err:
                failures[name] = f"{type(err).__name__}: {err}"
        if failures:
            raise WorkerCallError(method, failures, {name: True for name in failures})
        return results

    def kill(self, names: Sequence[str]) -> None:
        self.killed.extend(names)


class StubWire:
    """vLLM's NCCL endpoint and packed producer, replaced: what rank 0 would broadcast is kept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[dict] = []
        self.sent: list[list[tuple[str, torch.Tensor]]] = []
        self.destroyed = 0
        import vllm.distributed.weight_transfer.nccl_engine as vllm_nccl  # here: collection imports no vLLM

        monkeypatch.setattr(vllm_nccl, "open_trainer_endpoint", self._open)
        monkeypatch.setattr(vllm_nccl, "packed_nccl_broadcast_producer", self._produce)

    def _open(self, init_info: Any) -> Any:
        self.opened.append({"port": init_info.master_port, "world_size": init_info.world_size,
                            "rank": init_info.rank})
        wire = self

        class Group:
            def destroy(self) -> None:
                wire.destroyed += 1

        return Group()

    def _produce(self, *, iterator: Any, group: Any, src: int, post_iter_func: Any, **kwargs: Any) -> None:
        assert src == 0
        self.sent.append([(item[0], post_iter_func(item).clone()) for item in iterator])


def _sender(calls: ReceiverCalls) -> EngineWeightSender:
    def discover() -> tuple[list[EngineRanks], ReceiverCalls]:
        live = [name for name in calls.receivers if name not in calls.killed]
        return engines_from_answers(calls.call(DESCRIBE_METHOD, {name: () for name in live}, 1.0), "nccl"), calls

    return EngineWeightSender(TrainerTransferConfig(weight_transfer="nccl"), 0, 1, [], 5.0, dtype=torch.bfloat16,
                              device=torch.device("cpu"), discover=discover)


def test_a_push_through_vllms_nccl_engine_reaches_every_engine_in_order(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wire = StubWire(monkeypatch)
    calls = ReceiverCalls(["generation-worker-0", "generation-worker-1"])
    sender = _sender(calls)
    policy = _policy(tiny_model_dir)
    first, second = sender.send(policy, 7), sender.send(policy, 8)

    assert first.rebuilt and not second.rebuilt  # one group while the members stay
    assert first.served == {"generation-worker-0": 7, "generation-worker-1": 7}
    assert second.served == {"generation-worker-0": 8, "generation-worker-1": 8}
    assert [o["world_size"] for o in wire.opened] == [5]  # trainer rank 0 + two engines of 2 ranks
    # The engines' calls, in vLLM's order: join (own offsets), then per push pause, start, one
    # update naming every tensor, finish with the version, resume.
    expected = gather_full_state_dict(policy, dtype=torch.bfloat16)
    for name, offset in (("generation-worker-0", 1), ("generation-worker-1", 3)):
        engine_calls = calls.engines[name].calls
        init = engine_calls[0][1]
        assert (engine_calls[0][0], init["rank_offset"], init["world_size"], init["packed"]) == (
            "init_weight_transfer_engine", offset, 5, True)
        assert init["master_port"] == wire.opened[0]["port"]
        one_push = ["pause_generation", "start_weight_update", "update_weights", "finish_weight_update",
                    "resume_generation"]
        assert [call for call, _ in engine_calls[1:]] == one_push * 2
        update = engine_calls[3][1]
        assert update["names"] == list(expected)
        assert update["dtype_names"] == [str(t.dtype).removeprefix("torch.") for t in expected.values()]
        assert update["shapes"] == [list(t.shape) for t in expected.values()]
        assert [v for c, v in engine_calls if c == "finish_weight_update"] == ["7", "8"]
    # What rank 0 broadcast: every tensor, in the announced order, bit for bit.
    for sent in wire.sent:
        assert [n for n, _ in sent] == list(expected)
        assert all(torch.equal(t, expected[n]) for n, t in sent)


def test_a_failing_worker_is_replaced_and_the_group_rebuilt_without_it(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wire = StubWire(monkeypatch)
    calls = ReceiverCalls(["generation-worker-0", "generation-worker-1"],
                          fail_on={"generation-worker-1": FINISH_METHOD})
    sender = _sender(calls)
    policy = _policy(tiny_model_dir)
    failed = sender.send(policy, 3)
    assert failed.replaced == ["generation-worker-1"] and calls.killed == ["generation-worker-1"]
    assert failed.served == {} and wire.destroyed == 1  # the group is torn down (its communicator aborted)
    again = sender.send(policy, 4)
    assert again.rebuilt and again.served == {"generation-worker-0": 4}
    assert [o["world_size"] for o in wire.opened] == [5, 3]  # rebuilt for the one engine left
    assert wire.opened[1]["port"] != 0


def test_a_push_every_worker_refuses_raises_naming_them(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    StubWire(monkeypatch)
    calls = ReceiverCalls(["generation-worker-0"], fail_on={"generation-worker-0": START_METHOD})
    with pytest.raises(RuntimeError, match=r"v1 failed on every generation worker.*generation-worker-0: "
                                           r"RuntimeError: generation-worker-0 fails transfer_start"):
        _sender(calls).send(_policy(tiny_model_dir), 1)
    assert calls.killed == ["generation-worker-0"]


def test_engines_running_another_backend_are_refused_before_any_rendezvous(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wire = StubWire(monkeypatch)
    calls = ReceiverCalls(["generation-worker-0", "generation-worker-1"], backend="ipc")
    with pytest.raises(ValueError, match=r"sends weights by 'nccl'.*EngineTransferConfig.weight_transfer differs: "
                                         r"\{'generation-worker-0': 'ipc', 'generation-worker-1': 'ipc'\}"):
        _sender(calls).send(_policy(tiny_model_dir), 1)
    assert wire.opened == [] and calls.killed == []
    assert all(engine.calls == [] for engine in calls.engines.values())


def test_the_client_checks_the_version_every_worker_serves() -> None:
    class WrongVersion(ReceiverCalls):
        async def _dispatch(self, name: str, method: str, args: tuple) -> Any:
            return 2 if method == FINISH_METHOD else None

    plan = plan_group("nccl", 1, [ENGINES[0]])
    client = EngineWorkersClient(plan, WrongVersion([ENGINES[0].name]), 1.0)
    client.version = 3
    with pytest.raises(WorkerCallError, match="generation-worker-0: serves v2, not v3"):
        client.finish_weight_update()


def test_a_pusher_with_an_engine_transfer_sends_full_weights_through_it_only(tiny_model_dir: Path) -> None:
    class RecordingSender:
        config = TrainerTransferConfig(weight_transfer="nccl")
        sent: list[int] = []

        def send(self, model: Any, version: int) -> None:
            self.sent.append(version)

        def owns(self, registry: Any) -> bool:
            return True

        def shutdown(self) -> None:
            self.sent.append(-1)

    sender = RecordingSender()
    # No object-store publish: no Ray put, no barrier (no process group exists here).
    pusher = WeightPusher("gather", 0, 1, [], 1.0, engine_transfer=sender, object_store_weights=False)
    pusher.push(_policy(tiny_model_dir), 6)
    pusher.close()  # the group is released at the end of training
    assert sender.sent == [6, -1]


def test_group_plan_is_a_record() -> None:
    plan = plan_group("nccl", 1, ENGINES)
    assert isinstance(plan, GroupPlan) and plan.engines == tuple(ENGINES)


# ---------------------------------------------------------------- the generation worker's pass-through


def _generation_worker(backend: str, engine: RecordingEngine) -> Any:
    from async_grpo.config.worker_options import EngineTransferConfig
    from vllm_worker import GenerationWorker, GenerationWorkerConfig

    worker = GenerationWorker("generation-worker-0", GenerationWorkerConfig(
        model_path="unused", transfer=EngineTransferConfig(weight_transfer=backend)), verifier=object())
    worker._engine = engine  # started: what start() leaves behind
    return worker


_WORKER_HAS_PASS_THROUGH = hasattr(__import__("vllm_worker").GenerationWorker, "transfer_start")


@pytest.mark.skipif(not _WORKER_HAS_PASS_THROUGH, reason="vllm_worker.GenerationWorker has no transfer_* methods yet")
def test_the_generation_workers_pass_through_labels_the_version(tiny_model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    wire = StubWire(monkeypatch)
    engine = RecordingEngine(world_size=1)
    worker = _generation_worker("nccl", engine)

    class WorkerCalls(ReceiverCalls):
        async def _dispatch(self, name: str, method: str, args: tuple) -> Any:
            result = getattr(worker, method)(*args)
            return await result if asyncio.iscoroutine(result) else result

    calls = WorkerCalls([worker.worker_name])
    outcome = _sender(calls).send(_policy(tiny_model_dir), 9)
    assert outcome.served == {worker.worker_name: 9} and len(wire.sent) == 1
    assert worker.weight_version == 9 and worker.stats.weight_updates == 1 and worker.served.accepting.is_set()
    assert [c for c, _ in engine.calls] == ["init_weight_transfer_engine", "pause_generation", "start_weight_update",
                                            "update_weights", "finish_weight_update", "resume_generation"]


@pytest.mark.skipif(not _WORKER_HAS_PASS_THROUGH, reason="vllm_worker.GenerationWorker has no transfer_* methods yet")
def test_the_pass_through_refuses_without_harm_or_fails_the_worker_mid_update() -> None:
    from async_grpo.routing.worker_lifecycle import WorkerFailedError, WorkerState

    object_store = _generation_worker("object_store", RecordingEngine())
    with pytest.raises(ValueError, match="takes full weights from the object store"):
        object_store.transfer_describe()
    engine = RecordingEngine()
    worker = _generation_worker("nccl", engine)
    with pytest.raises(Exception, match="start before init"):  # nothing changed: the worker stays healthy
        asyncio.run(worker.transfer_start())
    assert worker.served.accepting.is_set() and worker.life.state != WorkerState.FAILED

    async def broken_update(request: Any) -> None:
        raise RuntimeError("NCCL error: remote process exited")

    engine.update_weights = broken_update
    asyncio.run(worker.transfer_init("nccl", INIT))
    asyncio.run(worker.transfer_start())
    with pytest.raises(WorkerFailedError, match="weight transfer update failed: RuntimeError: NCCL error"):
        asyncio.run(worker.transfer_update(UPDATE))
    assert worker.life.state == WorkerState.FAILED  # a mix of versions: its dispatcher replaces it
