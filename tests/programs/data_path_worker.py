"""One rank of tests/trainer/test_data_path.py: the rank-0 data path over a real gloo process group.

    torchrun --nproc_per_node=2 tests/programs/data_path_worker.py --scenario ordering --slow_rank 1 --out_dir OUT
    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python tests/programs/data_path_worker.py --scenario rank0_dies ...

Scenarios:
- ordering: rank 0 runs a real ExperienceBatcher (plain class, asyncio on a thread) with the
  in-process generation and logprob stand-ins of tests/support/batcher_fakes.py. Both ranks
  submit their prompts of two steps through Rank0DataPath.submit_prompts (step 1 before step 0
  trains, as with max_lag 1), then read every message of step 0, then of step 1, through
  Rank0DataPath.next_message; `--slow_rank` sleeps before each read. Rank r writes
  OUT/received_rank{r}.json: each message it received, encoded (encode_message, hex), plus its
  kind. Rank 0 also writes OUT/batcher.json: what the batcher's next_round returned for each rank
  (encoded the same way) and the order of next_round/ack_round calls. The test compares them.
- resample: as ordering for one step, with sampling.drop_zero_variance_groups (the stand-ins'
  rewards are all 0, so every group is dropped and the batcher sends PromptRequests); each rank
  answers them by drawing more prompt indices, as the trainer's PromptFeeder does.
- rank0_dies: rank 0 exits (os._exit) right after it read step 0's first round, before the
  scatter; rank 1 must raise Rank0DataPathError. rank0_hangs: rank 0 sleeps instead, so rank 1's
  wait reaches the data path's deadline (a little under --dist_timeout_s). Rank 1 prints the
  error and exits with FAILED_EXIT. These two need neither Ray nor the batcher (rank 0 reads a
  canned round, CannedClient), so they run on the GPU machine too, where the ranks join over
  NCCL (tests/trainer/test_gpu_data_path.py); elsewhere over gloo.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support

from async_grpo.batching.batcher_messages import EndOfStep, Minibatch, PromptRequest  # noqa: E402
from async_grpo.trainer.data_path import Rank0DataPath, Rank0DataPathError, encode_message  # noqa: E402
from async_grpo.trainer.fsdp_setup import init_distributed  # noqa: E402
from sample_processing_utils import Sample  # noqa: E402
from support.batcher_fakes import FakeGeneration, FakeLogprob, batcher_config, fake_prompts  # noqa: E402

FAILED_EXIT = 3
SLOW_S = 0.2
PROMPTS_PER_RANK = 3
NUM_PROMPTS = 40


class CannedClient:
    """A data_path.BatcherClient that takes prompts and hands out one fixed round per read: all the
    failure scenarios need from rank 0 before it dies or hangs (no Ray, no batcher)."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size

    def submit_prompts(self, rank: int, step: int, samples: list, round_index: int) -> None:
        pass

    def submit_prompts_of_ranks(self, step: int, per_rank: list[list], round_index: int) -> None:
        pass

    def next_message(self, rank: int, step: int, timeout_s: float) -> Any:
        raise AssertionError("the rank-0 path must read rounds, not single messages")

    def next_round(self, step: int, index: int, timeout_s: float) -> list:
        sample = Sample(input_token_ids=[1, 2], gt_answer="3", prompt_id=0, output_token_ids=[4],
                        sampling_logprobs=[-0.5])
        return [Minibatch(step=step, rank=rank, index=index, samples=[sample], loss_weight=1.0)
                for rank in range(self._world_size)]

    def ack_round(self, step: int, index: int) -> None:
        pass


def _canned_prompts(count: int) -> list[Sample]:
    return [Sample(input_token_ids=[i + 1], gt_answer=str(i), prompt_id=i) for i in range(count)]


class LoopClient:
    """A data_path.BatcherClient over a plain ExperienceBatcher running on its own event loop;
    records what next_round returned and the order of next_round/ack_round calls."""

    def __init__(self, batcher: Any) -> None:
        self._batcher = batcher
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self.events: list[list[Any]] = []
        self.rounds: list[list[str]] = []
        """Per round read: each rank's message, encoded (hex)."""

    def _run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def submit_prompts(self, rank: int, step: int, samples: list, round_index: int) -> None:
        self._run(self._batcher.submit_prompts(rank, step, samples, round_index))

    def submit_prompts_of_ranks(self, step: int, per_rank: list[list], round_index: int) -> None:
        for rank, samples in enumerate(per_rank):
            self.submit_prompts(rank, step, samples, round_index)

    def next_message(self, rank: int, step: int, timeout_s: float) -> Any:
        raise AssertionError("the rank-0 path must read rounds, not single messages")

    def next_round(self, step: int, index: int, timeout_s: float) -> list:
        messages = self._run(self._batcher.next_round(step, index), timeout_s)
        self.events.append(["read", step, index, type(messages[0]).__name__])
        self.rounds.append([encode_message(m).hex() for m in messages])
        return messages

    def ack_round(self, step: int, index: int) -> None:
        async def ack() -> None:
            self._batcher.ack_round(step, index)

        self._run(ack())
        self.events.append(["ack", step, index])


def _read_step(path: Rank0DataPath, step: int, rank: int, slow: bool, prompts_of_rank: list[int],
               received: list[dict]) -> None:
    while True:
        if slow:
            time.sleep(SLOW_S)
        message = path.next_message(step, timeout_s=60.0).message
        received.append({"kind": type(message).__name__, "hex": encode_message(message).hex()})
        if isinstance(message, PromptRequest):  # draw more, as PromptFeeder.submit_extra does
            more = [prompts_of_rank.pop(0) for _ in range(message.count)]
            path.submit_prompts(message.step, more, message.round_index)
        if isinstance(message, EndOfStep):
            return


def _batcher(world_size: int, scenario: str) -> Any:
    """A real ExperienceBatcher over the in-process stand-ins (imported here: the batcher needs Ray)."""
    from async_grpo.config.sampling import SamplingConfig
    from vllm_experience_batcher import ExperienceBatcher

    sampling = SamplingConfig(n=3, drop_zero_variance_groups=scenario == "resample", max_resample_rounds=2)
    config = batcher_config(world_size=world_size, sampling=sampling)
    return ExperienceBatcher(config, FakeGeneration({}, {}), FakeLogprob())


def _rank0_gone(scenario: str, info: Any, order: list[int], dist_timeout_s: float) -> None:
    """rank0_dies / rank0_hangs: rank 0 reads a round and then dies or hangs before the
    scatter; rank 1 reports how it stopped (FAILED_EXIT on Rank0DataPathError). Never returns."""
    client = CannedClient(info.world_size) if info.is_main else None
    path = Rank0DataPath(client, _canned_prompts(NUM_PROMPTS), info)
    path.submit_prompts(0, [order.pop(0) for _ in range(PROMPTS_PER_RANK)])
    if info.is_main:
        client.next_round(0, 0, 60.0)
        if scenario == "rank0_dies":
            os._exit(1)
        time.sleep(dist_timeout_s * 4)
        os._exit(1)
    print(f"rank {info.rank} on {info.backend} ({info.device}) waits for step 0", flush=True)
    started = time.monotonic()
    try:
        path.next_message(0, timeout_s=60.0)
    except Rank0DataPathError as error:
        print(f"rank {info.rank} stopped after {time.monotonic() - started:.1f} s: {error}", flush=True)
        os._exit(FAILED_EXIT)
    os._exit(0)  # not reached when the path works: the test fails on exit 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", required=True,
                        choices=["ordering", "resample", "rank0_dies", "rank0_hangs"])
    parser.add_argument("--slow_rank", type=int, default=-1)
    parser.add_argument("--dist_timeout_s", type=float, default=120.0)
    parser.add_argument("--out_dir", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    info = init_distributed(args.dist_timeout_s)
    out = Path(args.out_dir)
    # Rank r's data order: every other prompt, as a sampler shard would give it.
    order = [i for i in range(NUM_PROMPTS) if i % info.world_size == info.rank]
    if args.scenario in ("rank0_dies", "rank0_hangs"):
        _rank0_gone(args.scenario, info, order, args.dist_timeout_s)

    client = LoopClient(_batcher(info.world_size, args.scenario)) if info.is_main else None
    path = Rank0DataPath(client, fake_prompts(range(NUM_PROMPTS)), info)
    steps = [0, 1] if args.scenario == "ordering" else [0]
    for step in steps:
        path.submit_prompts(step, [order.pop(0) for _ in range(PROMPTS_PER_RANK)])

    received: list[dict] = []
    for step in steps:
        _read_step(path, step, info.rank, args.slow_rank == info.rank, order, received)
    (out / f"received_rank{info.rank}.json").write_text(json.dumps(received))
    if info.is_main:
        (out / "batcher.json").write_text(json.dumps({"rounds": client.rounds, "events": client.events}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
