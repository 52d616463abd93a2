"""The trainer's model on a GPU (gpu tier): bf16 FSDP2 and the varlen packed forward.

    scripts/test.sh --gpu            # the whole gpu tier (deselected, with a count, without CUDA)

- One bf16 FSDP2 step (fsdp_setup.build_training_model on a one-rank NCCL group: bf16 compute, fp32
  master weights and gradient reduction, the packed stream, chunked lm_head) against
  tests/trainer/test_step_parity.py's fp32 padded reference (plain HF model on the CPU, eager
  attention, one right-padded batch, the loss from its definition): the logprobs and every gradient
  agree within bf16's tolerance, and the decoder really computed in bf16.
- The varlen packed forward (PACKED_VARLEN: torch's flash-attention varlen kernel, and
  flash_attention_2 where flash-attn is installed) with the samples' boundaries computed once
  by TokenLogprobModel, against each sample run alone through plain sdpa; boundaries that merge
  two samples change the result, so the kwargs are what isolates the samples.
- Shared prompts (model.share_prompts) in bf16 against the same samples packed whole.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 2e-3 per value); through two decoder
# layers, the lm_head and the softmax, errors of a few 1e-3 per op add up to about 1% of a
# gradient's norm. 5% bounds that with room, and is still far below what a wrong scale, a lost
# sample or a cross-sample attention leak would give (tens of percent).
BF16_GRAD_REL = 0.05
# Logprobs of the tiny model's ~100-token vocabulary: bf16 logits round by ~1e-2 at their size.
BF16_LOGPROB_ATOL = 0.05
FIRST_TOKEN_ID = 2  # ids 0 and 1 are EOS and PAD in the tiny tokenizer


def _varlen_implementations() -> list:
    flash = pytest.param("flash_attention_2", marks=pytest.mark.skipif(
        importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed"))
    return ["packed_varlen", flash]


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-process NCCL group (init_distributed without torchrun), destroyed afterwards."""
    import torch.distributed as dist

    from async_grpo.trainer.fsdp_setup import init_distributed

    info = init_distributed(timeout_s=120.0)
    yield info
    dist.destroy_process_group()


def test_bf16_fsdp2_step_matches_the_fp32_padded_reference(one_rank_group, tiny_model_dir: Path) -> None:
    from async_grpo.trainer.fsdp_setup import build_training_model
    from grpo_loss import LossConfig, grpo_loss
    from sample_processing_utils import post_process_batch
    from setup_model import ModelConfig, training_compute_dtype
    from support.step_parity import (
        CLIP_HIGH, CLIP_LOW, KL_COEF, LOGPROB_CHUNK_SIZE, NO_CLIP, Case, build_samples, load_reference_model,
        optim_config, padded_batch, reference_step, token_logprobs,
    )

    info = one_rank_group
    assert (info.backend, info.device.type) == ("nccl", "cuda")
    assert training_compute_dtype(info.device, True) == torch.bfloat16
    case = Case(epochs_per_step=1, optim=optim_config(NO_CLIP),
                loss=LossConfig(kl_coef=KL_COEF, kl_estimator="k3", clip_low=CLIP_LOW, clip_high=CLIP_HIGH))
    samples = build_samples(tiny_model_dir, seed=0)
    expected = reference_step(tiny_model_dir, samples, case)

    model = build_training_model(ModelConfig(model_path=str(tiny_model_dir), logprob_chunk_size=LOGPROB_CHUNK_SIZE),
                                 info)
    seen_dtypes = []

    def record_input_dtype(module, args, kwargs) -> None:
        seen_dtypes.append((args[0] if args else kwargs["hidden_states"]).dtype)

    handle = model.causal_lm.get_decoder().layers[0].register_forward_pre_hook(record_input_dtype, with_kwargs=True)
    batch = post_process_batch(samples)
    logprobs, _ = model.score(batch.inputs)
    handle.remove()
    assert seen_dtypes == [torch.bfloat16], "the decoder must compute in bf16 under mixed precision"
    loss, _ = grpo_loss(logprobs, batch, case.loss)
    (loss / len(samples)).backward()

    # The reference's logprobs and loss, at the same (initial) weights.
    reference_model = load_reference_model(tiny_model_dir)
    padded = padded_batch(samples, pad_id=reference_model.config.pad_token_id)
    with torch.no_grad():
        reference_logprobs = token_logprobs(reference_model, padded)[padded.output_mask.bool()]
    torch.testing.assert_close(logprobs.detach().float().cpu(), reference_logprobs, rtol=0, atol=BF16_LOGPROB_ATOL)
    worst = 0.0
    for name, param in model.causal_lm.named_parameters():
        got = param.grad.full_tensor().float().cpu()
        want = expected.grads[0][name]
        relative = float((got - want).norm() / want.norm())
        worst = max(worst, relative)
        assert relative <= BF16_GRAD_REL, f"{name}: bf16 gradient off the fp32 reference by {relative:.3f} of its norm"
    # The loss is not compared on its own: at the first pass ratio = 1 and the groups' advantages
    # cancel, so it is the small KL term, whose bf16 error the logprob and gradient checks bound.
    print(f"bf16 FSDP2 step: largest gradient error {worst:.4f} of the tensor's norm; loss {float(loss):.5f}")


def _per_sample_logprobs(model_dir: Path, lengths: list[int], input_ids: torch.Tensor) -> torch.Tensor:
    """Each sample alone through plain sdpa (bf16, CUDA): logprob of each next token."""
    from setup_model import load_causal_lm

    model = load_causal_lm(model_dir, device=torch.device("cuda"), dtype=torch.bfloat16, attn_implementation="sdpa")
    out, start = [], 0
    with torch.no_grad():
        for n in lengths:
            ids = input_ids[start:start + n].cuda().unsqueeze(0)
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1))
            start += n
    return torch.cat(out).cpu()


@pytest.mark.parametrize("attn", _varlen_implementations())
def test_varlen_packed_forward_matches_per_sample_sdpa(tiny_model_dir: Path, attn: str) -> None:
    from async_grpo.model.packed_attention import varlen_kwargs
    from setup_model import TokenLogprobModel, load_causal_lm

    lengths = [37, 5, 64, 1, 20]
    model = TokenLogprobModel(load_causal_lm(tiny_model_dir, device=torch.device("cuda"), dtype=torch.bfloat16,
                                             attn_implementation=attn)).eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(FIRST_TOKEN_ID, model.causal_lm.config.vocab_size, (sum(lengths),), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.roll(input_ids, -1)
    # Every position but each sample's last predicts its sample's next token.
    ends = torch.cumsum(torch.tensor(lengths), 0) - 1
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[ends] = False
    output_indices = keep.nonzero().flatten()
    with torch.no_grad():
        packed, _ = model(input_ids.cuda(), positions.cuda(), labels[output_indices].cuda(), output_indices.cuda())
    expected = _per_sample_logprobs(tiny_model_dir, lengths, input_ids)
    torch.testing.assert_close(packed.float().cpu(), expected, rtol=0, atol=BF16_LOGPROB_ATOL)

    # Boundaries that merge the first two samples: the second then attends to the first.
    decoder = model.causal_lm.get_decoder()
    packed_kwargs = varlen_kwargs(positions.cuda().unsqueeze(0))
    merged = torch.tensor([0, lengths[0] + lengths[1], *packed_kwargs["cu_seq_lens_q"].tolist()[2:]],
                          dtype=torch.int32, device="cuda")
    with torch.no_grad():
        right = decoder(input_ids=input_ids.cuda().unsqueeze(0), position_ids=positions.cuda().unsqueeze(0),
                        use_cache=False, **packed_kwargs).last_hidden_state
        wrong = decoder(input_ids=input_ids.cuda().unsqueeze(0), position_ids=positions.cuda().unsqueeze(0),
                        use_cache=False, **{**packed_kwargs, "cu_seq_lens_q": merged, "cu_seq_lens_k": merged,
                                            "max_length_q": lengths[0] + lengths[1],
                                            "max_length_k": lengths[0] + lengths[1]}).last_hidden_state
    second = slice(lengths[0], lengths[0] + lengths[1])
    assert (right[0, second] - wrong[0, second]).abs().max() > 10 * BF16_LOGPROB_ATOL


def test_bf16_shared_prompts_match_whole_samples(tiny_model_dir: Path) -> None:
    """model.share_prompts on the GPU: step_parity's groups (several answers per prompt) scored
    with each prompt laid out once equal the same samples packed whole through the varlen kernel,
    within bf16's tolerance; the layout's answers run through sdpa with a mask on CUDA."""
    from sample_processing_utils import get_input_for_logprobs
    from setup_model import TokenLogprobModel, load_causal_lm
    from support.step_parity import build_samples

    model = TokenLogprobModel(load_causal_lm(tiny_model_dir, device=torch.device("cuda"), dtype=torch.bfloat16,
                                             attn_implementation="packed_varlen")).eval()
    samples = build_samples(tiny_model_dir, seed=0)
    whole, shared = get_input_for_logprobs(samples), get_input_for_logprobs(samples, share_prompts=True)
    assert shared.input_ids.numel() < whole.input_ids.numel()
    with torch.no_grad():
        whole_logprobs, _ = model.score(whole)
        shared_logprobs, _ = model.score(shared)
    torch.testing.assert_close(shared_logprobs.float().cpu(), whole_logprobs.float().cpu(), rtol=0,
                               atol=BF16_LOGPROB_ATOL)
