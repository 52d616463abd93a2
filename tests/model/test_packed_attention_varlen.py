"""A packed forward's sample boundaries, computed once and passed down (packed_attention.varlen_kwargs).

- varlen_kwargs gives the cumulative lengths and longest sample of a hand-built packed stream,
  and the same values transformers' flash-attention path would rebuild from the position ids
  (prepare_fa_kwargs_from_position_ids) in every layer.
- TokenLogprobModel computes them once per forward and every decoder layer's attention receives
  that one tensor (a spy attention over PACKED_SDPA).
- The model's output with them passed equals its output without (samples read from position
  ids), and wrong boundaries change it: the kwargs are really read, so the equality is not vacuous.
The flash-attention varlen kernel itself needs CUDA: tests/model/test_gpu_model.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import setup_model
from async_grpo.model.packed_attention import PACKED_SDPA, VARLEN_KWARGS, packed_sdpa_attention, varlen_kwargs
from setup_model import TokenLogprobModel, load_causal_lm

# Three samples of lengths 3, 2 and 4, positions restarting at 0.
LENGTHS = (3, 2, 4)
SPY_ATTENTION = "spy_packed_sdpa"


def _positions(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def test_varlen_kwargs_equal_a_hand_built_reference_and_transformers() -> None:
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    got = varlen_kwargs(_positions(LENGTHS).unsqueeze(0))
    assert set(got) == set(VARLEN_KWARGS)
    assert got["cu_seq_lens_q"].dtype == torch.int32
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and got["cu_seq_lens_k"] is got["cu_seq_lens_q"]
    assert got["max_length_q"] == got["max_length_k"] == 4 and isinstance(got["max_length_q"], int)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(_positions(LENGTHS).unsqueeze(0))
    assert torch.equal(got["cu_seq_lens_q"], cu_q) and torch.equal(got["cu_seq_lens_k"], cu_k)
    assert (got["max_length_q"], got["max_length_k"]) == (int(max_q), int(max_k))
    # One sample: one segment.
    assert varlen_kwargs(torch.arange(5)).get("cu_seq_lens_q").tolist() == [0, 5]


@pytest.fixture(scope="module")
def packed_model(tiny_model_dir: Path) -> TokenLogprobModel:
    torch.manual_seed(0)
    return TokenLogprobModel(load_causal_lm(tiny_model_dir, attn_implementation=PACKED_SDPA)).eval()


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    total = sum(LENGTHS)
    input_ids = torch.randint(3, vocab, (total,), generator=generator)
    output_indices = torch.arange(total - 1)
    return input_ids, _positions(LENGTHS), torch.roll(input_ids, -1)[output_indices], output_indices


def test_token_logprob_model_computes_the_boundaries_once_for_every_layer(
    packed_model: TokenLogprobModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AttentionInterface

    seen: list[dict] = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append({name: kwargs.get(name) for name in VARLEN_KWARGS})
        return packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs)

    computed = []

    def counted(position_ids: torch.Tensor) -> dict:
        computed.append(position_ids)
        return varlen_kwargs(position_ids)

    AttentionInterface.register(SPY_ATTENTION, spy)
    monkeypatch.setattr(setup_model, "varlen_kwargs", counted)
    monkeypatch.setattr(setup_model, "VARLEN_ATTENTIONS", (*setup_model.VARLEN_ATTENTIONS, SPY_ATTENTION))
    monkeypatch.setattr(packed_model.causal_lm.config, "_attn_implementation", SPY_ATTENTION)
    with torch.no_grad():
        packed_model(*_inputs(packed_model.causal_lm.config.vocab_size))
    num_layers = packed_model.causal_lm.config.num_hidden_layers
    assert len(computed) == 1, "the boundaries are computed once per forward"
    assert len(seen) == num_layers
    assert all(layer["cu_seq_lens_q"] is seen[0]["cu_seq_lens_q"] for layer in seen), "one tensor for every layer"
    assert seen[0]["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and seen[0]["max_length_q"] == 4


def test_output_with_the_boundaries_passed_equals_without(packed_model: TokenLogprobModel) -> None:
    input_ids, positions, _, _ = _inputs(packed_model.causal_lm.config.vocab_size)
    decoder = packed_model.causal_lm.get_decoder()

    def hidden(**packed) -> torch.Tensor:
        with torch.no_grad():
            return decoder(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                           use_cache=False, **packed).last_hidden_state

    without = hidden()
    with_kwargs = hidden(**varlen_kwargs(positions.unsqueeze(0)))
    torch.testing.assert_close(with_kwargs, without, rtol=0, atol=0)
    # Boundaries that merge the first two samples: the second then attends to the first.
    merged = {**varlen_kwargs(positions.unsqueeze(0)), "cu_seq_lens_q": torch.tensor([0, 5, 9], dtype=torch.int32)}
    assert not torch.allclose(hidden(**merged)[0, 3:5], without[0, 3:5], atol=1e-4)
    # The first sample is still alone (causal), up to the rounding of a different sdpa batch.
    torch.testing.assert_close(hidden(**merged)[0, :3], without[0, :3], rtol=0, atol=1e-5)


def test_forward_under_inference_mode(packed_model: TokenLogprobModel) -> None:
    """The logprob worker scores under torch.inference_mode, where the boundaries it computes are
    inference tensors (no version counter): the forward must accept them, with the same result."""
    inputs = _inputs(packed_model.causal_lm.config.vocab_size)
    with torch.no_grad():
        expected, _ = packed_model(*inputs)
    with torch.inference_mode():
        got, _ = packed_model(*inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_packed_varlen_defers_to_packed_sdpa_off_cuda(tiny_model_dir: Path, packed_model: TokenLogprobModel) -> None:
    """PACKED_VARLEN's kernel is CUDA-only (tests/model/test_gpu_model.py runs it); on the CPU a
    model loaded with it scores exactly as PACKED_SDPA, instead of failing in the first layer."""
    from async_grpo.model.packed_attention import PACKED_VARLEN

    varlen_model = TokenLogprobModel(load_causal_lm(tiny_model_dir, attn_implementation=PACKED_VARLEN)).eval()
    assert varlen_model.attn_implementation() == PACKED_VARLEN
    inputs = _inputs(packed_model.causal_lm.config.vocab_size)
    with torch.no_grad():
        expected, _ = packed_model(*inputs)
        got, _ = varlen_model(*inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
