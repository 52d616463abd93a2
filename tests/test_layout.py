"""The layering rules of the top-level modules, and that every module is installable.

The rules (README, "How the code is laid out"), read from the source with `ast`, imports inside
functions included, and followed transitively through project modules:

- the pure files (records, maths, names, config loading) import no Ray, vLLM or torch.distributed;
- no worker-side file imports the trainer or its training-only modules;
- the trainer imports no worker module (it reaches workers through registries and the batcher);
- project imports form no cycle.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p.stem for p in REPO_ROOT.glob("*.py"))

PURE = ("advantages", "algorithm", "arithmetic_data", "batcher_messages", "capacity_queue", "distributed_sampler",
        "group_preparer", "grpo_loss", "lease_book", "math_verifier", "optimizer", "packed_attention",
        "prompt_record", "ray_env", "reasoning_gym_tasks", "reward_failure", "rewards", "round_tracker",
        "run_config", "sample_processing_utils", "sampling", "step_stats", "token_budget_queue", "token_versions",
        "versions", "worker_options", "environments")
FORBIDDEN_IN_PURE = ("ray", "vllm", "torch.distributed")
WORKER_SIDE = ("batch_calls", "logprob_worker", "rollout_fetcher", "rollout_scoring", "verifier_cluster",
               "verifier_pool", "verifier_process", "vllm_experience_batcher", "vllm_registry", "vllm_worker",
               "weight_files", "weight_reload", "weight_transfer_engine", "worker_dispatcher",
               "worker_lifecycle", "multi_turn", "tool_environment", "openai_endpoint",
               "verifiers_rollouts", "verifiers_env", "verifiers_arith", "served_adapters")
TRAINER_ONLY = ("checkpoint", "data_path", "evaluation", "fsdp_setup", "metrics", "optimizer", "trainer_core",
                "weight_pusher", "weight_transfer_trainer")
WORKER_MODULES = ("logprob_worker", "rollout_scoring", "verifier_cluster", "verifier_pool", "verifier_process",
                  "vllm_worker", "weight_files", "weight_reload", "weight_transfer_engine",
                  "worker_dispatcher", "served_adapters")


@cache
def imports_of(module: str) -> frozenset[str]:
    """Every module name `module`'s source imports (dotted, as written), at any depth of the file."""
    tree = ast.parse((REPO_ROOT / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(names)


def project_imports(module: str) -> set[str]:
    return {name for name in imports_of(module) if name in MODULES}


def closure(module: str) -> set[str]:
    """`module` and every project module it imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(project_imports(current))
    return seen


def test_the_rule_lists_name_existing_modules():
    for name in (*PURE, *WORKER_SIDE, *TRAINER_ONLY, *WORKER_MODULES):
        assert name in MODULES, f"{name}.py is named in a layering rule but does not exist"


@pytest.mark.parametrize("module", PURE)
def test_pure_files_import_no_ray_vllm_or_torch_distributed(module):
    for reached in sorted(closure(module)):
        bad = sorted(name for name in imports_of(reached)
                     if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IN_PURE))
        assert not bad, f"{module}.py reaches {reached}.py, which imports {bad}"


@pytest.mark.parametrize("module", WORKER_SIDE)
def test_worker_side_files_do_not_import_the_trainer(module):
    bad = sorted(closure(module) & set(TRAINER_ONLY))
    assert not bad, f"{module}.py imports trainer-only module(s) {bad} (directly or through others)"


def test_the_trainer_imports_no_worker_module():
    bad = sorted(closure("trainer_core") & set(WORKER_MODULES))
    assert not bad, f"trainer_core.py imports worker module(s) {bad} (directly or through others)"


@pytest.mark.parametrize("module", MODULES)
def test_no_module_imports_ray_private_api(module):
    # Private modules move between Ray releases without notice. (ray_cluster.py uses two names of
    # ray._raylet, the GCS client and Ray's config refresh, which no public API offers; versions.py
    # pins Ray to 2.60.x and every entry point checks it.)
    bad = sorted(name for name in imports_of(module) if name.startswith("ray._private"))
    assert not bad, f"{module}.py imports Ray's private {bad}: use Ray's public API or documented variables"


def test_project_imports_form_no_cycle():
    visiting, done = set(), set()

    def visit(module: str, path: list[str]) -> None:
        if module in done:
            return
        assert module not in visiting, f"import cycle: {' -> '.join(path + [module])}"
        visiting.add(module)
        for dep in sorted(project_imports(module)):
            visit(dep, path + [module])
        visiting.discard(module)
        done.add(module)

    for module in MODULES:
        visit(module, [])


def test_pyproject_lists_every_top_level_module():
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["py-modules"])
    assert listed == set(MODULES), (f"pyproject.toml py-modules: missing {sorted(set(MODULES) - listed)}, "
                                    f"extra {sorted(listed - set(MODULES))}")


@pytest.mark.system
def test_a_non_editable_install_imports_from_another_directory(tmp_path):
    """`pip install .` (no editable link), then every entry point imports with the checkout off the path."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *(f"{m}.py" for m in MODULES)):
        shutil.copy2(REPO_ROOT / name, source / name)
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # --no-deps / --no-build-isolation: the test environment already has every dependency and the
    # build backend, and CI may be offline.
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    probe = ("import importlib, sys\n"
             f"for name in {MODULES!r}:\n"
             "    module = importlib.import_module(name)\n"
             "    print(name, module.__file__)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.splitlines():
        name, path = line.split(" ", 1)
        assert Path(path).resolve().is_relative_to(target.resolve()), f"{name} imported from {path}, not the install"
