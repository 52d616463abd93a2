"""The rank-0 data path (data_path.py, TrainerConfig.data_path: rank0).

- The codec turns every message back into an equal record (checked against the original
  objects), and refuses what is not one of its messages.
- ExperienceBatcher.next_round gives each rank exactly what next_message gives it on the
  per-rank path (two batchers fed the same way), and enforces the two-phase order: no round
  before the previous one's ack_round.
- Over a real 2-rank gloo group (tests/programs/data_path_worker.py) with a deliberately slow rank, every
  rank receives exactly the batcher's messages for it, in order, two steps submitted ahead; a
  step's EndOfStep comes after all its data; dynamic sampling's PromptRequests are answered
  through rank 0.
- If rank 0 dies, or hangs past the data path's deadline (0.9 x dist_timeout_s), rank 1 stops with
  Rank0DataPathError naming the step, through the asynchronous collective and its timed wait that
  NCCL needs (tests/trainer/test_gpu_data_path.py runs the same scenarios over NCCL); a wait that a
  backend reports as not completed (False) raises the same error.
The trainer through this path is checked by tests/trainer/test_step_parity.py (case
two_epochs_k3_rank0: one step over 2 ranks equals a padded single-process step) and
tests/system/test_end_to_end.py (a real run with data_path rank0 trains like per_rank).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

from async_grpo.trainer import data_path
from async_grpo.trainer.data_path import (
    Rank0DataPath, Rank0DataPathError, decode_message, encode_message, payload_nbytes,
)
from async_grpo.trainer.fsdp_setup import DistInfo
from sample_processing_utils import JudgeUsage, Sample
from support.batcher_fakes import FakeGeneration, FakeLogprob, batcher_config, fake_logprobs, fake_prompts
from support.data_path_launch import DIST_TIMEOUT_S, check_rank0_gone, launch_pair
from support.paths import PROGRAMS
from support.forked_ranks import run_ranks
from vllm_experience_batcher import EndOfStep, ExperienceBatcher, ExperienceBatcherError, Minibatch, PromptRequest

WORKER = PROGRAMS / "data_path_worker.py"
LAUNCH_TIMEOUT_S = 300  # generous: only stops a hung launch


def _rich_samples() -> list[Sample]:
    return [
        Sample(input_token_ids=[1, 2, 3], gt_answer="42 ü", prompt_id=3, output_token_ids=[5, 6],
               output_text="é\n\"x\"", sampling_logprobs=[-0.1, -0.25], ref_logprobs=None, old_logprobs=[],
               teacher_logprobs=[-1.5, -2.0], token_advantages=[0.1, 1 / 3], reward=0.5, advantage=-1 / 7,
               weight_version=4, finish_reason="length", truncated=True, reward_failed=True,
               reward_failure_reasons=["exact/timeout", "math_verify/rejected"],
               judge_usage=JudgeUsage(requests=1 / 16, tokens_in=20.5, tokens_out=0.4375, latency_s=0.01)),
        Sample(input_token_ids=[9], gt_answer="", prompt_id=0, group_id=5, run_id=2, output_token_ids=[7],
               sampling_logprobs=[-3.0], ref_logprobs=[-2.9], old_logprobs=[-3.1], weight_version=-1),
        # a multi-turn rollout: one observation token between two sampled ones, straddling a push
        Sample(input_token_ids=[4, 4], gt_answer="1", prompt_id=1, output_token_ids=[8, 3, 9],
               output_mask=[True, False, True], sampling_logprobs=[-0.5, -0.75], weight_version=2,
               token_versions=[(2, 1), (3, 1)]),
    ]


@pytest.mark.parametrize("message", [
    Minibatch(step=2, rank=1, index=3, samples=_rich_samples(), loss_weight=1.0),
    Minibatch(step=0, rank=0, index=0, samples=[], loss_weight=0.0),
    EndOfStep(step=1, num_samples=2, num_tokens=30, num_minibatches=4, num_prompts=1, timed_out_prompts=1,
              dropped_stale=2, oversized_samples=0, padding_minibatches=1, missing_rollouts=3, num_output_tokens=9,
              dropped_zero_variance_groups=1, resampled_prompts=2, masked_truncated=1, prepare_dropped=0),
    PromptRequest(step=7, count=2, round_index=1),
], ids=["minibatch", "empty-padding-minibatch", "end-of-step", "prompt-request"])
def test_codec_gives_back_an_equal_message(message) -> None:
    assert decode_message(encode_message(message)) == message


def test_codec_keeps_nan_rewards_and_reports_errors() -> None:
    sample = _rich_samples()[1]
    sample.reward = math.nan
    decoded = decode_message(encode_message(Minibatch(step=0, rank=0, index=0, samples=[sample], loss_weight=1.0)))
    assert math.isnan(decoded.samples[0].reward)
    with pytest.raises(Rank0DataPathError, match="rank 0 reported: ExperienceBatcherError: no live workers"):
        decode_message(encode_message(ExperienceBatcherError("no live workers")))
    with pytest.raises(ValueError):
        decode_message(b"\x00\x01")


def test_payload_bytes_count_tokens_and_per_token_values() -> None:
    samples = _rich_samples()
    # sample 0: 3 + 2 ids, sampling 2 + old 0 + teacher 2 + token_advantages 2; sample 1: 1 + 1 ids, 3 lists of 1;
    # sample 2: 2 + 3 ids, a mask of 3, sampling 2
    expected = 8 * ((5 + 2 + 0 + 2 + 2) + (2 + 3) + (5 + 3 + 2))
    assert payload_nbytes(Minibatch(step=0, rank=0, index=0, samples=samples, loss_weight=1.0)) == expected
    assert payload_nbytes(PromptRequest(step=0, count=1, round_index=1)) == 0


async def _feed(batcher: ExperienceBatcher) -> None:
    await batcher.submit_prompts(0, 0, fake_prompts(range(0, 4)))
    await batcher.submit_prompts(1, 0, fake_prompts(range(4, 7)))


def test_rounds_hold_what_each_rank_reads_on_the_per_rank_path() -> None:
    async def per_rank() -> list[list]:
        batcher = ExperienceBatcher(batcher_config(), FakeGeneration({}, {}), FakeLogprob())
        await _feed(batcher)

        async def drain(rank: int) -> list:
            messages = []
            while not messages or not isinstance(messages[-1], EndOfStep):
                messages.append(await batcher.next_message(rank, 0))
            return messages
        return list(await asyncio.gather(drain(0), drain(1)))

    async def by_rounds() -> list[list]:
        batcher = ExperienceBatcher(batcher_config(), FakeGeneration({}, {}), FakeLogprob())
        await _feed(batcher)
        with pytest.raises(ExperienceBatcherError, match="round 1 requested"):
            await batcher.next_round(0, 1)
        rounds = []
        while not rounds or not isinstance(rounds[-1][0], EndOfStep):
            rounds.append(await batcher.next_round(0, len(rounds)))
            if len(rounds) == 1:
                with pytest.raises(ExperienceBatcherError, match="not acknowledged"):
                    await batcher.next_round(0, 1)
                with pytest.raises(ExperienceBatcherError, match="ack of round 3"):
                    batcher.ack_round(0, 3)
            batcher.ack_round(0, len(rounds) - 1)
        return [list(messages) for messages in zip(*rounds)]

    expected, got = asyncio.run(per_rank()), asyncio.run(by_rounds())
    assert len(expected[0]) > 2, "the step should have several minibatches per rank"
    assert got == expected


def _decoded(hex_messages: list[str]) -> list:
    return [decode_message(bytes.fromhex(h)) for h in hex_messages]


def _check_steps(messages: list, steps: list[int]) -> None:
    """Per step: minibatches, then EndOfStep, whose count matches; every real sample carries the
    stand-in logprob worker's values."""
    by_step: dict[int, list] = {}
    for message in messages:
        by_step.setdefault(message.step, []).append(message)
    assert sorted(by_step) == steps
    for step, got in by_step.items():
        assert isinstance(got[-1], EndOfStep) and not any(isinstance(m, EndOfStep) for m in got[:-1]), step
        minibatches = [m for m in got if isinstance(m, Minibatch)]
        assert len(minibatches) == got[-1].num_minibatches
        for minibatch in minibatches:
            for sample in minibatch.samples:
                assert sample.ref_logprobs == fake_logprobs(sample)


@pytest.mark.distributed
@pytest.mark.parametrize("slow_rank", [0, 1])
def test_every_rank_gets_the_batchers_messages_in_order_with_a_slow_rank(tmp_path: Path, slow_rank: int) -> None:
    run_ranks(WORKER, ["--scenario", "ordering", "--slow_rank", str(slow_rank), "--out_dir", str(tmp_path)],
              nproc=2, timeout_s=LAUNCH_TIMEOUT_S)
    batcher = json.loads((tmp_path / "batcher.json").read_text())
    received = [json.loads((tmp_path / f"received_rank{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        # What the batcher handed rank 0 for this rank, in the batcher's order (compared decoded:
        # safetensors does not fix the order of its metadata entries, so bytes may differ).
        assert _decoded([m["hex"] for m in received[rank]]) == _decoded([r[rank] for r in batcher["rounds"]]), rank
        _check_steps(_decoded([m["hex"] for m in received[rank]]), steps=[0, 1])
    trained = Counter(s.prompt_id for rank in range(2) for m in _decoded([x["hex"] for x in received[rank]])
                      if isinstance(m, Minibatch) and m.loss_weight > 0 for s in m.samples)
    # data_path_worker: rank r's order is every other prompt; 3 per rank per step, n = 3.
    assert trained == {pid: 3 for pid in [0, 2, 4, 6, 8, 10] + [1, 3, 5, 7, 9, 11]}
    # Two-phase order: read i, ack i, read i + 1, ...; step 1 only after step 0's EndOfStep round.
    events = batcher["events"]
    expected_events = []
    for step in (0, 1):
        rounds = [e for e in events if e[0] == "read" and e[1] == step]
        for index, read in enumerate(rounds):
            expected_events += [["read", step, index, read[3]], ["ack", step, index]]
        assert rounds[-1][3] == "EndOfStep"
    assert events == expected_events


@pytest.mark.distributed
def test_prompt_requests_are_answered_through_rank_0(tmp_path: Path) -> None:
    run_ranks(WORKER, ["--scenario", "resample", "--out_dir", str(tmp_path)], nproc=2, timeout_s=LAUNCH_TIMEOUT_S)
    batcher = json.loads((tmp_path / "batcher.json").read_text())
    for rank in range(2):
        messages = _decoded([m["hex"] for m in json.loads((tmp_path / f"received_rank{rank}.json").read_text())])
        assert messages == _decoded([round_[rank] for round_ in batcher["rounds"]])
        requests = [m for m in messages if isinstance(m, PromptRequest)]
        end = messages[-1]
        # Every stand-in reward is 0: all groups drop, and each of the 2 rounds asks for more.
        assert [r.round_index for r in requests] == [1, 2]
        assert end.resampled_prompts == sum(r.count for r in requests) * 2 > 0
        assert end.num_samples == 0


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["rank0_dies", "rank0_hangs"])
def test_other_ranks_stop_with_a_clear_error_when_rank_0_is_gone(tmp_path: Path, scenario: str) -> None:
    result, elapsed = launch_pair(scenario, tmp_path, DIST_TIMEOUT_S)
    print(f"{scenario}: rank 1 stopped after {elapsed:.1f} s (process start included)")
    check_rank0_gone(result, "gloo")


class _Work:
    """A torch.distributed Work stand-in whose wait answers as told."""

    def __init__(self, completes: bool | None) -> None:
        self.completes, self.timeouts = completes, []

    def wait(self, timeout: timedelta) -> bool:
        self.timeouts.append(timeout)
        if self.completes is None:
            raise RuntimeError("Connection closed by peer")
        return self.completes


@pytest.mark.parametrize("completes", [False, None], ids=["wait-returns-false", "wait-raises"])
def test_receiving_rank_waits_asynchronously_with_a_deadline(monkeypatch: pytest.MonkeyPatch, completes) -> None:
    """Every collective is issued with async_op=True and waited with 0.9 x the group's timeout;
    a wait that fails or says "not completed" (as an NCCL wait past its timeout may) is a
    Rank0DataPathError naming the step. Checked without a process group: the collective is a
    stand-in, so what is checked is the path's own handling."""
    import torch

    calls = []
    work = _Work(completes)

    def broadcast(tensor, src, async_op=False):
        calls.append(("broadcast", async_op))
        return work

    monkeypatch.setattr(data_path.torch_dist, "broadcast", broadcast)
    info = DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), backend="gloo", timeout_s=20.0)
    path = Rank0DataPath(None, [], info)
    with pytest.raises(Rank0DataPathError, match=r"the message sizes for step 4 after .* \(deadline 18.0 s; "):
        path.next_message(4, timeout_s=1.0)
    assert calls == [("broadcast", True)]
    assert work.timeouts == [timedelta(seconds=18.0)]
