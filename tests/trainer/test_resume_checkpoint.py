"""async_grpo.trainer.checkpoint.save_checkpoint / load_checkpoint round trip in one process (no Ray, no torchrun):
weights, AdamW state, lr schedule, torch RNG and trainer state come back, and the next step of
the restored trainer equals the next step of the one that never stopped. Background saves
(BackgroundCheckpointWriter) write the same files as synchronous ones while training
changes the live tensors, appear only on commit, run one at a time and report their errors.

    .venv/bin/python -m pytest tests/trainer/test_resume_checkpoint.py -x -q

FSDP2 runs on a one-rank gloo group (init_distributed without torchrun). The expected values
come from the trainer objects that were saved, and the lr from the warmup formula by hand.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from async_grpo.trainer.checkpoint import (
    BackgroundCheckpointWriter, TrainerState, checkpoints_root, latest_checkpoint, load_checkpoint, save_checkpoint,
)
from async_grpo.trainer.fsdp_setup import build_training_model, init_distributed
from async_grpo.trainer.optimizer import OptimConfig, build_optimizer, build_scheduler
from async_grpo.weights import hf_checkpoint
from sample_processing_utils import Sample, post_process_batch
from setup_model import ModelConfig

LR = 1e-2
WARMUP_STEPS = 6
STEPS_BEFORE_SAVE = 3
SAMPLER_STATE = {"epoch": 1, "position": 5, "seed": 0, "num_items": 20, "world_size": 1}
# Large enough that Adam's update differs visibly between a restored and a fresh optimizer state.
OPTIM = OptimConfig(lr=LR, warmup_steps=WARMUP_STEPS, weight_decay=0.1)


def _batch():
    gen = torch.Generator().manual_seed(0)
    samples = [Sample(input_token_ids=torch.randint(2, 60, (5,), generator=gen).tolist(), gt_answer="",
                      output_token_ids=torch.randint(2, 60, (4,), generator=gen).tolist(), prompt_id=i,
                      sampling_logprobs=[0.0] * 4, advantage=1.0) for i in range(4)]
    return post_process_batch(samples)


def _train(model, optimizer, scheduler, steps: int) -> None:
    batch = _batch()
    for _ in range(steps):
        logprobs, _ = model.score(batch.inputs)
        (-logprobs.sum()).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _params(model) -> dict[str, torch.Tensor]:
    return {name: _full(p.detach()).clone() for name, p in model.named_parameters()}


def _optimizer_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: _full(v).clone() for k, v in optimizer.state[p].items()}
            for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def dist():
    return init_distributed()


def _build(model_path: Path, dist):
    model = build_training_model(ModelConfig(model_path=str(model_path)), dist)
    optimizer = build_optimizer(model, OPTIM)
    return model, optimizer, build_scheduler(optimizer, OPTIM)


def test_restored_trainer_takes_the_same_next_step(tiny_model_dir: Path, tmp_path: Path, dist) -> None:
    model, optimizer, scheduler = _build(tiny_model_dir, dist)
    _train(model, optimizer, scheduler, STEPS_BEFORE_SAVE)
    torch.manual_seed(1234)
    torch.rand(3)
    rng_at_save = torch.get_rng_state()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler,
                           TrainerState(step=STEPS_BEFORE_SAVE, sampler_state=SAMPLER_STATE), str(tiny_model_dir),
                           dist, keep=2)
    torch.rand(1000)  # the RNG moves on after the save, as it would in a crashed run

    restored, restored_optimizer, restored_scheduler = _build(path, dist)  # weights come from the HF files
    state = load_checkpoint(path, restored, restored_optimizer, restored_scheduler, dist)

    assert (state.step, state.sampler_state) == (STEPS_BEFORE_SAVE, SAMPLER_STATE)
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    expected_params = _params(model)
    assert all(torch.equal(p, expected_params[n]) for n, p in _params(restored).items())
    expected_state = _optimizer_state(model, optimizer)
    got_state = _optimizer_state(restored, restored_optimizer)
    for name, moments in expected_state.items():
        assert got_state[name].keys() == moments.keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        assert got_state[name]["step"].item() == STEPS_BEFORE_SAVE
        for key, value in moments.items():
            assert torch.equal(got_state[name][key], value), (name, key)
    # Warmup by hand: step s (0-based) uses lr * (s + 1) / WARMUP_STEPS; the next step is s = 3.
    next_lr = LR * (STEPS_BEFORE_SAVE + 1) / WARMUP_STEPS
    assert restored_scheduler.last_epoch == STEPS_BEFORE_SAVE
    assert restored_scheduler.get_last_lr() == pytest.approx([next_lr] * 2, rel=1e-12)
    assert [g["lr"] for g in restored_optimizer.param_groups] == pytest.approx([next_lr] * 2, rel=1e-12)
    assert [g["weight_decay"] for g in restored_optimizer.param_groups] == [0.1, 0.0]

    _train(model, optimizer, scheduler, 1)
    _train(restored, restored_optimizer, restored_scheduler, 1)
    after = _params(model)
    assert all(torch.equal(p, after[n]) for n, p in _params(restored).items())
    assert restored_scheduler.get_last_lr() == scheduler.get_last_lr()

    # Control: the same weights with a fresh optimizer take a different step, so the comparison
    # above does see the restored optimizer state.
    fresh, fresh_optimizer, fresh_scheduler = _build(path, dist)
    _train(fresh, fresh_optimizer, fresh_scheduler, 1)
    assert any(not torch.allclose(p, after[n], atol=1e-6) for n, p in _params(fresh).items())


def test_checkpoint_files_and_earlier_rng_format(tiny_model_dir: Path, tmp_path: Path, dist) -> None:
    model, optimizer, scheduler = _build(tiny_model_dir, dist)
    _train(model, optimizer, scheduler, 1)
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainerState(step=1), str(tiny_model_dir), dist,
                           keep=2)
    saved = json.loads((path / "trainer_state.json").read_text())
    assert saved["scheduler_state"]["last_epoch"] == 1
    assert set(torch.load(path / "rng_rank0.pt", weights_only=True)) == (
        {"cpu", "cuda"} if torch.cuda.is_available() else {"cpu"})
    # Checkpoints written before the RNG file held a dict store the bare CPU state.
    torch.manual_seed(7)
    old_format = torch.get_rng_state()
    torch.save(old_format, path / "rng_rank0.pt")
    torch.rand(10)
    restored = _build(path, dist)
    load_checkpoint(path, *restored, dist)
    assert torch.equal(torch.get_rng_state(), old_format)


def _tensors_equal(a, b) -> bool:
    """Nested dicts/lists of tensors and plain values, compared exactly."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_tensors_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _assert_same_checkpoint_files(got: Path, want: Path) -> None:
    """Same file names; the same bytes, except .pt files (torch.save archives), whose tensors are equal."""
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "config.json", "rng_rank0.pt"} <= set(names)
    for name in names:
        if name.endswith(".pt"):
            loaded = [torch.load(p / name, weights_only=True) for p in (got, want)]
            assert _tensors_equal(*loaded), name
        else:
            assert (got / name).read_bytes() == (want / name).read_bytes(), name


def _wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_background_save_writes_the_snapshot_while_training_goes_on(tiny_model_dir: Path, tmp_path: Path, dist,
                                                                    monkeypatch) -> None:
    """A background save holds the write until the test lets it go, after one more training step
    has changed weights, AdamW moments and step counts in place: the checkpoint must still equal a
    synchronous save taken at the same point, appear only once committed, and resume."""
    model, optimizer, scheduler = _build(tiny_model_dir, dist)
    _train(model, optimizer, scheduler, STEPS_BEFORE_SAVE)
    state = TrainerState(step=STEPS_BEFORE_SAVE, sampler_state=SAMPLER_STATE)
    sync_path = save_checkpoint(tmp_path / "sync", model, optimizer, scheduler, state, str(tiny_model_dir), dist,
                                keep=2)

    release = threading.Event()
    real_write = hf_checkpoint.write_safetensors

    def held_write(*args, **kwargs):
        assert release.wait(timeout=120), "the test never released the write"
        return real_write(*args, **kwargs)

    monkeypatch.setattr(hf_checkpoint, "write_safetensors", held_write)
    run_dir = tmp_path / "async"
    writer = BackgroundCheckpointWriter(run_dir, str(tiny_model_dir), dist, keep=2)
    blocked_s = writer.save(model, optimizer, scheduler, state)
    assert blocked_s >= 0.0
    _train(model, optimizer, scheduler, 1)  # the live tensors move on while the save is held
    release.set()
    tmp = checkpoints_root(run_dir) / "step_000003.tmp"
    _wait_for(lambda: (tmp / "trainer_state.json").is_file(), "the background write")
    assert latest_checkpoint(run_dir) is None  # written, but not visible before commit()
    writer.commit()
    writer.close()
    async_path = latest_checkpoint(run_dir)
    assert async_path == checkpoints_root(run_dir) / "step_000003" and not tmp.exists()
    _assert_same_checkpoint_files(async_path, sync_path)

    restored, restored_optimizer, restored_scheduler = _build(async_path, dist)
    loaded = load_checkpoint(async_path, restored, restored_optimizer, restored_scheduler, dist)
    assert (loaded.step, loaded.sampler_state) == (STEPS_BEFORE_SAVE, SAMPLER_STATE)
    _train(restored, restored_optimizer, restored_scheduler, 1)
    after = _params(model)  # the original, one step past the save
    assert all(torch.equal(p, after[n]) for n, p in _params(restored).items())


def test_background_saves_one_at_a_time_and_errors_surface(tiny_model_dir: Path, tmp_path: Path, dist,
                                                           monkeypatch) -> None:
    model, optimizer, scheduler = _build(tiny_model_dir, dist)
    _train(model, optimizer, scheduler, 1)
    release = threading.Event()
    real_write = hf_checkpoint.write_safetensors
    monkeypatch.setattr(hf_checkpoint, "write_safetensors",
                        lambda *a, **k: (release.wait(timeout=120), real_write(*a, **k))[1])
    writer = BackgroundCheckpointWriter(tmp_path, str(tiny_model_dir), dist, keep=5)
    writer.save(model, optimizer, scheduler, TrainerState(step=1))
    writer.commit()
    threading.Timer(0.5, release.set).start()
    # The second save must wait for the first: when it returns, step 1 is complete on disk.
    writer.save(model, optimizer, scheduler, TrainerState(step=2))
    assert latest_checkpoint(tmp_path) == checkpoints_root(tmp_path) / "step_000001"
    # Closed without commit(): step 2 is written but never renamed into place.
    writer.close()
    assert latest_checkpoint(tmp_path) == checkpoints_root(tmp_path) / "step_000001"
    assert (checkpoints_root(tmp_path) / "step_000002.tmp" / "trainer_state.json").is_file()

    def failing_write(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_checkpoint, "write_safetensors", failing_write)
    writer.save(model, optimizer, scheduler, TrainerState(step=3))
    writer.commit()
    with pytest.raises(RuntimeError, match="background checkpoint save failed.*disk full"):
        writer.close()
    assert latest_checkpoint(tmp_path) == checkpoints_root(tmp_path) / "step_000001"
