"""Where on-policy distillation's per-token signal sits: the student samples, both models score.

    .venv/bin/python -m benchmarks.distill_token_probe --teacher_path runs/alg-check-seed0/checkpoints/step_000450

For the first `--num_prompts` prompts of the demo's data, the student (HF `generate`, temperature
1, no top-k/top-p) samples `--samples` completions each; the student and the teacher then score
every sampled token with a plain HF forward. Printed: one completion per prompt with each token's
log p_student - log p_teacher (the sampled-token reverse KL; distillation's advantage is its
negative), then the mean gap by output position, and
`distill_token_probe: mean_token_mean_gap=<mean over samples of each one's token mean>`.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, replace

import torch

from async_grpo.data.dataset import DatasetConfig, load_prompts
from benchmarks.harness import load_bench_config, REPO_ROOT

SMOKE = {"num_prompts": 2, "samples": 2}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class ProbeConfig:
    """Command line of `python -m benchmarks.distill_token_probe`."""

    teacher_path: str = ""
    """The teacher checkpoint (sharing the student's tokenizer); required unless --smoke (which
    takes the student as its own teacher)."""
    student_path: str = str(REPO_ROOT / "runs" / "demo-assets" / "model")
    """The student: the demo's start."""
    data_path: str = str(REPO_ROOT / "runs" / "demo-assets" / "arithmetic.jsonl")
    """Prompts."""
    num_prompts: int = 12
    samples: int = 4
    """Completions sampled per prompt."""
    max_new_tokens: int = 16
    seed: int = 0
    smoke: bool = False
    """Smoke mode: 2 prompts x 2 samples, the student as the teacher (SMOKE); checks that the command still runs,
    its figures mean nothing."""

    def __post_init__(self) -> None:
        if not self.teacher_path and not self.smoke:
            raise ValueError("ProbeConfig.teacher_path must be set (a trained demo checkpoint)")


def token_logprobs(model: torch.nn.Module, sequence: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """log p(token) of every output token of `sequence` (1-D ids), from the full logits."""
    with torch.no_grad():
        logits = model(sequence[None]).logits[0, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, sequence[prompt_len:, None])[:, 0]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_bench_config(ProbeConfig, argv, description=__doc__)
    if config.smoke:
        config = replace(config, **SMOKE, teacher_path=config.teacher_path or config.student_path)
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.student_path)
    student = AutoModelForCausalLM.from_pretrained(config.student_path).eval()
    teacher = AutoModelForCausalLM.from_pretrained(config.teacher_path).eval()
    prompts = load_prompts(DatasetConfig(path=config.data_path), tokenizer)[:config.num_prompts]
    by_position: dict[int, list[float]] = {}
    sample_means = []
    for prompt in prompts:
        ids = torch.tensor([prompt.input_token_ids])
        for k in range(config.samples):
            sequence = student.generate(ids, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                        max_new_tokens=config.max_new_tokens,
                                        pad_token_id=tokenizer.eos_token_id)[0]
            gap = token_logprobs(student, sequence, ids.shape[1]) - token_logprobs(teacher, sequence, ids.shape[1])
            if k == 0:
                tokens = [tokenizer.decode([t]) for t in sequence[ids.shape[1]:]]
                print(f"{tokenizer.decode(prompt.input_token_ids)[-12:]!r} answer {prompt.gt_answer}: "
                      + " ".join(f"{t!r}:{g:+.1f}" for t, g in zip(tokens, gap.tolist())))
            for position, value in enumerate(gap.tolist()):
                by_position.setdefault(position, []).append(value)
            sample_means.append(gap.mean().item())
    print("mean gap by output position: " + ", ".join(
        f"{p}: {statistics.fmean(v):+.2f} (n={len(v)})" for p, v in sorted(by_position.items())))
    print(f"distill_token_probe: mean_token_mean_gap={statistics.fmean(sample_means):.3f} "
          f"over {len(sample_means)} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
