"""A generative judge's throughput: requests batched (sent together, as a generation worker's judge
client sends a step's groups) against one at a time, on one real vLLM engine in this process.

    .venv/bin/python -m benchmarks.judge_throughput                 # 3 rounds x 2 modes x 256 requests
    .venv/bin/python -m benchmarks.judge_throughput --smoke true

The judge is the judge demo's (scripts/prepare_judge_demo.py's folder `--model_path`; made by that
script when missing, or in smoke mode a tiny untrained model with the same chat template), asked
about the demo's answers: "a+b=c" with c right or wrong at random, rendered by the judge demo's
template and read by the yes_no rule. Each round runs both modes on the same requests, in
alternating order (benchmarks/ab_parts.schedule); an untimed batch warms the engine up first.

The LAST line is `judge_throughput: ` and key=value pairs: `speedup=` (median judgements/s batched
over one at a time), `batched_per_s=`, `one_per_s=` (medians), `parsable=` (share of the replies the
yes_no rule read, over every run) and `requests=`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from async_grpo.config.judge_config import JudgeConfig
from async_grpo.config.worker_options import EngineConfig
from async_grpo.demo_assets.arithmetic_judge import JUDGE_TEMPLATE
from async_grpo.rewards.judge_reward import JudgeReply, JudgeRequest
from async_grpo.rewards.judge_template import parse_verdict, sample_messages
from benchmarks.ab_parts import schedule
from benchmarks.harness import REPO_ROOT, apply_smoke, load_bench_config, setup_logging, summary_line

logger = logging.getLogger(__name__)

SMOKE = {"requests": 8, "rounds": 1}
"""Sizes of the smoke mode."""
MODES = ("one", "batched")
# The judge demo's judging: its template (scripts/prepare_judge_demo.py writes it beside the judge), yes/no.
DEMO_JUDGE = JudgeConfig(**JUDGE_TEMPLATE, verdict="yes_no", max_tokens=4)


@dataclass(kw_only=True, frozen=True)
class JudgeThroughputConfig:
    """Command line of `python -m benchmarks.judge_throughput`."""

    model_path: str = str(REPO_ROOT / "runs" / "demo-judge-assets" / "judge")
    """The judge's model folder; made by scripts/prepare_judge_demo.py when missing."""
    requests: int = 256
    """Judge requests per run (a demo step's worth: 32 prompts x 16 answers is 512)."""
    rounds: int = 3
    """Runs of each mode."""
    seed: int = 0
    """Seed of the requests' sums and answers."""
    work_dir: str = str(REPO_ROOT / "runs" / "judge-throughput")
    """Scratch folder (the smoke mode's untrained judge goes here)."""
    smoke: bool = False
    """Smoke mode: 8 requests, 1 round, an untrained judge, an uncompiled engine; its figures mean nothing."""


def judge_model(config: JudgeThroughputConfig, work: Path) -> Path:
    """The judge's folder: config.model_path, made by scripts/prepare_judge_demo.py when missing; in
    smoke mode an untrained tiny model with the chat template (training takes minutes)."""
    path = Path(config.model_path)
    if config.smoke:
        from async_grpo.demo_assets.arithmetic_judge import write_judge_model

        return write_judge_model(work / "judge")
    if not (path / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "prepare_judge_demo.py"),
                        "--out_dir", str(path.parent)], check=True)
    return path


def requests(count: int, seed: int) -> list[JudgeRequest]:
    """`count` demo questions "a+b=" with an answer right or wrong at even odds."""
    rng = random.Random(seed)
    template = DEMO_JUDGE.template()
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        answer = a + b if rng.random() < 0.5 else rng.choice([c for c in range(19) if c != a + b])
        messages = sample_messages(DEMO_JUDGE, template, prompt=f"{a}+{b}=", completion=str(answer),
                                   gt_answer=str(a + b))
        out.append(JudgeRequest(messages=messages, max_tokens=DEMO_JUDGE.max_tokens, temperature=0.0))
    return out


async def run_mode(judge, mode: str, batch: list[JudgeRequest]) -> tuple[float, list[JudgeReply]]:
    """(seconds, replies) of answering `batch` one request at a time or all at once."""
    started = time.perf_counter()
    if mode == "one":
        replies = [await judge.answer(request) for request in batch]
    else:
        replies = list(await asyncio.gather(*(judge.answer(request) for request in batch)))
    return time.perf_counter() - started, replies


async def run_all(config: JudgeThroughputConfig, model_path: Path) -> tuple[dict[str, list[float]], float]:
    """(judgements/s of each run, per mode; the share of all replies the yes_no rule read)."""
    from async_grpo.inference.judge_models import start_generative_judge

    engine = EngineConfig(dtype="float32", kv_cache_memory_bytes=256 * 2**20, max_num_seqs=256,
                          enforce_eager=config.smoke)
    judge = start_generative_judge("judge-bench", str(model_path), engine)
    try:
        batch = requests(config.requests, config.seed)
        await run_mode(judge, "batched", batch)  # warm-up, untimed
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        parsed = total = 0
        for round_index, mode in schedule(MODES, config.rounds, swap=True):
            seconds, replies = await run_mode(judge, mode, batch)
            rates[mode].append(len(batch) / seconds)
            parsed += sum(parse_verdict(r.text, DEMO_JUDGE).score is not None for r in replies)
            total += len(replies)
            logger.info("round %d %s: %d requests in %.2f s (%.1f/s)", round_index, mode, len(batch), seconds,
                        rates[mode][-1])
        return rates, parsed / total
    finally:
        await judge.close()


def main(argv: list[str] | None = None) -> None:
    config = apply_smoke(load_bench_config(JudgeThroughputConfig, argv, description=__doc__), SMOKE)
    setup_logging()
    work = Path(config.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rates, parsable = asyncio.run(run_all(config, judge_model(config, work)))
    batched, one = statistics.median(rates["batched"]), statistics.median(rates["one"])
    for mode in MODES:
        print(f"{mode}: " + ", ".join(f"{r:.1f}" for r in rates[mode]) + " judgements/s")
    print(summary_line("judge_throughput", {
        "speedup": f"{batched / one:.2f}", "batched_per_s": f"{batched:.1f}", "one_per_s": f"{one:.1f}",
        "parsable": f"{parsable:.3f}", "requests": config.requests}))


if __name__ == "__main__":
    main()
