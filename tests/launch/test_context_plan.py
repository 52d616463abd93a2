"""Context parallelism in the launcher's plan (async_grpo/launch/context_plan.py and placement.py's
tokens per rank): the degrees a model's heads allow, a rank's memory under cp, the printed mesh,
and the smallest degree that fits a run's longest sample, against hand-computed numbers; and the
plans docs/training.md shows, as its commands print them (issue 59, items 4 and 6)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from async_grpo.launch.context_plan import check_context_plan, context_degrees, context_parallel_refusal
from async_grpo.launch.placement import (
    GiB, ModelShape, PlacementError, RunShape, plan_placement, trainer_activation_bytes, trainer_bytes,
)
from async_grpo.model.context_parallel import kv_repeat
from support.paths import REPO_ROOT

# Qwen2.5's 0.5B, 1.5B and 7B shapes (heads 14/2, 12/2 and 28/4 query/key-value heads).
QWEN_0_5B = {"hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "intermediate_size": 4864,
             "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True}
QWEN_1_5B = {"hidden_size": 1536, "num_hidden_layers": 28, "vocab_size": 151936, "intermediate_size": 8960,
             "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True}
QWEN_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "vocab_size": 152064, "intermediate_size": 18944,
           "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False}
HEAD_DIM = 128  # 7B; the smaller two have 64-wide heads
LONG = 32768


def _shape(config: dict[str, int | bool]) -> ModelShape:
    return ModelShape.from_hf_config(config)


def _rank_bytes_by_hand(config: dict[str, int | bool], tokens: int, ranks: int, kv_repeat_times: int = 1) -> int:
    """One bf16 rank without checkpointing, term by term (tests/launch/test_placement.py's
    test_trainer_estimate_by_hand), the key/value heads widened as Ulysses repeats them."""
    h, layers, vocab, inter = (int(config[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                        "intermediate_size"))
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = h // heads
    p = _shape(config).num_params
    embedding = vocab * h
    gathered = 2 * (2 * embedding + 2 * ((p - 2 * embedding) // layers))
    norm = 4 * h + 4 + 2 * h + 2 * h
    attention = 3 * 2 * heads * head_dim + 2 * 2 * kv * kv_repeat_times * head_dim + 4 * heads
    kept = tokens * layers * (2 * norm + attention + 4 * 2 * inter)
    at_start = tokens * (norm + 2 * 2 * head_dim) + min(1024, tokens) * vocab * 4 * 3
    in_a_layer = tokens * 2 * (2 * h + 2 * inter)  # the MLP's backward: above the exchange for these shapes
    return 16 * p // ranks + gathered + kept + max(at_start, in_a_layer) + GiB


def test_the_heads_allow_the_degrees_that_ulysses_takes() -> None:
    assert context_degrees(_shape(QWEN_0_5B), 14) == [1, 2, 7, 14]
    assert context_degrees(_shape(QWEN_1_5B), 12) == [1, 2, 3, 4, 6, 12]
    assert context_degrees(_shape(QWEN_7B), 8) == [1, 2, 4, 7]
    for heads, kv_heads in [(14, 2), (12, 2), (28, 4), (8, 8), (6, 3), (32, 8)]:  # the model side's rule
        shape = ModelShape(num_params=1000, hidden_size=64 * heads, num_layers=1, vocab_size=10,
                           num_heads=heads, num_kv_heads=kv_heads)
        for cp in range(1, heads + 1):
            try:
                kv_repeat(heads, kv_heads, cp)
                allowed = True
            except ValueError:
                allowed = False
            assert (context_parallel_refusal(shape, cp) is None) == allowed, (heads, kv_heads, cp)


def test_a_rank_holds_its_share_of_the_group_minibatch() -> None:
    run = RunShape(trainer_ranks=4, max_tokens_per_gpu=16384, context_parallel=2, max_model_len=LONG)
    assert run.tokens_per_rank == 16384
    # A lone sample over the group's budget (oversized_sample_policy train_alone) is split too.
    assert RunShape(trainer_ranks=4, max_tokens_per_gpu=8192, context_parallel=2, max_model_len=20001
                    ).tokens_per_rank == 10001
    assert RunShape(trainer_ranks=1, max_tokens_per_gpu=8192, max_model_len=9000).tokens_per_rank == 9000
    with pytest.raises(ValueError, match="RunShape.context_parallel must be >= 1"):
        RunShape(trainer_ranks=1, max_tokens_per_gpu=8192, context_parallel=0)


@pytest.mark.parametrize("cp, repeat", [(2, 1), (7, 7), (14, 7)])
def test_a_context_parallel_rank_by_hand(cp: int, repeat: int) -> None:
    """Qwen2.5-0.5B's 2 key/value heads: cp 2 splits them, cp 7 and 14 repeat each 7 times."""
    share = -(-LONG // cp)  # 32,768 over 7 ranks: 4,682 tokens each at most
    run = RunShape(trainer_ranks=14, max_tokens_per_gpu=share, context_parallel=cp, max_model_len=LONG)
    assert trainer_bytes(_shape(QWEN_0_5B), run) == _rank_bytes_by_hand(QWEN_0_5B, share, 14, repeat)


def test_the_exchange_counts_where_it_outweighs_the_mlps_backward() -> None:
    """A shape with an MLP as narrow as its width: the exchange's 3 copies of q, k, v and output
    (2 x 1024 query-width + 2 x 1024 key/value-width values, bf16) pass the MLP backward's 2 x (2 + 2) x 1024."""
    shape = ModelShape(num_params=10**6, hidden_size=1024, num_layers=1, vocab_size=8, intermediate_size=1024,
                       num_heads=16, num_kv_heads=16)
    tokens = 1000
    run = RunShape(trainer_ranks=2, max_tokens_per_gpu=tokens, context_parallel=2, logprob_chunk_size=8)
    norm = 4 * 1024 + 4 + 4 * 1024
    layer = 2 * norm + 3 * 2 * 1024 + 2 * 2 * 1024 + 4 * 16 + 4 * 2 * 1024
    exchange = 3 * 2 * (2 * 1024 + 2 * 1024)
    assert exchange > 2 * (2 * 1024 + 2 * 1024)
    at_start = tokens * (norm + 2 * 2 * 64) + 8 * 8 * 4 * 3
    assert trainer_activation_bytes(shape, run) == tokens * layer + max(at_start, tokens * exchange)


def test_the_plan_prints_the_mesh_and_the_tokens_per_rank() -> None:
    run = RunShape(trainer_ranks=4, max_tokens_per_gpu=16384, context_parallel=2, generation_workers=3,
                   logprob_workers=1, max_model_len=LONG)
    plan = plan_placement(8, 80 * GiB, _shape(QWEN_0_5B), run)
    assert plan.trainer_gpus == (4, 5, 6, 7)
    assert ("  trainer  GPU(s) 4,5,6,7: 4 ranks = 2 data-parallel x 2 context-parallel, 16384 tokens per rank "
            "(32768 per group minibatch)") in plan.lines(run)
    assert plan_placement(0, 0, _shape(QWEN_0_5B), run).lines(run) == [
        "placement: CPU only (no GPU found): every process on the CPU",
        "  trainer  4 ranks = 2 data-parallel x 2 context-parallel, 16384 tokens per rank (32768 per group minibatch)"]


@pytest.mark.parametrize("gpus, ranks, cp, refusal", [
    (2, 2, 2, "model.context_parallel 2 needs 2 trainer ranks, and on 2 GPU(s) the trainer runs one"),
    (8, 6, 4, "model.context_parallel 4 must divide the trainer's 6 ranks: set --nproc_per_node to a multiple of 4"),
    (8, 4, 4, "14 attention heads are not divisible by model.context_parallel 4 (Ulysses splits the heads over "
              "the group): this model allows 1, 2, 7, 14"),
    (0, 3, 2, "model.context_parallel 2 must divide the trainer's 3 ranks"),
])
def test_a_degree_the_host_ranks_or_heads_cannot_take_is_refused(gpus: int, ranks: int, cp: int,
                                                                 refusal: str) -> None:
    run = RunShape(trainer_ranks=ranks, max_tokens_per_gpu=8192, context_parallel=cp)
    with pytest.raises(PlacementError) as failure:
        check_context_plan(gpus, 80 * GiB, _shape(QWEN_0_5B), run)
    assert str(failure.value).startswith(refusal) and "\n" not in str(failure.value)


def test_a_long_sample_that_one_rank_cannot_hold_gets_the_smallest_degree_that_fits() -> None:
    """Qwen2.5-1.5B, 32k-token samples, 4 trainer ranks on 80 GiB GPUs: one rank at 32,768 tokens
    needs ~101 GiB; two ranks at 16,384 each fit."""
    one, two = _rank_bytes_by_hand(QWEN_1_5B, LONG, 4), _rank_bytes_by_hand(QWEN_1_5B, LONG // 2, 4)
    assert two <= 80 * GiB < one
    run = RunShape(trainer_ranks=4, max_tokens_per_gpu=LONG, max_model_len=LONG)
    with pytest.raises(PlacementError) as failure:
        check_context_plan(8, 80 * GiB, _shape(QWEN_1_5B), run)
    assert str(failure.value) == (
        f"a trainer rank needs about {one / GiB:.1f} GiB (estimate) for 32768 tokens and a GPU has 80.0 GiB: the "
        f"longest sample (32768 tokens) fits at model.context_parallel 2 with max_tokens_per_gpu 16384 "
        f"(about {two / GiB:.1f} GiB per rank)")
    # Followed, the suggestion plans.
    check_context_plan(8, 80 * GiB, _shape(QWEN_1_5B), RunShape(trainer_ranks=4, max_tokens_per_gpu=LONG // 2,
                                                                 context_parallel=2, max_model_len=LONG))


def test_the_suggestion_keeps_the_ranks_or_raises_them_to_a_multiple_of_the_degree() -> None:
    """3 ranks: cp 2 needs 4 ranks, at 16,384 tokens each ~55 GiB; cp 3 (3 ranks, 10,923 tokens,
    the key/value heads repeated 3 times) ~42 GiB; cp 4 (4 ranks, 8,192 tokens) ~33 GiB."""
    two, three = _rank_bytes_by_hand(QWEN_1_5B, LONG // 2, 4), _rank_bytes_by_hand(QWEN_1_5B, 10923, 3, 3)
    four = _rank_bytes_by_hand(QWEN_1_5B, LONG // 4, 4, kv_repeat_times=2)
    assert four <= 40 * GiB < three <= 45 * GiB < two
    run = RunShape(trainer_ranks=3, max_tokens_per_gpu=LONG, max_model_len=LONG)
    with pytest.raises(PlacementError, match="fits at model.context_parallel 3 with max_tokens_per_gpu 10923 "
                                             rf"\(about {three / GiB:.1f} GiB per rank\)$"):
        check_context_plan(8, 45 * GiB, _shape(QWEN_1_5B), run)
    with pytest.raises(PlacementError, match="fits at model.context_parallel 4 with max_tokens_per_gpu 8192 and "
                                             rf"--nproc_per_node 4 \(about {four / GiB:.1f} GiB per rank\)$"):
        check_context_plan(8, 40 * GiB, _shape(QWEN_1_5B), run)


def test_where_no_degree_fits_the_refusal_says_so() -> None:
    """Qwen2.5-7B at 32k tokens on 24 GiB GPUs: even 7 ranks of 4,682 tokens each (the most that 28
    heads and 7 trainer GPUs allow) need more."""
    seven = _rank_bytes_by_hand({**QWEN_7B}, -(-LONG // 7), 7, kv_repeat_times=7)
    assert seven > 24 * GiB
    run = RunShape(trainer_ranks=4, max_tokens_per_gpu=LONG, max_model_len=LONG)
    with pytest.raises(PlacementError) as failure:
        check_context_plan(8, 24 * GiB, _shape(QWEN_7B), run)
    message = str(failure.value)
    assert ("and no context-parallel degree fits the longest sample (32768 tokens): at model.context_parallel 7, "
            "the most that 28 heads and 7 trainer GPUs allow, a rank holds 4682 tokens and needs about "
            f"{seven / GiB:.1f} GiB; turn on model.gradient_checkpointing") in message
    two_gpus = RunShape(trainer_ranks=1, max_tokens_per_gpu=LONG, max_model_len=LONG)
    with pytest.raises(PlacementError, match="context parallelism needs two trainer ranks beside the workers: "
                                             "3 or more GPUs"):
        check_context_plan(2, 24 * GiB, _shape(QWEN_7B), two_gpus)


def test_a_run_that_fits_passes_and_one_gpu_is_left_to_the_colocated_plan() -> None:
    run = RunShape(trainer_ranks=1, max_tokens_per_gpu=8192)
    check_context_plan(8, 80 * GiB, _shape(QWEN_0_5B), run)
    check_context_plan(1, 1 * GiB, _shape(QWEN_0_5B), run)  # plan_placement's colocated refusal speaks there


def _doc_plans() -> list[tuple[list[str], str]]:
    """docs/training.md's context-parallel `local_cluster.py` commands (words, continuations joined),
    each with the output block pasted after it."""
    text = (REPO_ROOT / "docs" / "training.md").read_text()
    pairs = re.findall(r"```bash\n([^`]*?local_cluster\.py[^`]*?)```\n```\n(.*?)\n```", text, flags=re.S)
    plans = []
    for block, output in pairs:
        words = shlex.split(block.replace("\\\n", " "))
        plans.append((words[words.index("local_cluster.py") + 1:], output))
    return plans


def test_the_training_docs_context_parallel_plans_are_what_the_launcher_prints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each command as written (the model folder: the qwen2.5-0.5b preset's config.json, all the
    plan reads of what `tiny_model --preset qwen2.5-0.5b` writes), its output as pasted."""
    import local_cluster
    from async_grpo.demo_assets.tiny_model import PRESETS

    preset = PRESETS["qwen2.5-0.5b"]
    model_dir = tmp_path / "qwen2.5-0.5b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "hidden_size": preset.hidden_size, "num_hidden_layers": preset.num_layers, "vocab_size": preset.vocab_size,
        "intermediate_size": preset.intermediate_size, "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads, "tie_word_embeddings": preset.tie_word_embeddings}))
    plans = _doc_plans()
    assert len(plans) == 2 and all("--model_path" in args for args, _ in plans)
    for args, pasted in plans:
        args = [str(model_dir) if a == "runs/qwen2.5-0.5b" else a.replace("runs/", f"{tmp_path}/") for a in args]
        try:
            code = local_cluster.main(args)
        except SystemExit as stop:
            code = stop.code
        captured = capsys.readouterr()
        printed = (captured.out + captured.err).strip()
        assert printed == pasted, f"exit {code}:\n{printed}"
        assert code == (0 if "context-parallel" in pasted else 2)


def test_the_engines_sequences_in_flight_count_a_groups_prompts_once(tmp_path: Path) -> None:
    """Only a group's first rank submits prompts: 4 ranks in groups of 2 are 2 consumers, so
    (max_lag 1 + 1) steps x 2 x 32 prompts x 8 samples = 1,024 sequences, not 2,048."""
    import local_cluster

    args = ["--config", str(REPO_ROOT / "configs" / "qwen2.5-1.5b-gsm8k.yaml"), "--run_dir", str(tmp_path),
            "--model.model_path", str(tmp_path)]
    one = local_cluster.load_trainer_config(args)
    split = local_cluster.load_trainer_config([*args, "--model.context_parallel", "2"])
    assert (one.prompts_per_rank, one.experience.sampling.n, one.experience.max_lag) == (32, 8, 1)
    assert local_cluster._run_load(one, 4)["sequences_in_flight"] == 2 * 4 * 32 * 8
    assert local_cluster._run_load(split, 4)["sequences_in_flight"] == 2 * 2 * 32 * 8
