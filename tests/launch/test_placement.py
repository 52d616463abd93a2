"""The local launcher's placement plan (async_grpo/launch/placement.py) for 0, 1, 2, 4 and 8 GPUs
and for runs that do not fit, checked against hand-computed numbers (issue 36, item 2; the
trainer's activations issue 56, item 3, measured in test_placement_memory.py)."""

from __future__ import annotations

import pytest

from async_grpo.launch.placement import (
    GiB, ModelShape, PlacementError, RunShape, engine_min_bytes, logprob_worker_bytes, plan_placement, trainer_bytes,
)

# Qwen2.5-0.5B's shape (494,032,768 parameters, tied embeddings), and an H200's 141 GB.
QWEN_0_5B = ModelShape.from_hf_config({
    "hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "intermediate_size": 4864,
    "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True})
H200 = 143_771_090_944
DEFAULT_RUN = RunShape(trainer_ranks=1, max_tokens_per_gpu=8192, generation_workers=1, logprob_workers=1,
                       max_tokens_per_forward=16384)


def test_the_parameter_count_is_qwens() -> None:
    assert QWEN_0_5B.num_params == 494_032_768


def test_the_shape_is_read_from_the_config() -> None:
    assert (QWEN_0_5B.intermediate_size, QWEN_0_5B.num_heads, QWEN_0_5B.num_kv_heads, QWEN_0_5B.head_dim) == (
        4864, 14, 2, 64)
    by_hand = ModelShape(num_params=1000, hidden_size=256, num_layers=2, vocab_size=10)
    assert (by_hand.intermediate_size, by_hand.num_heads, by_hand.num_kv_heads, by_hand.head_dim) == (1024, 4, 4, 64)


def test_trainer_estimate_by_hand() -> None:
    """The 0.5B shape at 8,192 tokens in bf16, tensor by tensor of what a decoder layer keeps."""
    p, h, layers, vocab, inter, heads, head_dim, tokens = 494_032_768, 896, 24, 151936, 4864, 14, 64, 8192
    state = 16 * p
    embedding = vocab * h
    gathered = 2 * (2 * embedding + 2 * ((p - 2 * embedding) // layers))
    norm = 4 * h + 4 + 2 * h + 2 * h  # fp32 upcast and inverse RMS; normalised input, output in bf16
    attention = 3 * 2 * heads * head_dim + 2 * 2 * 2 * head_dim + 4 * heads  # q, out, o_proj input; k, v; lse
    mlp = 4 * 2 * inter  # gate, up, SiLU, product
    kept = tokens * layers * (2 * norm + attention + mlp)
    at_start = tokens * (norm + 2 * 2 * head_dim) + 1024 * vocab * 4 * 3  # final norm, cos/sin; logit chunks
    in_a_layer = tokens * 2 * (2 * h + 2 * inter)
    activations = kept + max(at_start, in_a_layer)
    assert trainer_bytes(QWEN_0_5B, DEFAULT_RUN) == state + gathered + activations + GiB


def test_the_half_billion_shape_at_16k_tokens_needs_over_30_gib() -> None:
    """What a Qwen2 layer keeps (~66 x hidden bytes per token in bf16, not the 34 x hidden of a
    plain MLP) is most of the trainer's peak at a long token budget."""
    run = RunShape(trainer_ranks=1, max_tokens_per_gpu=16384)
    assert trainer_bytes(QWEN_0_5B, run) >= 30 * GiB
    assert trainer_bytes(QWEN_0_5B, RunShape(trainer_ranks=1, max_tokens_per_gpu=16384, gradient_checkpointing=True)
                         ) < 15 * GiB


@pytest.mark.parametrize("gpus, gib, refusal", [
    (1, 32, "the plan does not fit GPU 0 (shared with the trainer): 32.0 GiB, 30.4 GiB usable; trainer rank 32.4 GiB"),
    (2, 24, "a trainer rank needs about 32.4 GiB (estimate) and a GPU has 24.0 GiB"),
])
def test_a_trainer_that_would_not_fit_is_refused_before_start(gpus: int, gib: int, refusal: str) -> None:
    with pytest.raises(PlacementError) as failure:
        plan_placement(gpus, gib * GiB, QWEN_0_5B, RunShape(trainer_ranks=1, max_tokens_per_gpu=16384))
    assert str(failure.value).startswith(refusal)


def test_no_gpu_is_the_cpu_plan() -> None:
    plan = plan_placement(0, 0, QWEN_0_5B, DEFAULT_RUN)
    assert not plan.on_gpu and plan.worker_gpus == () and plan.engine_memory_fraction is None
    assert plan.lines(DEFAULT_RUN) == ["placement: CPU only (no GPU found): every process on the CPU"]


def test_one_gpu_shares_gpu_0_and_sizes_vllm_from_what_the_rest_needs() -> None:
    plan = plan_placement(1, H200, QWEN_0_5B, DEFAULT_RUN)
    assert plan.worker_gpus == (0,) and plan.trainer_gpus == (0,) and plan.colocated
    assert plan.worker_gpu_share == 0.5  # two workers on one GPU in Ray
    usable = int(H200 * 0.95)
    left = usable - trainer_bytes(QWEN_0_5B, DEFAULT_RUN) - logprob_worker_bytes(QWEN_0_5B, DEFAULT_RUN)
    assert plan.engine_memory_fraction == round(left / H200, 3)
    assert 0.5 < plan.engine_memory_fraction < 0.92  # below vLLM's default share, and a real one
    text = "\n".join(plan.lines(DEFAULT_RUN))
    assert "colocated" in text and f"gpu_memory_utilization {plan.engine_memory_fraction:.3f}" in text


def test_one_gpu_refuses_two_trainer_ranks() -> None:
    with pytest.raises(PlacementError, match="the trainer runs one rank .* got --nproc_per_node 2"):
        plan_placement(1, H200, QWEN_0_5B, RunShape(**{**DEFAULT_RUN.__dict__, "trainer_ranks": 2}))


def test_two_gpus_put_inference_on_0_and_the_trainer_on_1() -> None:
    plan = plan_placement(2, H200, QWEN_0_5B, DEFAULT_RUN)
    assert plan.worker_gpus == (0,) and plan.trainer_gpus == (1,) and not plan.colocated
    assert plan.worker_gpu_share == 0.5
    left = int(H200 * 0.95) - logprob_worker_bytes(QWEN_0_5B, DEFAULT_RUN)
    assert plan.engine_memory_fraction == round(left / H200, 3)


@pytest.mark.parametrize("gpus, ranks, workers, trainer", [(4, 2, (0, 1), (2, 3)), (8, 4, (0, 1), (4, 5, 6, 7))])
def test_four_and_eight_gpus_give_whole_gpus(gpus: int, ranks: int, workers: tuple[int, ...],
                                             trainer: tuple[int, ...]) -> None:
    run = RunShape(**{**DEFAULT_RUN.__dict__, "trainer_ranks": ranks})
    plan = plan_placement(gpus, H200, QWEN_0_5B, run)
    assert plan.worker_gpus == workers and plan.trainer_gpus == trainer
    assert plan.worker_gpu_share == 1.0 and plan.engine_memory_fraction is None


def test_eight_gpus_with_seven_ranks_share_the_last_inference_gpu() -> None:
    run = RunShape(**{**DEFAULT_RUN.__dict__, "trainer_ranks": 7})
    plan = plan_placement(8, H200, QWEN_0_5B, run)
    assert plan.worker_gpus == (0,) and plan.trainer_gpus == tuple(range(1, 8)) and plan.worker_gpu_share == 0.5


def test_a_plan_that_does_not_fit_says_so_with_its_numbers() -> None:
    small = 16 * GiB
    with pytest.raises(PlacementError) as failure:
        plan_placement(1, small, QWEN_0_5B, DEFAULT_RUN)
    message = str(failure.value)
    assert "\n" not in message and "does not fit GPU 0 (shared with the trainer): 16.0 GiB" in message
    assert f"{engine_min_bytes(QWEN_0_5B) / GiB:.1f} GiB" in message and "trainer rank" in message


def test_too_many_ranks_for_the_gpus_is_refused() -> None:
    with pytest.raises(PlacementError, match="cannot hold 4 trainer ranks"):
        plan_placement(4, H200, QWEN_0_5B, RunShape(**{**DEFAULT_RUN.__dict__, "trainer_ranks": 4}))


def test_the_bundled_tiny_model_fits_one_small_gpu() -> None:
    tiny = ModelShape(num_params=321_152, hidden_size=128, num_layers=2, vocab_size=101, intermediate_size=256,
                      num_heads=4, num_kv_heads=2)
    run = RunShape(trainer_ranks=1, max_tokens_per_gpu=4096, generation_workers=1, logprob_workers=1,
                   max_tokens_per_forward=8192)
    plan = plan_placement(1, 8 * GiB, tiny, run)
    need = trainer_bytes(tiny, run) + logprob_worker_bytes(tiny, run)  # 1.05 + 1.08 GiB, mostly the overheads
    assert plan.colocated and plan.engine_memory_fraction == round((int(0.95 * 8 * GiB) - need) / (8 * GiB), 3) == 0.684


def test_cuda_engines_get_bf16_the_plans_share_and_the_runs_longest_sample() -> None:
    from async_grpo.config.worker_options import EngineConfig
    from async_grpo.launch.engine_defaults import resolve_engine

    plan = plan_placement(1, H200, QWEN_0_5B, DEFAULT_RUN)
    engine, lines = resolve_engine(EngineConfig(max_num_seqs=256), plan, cuda=True, longest_sample=1536)
    assert (engine.dtype, engine.gpu_memory_utilization, engine.max_model_len) == (
        "bfloat16", plan.engine_memory_fraction, 1536)
    assert engine.kv_cache_memory_bytes is None  # vLLM sizes the KV cache within the share
    assert lines == [f"engine settings for CUDA (flags of the same name change them): dtype bfloat16 (the trainer's "
                     f"compute dtype), gpu_memory_utilization {plan.engine_memory_fraction} (the plan's share of the "
                     f"GPU), max_model_len 1536 (the run's longest sample)"]
    # What the user set stays.
    mine = EngineConfig(dtype="float16", gpu_memory_utilization=0.3, max_model_len=4096)
    assert resolve_engine(mine, plan, cuda=True, longest_sample=1536) == (mine, [])


def test_cpu_engines_keep_the_cpu_settings() -> None:
    from async_grpo.config.worker_options import EngineConfig
    from async_grpo.launch.engine_defaults import resolve_engine

    engine, lines = resolve_engine(EngineConfig(max_num_seqs=256), plan_placement(0, 0, QWEN_0_5B, DEFAULT_RUN),
                                   cuda=False, longest_sample=20)
    assert (engine.dtype, engine.kv_cache_memory_bytes, engine.max_model_len) == ("float32", 256 * 2**20, 512)
    assert len(lines) == 1 and lines[0].startswith("engine settings for CPU") and "max_model_len 512" in lines[0]


def test_a_judge_engine_keeps_the_device_choices_but_not_the_runs_sizes() -> None:
    """A judge's prompt (rubric, question, answer) outgrows the policy's longest sample: on CUDA its
    engine gets the dtype, and the plan's share only where it shares a GPU; on CPU the CPU sizes."""
    import dataclasses

    from async_grpo.config.worker_options import EngineConfig
    from async_grpo.launch.engine_defaults import judge_engine, resolve_engine

    given = EngineConfig(max_num_seqs=256)
    shared = plan_placement(1, H200, QWEN_0_5B, DEFAULT_RUN)
    resolved, _ = resolve_engine(given, shared, cuda=True, longest_sample=1536)
    judge = judge_engine(given, resolved, shared, cuda=True)
    assert (judge.dtype, judge.max_model_len, judge.kv_cache_memory_bytes, judge.max_num_seqs) == ("bfloat16", None, None, 256)
    assert shared.worker_gpu_share < 1 and judge.gpu_memory_utilization == shared.engine_memory_fraction
    whole = dataclasses.replace(shared, worker_gpu_share=1.0)
    assert judge_engine(given, resolved, whole, cuda=True).gpu_memory_utilization is None  # vLLM's own default
    on_cpu, _ = resolve_engine(given, plan_placement(0, 0, QWEN_0_5B, DEFAULT_RUN), cuda=False, longest_sample=20)
    assert judge_engine(given, on_cpu, plan_placement(0, 0, QWEN_0_5B, DEFAULT_RUN), cuda=False) == on_cpu


def test_the_plan_names_the_judges_apart() -> None:
    import dataclasses

    run = dataclasses.replace(DEFAULT_RUN, logprob_workers=2, judge_workers=1)
    (line,) = [line for line in plan_placement(4, H200, QWEN_0_5B, run).lines(run) if "workers  GPU" in line]
    assert "1 generation, 1 logprob-type, 1 judge;" in line


def test_the_transfer_must_suit_the_plan() -> None:
    from async_grpo.launch.placement import check_transfer_placement

    one_gpu, two_gpus = plan_placement(1, H200, QWEN_0_5B, DEFAULT_RUN), plan_placement(2, H200, QWEN_0_5B, DEFAULT_RUN)
    for transfer in ("nccl", "nccl_m2n"):
        with pytest.raises(ValueError, match="one GPU, where NCCL refuses two ranks"):
            check_transfer_placement(transfer, one_gpu)
        check_transfer_placement(transfer, two_gpus)
    with pytest.raises(ValueError, match="'ipc' shares CUDA memory between processes on one GPU.*GPU\\(s\\) 1"):
        check_transfer_placement("ipc", two_gpus)
    check_transfer_placement("ipc", one_gpu)
    check_transfer_placement("object_store", one_gpu)
    check_transfer_placement("nccl", plan_placement(0, 0, QWEN_0_5B, DEFAULT_RUN))  # CPU: the trainer refuses it


def _dry_run(capsys: pytest.CaptureFixture, model_dir: object, tmp_path: object, *flags: str) -> tuple[int, str, str]:
    import local_cluster

    try:
        code = local_cluster.main(["--model_path", str(model_dir), "--run_dir", str(tmp_path / "run"), "--dry_run",
                                   "true", *flags, "--", "--data.path", str(tmp_path / "prompts.jsonl")])
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("gpus, colocated", [(1, True), (2, False), (8, False)])
def test_dry_run_prints_the_plan_and_starts_nothing(capsys: pytest.CaptureFixture, tiny_model_dir: object,
                                                    tmp_path: object, gpus: int, colocated: bool) -> None:
    code, out, _ = _dry_run(capsys, tiny_model_dir, tmp_path, "--host_gpus", str(gpus), "--gpu_memory_gib", "80")
    assert code == 0
    assert out.startswith(f"placement: {gpus} GPU(s) of 80.0 GiB")
    assert ("colocated" in out) is colocated
    assert "engine settings for CUDA (flags of the same name change them): dtype bfloat16" in out
    assert not (tmp_path / "run").exists(), "a dry run creates nothing"


def test_a_plan_that_does_not_fit_is_one_line_and_exit_2(capsys: pytest.CaptureFixture, tiny_model_dir: object,
                                                         tmp_path: object) -> None:
    code, out, err = _dry_run(capsys, tiny_model_dir, tmp_path, "--host_gpus", "1", "--gpu_memory_gib", "1",
                              "--nproc_per_node", "1")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("local_cluster.py: the plan does not fit GPU 0 (shared with the trainer): 1.0 GiB")
