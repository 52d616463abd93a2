"""Make the tool demo's starting model and data: a tiny Qwen2 that knows how to call the calculator
and how to read its answer, but calls it only sometimes and cannot add 3-digit numbers itself.

    python scripts/prepare_tool_demo.py --out_dir runs/tool-demo-assets

1. Writes a randomly initialised tiny Qwen2 + char tokenizer (tiny_model.write_tiny_model), the
   demo's shape.
2. Supervised warm-up on two kinds of completions of "347+285=", mixed at `tool_fraction`:
   - a tool episode, exactly as ToolEnvironment (format "text") runs it: the call
     `<tool_call>{"name":"calculator","arguments":{"expression":"347+285"}}</tool_call>` and EOS,
     the observation `<tool_response>632</tool_response>` (context: masked out of the loss, as in
     training), then the answer `632` and EOS;
   - a direct answer: a *random* 3-digit sum and EOS (like scripts/prepare_demo.py's warm-up, the
     shape of an answer without the arithmetic).
   So the model starts knowing the tool's mechanics (copy the operands into a call, copy the
   result out) but choosing it in about `tool_fraction` of its rollouts; its direct answers are
   guesses. What GRPO must learn is *when to call the tool*: every rise in reward comes from
   rollouts that chose it being rewarded, and the same model without the tool has nothing to
   learn from (scripts/demo_tools.sh runs both).
3. Writes the training prompts: sums a+b with a, b in [100, 499] (so a sum is always 3 digits,
   and 160,000 distinct problems: far more than the model could memorise in a run).

The SFT loss is the mean negative logprob of the sampled (mask True) tokens, computed with the
trainer's own packed path (TokenLogprobModel over get_input_for_logprobs, which leaves the
observation tokens out of the labels); the model is saved with save_pretrained (safetensors).
"""

from __future__ import annotations

import logging
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # prepare_demo, also when loaded by path

from prepare_demo import supervised_warm_up  # noqa: E402

from async_grpo.config.run_config import load_config  # noqa: E402
from async_grpo.demo_assets.arithmetic_data import write_arithmetic_dataset  # noqa: E402
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model  # noqa: E402
from async_grpo.rollouts.tool_environment import tool_call_text, tool_response_text  # noqa: E402
from sample_processing_utils import Sample  # noqa: E402

logger = logging.getLogger("prepare_tool_demo")

MIN_OPERAND, MAX_OPERAND = 100, 499  # both operands 3 digits, the sum too (200..998)


@dataclass(kw_only=True, frozen=True)
class PrepareToolDemoConfig:
    """Command line of `python scripts/prepare_tool_demo.py`."""

    out_dir: str
    """Folder to write model/ and sums.jsonl to."""
    tool_fraction: float = 0.1
    """How often the warmed model chooses the calculator: the share of warm-up completions whose
    first token ('<' of the call, trained) opens a tool call; the others answer with a random sum."""
    episode_fraction: float = 0.5
    """Share of warm-up completions that are tool episodes. Those beyond tool_fraction keep their
    first token out of the loss: they teach the call's mechanics (copying operands, reading the
    answer) without teaching the choice."""
    warmup_steps: int = 800
    """Supervised warm-up steps."""
    warmup_batch_size: int = 32
    """Completions per warm-up step."""
    warmup_lr: float = 3e-3
    """AdamW learning rate of the warm-up."""
    num_prompts: int = 4000
    """Training prompts written to sums.jsonl."""
    seed: int = 0
    """Seed of the model's initialisation, the warm-up and the training prompts."""

    def __post_init__(self) -> None:
        if not 0.0 < self.tool_fraction <= self.episode_fraction < 1.0:
            raise ValueError("PrepareToolDemoConfig needs 0 < tool_fraction <= episode_fraction < 1, got "
                             f"tool_fraction={self.tool_fraction!r}, episode_fraction={self.episode_fraction!r}")
        for name in ("warmup_steps", "warmup_batch_size", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"PrepareToolDemoConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.warmup_lr > 0:
            raise ValueError(f"PrepareToolDemoConfig.warmup_lr must be > 0, got {self.warmup_lr!r}")


def tool_episode(tokenizer, a: int, b: int, train_choice: bool = True) -> Sample:
    """"a+b=" -> call the calculator, read its answer (masked), write it: as ToolEnvironment runs it.
    train_choice False leaves the call's first token (the choice to call) out of the loss."""
    eos = tokenizer.eos_token_id
    call = _ids(tokenizer, tool_call_text("calculator", {"expression": f"{a}+{b}"})) + [eos]
    observation = _ids(tokenizer, tool_response_text(str(a + b)))
    answer = _ids(tokenizer, str(a + b)) + [eos]
    mask = [True] * len(call) + [False] * len(observation) + [True] * len(answer)
    mask[0] = train_choice
    return Sample(input_token_ids=_ids(tokenizer, f"{a}+{b}="), gt_answer=str(a + b),
                  output_token_ids=call + observation + answer, output_mask=mask)


def direct_guess(tokenizer, a: int, b: int, rng: random.Random) -> Sample:
    """"a+b=" -> a random 3-digit sum and EOS: the answer's shape, not the arithmetic."""
    guess = rng.randint(2 * MIN_OPERAND, 2 * MAX_OPERAND)
    return Sample(input_token_ids=_ids(tokenizer, f"{a}+{b}="), gt_answer=str(a + b),
                  output_token_ids=_ids(tokenizer, str(guess)) + [tokenizer.eos_token_id])


def warmup_batch(tokenizer, args: PrepareToolDemoConfig, rng: random.Random) -> list[Sample]:
    """Tool episodes (episode_fraction of them; the choice trained on tool_fraction) and guesses.
    Among completions whose first token is trained, tool_fraction / (1 - episode_fraction +
    tool_fraction) open a call: the warmed model's tool rate."""
    samples = []
    for _ in range(args.warmup_batch_size):
        a, b = rng.randint(MIN_OPERAND, MAX_OPERAND), rng.randint(MIN_OPERAND, MAX_OPERAND)
        draw = rng.random()
        if draw < args.episode_fraction:
            samples.append(tool_episode(tokenizer, a, b, train_choice=draw < args.tool_fraction))
        else:
            samples.append(direct_guess(tokenizer, a, b, rng))
    return samples


def warm_up(model_dir: Path, args: PrepareToolDemoConfig) -> None:
    """Supervised steps on the mixture; saves the result over model_dir."""
    supervised_warm_up(model_dir, lambda tokenizer, rng: warmup_batch(tokenizer, args, rng), args.warmup_steps,
                       args.warmup_lr, args.seed, what="tool warm-up", loss_name="sampled-token NLL")


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def main(argv: list[str] | None = None) -> None:
    args = load_config(PrepareToolDemoConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    out_dir = Path(args.out_dir)
    model_dir = write_tiny_model(out_dir / "model", TinyModelConfig(seed=args.seed))
    warm_up(model_dir, args)
    data_path = write_arithmetic_dataset(out_dir / "sums.jsonl", num_samples=args.num_prompts, seed=args.seed,
                                         min_operand=MIN_OPERAND, max_operand=MAX_OPERAND)
    print(f"model: {model_dir}\ndata: {data_path}")


if __name__ == "__main__":
    main()
