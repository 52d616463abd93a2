"""The README's plan command runs as written, and gives the demo's engine on one 80 GiB GPU a KV
cache sized to the demo (not vLLM's 0.92 of the card)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from support.paths import REPO_ROOT


def readme_plan_command() -> list[str]:
    """The words of the README's `local_cluster.py ... --dry_run true` command, continuations joined."""
    text = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if "local_cluster.py" in b and "--dry_run true" in b]
    return shlex.split(block.replace("\\\n", " "))


def test_the_readmes_plan_command_sizes_the_demos_engine_to_the_demo(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import local_cluster

    words = readme_plan_command()
    args = words[words.index("local_cluster.py") + 1:]
    # The demo's files where this test has them: the bundled tiny model's shape is the demo's.
    args = [str(tiny_model_dir) if a == "runs/demo-assets/model" else a.replace("runs/", f"{tmp_path}/")
            for a in args]
    assert local_cluster.main(args) == 0
    out = capsys.readouterr().out
    share = float(re.search(r"gpu_memory_utilization ([0-9.]+) per engine", out).group(1))
    assert share < 0.1, out  # a few GiB of an 80 GiB card, not vLLM's 0.92
    kv = re.search(r"KV cache ([0-9.]+) GiB \((\d+) blocks of 16 tokens, sized to the run's sequences in flight\), "
                   r"max_num_seqs (\d+)", out)
    assert kv, out
    # 2 ranks x 16 prompts x 16 samples (max_lag 0) of 16 + 4 tokens: 2 blocks each, 1.25 headroom.
    assert (int(kv.group(2)), int(kv.group(3))) == (1280, 512), out
    assert "engine settings for CUDA" in out and "max_num_seqs 512" in out
