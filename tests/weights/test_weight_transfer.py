"""The object-store weight transport's pieces without an engine: a bucket's memory file read back
as the engine reads it, the shared-memory free-space check, the weight_transfer option and its
wiring into vLLM's engine arguments, and the streamed load into a plain model.

The real engine path (vLLM's start/update/finish_weight_update with our registered backend) runs in
tests/inference/test_vllm_worker.py.

    .venv/bin/python -m pytest tests/weights/test_weight_transfer.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from async_grpo.config.worker_options import (
    WEIGHT_TRANSFER_BACKENDS, EngineTransferConfig, check_transfer_packages, check_weight_transfer_device,
    module_available,
)
from async_grpo.weights.update import state_dict_to_blobs, tensor_to_blob
from async_grpo.weights.worker_bucket_files import BucketBuffer, SharedMemoryFullError, check_free_space, read_bucket
from async_grpo.weights.worker_loader import iter_assembled, load_streamed_into, update_shapes
from support.paths import REPO_ROOT


def _bucket() -> dict[str, torch.Tensor]:
    """Odd sizes, so that offsets need alignment; every dtype a push carries; a 0-dim and an empty tensor."""
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(3, 5, generator=gen),
        "model.layers.0.input_layernorm.weight": torch.randn(7, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 3, generator=gen).to(torch.float16).t(),  # not contiguous
        "model.scale": torch.tensor(2.5),
        "model.positions": torch.arange(9, dtype=torch.int64),
        "model.empty": torch.empty(0, 4),
    }


def test_a_bucket_reads_back_bit_exact_with_aligned_offsets() -> None:
    bucket = _bucket()
    buffer = BucketBuffer("transfer-test", bucket)
    try:
        info = buffer.update_info
        assert all(offset % 64 == 0 for offset in info["offsets"])
        got = read_bucket(info)
    finally:
        buffer.close()
    # The engine's views outlive the sender's handle (vLLM may keep a layer's tensors a while).
    assert list(got) == list(bucket)
    for name, tensor in bucket.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_a_bucket_written_in_short_writes_reads_back_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """pwrite may write fewer bytes than asked (a signal, or Linux's ~2 GiB cap per call on a
    large tensor): the writer goes on from where the kernel stopped."""
    import os

    real_pwrite, calls = os.pwrite, []

    def short_pwrite(fd: int, data: bytes, offset: int) -> int:
        calls.append(len(data))
        return real_pwrite(fd, memoryview(data)[:7], offset)  # at most 7 bytes per call

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    bucket = _bucket()
    buffer = BucketBuffer("transfer-test", bucket)
    try:
        got = read_bucket(buffer.update_info)
    finally:
        buffer.close()
    assert len(calls) > len(bucket)  # the short writes really happened
    for name, tensor in bucket.items():
        assert torch.equal(got[name], tensor), name


def test_the_engine_reads_a_private_copy() -> None:
    bucket = {"w": torch.ones(16)}
    buffer = BucketBuffer("transfer-test", bucket)
    first, second = read_bucket(buffer.update_info)["w"], read_bucket(buffer.update_info)["w"]
    buffer.close()
    first.zero_()
    assert torch.equal(second, torch.ones(16))


def test_a_bucket_of_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="complex64"):
        BucketBuffer("transfer-test", {"w": torch.zeros(2, dtype=torch.complex64)})


def test_shared_memory_check_names_free_space_and_size(tmp_path: Path) -> None:
    sixty_four_mb = lambda folder: 64 * 2**20  # noqa: E731  (a container's default /dev/shm)
    with pytest.raises(SharedMemoryFullError, match=r"has 64\.0 MiB free, adapter v3 needs 512\.0 MiB"):
        check_free_space(tmp_path, 512 * 2**20, "adapter v3", free_bytes=sixty_four_mb)
    check_free_space(tmp_path, 64 * 2**20, "adapter v3", free_bytes=sixty_four_mb)  # fits exactly


def test_weight_transfer_option_is_validated_naming_the_field() -> None:
    with pytest.raises(ValueError, match="EngineTransferConfig.weight_transfer"):
        EngineTransferConfig(weight_transfer="rdma")
    for cuda_only in ("nccl", "nccl_m2n", "ipc"):
        EngineTransferConfig(weight_transfer=cuda_only)  # a valid choice; the device decides at start
        with pytest.raises(ValueError, match=f"^weight_transfer '{cuda_only}'.*no CUDA"):
            check_weight_transfer_device(cuda_only, has_cuda=False)
        check_weight_transfer_device(cuda_only, has_cuda=True)
    check_weight_transfer_device("object_store", has_cuda=False)


def test_cuda_transfers_name_the_packages_they_need_and_where_they_come_from() -> None:
    """nccl_m2n needs NVIDIA's nccl.m2n (vLLM does not install it); every CUDA transfer needs vLLM
    in the trainer too, whose own requirements hold none. Decided by what can be imported."""
    assert module_available("vllm") and module_available("async_grpo.config")
    assert not module_available("nccl.m2n") and not module_available("no_such_package.sub")
    check_transfer_packages("object_store", "trainer", available=lambda name: False)  # needs nothing
    for transfer in ("nccl", "ipc"):
        check_transfer_packages(transfer, "trainer", available=lambda name: name == "vllm")
        with pytest.raises(ValueError, match=rf"^weight_transfer '{transfer}' needs vllm importable in the trainer, "
                                             r"and it is not \(vllm: pip install -r requirements_base\.txt"):
            check_transfer_packages(transfer, "trainer", available=lambda name: False)
    with pytest.raises(ValueError, match=r"'nccl_m2n' needs nccl\.m2n importable in the trainer.*nccl-extensions"
                                         r".*or use 'object_store'$"):
        check_transfer_packages("nccl_m2n", "trainer", available=lambda name: name == "vllm")
    with pytest.raises(ValueError, match=r"needs vllm, nccl\.m2n importable in the logprob node"):
        check_transfer_packages("nccl_m2n", "logprob node", available=lambda name: False)
    check_transfer_packages("nccl_m2n", "trainer", available=lambda name: True)


def test_trainer_refuses_a_cuda_transfer_it_cannot_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer_core.check_environment, CUDA faked: nccl_m2n without nccl.m2n is one line; a LoRA
    policy (adapters through the object store) is not asked for it."""
    import trainer_core
    from async_grpo.weights.trainer_cuda_transfer import TRANSFER_PUSH_MODE

    monkeypatch.setattr(trainer_core.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trainer_core, "check_trainer_gpus", lambda *args: None)
    monkeypatch.setattr(trainer_core, "check_versions", lambda *args: None)
    config = trainer_core.load_trainer_config(["--model.model_path", "m", "--data.path", "d.jsonl",
                                               "--transfer.weight_transfer", "nccl_m2n",
                                               "--weight_push_mode", TRANSFER_PUSH_MODE["nccl_m2n"]])
    with pytest.raises(trainer_core.InputError, match=r"'nccl_m2n' needs nccl\.m2n importable in the trainer"):
        trainer_core.check_environment(config)


def test_engine_args_name_our_backend_and_its_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    from async_grpo.inference import engine_start
    from async_grpo.inference.engine_start import engine_args
    from vllm_worker import GenerationWorkerConfig

    # vLLM's platform detection starts a child process; the CPU answer is what this machine gives.
    monkeypatch.setattr(engine_start, "on_cpu_platform", lambda: True)
    for choice, backend in WEIGHT_TRANSFER_BACKENDS.items():
        config = GenerationWorkerConfig(model_path="m", transfer=EngineTransferConfig(weight_transfer=choice))
        args = engine_args(config, in_process=True)
        assert args["weight_transfer_config"] == {"backend": backend}
    module, cls = args["worker_extension_cls"].rsplit(".", 1)
    # Read from the source: importing it imports vLLM, as the engine-core process does.
    tree = ast.parse((REPO_ROOT / f"{module.replace('.', '/')}.py").read_text())
    assigned = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    assert cls in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert assigned["OBJECT_STORE_BACKEND"] == WEIGHT_TRANSFER_BACKENDS["object_store"]


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.proj = nn.Linear(4, 3)


def test_streamed_load_checks_everything_before_copying_then_copies_each() -> None:
    model, source = _Tiny(), _Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shards = [state_dict_to_blobs(source.state_dict())]
    wrong = {**update_shapes(shards), "proj.weight": (3, 5)}
    with pytest.raises(ValueError, match="proj.weight"):
        load_streamed_into(model, wrong, iter_assembled(shards))
    with pytest.raises(KeyError, match="extra"):
        load_streamed_into(model, {**update_shapes(shards), "extra": (1,)}, iter_assembled(shards))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    assert load_streamed_into(model, update_shapes(shards), iter_assembled(shards)) == 3
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())


def test_streamed_load_of_a_sharded_update_equals_the_full_weights() -> None:
    """The fan-in: rows cut as two FSDP ranks would, reassembled tensor by tensor."""
    source, model = _Tiny(), _Tiny()
    full = source.state_dict()
    halves = [{name: t[: (t.shape[0] + 1) // 2] for name, t in full.items()},
              {name: t[(t.shape[0] + 1) // 2:] for name, t in full.items()}]
    shards = [{name: tensor_to_blob(half[name], global_shape=tuple(full[name].shape),
                                    offset=0 if rank == 0 else halves[0][name].shape[0])
               for name in full} for rank, half in enumerate(halves)]
    load_streamed_into(model, update_shapes(shards), iter_assembled(shards))
    assert all(torch.equal(v, full[k]) for k, v in model.state_dict().items())


def test_views_skip_the_copy_only_for_tensors_that_travelled_whole() -> None:
    full = _Tiny().state_dict()
    gathered = [state_dict_to_blobs(full)]
    for name, tensor in iter_assembled(gathered, views=True):
        assert tensor.data_ptr() == gathered[0][name].data.ctypes.data and torch.equal(tensor, full[name])
    rows = full["embed.weight"].shape[0]
    halves = [{"embed.weight": tensor_to_blob(full["embed.weight"][:2], global_shape=(rows, 4))},
              {"embed.weight": tensor_to_blob(full["embed.weight"][2:], global_shape=(rows, 4), offset=2)}]
    (name, joined), = iter_assembled(halves, views=True)
    assert torch.equal(joined, full["embed.weight"])
