"""Which dtypes, head sizes and engine settings vLLM's CPU build runs on this CPU, and which crash.

    .venv/bin/python scripts/cpu_engine_dtypes.py               # the grid: ~30 s per case on 2 cores
    .venv/bin/python scripts/cpu_engine_dtypes.py --head_dims 32 --dtypes bfloat16 --eager both

Each case writes a random tiny Qwen2 of that head size (4 heads, 2 layers, the demo's char
tokenizer), starts `vllm.LLM` on it in a child process and generates 8 tokens greedily. A case
either prints `ok`, or `crashed` with the last line of the child's error output (vLLM's CPU
build in bfloat16 kills its worker process on some CPUs: async_grpo/inference/engine_dtype.py).
The CPU's flags that matter (avx2, avx512_bf16, amx_bf16, amx_tile) head the output, so a result
names the machine it came from. No timing is measured here: this is a boundary probe; its
results are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from async_grpo.config.run_config import load_config  # noqa: E402
from async_grpo.inference.engine_dtype import cpu_flags  # noqa: E402

logger = logging.getLogger(__name__)

_NUM_HEADS = 4
_CASE_TIMEOUT_S = 300.0  # an engine start takes ~30 s on 2 cores; a hang is a result too
_CHILD = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], enforce_eager=sys.argv[3] == "1",
          kv_cache_memory_bytes=64 * 2**20, max_model_len=256, seed=0)
out = llm.generate(["3+4="], SamplingParams(max_tokens=8, temperature=0.0))
print("GENERATED", repr(out[0].outputs[0].text))
"""


@dataclass(kw_only=True, frozen=True)
class ProbeConfig:
    """The grid to probe."""

    head_dims: tuple[int, ...] = (32, 64, 128)
    """Attention head sizes (the demo's tiny model has 32)."""
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    """Engine dtypes to try."""
    eager: str = "true"
    """'true': enforce_eager only (fast starts), 'false': compiled only, 'both'."""

    def __post_init__(self) -> None:
        if self.eager not in ("true", "false", "both"):
            raise ValueError(f"ProbeConfig.eager must be 'true', 'false' or 'both', got {self.eager!r}")


def run_case(model_dir: Path, dtype: str, eager: bool) -> tuple[str, str]:
    """('ok' | 'crashed' | 'hung', detail) for one engine start and generation."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(model_dir), dtype, "1" if eager else "0"],
                              capture_output=True, text=True, timeout=_CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "hung", f"no result in {_CASE_TIMEOUT_S:.0f} s"
    generated = [line for line in done.stdout.splitlines() if line.startswith("GENERATED")]
    if done.returncode == 0 and generated:
        return "ok", generated[-1]
    errors = [line.strip() for line in done.stderr.splitlines() if "Error" in line or "died" in line]
    return "crashed", (errors[-1] if errors else f"exit {done.returncode}")[:200]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(ProbeConfig, argv, description=__doc__)
    from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model

    print(f"cpu flags: {' '.join(cpu_flags()) or '(none of avx2/avx512_bf16/amx_bf16/amx_tile)'}", flush=True)
    eagers = {"true": (True,), "false": (False,), "both": (True, False)}[config.eager]
    with tempfile.TemporaryDirectory() as tmp:
        for head_dim in config.head_dims:
            model_dir = write_tiny_model(Path(tmp) / f"head{head_dim}",
                                         TinyModelConfig(hidden_size=head_dim * _NUM_HEADS, num_heads=_NUM_HEADS))
            for dtype in config.dtypes:
                for eager in eagers:
                    verdict, detail = run_case(model_dir, dtype, eager)
                    print(f"head_dim={head_dim} dtype={dtype} enforce_eager={eager}: {verdict}  {detail}", flush=True)


if __name__ == "__main__":
    main()
