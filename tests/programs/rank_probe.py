"""One rank of tests/trainer/test_forked_ranks.py: records what it was started with, then exits, fails or
waits as told.

    torchrun --nproc_per_node=2 tests/programs/rank_probe.py --out_dir OUT [--fail_rank R]

Each rank writes OUT/rank<RANK>.json (its torchrun variables, its torch seed, its process id). With
--fail_rank R, rank R then exits with code 3 and the other ranks wait FAIL_WAIT_S, long enough
that only their launcher's stop ends them in time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

FAIL_EXIT_CODE = 3
FAIL_WAIT_S = 120.0
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--fail_rank", type=int, default=None)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    record = {"env": {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}, "seed": torch.initial_seed(),
              "pid": os.getpid(), "threads": torch.get_num_threads(), "argv": sys.argv[1:]}
    (Path(args.out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    print(f"rank {rank} recorded", flush=True)
    if args.fail_rank is None:
        return
    if rank == args.fail_rank:
        sys.exit(FAIL_EXIT_CODE)
    time.sleep(FAIL_WAIT_S)


if __name__ == "__main__":
    main()
