"""Learning parity: the full system against a plain single-process GRPO loop, same start and settings.

    .venv/bin/python -m benchmarks.learning_parity --model_dir runs/demo-assets/model \
        --data runs/demo-assets/arithmetic.jsonl --trainer_config configs/demo.yaml --seeds 0 1 2
    .venv/bin/python -m benchmarks.learning_parity ... --only reference     # the reference alone
    .venv/bin/python -m benchmarks.learning_parity ... -- --optim.lr 3e-4   # trainer flags for both loops

The *reference* is written here from the definitions, sharing no maths with the system: a
Hugging Face model sampled token by token with its own sampler, rewards from math-verify's
`score_completion` in-process, group advantages, reference logprobs from a frozen copy of the
starting model, and the GRPO loss on a padded batch (clipped ratio, per-sample token mean, k1/k2/k3
KL, mean over the step's samples), one backward, clipping and AdamW. It draws the same prompts as
the system (the same `InfiniteDistributedSampler` per rank, concatenated over ranks) and takes
every hyperparameter from the same trainer config. With `--model.lora.r` > 0 it wraps its model in
PEFT's LoRA (the same r, alpha and target modules) and trains only the adapters.

The *system* is `local_cluster.py` (Ray, a vLLM generation worker, a logprob worker, the
ExperienceBatcher, 2 FSDP ranks, weight push) with the same config and seed; with `--attach
<Ray address>` its trainers run on that running local cluster instead (benchmarks/clusters.py,
as the tests' smoke does), which must have the workers local_cluster.py would start.

Printed per seed: the trailing mean reward (over run_report.WINDOW steps) every `--print_every`
steps for both, the step at which each first reached run_report.THRESHOLDS, samples/s, and
`parity=<ratio>`, the system's mean reward over the last 100 steps divided by the reference's
(1.0 = learns as much per step).
The system's time per stage comes from its metrics.jsonl (`timing/*`).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from async_grpo.config.run_config import flattened, load_config, split_passthrough
from async_grpo.data.dataset import load_prompts
from async_grpo.rewards.math_verifier import score_completion
from async_grpo.telemetry.run_report import THRESHOLDS, WINDOW, first_reached, moving_average, read_metrics
from async_grpo.trainer.config import TrainerConfig
from async_grpo.trainer.distributed_sampler import InfiniteDistributedSampler
from benchmarks.clusters import AttachConfig, local_cluster
from benchmarks.harness import (
    apply_smoke, for_trainer, launcher_engine_flags, load_bench_config, REPO_ROOT, run_trainer, setup_logging,
)
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)

PARITY_TAIL = 100  # parity compares mean reward over the last this-many steps
_MAX_LOG_RATIO = 20.0  # the same guard any PPO loss needs so exp() stays finite


SMOKE = {"seeds": [0], "num_steps": 2}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class LearningParityConfig:
    """Command line of `python -m benchmarks.learning_parity`; trainer flags for both loops go after `--`."""

    model_dir: str
    """Starting model (Hugging Face folder)."""
    data: str
    """Prompt JSONL."""
    trainer_config: str = str(REPO_ROOT / "configs" / "demo.yaml")
    """Trainer config file (YAML/TOML) both loops take their settings from (not `--config`: that one
    reads this command's own flags from a file)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds to run, one comparison each."""
    num_steps: int | None = None
    """Steps per run; None: the trainer config's num_steps."""
    world_size: int = 2
    """The system's trainer ranks."""
    only: Literal["reference", "system", "both"] = "both"
    """Which loops to run."""
    eval_data: str | None = None
    """Prompt JSONL for a final greedy accuracy (the system evaluates per its config)."""
    system_runs: str | None = None
    """Take the system's runs from <dir>/demo-seed<seed> (e.g. runs/, after scripts/demo_seeds.sh)
    instead of starting them."""
    out_dir: str = str(REPO_ROOT / "runs" / "learning_parity")
    """Where the reference's records and the system's runs go."""
    print_every: int = 50
    """Print the curves every this many steps."""
    threads: int = 2
    """torch threads of the reference loop."""
    smoke: bool = False
    """Smoke mode: seed 0, 2 steps (SMOKE); checks that the command still runs, its figures mean nothing."""
    cluster: AttachConfig = flattened(AttachConfig())
    """`--attach`: the system's trainers on that running local cluster instead of local_cluster.py's own."""


@dataclass(slots=True)
class Rollout:
    """One sampled completion of one prompt, as the reference loop keeps it."""

    prompt_ids: list[int]
    output_ids: list[int]
    """Sampled tokens, EOS included when the completion finished."""
    reward: float
    advantage: float = 0.0


class ReferenceGRPO:
    """A plain GRPO loop on one process: sample, score, advantages, padded loss, AdamW."""

    def __init__(self, config: TrainerConfig, model_dir: Path, world_size: int, seed: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          attn_implementation="eager")
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        if config.model.lora.enabled:
            # model.lora: PEFT's own LoRA on the plain HF model (no FSDP, no adapter push), so only
            # the adapters train, as in the system.
            from peft import get_peft_model

            self.model = get_peft_model(self.model, config.model.lora.peft_config(str(model_dir)))
        optim = config.optim
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        matrices = [p for p in trainable if p.ndim >= 2]
        vectors = [p for p in trainable if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": optim.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
            lr=optim.lr, betas=optim.betas, eps=optim.eps,
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.prompts = load_prompts(config.data, self.tokenizer)
        self.samplers = [InfiniteDistributedSampler(len(self.prompts), r, world_size, config.seed)
                         for r in range(world_size)]
        self._reward_cache: dict[tuple[str, str], float] = {}
        self.step = 0

    # ---- sampling ----------------------------------------------------------------------------

    def _padded(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ids, attention mask and positions (0 at each sequence's first real token)."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return ids, mask, positions

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """n completions per prompt, token by token at the configured temperature and top-p."""
        sampling = self.config.experience.sampling
        sequences = [list(p) for p in prompt_ids for _ in range(sampling.n)]
        outputs: list[list[int]] = [[] for _ in sequences]
        done = [False] * len(sequences)
        self.model.eval()
        for _ in range(sampling.max_tokens):
            ids, mask, positions = self._padded([s + o for s, o in zip(sequences, outputs)])
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                use_cache=False).logits[:, -1].float()
            probs = self._sampling_probs(logits)
            tokens = torch.multinomial(probs, 1, generator=self.generator)[:, 0].tolist()
            for i, token in enumerate(tokens):
                if not done[i]:
                    outputs[i].append(token)
                    done[i] = token == self.eos
            if all(done):
                break
        self.model.train()
        return outputs

    @torch.no_grad()
    def greedy_accuracy(self, prompts: list[Sample]) -> float:
        """Share of prompts whose greedy completion earns the full reward."""
        outputs: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        self.model.eval()
        for _ in range(self.config.experience.sampling.max_tokens):
            ids, mask, positions = self._padded([p.input_token_ids + o for p, o in zip(prompts, outputs)])
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            for i, token in enumerate(logits[:, -1].argmax(dim=-1).tolist()):
                if not done[i]:
                    outputs[i].append(token)
                    done[i] = token == self.eos
        self.model.train()
        return sum(self.reward(o, p.gt_answer) >= 1.0 for o, p in zip(outputs, prompts)) / len(prompts)

    def _sampling_probs(self, logits: torch.Tensor) -> torch.Tensor:
        sampling = self.config.experience.sampling
        probs = torch.softmax(logits / max(sampling.temperature, 1e-6), dim=-1)
        if sampling.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs > sampling.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
        return probs

    # ---- rewards and advantages --------------------------------------------------------------

    def reward(self, output_ids: list[int], gt_answer: str) -> float:
        """math-verify's verdict; a completion without EOS (cut off at max_tokens) earns the
        configured truncated reward instead, as the generation worker does."""
        truncated_reward = self.config.experience.sampling.truncated_reward
        if (not output_ids or output_ids[-1] != self.eos) and truncated_reward is not None:
            return float(truncated_reward)
        text = self.tokenizer.decode([t for t in output_ids if t != self.eos], skip_special_tokens=True)
        key = (text, gt_answer)
        if key not in self._reward_cache:
            self._reward_cache[key] = float(score_completion(text, gt_answer).reward)
        return self._reward_cache[key]

    def advantages(self, rewards: list[float]) -> list[float]:
        """(r - mean) / (population std + eps) (grpo), or r - mean (dr_grpo); 0 for equal rewards."""
        algorithm = self.config.experience.algorithm
        if algorithm.estimator not in ("grpo", "dr_grpo") or algorithm.prepare_batch is not None:
            raise ValueError(f"the reference loop writes out grpo and dr_grpo only, not {algorithm.estimator}")
        mean = sum(rewards) / len(rewards)
        if max(rewards) == min(rewards):
            return [0.0] * len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        scale = (std + algorithm.advantage_eps) if algorithm.estimator == "grpo" else 1.0
        return [(r - mean) / scale for r in rewards]

    # ---- the loss on a padded batch ----------------------------------------------------------

    def _token_logprobs(self, model: torch.nn.Module, rollouts: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, O] logprobs of each rollout's output tokens (right-padded), and the [B, O] mask."""
        sequences = [r.prompt_ids + r.output_ids for r in rollouts]
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        logp_all = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:, None])[..., 0]
        out_width = max(len(r.output_ids) for r in rollouts)
        logp = torch.zeros((len(rollouts), out_width))
        out_mask = torch.zeros((len(rollouts), out_width))
        for i, r in enumerate(rollouts):
            start = len(r.prompt_ids) - 1  # position predicting the first output token
            logp[i, :len(r.output_ids)] = logp_all[i, start:start + len(r.output_ids)]
            out_mask[i, :len(r.output_ids)] = 1.0
        return logp, out_mask

    def loss(self, logp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, mask: torch.Tensor,
             advantages: torch.Tensor) -> torch.Tensor:
        """Mean over samples of each sample's token-mean of the clipped PPO term plus the KL term."""
        lc = self.config.loss
        ratio = torch.exp((logp - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        adv = advantages[:, None]
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - lc.clip_low, 1 + lc.clip_high) * adv)
        if lc.kl_coef > 0:
            d = (ref - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # log ref/pi
            kl = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1.0}[lc.kl_estimator]
            per_token = per_token + lc.kl_coef * kl
        per_sample = (per_token * mask).sum(dim=1) / mask.sum(dim=1)
        return per_sample.mean()

    def lr_factor(self, step: int) -> float:
        optim = self.config.optim
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / (optim.total_steps - optim.warmup_steps))
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def train_step(self) -> dict[str, float]:
        """Draw the step's prompts, sample, score, and take epochs_per_step optimizer steps."""
        started = time.perf_counter()
        prompts: list[Sample] = []
        for sampler in self.samplers:
            prompts += [self.prompts[i] for i in sampler.next_batch(self.config.prompts_per_rank)]
        outputs = self.sample([p.input_token_ids for p in prompts])
        n = self.config.experience.sampling.n
        rollouts: list[Rollout] = []
        for k, prompt in enumerate(prompts):
            group = [Rollout(prompt.input_token_ids, o, self.reward(o, prompt.gt_answer))
                     for o in outputs[k * n:(k + 1) * n]]
            for r, a in zip(group, self.advantages([r.reward for r in group])):
                r.advantage = a
            rollouts += group
        sample_s = time.perf_counter() - started
        advantages = torch.tensor([r.advantage for r in rollouts])
        with torch.no_grad():
            ref = self._token_logprobs(self.ref_model, rollouts)[0] if self.config.loss.kl_coef > 0 else None
        old = None
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = self.config.optim.lr * self.lr_factor(self.step)
        for _ in range(self.config.epochs_per_step):
            logp, mask = self._token_logprobs(self.model, rollouts)
            if old is None:
                old = logp.detach()
            loss = self.loss(logp, old, ref, mask, advantages)
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                           self.config.optim.max_grad_norm)
            self.optimizer.step()
        self.step += 1
        rewards = [r.reward for r in rollouts]
        return {"step": self.step - 1, "reward/mean": sum(rewards) / len(rewards),
                "time_s": 0.0, "timing/step_s": time.perf_counter() - started, "timing/sample_s": sample_s,
                "samples": float(len(rollouts))}


def run_reference(config: TrainerConfig, model_dir: Path, seed: int, num_steps: int, world_size: int,
                  out: Path, eval_path: Path | None = None) -> list[dict[str, float]]:
    """The reference loop for num_steps; records written to out as JSONL. With eval_path, the
    last record carries the greedy accuracy on those prompts as eval/accuracy."""
    loop = ReferenceGRPO(config, model_dir, world_size, seed)
    records = []
    began = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for _ in range(num_steps):
            record = loop.train_step()
            record["time_s"] = time.perf_counter() - began
            records.append(record)
            f.write(json.dumps(record) + "\n")
            f.flush()
            if record["step"] % 50 == 0:
                recent = [r["reward/mean"] for r in records[-WINDOW:]]
                logger.info("reference seed %d step %d: %d-step mean reward %.3f (%.2f s/step)", seed,
                            record["step"], WINDOW, sum(recent) / len(recent), record["timing/step_s"])
        if eval_path is not None:
            eval_prompts = load_prompts(replace(config.data, path=str(eval_path)), loop.tokenizer)
            records[-1]["eval/accuracy"] = loop.greedy_accuracy(eval_prompts)
            f.write(json.dumps({"final_eval_accuracy": records[-1]["eval/accuracy"]}) + "\n")
    return records


def run_system(args: LearningParityConfig, num_steps: int, trainer_args: list[str], seed: int,
               run_dir: Path) -> list[dict[str, float]]:
    """The full system through local_cluster.py, as the demo runs it (its engine uncompiled in smoke
    mode), or on the cluster at args.cluster.attach; trainer_args go last."""
    trainer = ["--config", str(args.trainer_config), "--data.path", str(args.data), "--seed", str(seed),
               "--num_steps", str(num_steps), "--progress_bar", "false", "--tensorboard", "false",
               "--checkpoint_every", "0", *trainer_args]
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    if args.cluster.attach:
        from local_cluster import LocalClusterConfig

        trainer = ["--run_dir", str(run_dir), "--model.model_path", str(args.model_dir), *trainer]
        logger.info("system seed %d on the cluster at %s: %s", seed, args.cluster.attach, " ".join(trainer))
        cluster_config = for_trainer(LocalClusterConfig(model_path=str(args.model_dir), log_dir=str(run_dir)), trainer)
        with local_cluster(cluster_config, args.cluster.attach) as cluster:
            return run_trainer(cluster, trainer, run_dir, nproc_per_node=args.world_size, log=log).require(num_steps)
    command = [sys.executable, str(REPO_ROOT / "local_cluster.py"), "--model_path", str(args.model_dir),
               "--run_dir", str(run_dir), "--nproc_per_node", str(args.world_size),
               *launcher_engine_flags(args.smoke), "--", *trainer]
    logger.info("system seed %d: %s", seed, " ".join(command))
    with log.open("w") as f:
        subprocess.run(command, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    return read_metrics(run_dir / "metrics.jsonl")


def first_step_at(records: list[dict[str, float]], threshold: float) -> int | None:
    index = first_reached(records, threshold, WINDOW)
    return None if index is None else records[index]["step"]


def tail_mean(records: list[dict[str, float]]) -> float:
    tail = records[-PARITY_TAIL:]
    return sum(r["reward/mean"] for r in tail) / len(tail)


def samples_per_s(records: list[dict[str, float]], key_samples: str) -> float:
    total = sum(r[key_samples] for r in records)
    return total / sum(r["timing/step_s"] for r in records)


def final_eval_accuracy(records: list[dict[str, float]]) -> float | None:
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return evals[-1] if evals else None


def describe(name: str, records: list[dict[str, float]], key_samples: str) -> str:
    reached = ", ".join(f"{t}: step {first_step_at(records, t)}" for t in THRESHOLDS)
    accuracy = final_eval_accuracy(records)
    evaluated = "" if accuracy is None else f"; final greedy eval accuracy {accuracy:.3f}"
    return (f"{name:9s} last-{PARITY_TAIL} mean reward {tail_mean(records):.3f}; {WINDOW}-step mean first >= "
            f"{reached}{evaluated}; {samples_per_s(records, key_samples):.0f} samples/s; median step "
            f"{statistics.median(r['timing/step_s'] for r in records):.3f} s")


def system_timing(records: list[dict[str, float]]) -> str:
    keys = sorted(k for k in records[0] if k.startswith("timing/"))
    return ", ".join(f"{k.removeprefix('timing/')}={statistics.median(r.get(k, 0.0) for r in records):.3f}"
                     for k in keys)


def print_curves(seed: int, runs: dict[str, list[dict[str, float]]], every: int) -> None:
    smoothed = {name: moving_average([r["reward/mean"] for r in recs], WINDOW) for name, recs in runs.items()}
    print(f"seed {seed}: {WINDOW}-step mean reward per step")
    print("  step " + " ".join(f"{name:>9s}" for name in runs))
    length = min(len(s) for s in smoothed.values())
    for i in list(range(every - 1, length, every)) + ([length - 1] if (length - 1) % every != every - 1 else []):
        print(f"  {i:4d} " + " ".join(f"{smoothed[name][i]:9.3f}" for name in runs))


def main(argv: list[str] | None = None) -> None:
    own, trainer_args = split_passthrough(sys.argv[1:] if argv is None else argv)
    args = load_bench_config(LearningParityConfig, own, description=__doc__)
    args = apply_smoke(args, SMOKE)
    setup_logging()
    torch.set_num_threads(args.threads)
    model_dir, out_dir = Path(args.model_dir), Path(args.out_dir)
    eval_data = Path(args.eval_data) if args.eval_data else None
    base = ["--config", str(args.trainer_config), "--data.path", str(args.data),
            "--model.model_path", str(args.model_dir)]
    # The system evaluates per its config when given the held-out file; without one, it does not.
    eval_args = ["--eval.data.path", str(args.eval_data)] if args.eval_data else ["--eval.every", "0"]
    base += eval_args
    config = load_config(TrainerConfig, base + trainer_args)
    num_steps = args.num_steps or config.num_steps
    summary = []
    for seed in args.seeds:
        seeded = load_config(TrainerConfig, base + ["--seed", str(seed)] + trainer_args)
        runs: dict[str, list[dict[str, float]]] = {}
        if args.only in ("reference", "both"):
            runs["reference"] = run_reference(seeded, model_dir, seed, num_steps, args.world_size,
                                              out_dir / f"reference_seed{seed}.jsonl", eval_data)
        if args.only in ("system", "both"):
            if args.system_runs is not None:
                runs["system"] = read_metrics(Path(args.system_runs) / f"demo-seed{seed}" / "metrics.jsonl")[:num_steps]
            else:
                runs["system"] = run_system(args, num_steps, eval_args + trainer_args, seed,
                                            out_dir / f"system_seed{seed}")
        print_curves(seed, runs, args.print_every)
        keys = {"reference": "samples", "system": "counts/samples"}
        for name, records in runs.items():
            line = describe(name, records, keys[name])
            print("  " + line)
            summary.append(f"seed {seed} {line}")
        if "system" in runs:
            print(f"  system timing (median s): {system_timing(runs['system'])}")
        if len(runs) == 2:
            ratio = tail_mean(runs["system"]) / max(tail_mean(runs["reference"]), 1e-9)
            print(f"  parity={ratio:.3f}")
            summary.append(f"seed {seed} parity={ratio:.3f}")
    print("\n".join(["summary:"] + summary))


if __name__ == "__main__":
    main()
