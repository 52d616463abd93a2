"""benchmarks/ stays in shape: scripts run as `python -m benchmarks.NAME` (no sys.path edits), no
benchmark script imports another, tests import none, and every script has a smoke mode that a test
runs, and reads its command line through harness.load_bench_config. Pure (reads source files only,
and calls load_bench_config in this process)."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.paths import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
# Scripts whose smoke mode another test runs (tests/system/test_benchmarks_smoke.py names the rest).
SMOKED_ELSEWHERE = {"soak": "system/test_soak.py", "scale": "system/test_scale_benchmark.py"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _is_script(path: Path) -> bool:
    """A benchmark script has the `if __name__ == "__main__":` entry; library modules have none."""
    return "if __name__ == \"__main__\":" in path.read_text()


def _scripts() -> dict[str, Path]:
    return {p.stem: p for p in sorted(BENCHMARKS.glob("*.py")) if _is_script(p)}


def _benchmark_imports(tree: ast.Module) -> set[str]:
    """benchmarks.<name> modules a file imports (import x / from x import y / from benchmarks import y)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks."))
    return names


def test_there_are_scripts_and_libraries() -> None:
    scripts = _scripts()
    assert {"algorithms", "realistic_run", "soak", "scale"} <= set(scripts)
    assert not {"harness", "process_monitor"} & set(scripts)


def test_no_benchmark_module_edits_sys_path() -> None:
    offenders = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"sys.path used in {offenders}: run scripts as python -m benchmarks.NAME"


def test_scripts_start_themselves_as_modules() -> None:
    """A script that runs itself in a child (torchrun, a per-mode process) does so with `-m`: its
    file path alone would leave the repository root off the child's sys.path."""
    offenders = [name for name, path in _scripts().items() if "__file__" in path.read_text()]
    assert not offenders, f"{offenders} use __file__: start children with -m benchmarks.NAME (cwd REPO_ROOT)"


def test_no_benchmark_script_imports_another() -> None:
    scripts = _scripts()
    offenders = {path.name: sorted(_benchmark_imports(_tree(path)) & set(scripts))
                 for path in sorted(BENCHMARKS.glob("*.py"))}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_no_test_imports_a_benchmark_script() -> None:
    scripts = _scripts()
    offenders = {path.name: sorted(_benchmark_imports(_tree(path)) & set(scripts))
                 for path in sorted((REPO_ROOT / "tests").rglob("*.py"))}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_every_script_has_a_smoke_mode_that_a_test_runs() -> None:
    smoke_tests = (REPO_ROOT / "tests" / "system" / "test_benchmarks_smoke.py").read_text()
    missing_mode, missing_test = [], []
    for name, path in _scripts().items():
        if "SMOKE" not in path.read_text() and "smoke" not in path.read_text():
            missing_mode.append(name)
        elsewhere = SMOKED_ELSEWHERE.get(name)
        if f'Smoke("{name}"' not in smoke_tests and not (
                elsewhere and "--smoke" in (REPO_ROOT / "tests" / elsewhere).read_text()):
            missing_test.append(name)
    assert not missing_mode, f"benchmarks without a smoke mode: {missing_mode}"
    assert not missing_test, f"benchmarks whose smoke mode no test runs: {missing_test}"


def test_every_script_loads_its_own_config_through_load_bench_config() -> None:
    """So a bad value on a benchmark's command line is one line and exit 2, not a traceback
    (harness.load_bench_config); the trainer configs some scripts build for their runs are not
    their command lines."""
    offenders = []
    for name, path in _scripts().items():
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "load_config"
                    and not (node.args and getattr(node.args[0], "id", "") == "TrainerConfig")):
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders, f"scripts loading their config with load_config: {offenders}"


@dataclass(frozen=True)
class _BenchConfig:
    steps: int = 1
    """Steps."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"_BenchConfig.steps must be >= 1, got {self.steps}")


def test_a_refused_value_is_one_line_naming_the_script_and_exit_2(capsys, monkeypatch) -> None:
    from benchmarks.harness import load_bench_config

    monkeypatch.setattr(sys, "argv", ["/repo/benchmarks/some_bench.py", "--steps", "3"])
    assert load_bench_config(_BenchConfig, None) == _BenchConfig(steps=3)  # None: the command line
    with pytest.raises(SystemExit) as stopped:
        load_bench_config(_BenchConfig, ["--steps", "0"])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("some_bench.py: ") and "steps must be >= 1, got 0" in lines[0], lines
