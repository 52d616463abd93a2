"""Verifier pool throughput and latency on realistic completions with hostile ones mixed in.

    cd /work/main && .venv/bin/python -m benchmarks.reward
    .venv/bin/python -m benchmarks.reward --num_processes 2 --hostile_fraction 0.03 --timeout_s 2

The workload imitates generation workers: prompts with a gold answer, each sending its group of
`group_size` completions to the pool at once, `num_clients` prompts in flight. Completions are
short answers ("... \\boxed{42}") or ~4k-character step-by-step reasoning texts ending in an
answer, half of them right; a `hostile_fraction` of them are outputs that hang math-verify (an
exponent tower, a megabyte of LaTeX), which the pool's pre-checks reject, and an
`evasive_fraction` are outputs that pass the pre-checks and still hang it (a 20k-character `$x...x$`),
which only the deadline stops. Every reward is checked against the answer the completion was
built with; every hostile one must come back failed ("rejected" or "timeout").

All answers of this workload are plain numbers, which the pool's fast path decides without
math-verify; `--fast_path false` makes the processes verify them, as before the fast path existed.

Each invocation first replays the same kind of workload with no hostile inputs (`--compare_clean`,
on by default), each workload on a fresh pool, and prints one line per run and then the ratio
`hostile_over_clean` of their throughputs: what a few hostile outputs cost the pool. `--rounds N`
repeats the clean/hostile pair N times back to back and prints each pair's ratio and their median:
on a shared machine the load moves within seconds, and a ratio of two runs minutes apart measured
the load as much as the pool (a trivial function's 8,000-sample run lasts ~2-4 s).

The pool's result cache is off by default (`--cache_size 0`): these completions are long and
mostly distinct, so the figure is the cost of verification itself. Pass a size to include it.

`--reward` picks the scoring path (each on the same pool, processes and deadline rules):
    math            math-verify through VerifierPool.score (the default reward), as above;
    math_function   math-verify as a plug-in reward function (async_grpo.rewards.math_verifier:math_verify_reward)
                    through VerifierPool.score_function, same completions, no cache or fast path
                    in the parent (the function's own pre-checks and fast path run in the process);
    function        a trivial Python function (`trivial` below: the completion equals the gold);
                    hostile completions are those of the math workload (an exponent tower, 1 MB
                    strings), or with --function_hostile misbehaving, inputs that make the
                    function raise, return NaN or a string, hang (killed at
                    --function_timeout_s) or kill its own process;
    code            async_grpo.rewards.code_reward:run_tests on tiny programs (one stdin/stdout test each, half
                    wrong) in the sandbox; hostile programs loop forever, fork-bomb, allocate
                    8 GB, print 100 MB, write outside their directory or open a socket
                    (--sandbox_timeout_s per program).
For the plug-in paths every hostile completion must score 0 (failed with its reason for
`function`; a wrong answer for `code`, whose sandbox contains it) and every other one its
expected reward.

Latency is per completion, from its group's submission to its result (queueing included).
Startup is excluded: the pool's start, and on the plug-in paths each process's first import of
the function's module (one clean call per process before the clock starts; the pool imports a
module outside the deadline, as start-up work). A process that replaces a killed one imports it
again inside the timed window: that is part of what a misbehaving function costs. Each run's line is key=value pairs: samples_per_s, p50_ms, p99_ms, the pool
size, hostile fractions, deadline, rejected (by a pre-check), fast_path (plain-number verdicts),
timeouts, restarts and reward mismatches (should be 0).
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from dataclasses import dataclass
from typing import Literal

from async_grpo.rewards.math_verifier import RewardResult
from async_grpo.rewards.reward_functions import FunctionScore
from async_grpo.rewards.math_verify_pool import VerifierPool
from benchmarks.harness import apply_smoke, load_bench_config, setup_logging

# Target length of a long reasoning completion: ~1k tokens, a typical math rollout.
_LONG_COMPLETION_CHARS = 4000
_HOSTILE_OUTPUTS = (
    "\\boxed{5^{5^{5^{5^5}}}}",
    "\\boxed{" + "1+" * 500_000 + "1}",
    "$" + "x" * 1_000_000 + "$",
)
# A 20k-character LaTeX span without a box: within every pre-check cap (no box, no nesting, no
# power, far below max_completion_chars), and math-verify still spends seconds on it (6.8 s
# measured), so only the deadline stops it.
_EVASIVE_OUTPUT = "$" + "x" * 20_000 + "$"
_FAILED_KINDS = ("rejected", "timeout")
# What `trivial` does with each hostile completion, and the error kind it must come back with.
_HOSTILE_FUNCTION_INPUTS = {"raise": "raised", "nan": "bad_return", "text": "bad_return", "hang": "timeout",
                            "exit": "crash"}
# Hostile programs for the code sandbox (each must score 0, and cost at most its deadline).
_HOSTILE_PROGRAMS = (
    "while True:\n    pass",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "x = bytearray(8 * 1024 ** 3)",
    "import sys\nsys.stdout.write('x' * 100_000_000)",
    "open('/tmp/sandbox-bench-escape', 'w').write('x')",
    "import socket\nsocket.create_connection(('127.0.0.1', 22))",
)
TRIVIAL = "benchmarks.reward:trivial"  # the pool's processes import it from the repository root
CODE = "async_grpo.rewards.code_reward:run_tests"
MATH_FUNCTION = "async_grpo.rewards.math_verifier:math_verify_reward"


def trivial(prompt: dict, completion: str, token_ids: list[int], metadata: dict) -> float:
    """The benchmark's trivial reward function: 1.0 when the completion is the gold answer. Its
    hostile inputs (_HOSTILE_FUNCTION_INPUTS) make it misbehave in each way the pool must survive."""
    if completion == "raise":
        raise ValueError("hostile input")
    if completion == "nan":
        return float("nan")
    if completion == "text":
        return "1.0"  # type: ignore[return-value]
    if completion == "hang":
        time.sleep(3600)
    if completion == "exit":
        import os

        os._exit(3)
    return float(completion == prompt["gt_answer"])


SMOKE = {"num_samples": 64, "rounds": 1, "num_processes": 1}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class RewardBenchConfig:
    """Command line of `python -m benchmarks.reward`."""

    num_processes: int | None = 2
    """Verifier worker processes in the pool (None: the pool's default, one per core, at least 2)."""
    timeout_s: float = 2.0
    """Hard deadline per completion; a verifier past it is killed and replaced."""
    num_samples: int = 800
    """Completions scored in all."""
    group_size: int = 8
    """Completions per prompt, sent to the pool together."""
    num_clients: int = 4
    """Groups in flight at once."""
    hostile_fraction: float = 0.03
    """Share of completions that hang math-verify in shapes the pre-checks catch (tower, 1 MB)."""
    evasive_fraction: float = 0.0
    """Share of completions that pass the pre-checks and hang math-verify (they must time out)."""
    compare_clean: bool = True
    """First run the workload with no hostile inputs, then print hostile_over_clean."""
    rounds: int = 1
    """Clean/hostile pairs run back to back (each pair's ratio printed, then the median)."""
    seed: int = 0
    """Seed of the workload."""
    cache_size: int = 0
    """VerifierPool result cache entries (0: off)."""
    reward: Literal["math", "math_function", "function", "code"] = "math"
    """Scoring path (module docstring): math-verify, math-verify as a plug-in function, a trivial
    plug-in function, or the code sandbox."""
    function_hostile: Literal["inputs", "misbehaving"] = "inputs"
    """`function`: hostile completions are hostile *inputs* (the math workload's towers and 1 MB
    strings, which the trivial function scores 0) or make the function *misbehave* (raise, NaN,
    a string, hang, os._exit): the failure paths, each costing a deadline or a process restart."""
    function_timeout_s: float = 1.0
    """Deadline of one `function` call (a hang costs this plus a process restart). The trivial
    function takes microseconds, but on a loaded machine a process may wait that long for a core:
    0.2 s timed out clean calls at load average 40; 1 s is the pool's default deadline."""
    sandbox_timeout_s: float = 2.0
    """`code`: wall deadline of one sandboxed program (tiny programs finish in ~30-150 ms, more on
    a loaded machine: a correct program past it scores 0 and counts as a mismatch)."""
    code_function_timeout_s: float = 10.0
    """`code`: deadline of one run_tests call (one program, one test), above sandbox_timeout_s."""
    fast_path: bool = True
    """The pool's plain-number fast path. This workload's answers and golds are all plain numbers,
    so with it every non-hostile completion is decided without math-verify; false measures
    math-verify in the processes (the pre-checks stay on)."""
    smoke: bool = False
    """Smoke mode: 64 samples, 1 round, 1 process (SMOKE); checks that the command still runs, its figures mean
    nothing."""


@dataclass(slots=True)
class Case:
    """One completion of the workload and what the pool should make of it."""

    completion: str
    gold: str
    expected_reward: float | None
    """1.0/0.0 for built completions; None for hostile ones (they must fail: rejected or timeout)."""
    expected_kinds: tuple[str, ...] = ()
    """For hostile ones: the error kinds that count as handled."""
    record: dict | None = None
    """Plug-in paths: the prompt record the function gets (gt_answer added)."""


def _long_reasoning(rng: random.Random, answer: int) -> str:
    steps = []
    total = 0
    while sum(len(s) for s in steps) < _LONG_COMPLETION_CHARS:
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        total += a + b
        steps.append(f"Step {len(steps) + 1}: we add {a} and {b}, so {a} + {b} = {a + b}; the running total is {total}.\n")
    return "Let us work through the problem carefully.\n" + "".join(steps) + f"Therefore the final answer is $\\boxed{{{answer}}}$."


def build_workload(
    num_samples: int, group_size: int, hostile_fraction: float, seed: int, evasive_fraction: float = 0.0
) -> list[list[Case]]:
    """Groups of completions sharing one gold answer; deterministic from the seed."""
    rng = random.Random(seed)
    groups: list[list[Case]] = []
    for start in range(0, num_samples, group_size):
        gold = rng.randint(0, 10_000)
        group = []
        for _ in range(min(group_size, num_samples - start)):
            draw = rng.random()
            if draw < hostile_fraction:
                completion = rng.choice(_HOSTILE_OUTPUTS)
                group.append(Case(completion=completion, gold=str(gold), expected_reward=None, expected_kinds=_FAILED_KINDS))
                continue
            if draw < hostile_fraction + evasive_fraction:
                group.append(Case(completion=_EVASIVE_OUTPUT, gold=str(gold), expected_reward=None, expected_kinds=("timeout",)))
                continue
            correct = rng.random() < 0.5
            answer = gold if correct else gold + rng.randint(1, 50)
            text = _long_reasoning(rng, answer) if rng.random() < 0.5 else f"The answer is \\boxed{{{answer}}}."
            group.append(Case(completion=text, gold=str(gold), expected_reward=1.0 if correct else 0.0))
        groups.append(group)
    return groups


def build_function_workload(num_samples: int, group_size: int, hostile_fraction: float, seed: int,
                            misbehaving: bool) -> list[list[Case]]:
    """`function`: short answers, half right; hostile ones are the math workload's hostile outputs
    (scored 0), or with `misbehaving` make `trivial` misbehave (failed, with their kind)."""
    rng = random.Random(seed)
    groups = []
    for start in range(0, num_samples, group_size):
        gold = str(rng.randint(0, 10_000))
        group = []
        for _ in range(min(group_size, num_samples - start)):
            if rng.random() < hostile_fraction and not misbehaving:
                group.append(Case(completion=rng.choice(_HOSTILE_OUTPUTS), gold=gold, expected_reward=0.0,
                                  expected_kinds=("hostile",)))
                continue
            if rng.random() < hostile_fraction and misbehaving:
                text = rng.choice(sorted(_HOSTILE_FUNCTION_INPUTS))
                group.append(Case(completion=text, gold=gold, expected_reward=None,
                                  expected_kinds=(_HOSTILE_FUNCTION_INPUTS[text],)))
                continue
            correct = rng.random() < 0.5
            group.append(Case(completion=gold if correct else gold + "0", gold=gold, expected_reward=float(correct)))
        groups.append(group)
    return groups


def build_code_workload(num_samples: int, group_size: int, hostile_fraction: float, seed: int,
                        sandbox_timeout_s: float) -> list[list[Case]]:
    """`code`: tiny programs (add k to the input; half add the wrong k), one test each; hostile
    ones from _HOSTILE_PROGRAMS, which the sandbox contains: they fail their test (reward 0)."""
    rng = random.Random(seed)
    groups = []
    for start in range(0, num_samples, group_size):
        k, x = rng.randint(1, 99), rng.randint(0, 10_000)
        record = {"tests": [{"input": f"{x}\n", "output": f"{x + k}\n"}], "sandbox_timeout_s": sandbox_timeout_s}
        group = []
        for _ in range(min(group_size, num_samples - start)):
            if rng.random() < hostile_fraction:
                program, expected = rng.choice(_HOSTILE_PROGRAMS), 0.0
            else:
                correct = rng.random() < 0.5
                program = f"n = int(input())\nprint(n + {k if correct else k + 1})"
                expected = float(correct)
            group.append(Case(completion=f"```python\n{program}\n```", gold="", expected_reward=expected,
                              record=record, expected_kinds=("hostile",) if program in _HOSTILE_PROGRAMS else ()))
        groups.append(group)
    return groups


def handled_function(case: Case, score: FunctionScore) -> bool:
    """Plug-in paths: hostile `function` inputs fail with their kind; everything else gets its reward."""
    if case.expected_reward is None:
        return score.failed and score.reward == 0.0 and score.error.split(":", 1)[0] in case.expected_kinds
    if case.expected_kinds == ("hostile",):  # scored 0 by the function, or rejected by the pool's length cap
        return score.reward == 0.0 and (not score.failed or score.error.startswith("rejected"))
    return not score.failed and score.reward == case.expected_reward


def handled(case: Case, result: RewardResult) -> bool:
    """Whether the pool's result is what the case should get."""
    if case.expected_reward is None:
        return result.failed and result.reward == 0.0 and result.error.split(":", 1)[0] in case.expected_kinds
    return result.reward == case.expected_reward and not result.failed


async def _score_one(pool: VerifierPool, case: Case, latencies: list[float], function: str | None,
                     timeout_s: float | None) -> bool:
    """Score one completion; returns whether the result was what the case expected."""
    start = time.perf_counter()
    if function is None:
        (result,) = await pool.score([case.completion], case.gold)
        latencies.append(time.perf_counter() - start)
        return handled(case, result)
    call = {"prompt": {**(case.record or {}), "gt_answer": case.gold}, "completion": case.completion,
            "token_ids": [], "metadata": {}}
    (score,) = await pool.score_function(function, [call], timeout_s)
    latencies.append(time.perf_counter() - start)
    if function == MATH_FUNCTION and case.expected_reward is None:  # its pre-checks answer 0, not failed
        return score.reward == 0.0
    return handled_function(case, score)


async def run(pool: VerifierPool, groups: list[list[Case]], num_clients: int, function: str | None = None,
              timeout_s: float | None = None) -> tuple[list[float], int]:
    """Replay the groups with num_clients groups in flight; returns (latencies_s, mismatches)."""
    latencies: list[float] = []
    mismatches = 0
    pending = iter(groups)

    async def client() -> None:
        nonlocal mismatches
        for group in pending:
            ok = await asyncio.gather(*(_score_one(pool, case, latencies, function, timeout_s) for case in group))
            mismatches += ok.count(False)

    await asyncio.gather(*(client() for _ in range(num_clients)))
    return latencies, mismatches


def bench_once(args: RewardBenchConfig, hostile_fraction: float, evasive_fraction: float, label: str) -> float:
    """One run on a fresh pool; prints its line and returns its samples per second."""
    groups, function, timeout = _workload(args, hostile_fraction, evasive_fraction)
    num_hostile = sum(case.expected_reward is None or bool(case.expected_kinds) for group in groups for case in group)
    pool_args = {"timeout_s": args.timeout_s, "cache_size": args.cache_size, "fast_path": args.fast_path}
    if args.num_processes is not None:
        pool_args["num_processes"] = args.num_processes
    with VerifierPool(**pool_args) as pool:
        if function is not None:
            asyncio.run(_warm_up(pool, groups, function, timeout))
        start = time.perf_counter()
        latencies, mismatches = asyncio.run(run(pool, groups, args.num_clients, function, timeout))
        elapsed = time.perf_counter() - start
    stats = pool.stats()  # after close(): the last replacement process has been counted
    latencies_ms = sorted(1000 * x for x in latencies)
    p99 = latencies_ms[min(len(latencies_ms) - 1, int(0.99 * len(latencies_ms)))]
    samples_per_s = len(latencies) / elapsed
    print(
        f"run={label} reward={args.reward} samples_per_s={samples_per_s:.1f} p99_ms={p99:.1f} "
        f"p50_ms={statistics.median(latencies_ms):.1f} num_processes={stats['num_processes']} "
        f"hostile_fraction={hostile_fraction} evasive_fraction={evasive_fraction} hostile={num_hostile} "
        f"samples={len(latencies)} timeout_s={args.timeout_s} fast_path_on={args.fast_path} rejected={stats['rejected']} "
        f"fast_path={stats['fast_path']} timeouts={stats['timeouts']} restarts={stats['restarts']} "
        f"cache_hits={stats['cache_hits']} function_failed={stats['function_failed']} "
        f"function_timeouts={stats['function_timeouts']} function_crashes={stats['function_crashes']} "
        f"mismatches={mismatches}",
        flush=True,
    )
    return samples_per_s


async def _warm_up(pool: VerifierPool, groups: list[list[Case]], function: str, timeout_s: float | None) -> None:
    """One clean call per process at once (each idle dispatcher takes one), so every process has
    imported the function's module before the timed run; the results are not counted."""
    case = next(c for group in groups for c in group if c.expected_reward is not None and not c.expected_kinds)
    await asyncio.gather(*(_score_one(pool, case, [], function, timeout_s) for _ in range(pool.num_processes)))


def _workload(args: RewardBenchConfig, hostile_fraction: float,
              evasive_fraction: float) -> tuple[list[list[Case]], str | None, float | None]:
    """(groups, the reward function or None for VerifierPool.score, its deadline) of args.reward."""
    if args.reward == "function":
        misbehaving = args.function_hostile == "misbehaving"
        return (build_function_workload(args.num_samples, args.group_size, hostile_fraction, args.seed, misbehaving),
                TRIVIAL, args.function_timeout_s)
    if args.reward == "code":
        return (build_code_workload(args.num_samples, args.group_size, hostile_fraction, args.seed,
                                    args.sandbox_timeout_s), CODE, args.code_function_timeout_s)
    groups = build_workload(args.num_samples, args.group_size, hostile_fraction, args.seed, evasive_fraction)
    return groups, (MATH_FUNCTION if args.reward == "math_function" else None), None


def main(argv: list[str] | None = None) -> None:
    args = load_bench_config(RewardBenchConfig, argv, description=__doc__)
    args = apply_smoke(args, SMOKE)
    setup_logging(logging.ERROR)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    ratios = []
    for index in range(args.rounds):
        suffix = f"_{index + 1}" if args.rounds > 1 else ""
        clean = bench_once(args, 0.0, 0.0, f"clean{suffix}") if args.compare_clean else None
        hostile = bench_once(args, args.hostile_fraction, args.evasive_fraction, f"hostile{suffix}")
        if clean is not None:
            ratios.append(hostile / clean)
            print(f"hostile_over_clean{suffix}={hostile / clean:.3f} clean_samples_per_s={clean:.1f} "
                  f"hostile_samples_per_s={hostile:.1f}", flush=True)
    if len(ratios) > 1:
        print(f"hostile_over_clean_median={statistics.median(ratios):.3f} min={min(ratios):.3f} "
              f"max={max(ratios):.3f} rounds={len(ratios)}")


if __name__ == "__main__":
    main()
