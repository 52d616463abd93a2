"""The judge demo's figures per run: greedy accuracy by math-verify at each evaluation, when it
first reached the target, and how far the judge agreed with math-verify over the run.

    python scripts/demo_judge_report.py --runs runs/demo-judge-s0 runs/demo-judge-s1 runs/demo-judge-s2

Prints one line per run, then a markdown table of all of them (docs/rewards.md keeps it). Every
figure comes from the run's metrics.jsonl: `eval/accuracy` (eval.reward math_verify),
`reward/judge_agreement`, `reward/judge` and `reward/math_verify_reward` (per step, over every
generated answer), and what judging cost: the median step's `judge/requests`, `judge/tokens_in` +
`judge/tokens_out`, `judge/latency_s_mean` and `timing/step_s` (group-wise against per-sample).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from async_grpo.config.run_config import load_config  # noqa: E402
from async_grpo.telemetry.run_report import EVAL_ACCURACY, read_metrics  # noqa: E402

AGREEMENT = "reward/judge_agreement"
JUDGE_REWARD = "reward/judge"
MATH_VERIFY_REWARD = "reward/math_verify_reward"
JUDGE_REQUESTS, JUDGE_TOKENS_IN, JUDGE_TOKENS_OUT = "judge/requests", "judge/tokens_in", "judge/tokens_out"
JUDGE_LATENCY = "judge/latency_s_mean"
STEP_SECONDS = "timing/step_s"
EDGE_STEPS = 50
"""Steps at each end of a run whose agreement is reported apart (a judge fooled late shows there)."""
START_STEPS = 10
"""First steps whose math-verify mean stands for the starting model's sampled accuracy."""


@dataclass(kw_only=True, frozen=True)
class JudgeReportConfig:
    """Command line of `python scripts/demo_judge_report.py`."""

    runs: list[str]
    """Run directories (each with the trainer's metrics.jsonl)."""
    target: float = 0.8
    """The greedy accuracy the demo aims at; the table says the first evaluation reaching it."""


@dataclass(slots=True, frozen=True)
class JudgeRunSummary:
    """One run's figures."""

    name: str
    steps: int
    evals: list[tuple[int, float]]
    """(step, eval/accuracy) of each evaluation."""
    first_at_target: int | None
    agreement_all: float | None
    agreement_first: float | None
    agreement_last: float | None
    math_verify_start: float | None
    """Mean reward/math_verify_reward over the first START_STEPS steps: where the policy started."""
    judge_last: float | None
    """Mean reward/judge over the last EDGE_STEPS steps: what the policy was paid."""
    math_verify_last: float | None
    """Mean reward/math_verify_reward over the same steps: how often it was right."""
    requests_median: float | None
    """Median over steps of judge/requests (retries included)."""
    tokens_median: float | None
    """Median over steps of the judge's tokens, request and reply."""
    latency_median: float | None
    """Median over steps of judge/latency_s_mean."""
    step_s_median: float | None
    """Median over steps of timing/step_s."""


def _mean(records: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values) if values else None


def _median(records: Sequence[dict[str, Any]], *keys: str) -> float | None:
    """The median over steps that carry every key of the keys' sum."""
    values = [sum(r[key] for key in keys) for r in records if all(key in r for key in keys)]
    return statistics.median(values) if values else None


def summarize(run_dir: Path, target: float) -> JudgeRunSummary:
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [(int(r["step"]), float(r[EVAL_ACCURACY])) for r in records if EVAL_ACCURACY in r]
    first = next((step for step, accuracy in evals if accuracy >= target), None)
    last = records[-EDGE_STEPS:]
    return JudgeRunSummary(
        name=run_dir.name, steps=len(records), evals=evals, first_at_target=first,
        agreement_all=_mean(records, AGREEMENT), agreement_first=_mean(records[:EDGE_STEPS], AGREEMENT),
        agreement_last=_mean(last, AGREEMENT), math_verify_start=_mean(records[:START_STEPS], MATH_VERIFY_REWARD),
        judge_last=_mean(last, JUDGE_REWARD),
        math_verify_last=_mean(last, MATH_VERIFY_REWARD), requests_median=_median(records, JUDGE_REQUESTS),
        tokens_median=_median(records, JUDGE_TOKENS_IN, JUDGE_TOKENS_OUT),
        latency_median=_median(records, JUDGE_LATENCY), step_s_median=_median(records, STEP_SECONDS))


def _text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def line(s: JudgeRunSummary, target: float) -> str:
    evals = ", ".join(f"{accuracy:.2f}@{step}" for step, accuracy in s.evals) or "none"
    reached = f"step {s.first_at_target}" if s.first_at_target is not None else "not reached"
    return (f"{s.name}: {s.steps} steps; sampled answers right (math-verify) over the first {START_STEPS} steps "
            f"{_text(s.math_verify_start)}; greedy accuracy (math-verify) {evals}; >= {target:g} at {reached}; "
            f"judge agreement {_text(s.agreement_all)} (first {EDGE_STEPS} steps {_text(s.agreement_first)}, "
            f"last {_text(s.agreement_last)}); last {EDGE_STEPS} steps: judge paid {_text(s.judge_last)}, "
            f"math-verify {_text(s.math_verify_last)}; median step: {_count(s.requests_median)} judge requests, "
            f"{_count(s.tokens_median)} judge tokens, judge latency {_text(s.latency_median)} s, "
            f"step {_text(s.step_s_median)} s")


def table(summaries: Sequence[JudgeRunSummary], target: float) -> str:
    rows = [f"| run | steps | first {START_STEPS} steps: right | greedy accuracy at each evaluation | first >= "
            f"{target:g} | agreement (all / first {EDGE_STEPS} / last {EDGE_STEPS}) | last {EDGE_STEPS}: judge / "
            "math-verify | median step: judge requests / tokens / latency s | median step s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        evals = ", ".join(f"{accuracy:.2f} ({step})" for step, accuracy in s.evals)
        first = f"step {s.first_at_target}" if s.first_at_target is not None else "not reached"
        rows.append(f"| {s.name} | {s.steps} | {_text(s.math_verify_start)} | {evals} | {first} | {_text(s.agreement_all)} / "
                    f"{_text(s.agreement_first)} / {_text(s.agreement_last)} | {_text(s.judge_last)} / "
                    f"{_text(s.math_verify_last)} | {_count(s.requests_median)} / {_count(s.tokens_median)} / "
                    f"{_text(s.latency_median)} | {_text(s.step_s_median)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    config = load_config(JudgeReportConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    summaries = [summarize(Path(run), config.target) for run in config.runs]
    for s in summaries:
        print(line(s, config.target))
    print()
    print(table(summaries, config.target))


if __name__ == "__main__":
    main()
