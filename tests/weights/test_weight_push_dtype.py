"""Weight pushes in the serving dtype: real WeightPusher pushes from 2 FSDP ranks, both modes.

tests/programs/weight_push_worker.py runs on 2 forked ranks (support.forked_ranks; gloo on 127.0.0.1) and joins this
session's Ray cluster; each rank builds the FSDP2 model from a tiny checkpoint and pushes it with
WeightPusher in "gather" and "sharded" mode, in float32 and bfloat16, to a recorder that reads
every update as a worker does (fetch_state_dict and iter_state_dict). The reference is
independent of weights/: the checkpoint's fp32 tensors, loaded with from_pretrained, and
`tensor.to(torch.bfloat16)` of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from setup_model import load_causal_lm
from support.paths import PROGRAMS
from support.forked_ranks import run_ranks

WORKER = PROGRAMS / "weight_push_worker.py"
WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 600  # bounds a hung launch only; two ranks on 2 shared cores take well under that


@pytest.fixture(scope="module")
def uneven_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings and an odd MLP width: gate/up_proj rows split 65 / 64 over two ranks."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-tied-odd"), TinyModelConfig(tie_word_embeddings=True, intermediate_size=129)
    )


@pytest.fixture(scope="module")
def pushes(ray_local, tmp_path_factory, tiny_model_dir: Path, uneven_tied_model_dir: Path) -> list[dict]:
    """Every push the 2-rank worker made, as its recorder received it."""
    out_dir = tmp_path_factory.mktemp("weight-push")
    address = ray_local.get_runtime_context().gcs_address
    namespace = ray_local.get_runtime_context().namespace
    models = ["--model_path", str(tiny_model_dir), "--model_path", str(uneven_tied_model_dir)]
    run_ranks(WORKER, ["--ray_address", address, "--namespace", namespace, "--out_dir", str(out_dir), *models],
              WORLD_SIZE, LAUNCH_TIMEOUT_S)
    return torch.load(out_dir / "received.pt")


def _checkpoint_tensors(model_path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 weights under HF names, a tied embedding once (as pushes carry it)."""
    model = load_causal_lm(model_path, dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["gather", "sharded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_push_arrives_in_its_dtype_equal_to_the_rounded_weights(pushes: list[dict], mode: str, dtype: torch.dtype) -> None:
    chosen = [p for p in pushes if p["mode"] == mode and p["dtype"] == dtype]
    assert len(chosen) == 2  # the untied and the uneven tied model
    for push in chosen:
        assert push["mode"] == mode  # the WeightUpdate's own mode, as the recorder saw it
        expected = _checkpoint_tensors(push["model_path"])
        assert push["fetched"].keys() == expected.keys()
        for name, weight in expected.items():
            got = push["fetched"][name]
            assert got.dtype == dtype, f"{name}: {got.dtype}"
            assert torch.equal(got, weight.to(dtype)), name
        # A bf16 push must really be rounded: equality above would be vacuous if fp32 values
        # happened to be representable in bf16.
        if dtype == torch.bfloat16:
            assert any(not torch.equal(w.to(dtype).float(), w) for w in expected.values())
        # Streaming one tensor at a time yields the same tensors in the same order.
        assert push["streamed_names"] == list(push["fetched"].keys())
        assert all(torch.equal(push["streamed"][n], t) for n, t in push["fetched"].items())


@pytest.mark.distributed
def test_push_phases_split_rank_zeros_push_time(pushes: list[dict]) -> None:
    """WeightPusher.phases (the trainer logs them as timing/push_<phase>_s): every phase on every
    push, none negative, together within the push's own time, and the registry's publish (the
    recorder holds each one PUBLISH_HOLD_S, as a worker loading into its engine would) inside 'load'."""
    from async_grpo.weights.trainer_object_store import PUSH_PHASES

    for push in pushes:
        phases = push["phases"]
        assert tuple(phases) == PUSH_PHASES, push["phases"]
        assert all(seconds >= 0 for seconds in phases.values()), phases
        assert sum(phases.values()) <= push["seconds"], (phases, push["seconds"])
        assert phases["load"] >= 0.2, phases  # weight_push_worker.PUBLISH_HOLD_S
