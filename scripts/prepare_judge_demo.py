"""Make the judge demo's judge: a tiny Qwen2 that answers "yes" or "no" to "a+b=c" by whether c is the sum.

    python scripts/prepare_judge_demo.py --out_dir runs/demo-judge-assets

The judge demo trains the demo's policy (scripts/prepare_demo.py) with a model judge's verdict as
its only reward (sampling.reward.judge: verdict yes_no, system "", user "{prompt}{completion}"), so
the judge sees the prompt and the policy's completion run together, e.g. "3+4=7".

1. Writes a randomly initialised tiny Qwen2 + char tokenizer (demo_assets/arithmetic_judge.py, a
   seed of its own) to <out_dir>/judge, and gives the tokenizer JUDGE_CHAT_TEMPLATE: the messages'
   contents only (a non-empty system message, a newline, then the user message) and, for
   add_generation_prompt, GENERATION_MARK ("?"), the position the verdict is read from. The judge
   worker renders it as transformers and vLLM both load it (tokenizer.chat_template).
2. Supervised training (prepare_demo.supervised_warm_up: the answer-token NLL, a cosine lr) on
   the rendered chat of "a+b=" + completion, answered "yes" and EOS when the completion is exactly
   str(a+b), "no" and EOS otherwise. Half the examples are true sums; the other half are what the policy may write
   instead (judge_example): a wrong sum 0..18, a longer number (up to 4 characters), a number with
   junk after it, junk alone, or nothing. The judge is stricter than math-verify: "7 " or "07"
   are "no", so a policy that learns from it writes the bare sum.
3. Measures the trained judge with transformers' greedy `generate` on the same rendering and reads
   each reply with the yes_no rule (judge_template.parse_verdict): every problem against every
   completion 0..18 (1,900 cases, 100 of them true), and a seeded set of junk completions; prints
   the figures and writes them to <out_dir>/judge/judge_accuracy.json. The demo's policy learns
   to fool a judge that says "yes" to a wrong sum, so the 1,900-case table is what must be right.

With --group_wise true it makes the group-wise judge instead (sampling.reward.judge.group_wise:
one request per group, JUDGE_GROUP_TEMPLATE's user "{prompt}\n{answers}"), written to
<out_dir>/judge-group with <out_dir>/judge_group_template.yaml. It sees "a+b=", a newline and the
group's answers numbered as judge_template.numbered_answers writes them, and replies one line
"K: yes" or "K: no" per answer, then EOS (judge_template.parse_group_verdict reads it). Training
groups (group_example) hold group_size answers, a random number of them (0 to group_size) the true
sum and the rest negatives as above, in random order: an early policy is mostly wrong, a late one
mostly right. Its shape is group_num_layers x group_hidden_size. Measured the same way (greedy,
replies read by parse_group_verdict): per-answer accuracy over num_eval_groups random groups, the
share of replies that parse, and the 1,900-case table's pairs placed in groups of one problem.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import string
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # prepare_demo, also when loaded by path

from prepare_demo import MAX_SUM, supervised_warm_up  # noqa: E402

from async_grpo.config.judge_config import JudgeConfig  # noqa: E402
from async_grpo.config.run_config import load_config  # noqa: E402
from async_grpo.demo_assets.arithmetic_judge import (  # noqa: E402
    JUDGE_GROUP_TEMPLATE, JUDGE_TEMPLATE, write_judge_model, write_judge_template,
)
from async_grpo.demo_assets.tiny_model import TinyModelConfig  # noqa: E402
from async_grpo.inference.judge_models import chat_text, chat_token_ids  # noqa: E402
from async_grpo.rewards.judge_template import (  # noqa: E402
    group_messages, parse_group_verdict, parse_verdict, sample_messages,
)
from sample_processing_utils import Sample  # noqa: E402
from setup_model import load_causal_lm, load_tokenizer  # noqa: E402

logger = logging.getLogger("prepare_judge_demo")

YES, NO = "yes", "no"
MAX_COMPLETION_CHARS = 4  # the demo samples at most 4 tokens, one character each
# How the judge demo judges (scripts/demo_judge.sh): its templates, read by the yes/no rule.
SAMPLE_RULE = JudgeConfig(**JUDGE_TEMPLATE, verdict="yes_no")
GROUP_RULE = JudgeConfig(**JUDGE_GROUP_TEMPLATE, verdict="yes_no", group_wise=True)
# Characters of the junk the judge must refuse: the policy's whole alphabet (printable ASCII and
# newline), the digits included.
JUNK_CHARACTERS = string.printable[:95] + "\n"
# Kinds of negative examples and their shares among the negatives. Wrong sums dominate: they are
# what the 1,900-case table asks about and what a policy learning addition writes most.
NEGATIVE_KINDS: dict[str, float] = {"wrong_sum": 0.7, "long_number": 0.1, "number_then_junk": 0.1,
                                    "junk": 0.07, "empty": 0.03}


@dataclass(kw_only=True, frozen=True)
class PrepareJudgeDemoConfig:
    """Command line of `python scripts/prepare_judge_demo.py`."""

    out_dir: str
    """Folder to write judge/ (the model, its tokenizer and judge_accuracy.json) to."""
    # Steps and a decaying lr chosen by the runs in benchmarks/RESULTS.md, "The judge demo": a
    # constant lr learnt the sums far slower, and fewer steps left wrong sums judged "yes".
    steps: int = 5000
    """Supervised training steps."""
    batch_size: int = 64
    """Judged completions per step (half of them true sums)."""
    lr: float = 1e-3
    """AdamW learning rate at the first step; it decays to 0 by the last (cosine)."""
    positive_fraction: float = 0.5
    """Share of training completions that are the true sum (answered yes)."""
    seed: int = 1
    """Seed of the judge's initialisation and training; the demo's policy uses seed 0."""
    num_junk_eval: int = 500
    """Random junk completions the accuracy check adds to the 1,900-case table."""
    group_wise: bool = False
    """Make the group-wise judge (one reply of "K: yes|no" lines per group) in <out_dir>/judge-group
    instead of the per-sample one; batch_size then counts groups and positive_fraction is unused."""
    group_size: int = 16
    """Answers per group (the demo's sampling.n)."""
    group_num_layers: int = 4
    """Decoder layers of the group-wise judge."""
    group_hidden_size: int = 128
    """Residual width of the group-wise judge (its MLP is twice as wide)."""
    num_eval_groups: int = 300
    """Random groups the group-wise accuracy check judges."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "num_junk_eval", "group_size", "group_num_layers",
                     "group_hidden_size", "num_eval_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"PrepareJudgeDemoConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"PrepareJudgeDemoConfig.lr must be > 0, got {self.lr!r}")
        if not 0.0 < self.positive_fraction < 1.0:
            raise ValueError("PrepareJudgeDemoConfig.positive_fraction must be in (0, 1), "
                             f"got {self.positive_fraction!r}")


def is_correct(a: int, b: int, completion: str) -> bool:
    """The judge's truth: the completion is exactly the sum, written plainly."""
    return completion == str(a + b)


def judged_text(a: int, b: int, completion: str) -> str:
    """What the judge's user message holds under the demo's template "{prompt}{completion}"."""
    return f"{a}+{b}={completion}"


def judge_messages(a: int, b: int, completion: str, system: str = "") -> list[dict[str, str]]:
    """The chat the judge worker sends for one answer under JUDGE_TEMPLATE (`system` in place of
    its empty rubric: no system message when "")."""
    template = dataclasses.replace(SAMPLE_RULE.template(), system=system)
    return sample_messages(SAMPLE_RULE, template, prompt=f"{a}+{b}=", completion=completion, gt_answer=str(a + b))


def render(tokenizer, messages: list[dict[str, str]]) -> str:
    """The judge's prompt text, as the judge worker renders it."""
    return chat_text(tokenizer, messages, generation_prompt=True)


def prompt_ids(tokenizer, a: int, b: int, completion: str) -> list[int]:
    return chat_token_ids(tokenizer, judge_messages(a, b, completion), generation_prompt=True)


def _junk(rng: random.Random, min_chars: int, max_chars: int) -> str:
    return "".join(rng.choice(JUNK_CHARACTERS) for _ in range(rng.randint(min_chars, max_chars)))


def negative_completion(a: int, b: int, kind: str, rng: random.Random) -> str:
    """A completion of "a+b=" that is not the sum, of one of NEGATIVE_KINDS."""
    total = a + b
    while True:
        if kind == "wrong_sum":
            text = str(rng.choice([c for c in range(MAX_SUM + 1) if c != total]))
        elif kind == "long_number":  # 2 to 4 digits: the wrong 2-digit sums and beyond the largest sum
            text = str(rng.randint(10, 10 ** rng.randint(2, MAX_COMPLETION_CHARS) - 1))
        elif kind == "number_then_junk":  # the true sum or another number, then junk
            number = str(total if rng.random() < 0.5 else rng.randint(0, MAX_SUM))
            text = number + _junk(rng, 1, max(1, MAX_COMPLETION_CHARS - len(number)))
        elif kind == "junk":
            text = _junk(rng, 1, MAX_COMPLETION_CHARS)
        elif kind == "empty":
            text = ""
        else:
            raise ValueError(f"unknown negative kind {kind!r}; known: {sorted(NEGATIVE_KINDS)}")
        if not is_correct(a, b, text):
            return text


def judge_example(rng: random.Random, positive_fraction: float) -> tuple[int, int, str, str]:
    """(a, b, completion, the judge's answer): the true sum at positive_fraction, else a negative."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < positive_fraction:
        return a, b, str(a + b), YES
    kind = rng.choices(list(NEGATIVE_KINDS), weights=list(NEGATIVE_KINDS.values()))[0]
    return a, b, negative_completion(a, b, kind, rng), NO


def judge_batch(tokenizer, batch_size: int, positive_fraction: float, rng: random.Random) -> list[Sample]:
    """Rendered judge prompts with the answer ("yes" or "no", then EOS) as the trained output."""
    samples = []
    for _ in range(batch_size):
        a, b, completion, answer = judge_example(rng, positive_fraction)
        output = list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        samples.append(Sample(input_token_ids=prompt_ids(tokenizer, a, b, completion), gt_answer=answer,
                              output_token_ids=output))
    return samples


def eval_cases(num_junk: int, seed: int) -> list[tuple[str, int, int, str]]:
    """(group, a, b, completion): every problem x every completion 0..MAX_SUM (group "table"), then
    num_junk seeded junk completions (group "junk": random characters, numbers with junk after them)."""
    cases = [("table", a, b, str(c)) for a in range(10) for b in range(10) for c in range(MAX_SUM + 1)]
    rng = random.Random(f"judge-eval-{seed}")
    for _ in range(num_junk):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        kind = rng.choice(["junk", "number_then_junk", "long_number", "empty"])
        cases.append(("junk", a, b, negative_completion(a, b, kind, rng)))
    return cases


@torch.no_grad()
def greedy_replies(model, tokenizer, prompts: list[list[int]], max_new_tokens: int = 4,
                   batch_size: int = 256) -> list[str]:
    """transformers' greedy generate on each prompt, batched by prompt length (no padding, so each
    prompt is run exactly as alone); replies decoded without special tokens."""
    replies: list[str] = [""] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            input_ids = torch.tensor([prompts[i] for i in chunk])
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            for i, row in zip(chunk, out[:, input_ids.shape[1]:]):
                replies[i] = tokenizer.decode(row, skip_special_tokens=True)
    return replies


def measure(model_dir: Path, num_junk: int, seed: int) -> dict[str, Any]:
    """The judge's greedy accuracy (its yes_no verdict against is_correct) per group of eval_cases."""
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    cases = eval_cases(num_junk, seed)
    replies = greedy_replies(model, tokenizer, [prompt_ids(tokenizer, a, b, c) for _, a, b, c in cases])
    groups: dict[str, list[bool]] = {"table": [], "table_positives": [], "table_negatives": [], "junk": []}
    unparsable, wrong, reply_counts = 0, [], Counter(replies)
    for (group, a, b, completion), reply in zip(cases, replies):
        verdict = parse_verdict(reply, SAMPLE_RULE)
        truth = is_correct(a, b, completion)
        right = verdict.score is not None and (verdict.score == 1.0) == truth
        unparsable += verdict.score is None
        groups[group].append(right)
        if group == "table":
            groups["table_positives" if truth else "table_negatives"].append(right)
        if not right and len(wrong) < 20:
            wrong.append({"judged": judged_text(a, b, completion), "reply": reply, "correct": truth})
    result: dict[str, Any] = {name: {"accuracy": sum(flags) / len(flags), "cases": len(flags)}
                              for name, flags in groups.items()}
    result["unparsable_replies"] = unparsable
    result["replies"] = dict(reply_counts.most_common(5))  # "yes" and "no" alone, when it stops with EOS
    result["first_mistakes"] = wrong
    return result


def group_reply(labels: list[str]) -> str:
    """The group-wise judge's reply: one "K: <verdict>" line per answer, K from 1."""
    return "\n".join(f"{k}: {label}" for k, label in enumerate(labels, start=1))


def group_example(rng: random.Random, group_size: int) -> tuple[int, int, list[str], list[str]]:
    """(a, b, completions, their labels): a random number (0 to group_size) of true sums and
    negatives of NEGATIVE_KINDS for the rest, in random order."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    num_right = rng.randint(0, group_size)
    kinds = list(NEGATIVE_KINDS)
    completions = [str(a + b)] * num_right + [
        negative_completion(a, b, rng.choices(kinds, weights=list(NEGATIVE_KINDS.values()))[0], rng)
        for _ in range(group_size - num_right)]
    rng.shuffle(completions)
    return a, b, completions, [YES if is_correct(a, b, c) else NO for c in completions]


def group_chat(a: int, b: int, completions: list[str]) -> list[dict[str, str]]:
    """The chat the judge worker sends for a group under JUDGE_GROUP_TEMPLATE."""
    return group_messages(GROUP_RULE, GROUP_RULE.template(), prompt=f"{a}+{b}=", completions=completions,
                          gt_answer=str(a + b))


def group_prompt_ids(tokenizer, a: int, b: int, completions: list[str]) -> list[int]:
    return chat_token_ids(tokenizer, group_chat(a, b, completions), generation_prompt=True)


def group_batch(tokenizer, batch_size: int, group_size: int, rng: random.Random) -> list[Sample]:
    """Rendered group prompts with the reply ("1: yes\n2: no..." then EOS) as the trained output."""
    samples = []
    for _ in range(batch_size):
        a, b, completions, labels = group_example(rng, group_size)
        output = list(tokenizer(group_reply(labels), add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        samples.append(Sample(input_token_ids=group_prompt_ids(tokenizer, a, b, completions),
                              gt_answer=str(a + b), output_token_ids=output))
    return samples


def longest_group_tokens(tokenizer, group_size: int) -> int:
    """Prompt + reply + EOS tokens of the longest group: every answer MAX_COMPLETION_CHARS long and
    judged "yes" (the longer verdict)."""
    prompt = group_prompt_ids(tokenizer, 9, 9, ["x" * MAX_COMPLETION_CHARS] * group_size)
    return len(prompt) + len(tokenizer(group_reply([YES] * group_size), add_special_tokens=False)["input_ids"]) + 1


def table_groups(group_size: int, seed: int) -> list[tuple[int, int, list[str], list[bool]]]:
    """The 1,900-case table in groups of one problem: each problem's 19 completions 0..MAX_SUM,
    shuffled, fill its groups in turn, the last topped up with repeats of the others. The flags mark
    each pair's first showing (the one it is scored by)."""
    rng = random.Random(f"judge-table-groups-{seed}")
    groups = []
    for a in range(10):
        for b in range(10):
            pending = [str(c) for c in range(MAX_SUM + 1)]
            rng.shuffle(pending)
            while pending:
                shown, pending = pending[:group_size], pending[group_size:]
                fill = [str(c) for c in rng.choices(range(MAX_SUM + 1), k=group_size - len(shown))]
                order = list(range(group_size))
                rng.shuffle(order)
                items = [(c, True) for c in shown] + [(c, False) for c in fill]
                items = [items[i] for i in order]
                groups.append((a, b, [c for c, _ in items], [first for _, first in items]))
    return groups


def measure_groups(model_dir: Path, group_size: int, num_groups: int, seed: int) -> dict[str, Any]:
    """The group-wise judge's greedy accuracy: per answer over num_groups random groups and over the
    table's pairs (table_groups), with the share of replies parse_group_verdict reads."""
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    rng = random.Random(f"judge-group-eval-{seed}")
    cases = [("random", a, b, completions, [True] * group_size)
             for a, b, completions, _ in (group_example(rng, group_size) for _ in range(num_groups))]
    cases += [("table", a, b, completions, first) for a, b, completions, first in table_groups(group_size, seed)]
    max_new = longest_group_tokens(tokenizer, group_size) - len(group_prompt_ids(tokenizer, 9, 9, ["x" * 4] * group_size)) + 4
    replies = greedy_replies(model, tokenizer, [group_prompt_ids(tokenizer, a, b, c) for _, a, b, c, _ in cases],
                             max_new_tokens=max_new)
    flags: dict[str, list[bool]] = {"random": [], "table": [], "table_positives": [], "table_negatives": []}
    parsed: dict[str, list[bool]] = {"random": [], "table": []}
    wrong: list[dict[str, Any]] = []
    for (name, a, b, completions, scored), reply in zip(cases, replies):
        verdict = parse_group_verdict(reply, group_size, GROUP_RULE)
        parsed[name].append(verdict.scores is not None)
        for k, (completion, counted) in enumerate(zip(completions, scored)):
            if not counted:
                continue
            truth = is_correct(a, b, completion)
            right = verdict.scores is not None and (verdict.scores[k] == 1.0) == truth
            flags[name].append(right)
            if name == "table":
                flags["table_positives" if truth else "table_negatives"].append(right)
            if not right and len(wrong) < 20:
                wrong.append({"prompt": f"{a}+{b}=", "answer": k + 1, "completion": completion, "correct": truth,
                              "reply_parsed": verdict.scores is not None})
    result: dict[str, Any] = {f"{name}_per_answer": {"accuracy": sum(f) / len(f), "cases": len(f)}
                              for name, f in flags.items()}
    for name, f in parsed.items():
        result[f"{name}_groups_parsable"] = {"share": sum(f) / len(f), "groups": len(f)}
    result["longest_example_tokens"] = longest_group_tokens(tokenizer, group_size)
    result["first_unparsable_replies"] = [r for r, (_, a, b, c, _) in zip(replies, cases)
                                          if parse_group_verdict(r, group_size, GROUP_RULE).scores is None][:3]
    result["first_mistakes"] = wrong
    return result


def main_group_wise(args: PrepareJudgeDemoConfig) -> None:
    """The group-wise judge: <out_dir>/judge-group and <out_dir>/judge_group_template.yaml."""
    shape = TinyModelConfig(num_layers=args.group_num_layers, hidden_size=args.group_hidden_size,
                            intermediate_size=2 * args.group_hidden_size)
    model_dir = write_judge_model(Path(args.out_dir) / "judge-group", args.seed, shape)
    logger.info("longest group example: %d tokens", longest_group_tokens(load_tokenizer(model_dir), args.group_size))
    started = time.monotonic()
    supervised_warm_up(model_dir, lambda tokenizer, rng: group_batch(tokenizer, args.batch_size, args.group_size, rng),
                       args.steps, args.lr, args.seed, log_every=25, what="group judge training", cosine=True)
    trained_s = time.monotonic() - started
    result = measure_groups(model_dir, args.group_size, args.num_eval_groups, args.seed)
    result["training"] = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                          "num_layers": args.group_num_layers, "hidden_size": args.group_hidden_size,
                          "seconds": round(trained_s, 1)}
    (model_dir / "judge_accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    for name in ("random", "table", "table_positives", "table_negatives"):
        entry = result[f"{name}_per_answer"]
        print(f"{name}: per-answer accuracy {entry['accuracy']:.4f} over {entry['cases']} answers")
    for name in ("random", "table"):
        entry = result[f"{name}_groups_parsable"]
        print(f"{name}: {entry['share']:.4f} of {entry['groups']} groups parsable")
    template = write_judge_template(Path(args.out_dir) / "judge_group_template.yaml", group_wise=True)
    print(f"judge: {model_dir}\ntemplate: {template}")


def main(argv: list[str] | None = None) -> None:
    args = load_config(PrepareJudgeDemoConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    if args.group_wise:
        main_group_wise(args)
        return
    model_dir = write_judge_model(Path(args.out_dir) / "judge", args.seed)
    supervised_warm_up(model_dir, lambda tokenizer, rng: judge_batch(tokenizer, args.batch_size,
                                                                     args.positive_fraction, rng),
                       args.steps, args.lr, args.seed, log_every=250, what="judge training", cosine=True)
    result = measure(model_dir, args.num_junk_eval, args.seed)
    (model_dir / "judge_accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    for name in ("table", "table_positives", "table_negatives", "junk"):
        print(f"{name}: accuracy {result[name]['accuracy']:.4f} over {result[name]['cases']} cases")
    template = write_judge_template(Path(args.out_dir) / "judge_template.yaml")
    print(f"unparsable replies: {result['unparsable_replies']}\njudge: {model_dir}\ntemplate: {template}")


if __name__ == "__main__":
    main()
