"""worker_loader's assembly of dim-0 pieces into full tensors (all at once or one at a time),
against torch.chunk slicing, and the dtype pushes carry."""

from __future__ import annotations

import pytest
import torch

from async_grpo.weights.trainer_gather import fsdp_shard_extent, gather_full_state_dict, local_shard_blobs
from async_grpo.weights.trainer_pusher import WeightPusher, resolve_push_dtype
from async_grpo.weights.update import WeightUpdate, tensor_to_blob
from async_grpo.weights.worker_loader import assemble_state_dict, fetch_state_dict, iter_assembled, iter_state_dict


def _pieces(tensor: torch.Tensor, num_shards: int) -> list[dict]:
    """One dict per rank with that rank's rows of `tensor`, as FSDP2 shards them."""
    shards = []
    for index in range(num_shards):
        offset, rows = fsdp_shard_extent(tensor.shape[0], num_shards, index)
        piece = tensor[offset : offset + rows]
        shards.append({"w": tensor_to_blob(piece, global_shape=tuple(tensor.shape), offset=offset)})
    return shards


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim0_size, num_shards", [(5, 4), (7, 3), (1, 2), (6, 1)])
def test_pieces_in_any_order_assemble_to_the_tensor(dtype: torch.dtype, dim0_size: int, num_shards: int) -> None:
    tensor = torch.randn(dim0_size, 3, generator=torch.Generator().manual_seed(dim0_size)).to(dtype)
    shards = _pieces(tensor, num_shards)[::-1]  # ranks arrive in any order
    got = assemble_state_dict(shards)["w"]
    assert got.dtype == dtype and torch.equal(got, tensor)
    got.add_(1)  # a fresh, writable tensor: the blobs' buffers are untouched
    assert torch.equal(assemble_state_dict(shards)["w"], tensor)


def test_scalars_and_empty_tensors_travel_whole() -> None:
    state = {"scale": torch.tensor(2.5), "empty": torch.empty(0, 4)}
    got = assemble_state_dict([{k: tensor_to_blob(v) for k, v in state.items()}])
    assert torch.equal(got["scale"], state["scale"]) and got["empty"].shape == (0, 4)


def _blob(rows: torch.Tensor, offset: int, global_rows: int = 4):
    return tensor_to_blob(rows, global_shape=(global_rows, 2), offset=offset)


@pytest.mark.parametrize(
    "pieces, message",
    [
        ([(torch.ones(2, 2), 0)], "cover 2 of 4 rows"),  # a rank's piece never arrived
        ([(torch.ones(2, 2), 0), (torch.ones(2, 2), 1)], "piece at row 1"),  # overlap
        ([(torch.ones(2, 2), 0), (torch.ones(1, 2), 3)], "piece at row 3"),  # gap
        ([(torch.ones(2, 2), 0), (torch.ones(2, 3), 2)], r"shape \(2, 3\)"),  # wrong trailing shape
    ],
)
def test_bad_pieces_name_the_weight(pieces: list, message: str) -> None:
    with pytest.raises(ValueError, match=f"weight w: .*{message}"):
        assemble_state_dict([{"w": _blob(rows, offset)} for rows, offset in pieces])


def test_mixed_dtypes_are_refused() -> None:
    shards = [{"w": _blob(torch.ones(2, 2), 0)}, {"w": _blob(torch.ones(2, 2, dtype=torch.bfloat16), 2)}]
    with pytest.raises(ValueError, match="weight w: pieces have mixed dtypes"):
        assemble_state_dict(shards)


# ------------------------------------------------------------------------------------------
# One tensor at a time (iter_assembled / iter_state_dict) and the push dtype.
# ------------------------------------------------------------------------------------------


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small state dict in model order: uneven dim 0 sizes, a scalar, an empty tensor."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(7, 3, generator=gen),
        "layer.weight": torch.randn(5, 2, 2, generator=gen),
        "layer.bias": torch.randn(5, generator=gen),
        "scale": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }


def _sharded(state: dict[str, torch.Tensor], num_shards: int) -> list[dict]:
    """One dict per rank with that rank's dim-0 piece of every tensor (scalars on rank 0 only)."""
    shards: list[dict] = [{} for _ in range(num_shards)]
    for name, tensor in state.items():
        if tensor.dim() == 0:
            shards[0][name] = tensor_to_blob(tensor)
            continue
        for index in range(num_shards):
            offset, rows = fsdp_shard_extent(tensor.shape[0], num_shards, index)
            shards[index][name] = tensor_to_blob(tensor[offset : offset + rows], tuple(tensor.shape), offset)
    return shards


@pytest.mark.parametrize("num_shards", [1, 3])  # 1: a 'gather' update's one whole shard
def test_iter_assembled_yields_assemble_state_dict_one_tensor_at_a_time(num_shards: int) -> None:
    state = _state()
    shards = _sharded(state, num_shards)  # in rank order, as the shard stager hands them over
    whole = assemble_state_dict(shards)
    iterator = iter_assembled(shards)
    first_name, first = next(iterator)  # lazily: one tensor built, the rest not yet
    rest = list(iterator)
    assert [first_name] + [name for name, _ in rest] == list(whole) == list(state)
    for name, tensor in [(first_name, first), *rest]:
        assert tensor.dtype == whole[name].dtype and torch.equal(tensor, whole[name]) and torch.equal(tensor, state[name])


def test_iter_assembled_names_a_bad_weight_when_it_reaches_it() -> None:
    shards = _sharded(_state(), 2)
    del shards[1]["layer.bias"]  # rank 1's rows of the third tensor never arrived
    iterator = iter_assembled(shards)
    assert [next(iterator)[0], next(iterator)[0]] == ["embed.weight", "layer.weight"]
    with pytest.raises(ValueError, match="weight layer.bias: pieces cover 3 of 5 rows"):
        next(iterator)


@pytest.mark.parametrize("mode, num_shards", [("gather", 1), ("sharded", 2)])
def test_iter_state_dict_reads_an_update_from_ray(ray_local, mode: str, num_shards: int) -> None:
    state = {name: t.to(torch.bfloat16) for name, t in _state(1).items()}
    update = WeightUpdate(version=3, mode=mode, shard_refs=[ray_local.put(s) for s in _sharded(state, num_shards)])
    streamed = list(iter_state_dict(update))
    assert [name for name, _ in streamed] == list(state)
    for name, tensor in streamed:
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name]), name
    fetched = fetch_state_dict(update)
    assert all(torch.equal(fetched[name], tensor) for name, tensor in streamed)


class _WithBuffer(torch.nn.Module):
    """A float parameter and a persistent integer buffer, as some checkpoints carry."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(2)))
        self.register_buffer("position_ids", torch.arange(5))


def test_publish_helpers_cast_floating_point_tensors_only() -> None:
    model = _WithBuffer()
    gathered = gather_full_state_dict(model, dtype=torch.bfloat16)
    assembled = assemble_state_dict([local_shard_blobs(model, dtype=torch.bfloat16)])
    for state in (gathered, assembled):
        assert state["weight"].dtype == torch.bfloat16 and torch.equal(state["weight"], model.weight.detach().to(torch.bfloat16))
        assert state["position_ids"].dtype == torch.int64 and torch.equal(state["position_ids"], model.position_ids)
    assert gather_full_state_dict(model)["weight"].dtype == torch.float32  # None keeps the model's dtype


@pytest.mark.parametrize(
    "name, device, mixed_precision, expected",
    [
        ("auto", "cuda", True, torch.bfloat16),  # the trainer computes in bf16: push what it computed with
        ("auto", "cuda", False, torch.float32),
        ("auto", "cpu", True, torch.float32),  # mixed precision applies on CUDA only
        ("float16", "cpu", False, torch.float16),
        ("float32", "cuda", True, torch.float32),
    ],
)
def test_resolve_push_dtype(name: str, device: str, mixed_precision: bool, expected: torch.dtype) -> None:
    assert resolve_push_dtype(name, torch.device(device), mixed_precision) == expected


def test_push_dtype_errors() -> None:
    with pytest.raises(ValueError, match="weight push dtype must be one of"):
        resolve_push_dtype("int8", torch.device("cpu"), True)
    with pytest.raises(ValueError, match="WeightPusher dtype must be one of"):
        WeightPusher("gather", 0, 1, [], 1.0, dtype=torch.int8)
    assert WeightPusher("gather", 0, 1, [], 1.0).dtype == torch.float32


def test_replicated_tensors_are_published_by_rank_0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsharded tensors (persistent buffers under FSDP) are whole on every rank: one copy only."""
    from async_grpo.weights import trainer_gather

    model = _WithBuffer()
    assert local_shard_blobs(model).keys() == {"weight", "position_ids"}
    monkeypatch.setattr(trainer_gather, "_is_main_process", lambda: False)
    assert local_shard_blobs(model) == {}
