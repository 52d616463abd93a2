"""weight_sync's assembly of dim-0 pieces into full tensors, against torch.chunk slicing."""

from __future__ import annotations

import pytest
import torch

from weight_sync import fsdp_shard_extent
from weight_sync import assemble_state_dict, tensor_to_blob


def _pieces(tensor: torch.Tensor, num_shards: int) -> list[dict]:
    """One dict per rank with that rank's rows of `tensor`, as FSDP2 shards them."""
    shards = []
    for index in range(num_shards):
        offset, rows = fsdp_shard_extent(tensor.shape[0], num_shards, index)
        piece = tensor[offset : offset + rows]
        shards.append({"w": tensor_to_blob(piece, global_shape=tuple(tensor.shape), dim0_offset=offset)})
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
    return tensor_to_blob(rows, global_shape=(global_rows, 2), dim0_offset=offset)


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
