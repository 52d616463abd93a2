"""Training setup: FSDP2 on two gloo ranks against single-process references, plus its pieces.

Distributed tests launch tests/programs/fsdp_worker.py once on 2 ranks forked with torchrun's environment
(support.forked_ranks; 127.0.0.1, a free port) and check the files its rank 0 writes; the stalled-peer
check runs under torchrun itself. What they establish:

- gradient equivalence: per-microbatch loss x world_size, gradients / total samples on 2 FSDP
  ranks (gradient checkpointing on, small logprob chunks) == one plain process averaging the loss
  over all samples in one packed batch;
- export: after one AdamW step, export_hf_checkpoint reloads with from_pretrained and gives the
  trained model's logits; local_shard_blobs assemble to exactly gather_full_state_dict
  (untied model, and a tied model whose odd MLP width makes uneven shards);
- init_distributed without torchrun makes a one-rank group that the same code runs on;
- init_distributed's timeout reaches gloo: a rank whose peer never joins a collective gets an
  error instead of hanging.

The rest run in-process: shard extents against torch.chunk, the LR schedule, the optimizer's
groups, config validation, and load_state_dict_into.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from async_grpo.trainer.optimizer import OptimConfig, build_optimizer, build_scheduler, lr_factor
from async_grpo.weights.trainer_gather import fsdp_shard_extent, gather_full_state_dict, local_shard_blobs
from async_grpo.weights.worker_loader import assemble_state_dict, load_state_dict_into
from grpo_loss import LossConfig, grpo_loss
from sample_processing_utils import Sample, get_input_for_logprobs, post_process_batch
from setup_model import ModelConfig, TokenLogprobModel, load_causal_lm, load_tokenizer
from support.forked_ranks import run_ranks
from support.paths import PROGRAMS
from support.torchrun_launch import run_worker

WORKER = PROGRAMS / "fsdp_worker.py"
REPO_ROOT = WORKER.parent.parent
WORLD_SIZE = 2
# Generous bound on one launch (two ranks sharing 2 cores take ~1 min); it only stops a
# hung run from blocking the suite.
LAUNCH_TIMEOUT_S = 600
# fp32 gradients: FSDP reduce-scatter, checkpoint recompute and chunked lm_head change the order
# of float sums only, which moves values by ~1e-7 relative.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
# Same weights, same kernels, one process each: logits agree to float rounding.
LOGIT_ATOL = 1e-5
LOSS_CONFIG = LossConfig(kl_coef=0.1, kl_estimator="k3", clip_low=0.2, clip_high=0.28, is_mode="tis", is_cap=2.0)
# lr large enough that one step moves logits far beyond LOGIT_ATOL.
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0)
# Each rank runs the same number of microbatches (every backward is a collective) of unequal sizes.
RANK_MICROBATCHES = [[[0, 1, 2], [3, 4], [5]], [[6], [7, 8, 9], [10, 11]]]
NUM_SAMPLES = 12


def _build_samples(model_dir: Path, num_samples: int, seed: int) -> list[Sample]:
    """Random prompts/outputs; old/ref/sampling logprobs near the model's own, so some ratios clip."""
    gen = torch.Generator().manual_seed(seed)
    vocab = load_causal_lm(model_dir).config.vocab_size
    samples = []
    for i in range(num_samples):
        prompt_len = int(torch.randint(2, 12, (1,), generator=gen))
        output_len = int(torch.randint(1, 16, (1,), generator=gen))
        samples.append(Sample(
            input_token_ids=torch.randint(2, vocab, (prompt_len,), generator=gen).tolist(),
            output_token_ids=torch.randint(2, vocab, (output_len,), generator=gen).tolist(),
            gt_answer="",
            prompt_id=i,
            advantage=float(torch.randn(1, generator=gen)),
        ))
    model = TokenLogprobModel(load_causal_lm(model_dir))
    with torch.no_grad():
        current, _ = model.score(get_input_for_logprobs(samples))
    old = current + 0.3 * torch.randn(current.shape, generator=gen)
    ref = current + 0.3 * torch.randn(current.shape, generator=gen)
    sampling = old + 0.2 * torch.randn(current.shape, generator=gen)
    lengths = [len(s.output_token_ids) for s in samples]
    for sample, o, r, s in zip(samples, old.split(lengths), ref.split(lengths), sampling.split(lengths)):
        sample.old_logprobs, sample.ref_logprobs, sample.sampling_logprobs = o.tolist(), r.tolist(), s.tolist()
    return samples


def _launch(worker_args: list[str], out_dir: Path, nproc: int | None) -> None:
    """Run the worker (torchrun with nproc ranks, or plain python when nproc is None)."""
    run_worker(WORKER, ["--out_dir", str(out_dir)] + worker_args, nproc, LAUNCH_TIMEOUT_S)


def _write_spec(spec: dict, out_dir: Path) -> Path:
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return spec_path


def _spec(samples: list[Sample], grad_model: Path, export_models: dict[str, str], microbatches: list) -> dict:
    return {
        "samples": [asdict(s) for s in samples],
        "grad_model": str(grad_model),
        "rank_microbatches": microbatches,
        "loss": asdict(LOSS_CONFIG),
        "export_models": export_models,
        "probe_sample": 0,
        "optim": asdict(OPTIM),
    }


@pytest.fixture(scope="module")
def uneven_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings and an odd MLP width: gate/up_proj rows split 65 / 64 over two ranks."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-tied-odd"), TinyModelConfig(tie_word_embeddings=True, intermediate_size=129)
    )


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[Sample]:
    return _build_samples(tiny_model_dir, NUM_SAMPLES, seed=1)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tiny_model_dir: Path, uneven_tied_model_dir: Path, samples: list[Sample]) -> Path:
    """One launch of the worker on 2 forked ranks (support.forked_ranks); returns its output folder."""
    out_dir = tmp_path_factory.mktemp("fsdp-run")
    exports = {"untied": str(tiny_model_dir), "tied": str(uneven_tied_model_dir)}
    spec_path = _write_spec(_spec(samples, tiny_model_dir, exports, RANK_MICROBATCHES), out_dir)
    run_ranks(WORKER, ["--out_dir", str(out_dir), "--spec", str(spec_path)], WORLD_SIZE, LAUNCH_TIMEOUT_S)
    return out_dir


def _reference_grads(model_dir: Path, samples: list[Sample]) -> dict[str, torch.Tensor]:
    """One plain process, all samples in one packed batch, loss averaged over samples."""
    model = TokenLogprobModel(load_causal_lm(model_dir))
    batch = post_process_batch(samples)
    logprobs, _ = model.score(batch.inputs)
    loss, _ = grpo_loss(logprobs, batch, LOSS_CONFIG)
    (loss / len(samples)).backward()
    return {name: p.grad for name, p in model.causal_lm.named_parameters()}


def _assert_grads_match(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        assert grad.abs().max() > 0, f"{name}: reference gradient is zero, the check would be vacuous"
        torch.testing.assert_close(actual[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
def test_fsdp_gradients_equal_single_process_mean(fsdp_run: Path, tiny_model_dir: Path, samples) -> None:
    info = json.loads((fsdp_run / "dist_info.json").read_text())
    # gloo and fp32 on any host: run_ranks hides the GPUs from this tier's ranks (a CUDA host would
    # otherwise pick NCCL and bf16); tests/model/test_gpu_model.py checks the bf16 step on a GPU.
    assert (info["world_size"], info["backend"], info["device"]) == (WORLD_SIZE, "gloo", "cpu")
    expected = _reference_grads(tiny_model_dir, samples)
    _assert_grads_match(torch.load(fsdp_run / "grads.pt"), expected)


@pytest.mark.distributed
def test_single_process_without_torchrun(tmp_path: Path, tiny_model_dir: Path, samples) -> None:
    """init_distributed with no torchrun env: a one-rank group; FSDP2 and the scaling still hold."""
    all_in_one_rank = [[list(range(0, 5)), list(range(5, NUM_SAMPLES))]]
    _launch(["--spec", str(_write_spec(_spec(samples, tiny_model_dir, {}, all_in_one_rank), tmp_path))], tmp_path,
            nproc=None)
    info = json.loads((tmp_path / "dist_info.json").read_text())
    assert (info["rank"], info["world_size"]) == (0, 1)
    _assert_grads_match(torch.load(tmp_path / "grads.pt"), _reference_grads(tiny_model_dir, samples))


@pytest.mark.distributed
def test_stalled_peer_raises_instead_of_hanging(tmp_path: Path) -> None:
    """init_distributed's timeout reaches the collectives: a silent peer gives an error."""
    _launch(["--stalled_peer"], tmp_path, nproc=WORLD_SIZE)
    verdict = (tmp_path / "stalled_peer.txt").read_text()
    assert "timed out" in verdict.lower(), verdict


def _checkpoint_keys(model_dir: Path) -> set[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.distributed
@pytest.mark.parametrize("tag", ["untied", "tied"])
def test_export_reloads_with_trained_logits(fsdp_run: Path, tag: str, tiny_model_dir, uneven_tied_model_dir) -> None:
    source = tiny_model_dir if tag == "untied" else uneven_tied_model_dir
    tag_dir = fsdp_run / tag
    before, after = torch.load(tag_dir / "before.pt"), torch.load(tag_dir / "after.pt")
    # The step must move the model, or matching logits would prove nothing about the export.
    assert (after["logits"] - before["logits"]).abs().max() > 100 * LOGIT_ATOL

    checkpoint = tag_dir / "checkpoint"
    reloaded = load_causal_lm(checkpoint)
    inputs = get_input_for_logprobs([Sample(**_probe_fields(fsdp_run))])
    with torch.no_grad():
        logits = reloaded(input_ids=inputs.input_ids[None], use_cache=False).logits[0]
        logprobs, _ = TokenLogprobModel(reloaded).score(inputs)
    torch.testing.assert_close(logits, after["logits"], rtol=0, atol=LOGIT_ATOL)
    torch.testing.assert_close(logprobs, after["logprobs"], rtol=0, atol=LOGIT_ATOL)

    assert _checkpoint_keys(checkpoint) == _checkpoint_keys(source)
    tied = tag == "tied"
    assert ("lm_head.weight" not in _checkpoint_keys(checkpoint)) == tied
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tied
    text = "x = 3 + 4\nso x is 7."
    tokenizer, source_tokenizer = load_tokenizer(checkpoint), load_tokenizer(source)
    assert tokenizer(text)["input_ids"] == source_tokenizer(text)["input_ids"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def _probe_fields(fsdp_run: Path) -> dict:
    spec = json.loads((fsdp_run / "spec.json").read_text())
    return spec["samples"][spec["probe_sample"]]


@pytest.mark.distributed
@pytest.mark.parametrize("tag", ["untied", "tied"])
def test_shard_blobs_assemble_to_gathered_state(fsdp_run: Path, tag: str) -> None:
    gathered = torch.load(fsdp_run / tag / "gathered.pt")
    assembled = torch.load(fsdp_run / tag / "assembled.pt")
    assert assembled.keys() == gathered.keys()
    for name, tensor in gathered.items():
        assert assembled[name].dtype == tensor.dtype and torch.equal(assembled[name], tensor), name
    reloaded = load_causal_lm(fsdp_run / tag / "checkpoint").state_dict()
    for name, tensor in gathered.items():
        assert torch.equal(reloaded[name], tensor), name


@pytest.mark.distributed
@pytest.mark.parametrize("tag", ["untied", "tied"])
def test_bucketed_gathers_equal_torchs_own_gather_of_each_tensor(fsdp_run: Path, tag: str) -> None:
    """gather_full_state_dict packs FSDP's shards into one all-gather per bucket and unpads them
    itself; torch's DTensor.full_tensor() of each weight, one by one, is the reference. The tied
    model's odd MLP width leaves rank 1 a shorter shard of gate/up_proj (65 / 64 rows)."""
    reference = torch.load(fsdp_run / tag / "per_tensor.pt")
    default = torch.load(fsdp_run / tag / "gathered.pt")
    buckets = torch.load(fsdp_run / tag / "gathered_buckets.pt")
    for gathered, dtype in ((default, torch.float32), (buckets["float32"], torch.float32),
                            (buckets["bfloat16"], torch.bfloat16)):
        assert gathered.keys() == reference.keys()
        for name, tensor in reference.items():
            assert gathered[name].dtype == dtype and torch.equal(gathered[name], tensor.to(dtype)), name


# ------------------------------------------------------------------------------------------
# In-process pieces.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim0_size, num_shards", [(5, 4), (6, 4), (1, 2), (128, 2), (129, 2), (7, 3)])
def test_fsdp_shard_extent_matches_torch_chunk(dim0_size: int, num_shards: int) -> None:
    chunks = torch.chunk(torch.arange(dim0_size), num_shards)
    for index in range(num_shards):
        expected = (int(chunks[index][0]), len(chunks[index])) if index < len(chunks) else (dim0_size, 0)
        assert fsdp_shard_extent(dim0_size, num_shards, index) == expected


def _scheduled_lrs(config: OptimConfig, num_steps: int) -> list[float]:
    """LR used at each optimizer step 0..num_steps-1 by a real AdamW + build_scheduler."""
    optimizer = build_optimizer(torch.nn.Linear(2, 2), config)
    scheduler = build_scheduler(optimizer, config)
    lrs = []
    for _ in range(num_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_scheduler_warmup_then_constant() -> None:
    lrs = _scheduled_lrs(OptimConfig(lr=1e-3, warmup_steps=4, schedule="constant"), 8)
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3], rel=1e-12)


def test_scheduler_warmup_then_cosine() -> None:
    config = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=10, min_lr_ratio=0.1)
    lrs = _scheduled_lrs(config, 13)
    # Cosine over steps 2..10: progress (s - 2) / 8, value 0.1 + 0.9 * (1 + cos(pi * progress)) / 2.
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0], rel=1e-12)
    assert lrs[4] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, rel=1e-12)
    assert lrs[6] == pytest.approx(0.55, rel=1e-12)  # halfway: midpoint of 1.0 and the 0.1 floor
    assert lrs[10:] == pytest.approx([0.1, 0.1, 0.1], rel=1e-12)  # the floor, held after total_steps
    assert lr_factor(6, config) == pytest.approx(0.55)
    assert lr_factor(0, OptimConfig(warmup_steps=0)) == 1.0


def test_optimizer_decays_matrices_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5, betas=(0.8, 0.9), eps=1e-6))
    decay, no_decay = optimizer.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 3])] and decay["weight_decay"] == 0.5
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
    assert (decay["betas"], decay["eps"]) == ((0.8, 0.9), 1e-6)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: OptimConfig(lr=0.0), "lr"),
        (lambda: OptimConfig(betas=(0.9, 1.0)), "betas"),
        (lambda: OptimConfig(schedule="linear"), "schedule"),
        (lambda: OptimConfig(schedule="cosine", warmup_steps=10, total_steps=10), "total_steps"),
        (lambda: OptimConfig(min_lr_ratio=1.5), "min_lr_ratio"),
        (lambda: OptimConfig(max_grad_norm=0.0), "max_grad_norm"),
        (lambda: OptimConfig(warmup_steps=-1), "warmup_steps"),
        (lambda: ModelConfig(model_path=""), "model_path"),
        (lambda: ModelConfig(model_path="m", logprob_chunk_size=0), "logprob_chunk_size"),
        (lambda: ModelConfig(model_path="m", attn_implementation=""), "attn_implementation"),
        (lambda: ModelConfig(model_path="m", fsdp_per_layer_min_params=-1), "fsdp_per_layer_min_params"),
    ],
)
def test_config_errors_name_the_field(make, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()


def _perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every entry moved by a distinct small amount, so a misrouted tensor cannot pass unnoticed."""
    return {name: t + 0.01 * torch.linspace(0, 1, t.numel()).reshape(t.shape) for name, t in state.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_load_state_dict_into(tied: bool, tiny_model_dir: Path, tiny_tied_model_dir: Path) -> None:
    model_dir = tiny_tied_model_dir if tied else tiny_model_dir
    target = load_causal_lm(model_dir)
    new_state = _perturbed(gather_full_state_dict(load_causal_lm(model_dir)))
    assert ("lm_head.weight" in new_state) != tied
    load_state_dict_into(target, new_state)
    for name, tensor in target.state_dict().items():
        source_name = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
        assert torch.equal(tensor, new_state[source_name]), name
    assert (target.lm_head.weight is target.model.embed_tokens.weight) == tied
    # Blobs of a plain model are whole tensors at offset 0 and assemble back to its state.
    assembled = assemble_state_dict([local_shard_blobs(target)])
    assert all(torch.equal(assembled[n], t) for n, t in new_state.items()) and assembled.keys() == new_state.keys()


def test_load_state_dict_into_errors(tiny_model_dir: Path, tiny_tied_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir)
    state = gather_full_state_dict(model)
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(KeyError, match=r"missing keys \['model.norm.weight'\]"):
        load_state_dict_into(model, missing)
    with pytest.raises(KeyError, match=r"unexpected keys \['extra.weight'\]"):
        load_state_dict_into(model, {**state, "extra.weight": torch.zeros(1)})
    wrong_shape = {**state, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_state_dict_into(model, wrong_shape)
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])  # nothing copied on error
    tied = load_causal_lm(tiny_tied_model_dir)
    with pytest.raises(KeyError, match=r"unexpected keys \['lm_head.weight'\]"):
        load_state_dict_into(tied, {**gather_full_state_dict(tied), "lm_head.weight": tied.lm_head.weight})
