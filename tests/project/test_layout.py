"""The layout and its layering rules, read from the source with `ast` (imports inside functions
included, followed transitively through project modules), and that `pip install .` installs it.

The rules are declared once, over folders, in async_grpo/__init__.py (LAYERS, PURE, WORKER_SIDE,
TRAINER_SIDE); the README's layout section describes them. Here they are enforced:

- the root holds the spine (SPINE below) and nothing else; every other module is in a folder of
  the package;
- a package folder imports only folders of earlier layers, and of the spine only its shared files
  (grpo_loss, sample_processing_utils, setup_model), never a service or launcher;
- the pure folders reach no Ray, vLLM or torch.distributed;
- worker-side folders (or modules, in a folder split between the sides) never reach trainer-side
  ones, and the reverse; the trainer reaches no worker module; a split folder's other modules
  reach neither side;
- the trainer side (its folders and modules, and trainer_core) imports nothing of the generation
  side (rollouts/, inference/), at any depth: the records both read live on the ground floor (config/);
- project imports form no cycle.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

import async_grpo
from support.paths import REPO_ROOT

PACKAGE = "async_grpo"
SPINE_SHARED = ("grpo_loss", "sample_processing_utils", "setup_model")
"""Spine files the package may import: the loss, the sample records, model loading."""
SPINE_WORKERS = ("vllm_worker", "logprob_worker", "worker_dispatcher")
SPINE_SERVICES = ("trainer_core", *SPINE_WORKERS, "vllm_registry", "vllm_experience_batcher", "local_cluster")
SPINE = (*SPINE_SHARED, *SPINE_SERVICES)
FOLDERS = tuple(folder for layer in async_grpo.LAYERS for folder in layer)
FORBIDDEN_IN_PURE = ("ray", "vllm", "torch.distributed")


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for the spine and every package module (no __init__)."""
    files = {path.stem: path for path in REPO_ROOT.glob("*.py")}
    for path in sorted((REPO_ROOT / PACKAGE).rglob("*.py")):
        if path.name != "__init__.py":
            files[".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)] = path
    return files


MODULES = _module_files()


def folder_of(module: str) -> str | None:
    """The package folder holding `module` ('rewards' for 'async_grpo.rewards.sandbox'), else None."""
    parts = module.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 2 else None


def on_side(module: str, side: tuple[str, ...]) -> bool:
    """True when `module` runs on `side` (async_grpo.WORKER_SIDE or TRAINER_SIDE): its folder is
    listed, or it matches a 'folder.pattern' entry of a folder split between the sides."""
    folder = folder_of(module)
    local = module.removeprefix(f"{PACKAGE}.")
    return folder is not None and any(entry == folder or ("." in entry and fnmatch.fnmatchcase(local, entry))
                                       for entry in side)


SPLIT_FOLDERS = tuple(sorted({entry.split(".")[0] for entry in (*async_grpo.WORKER_SIDE, *async_grpo.TRAINER_SIDE)
                              if "." in entry}))
"""Folders holding both sides' modules (weights/: each transport's publisher and receiver)."""


def layer_of(folder: str) -> int:
    return next(i for i, layer in enumerate(async_grpo.LAYERS) if folder in layer)


@cache
def imports_of(module: str) -> frozenset[str]:
    """Every module name `module`'s source imports (dotted, as written), at any depth of the file."""
    tree = ast.parse(MODULES[module].read_text())
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


def closure(module: str, imports: Callable[[str], set[str]] = project_imports) -> set[str]:
    """`module` and every project module it imports (`imports`: at any depth of each file, by
    default), directly or through others."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(imports(current))
    return seen


def test_the_root_holds_the_spine_and_the_package_its_folders():
    assert sorted(p.stem for p in REPO_ROOT.glob("*.py")) == sorted(SPINE), (
        "the root holds the spine only: move other modules into a folder of async_grpo/")
    for path in (REPO_ROOT / PACKAGE).rglob("*.py"):
        parts = path.relative_to(REPO_ROOT / PACKAGE).parts
        if parts != ("__init__.py",):
            assert len(parts) == 2 and parts[0] in FOLDERS, f"{path}: modules live in one of {FOLDERS}"
    for folder in FOLDERS:
        assert (REPO_ROOT / PACKAGE / folder / "__init__.py").is_file(), f"async_grpo/{folder}/ lacks __init__.py"


def test_the_rules_name_existing_folders():
    for name in (*async_grpo.PURE, *async_grpo.WORKER_SIDE, *async_grpo.GENERATION_SIDE, *async_grpo.TRAINER_SIDE):
        assert name.split(".")[0] in FOLDERS, f"async_grpo/__init__.py names folder {name!r}, which LAYERS lacks"
    for entry in (e for e in (*async_grpo.WORKER_SIDE, *async_grpo.TRAINER_SIDE) if "." in e):
        assert any(on_side(m, (entry,)) for m in MODULES), f"async_grpo/__init__.py's {entry!r} matches no module"
    assert len(set(FOLDERS)) == len(FOLDERS), "a folder appears in two layers"
    on_disk = {p.name for p in (REPO_ROOT / PACKAGE).iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert on_disk == set(FOLDERS), f"folders on disk {sorted(on_disk)} != LAYERS {sorted(FOLDERS)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if folder_of(m)))
def test_a_folder_imports_earlier_layers_and_the_spines_shared_files_only(module):
    own = folder_of(module)
    for name in sorted(project_imports(module)):
        folder = folder_of(name)
        if folder is None:
            assert name in SPINE_SHARED, (f"{module} imports the spine's {name}: the package imports only "
                                          f"{SPINE_SHARED} of the spine")
        elif folder != own:
            assert layer_of(folder) < layer_of(own), (
                f"{module} ({own}, layer {layer_of(own)}) imports {name} ({folder}, layer {layer_of(folder)}): "
                f"a folder imports only folders of earlier layers (async_grpo/__init__.py LAYERS)")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if folder_of(m) in async_grpo.PURE))
def test_pure_folders_reach_no_ray_vllm_or_torch_distributed(module):
    for reached in sorted(closure(module)):
        bad = sorted(name for name in imports_of(reached)
                     if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IN_PURE))
        assert not bad, f"{module} reaches {reached}, which imports {bad}"


def _reaches(module: str, side: tuple[str, ...], spine: tuple[str, ...] = ()) -> list[str]:
    return sorted(m for m in closure(module) if on_side(m, side) or m in spine)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if on_side(m, async_grpo.WORKER_SIDE))
                         + list(SPINE_WORKERS))
def test_worker_side_reaches_no_trainer_side(module):
    bad = _reaches(module, async_grpo.TRAINER_SIDE, ("trainer_core",))
    assert not bad, f"{module} (worker side) reaches trainer-side {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if on_side(m, async_grpo.TRAINER_SIDE))
                         + ["trainer_core"])
def test_trainer_side_reaches_no_worker_side(module):
    bad = _reaches(module, async_grpo.WORKER_SIDE, SPINE_WORKERS)
    assert not bad, f"{module} (trainer side) reaches worker-side {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if on_side(m, async_grpo.TRAINER_SIDE))
                         + ["trainer_core"])
def test_trainer_side_imports_no_generation_side(module):
    bad = _reaches(module, async_grpo.GENERATION_SIDE)
    assert not bad, (f"{module} (trainer side) reaches generation-side {bad}: a record both sides read "
                     f"belongs on the ground floor (async_grpo/config/)")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if folder_of(m) in SPLIT_FOLDERS
                                          and not on_side(m, async_grpo.WORKER_SIDE)
                                          and not on_side(m, async_grpo.TRAINER_SIDE)))
def test_a_split_folders_shared_modules_reach_neither_side(module):
    bad = _reaches(module, (*async_grpo.WORKER_SIDE, *async_grpo.TRAINER_SIDE), (*SPINE_WORKERS, "trainer_core"))
    assert not bad, f"{module} (shared by both sides) reaches {bad}"


def _import_time_names(module: str) -> set[str]:
    """What `module` imports while it is being imported: module and class bodies, not functions
    (which import when called) nor `if TYPE_CHECKING:` blocks."""
    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.Try, ast.With, ast.ClassDef)):
                visit(node.body)

    visit(ast.parse(MODULES[module].read_text()).body)
    return names


LIGHT_ENTRY_POINTS = ("worker_dispatcher", "local_cluster")
"""Processes that check their flags and inputs before they do anything heavy: importing them
reaches no torch, so a bad flag is one line in ~0.5 s instead of ~2 s (torch's import)."""
HEAVY_LIBRARIES = ("torch", "transformers", "vllm")
TENSOR_FREE_ACTORS = ("vllm_experience_batcher", "vllm_registry", "async_grpo.rewards.math_verify_pool")
"""Ray actors that handle no tensors, started once per run (and once per cluster in the suite):
their processes import none of the heavy libraries, ~1.5 CPU-s each (torch alone ~1.1)."""


@pytest.mark.parametrize("module", LIGHT_ENTRY_POINTS + TENSOR_FREE_ACTORS)
def test_launchers_and_tensor_free_actors_import_no_heavy_library(module):
    for reached in sorted(closure(module, lambda m: {n for n in _import_time_names(m) if n in MODULES})):
        heavy = sorted(n for n in _import_time_names(reached) if n.split(".")[0] in HEAVY_LIBRARIES)
        assert not heavy, f"importing {module} imports {reached}, which imports {heavy} at import time"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_ray_private_api(module):
    # Private modules move between Ray releases without notice. (ray_cluster.py uses two names of
    # ray._raylet, the GCS client and Ray's config refresh, which no public API offers; versions.py
    # pins Ray to 2.60.x and every entry point checks it.)
    bad = sorted(name for name in imports_of(module) if name.startswith("ray._private"))
    assert not bad, f"{module} imports Ray's private {bad}: use Ray's public API or documented variables"


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


def test_pyproject_installs_the_spine_and_the_package():
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(config["py-modules"]) == sorted(SPINE)
    assert config["packages"]["find"]["include"] == [f"{PACKAGE}*"]


@pytest.mark.system
def test_a_non_editable_install_imports_from_another_directory(tmp_path):
    """`pip install .` (no editable link), then every module imports with the checkout off the path."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *(f"{m}.py" for m in SPINE)):
        shutil.copy2(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / PACKAGE, source / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # --no-deps / --no-build-isolation: the test environment already has every dependency and the
    # build backend, and CI may be offline.
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    names = sorted(MODULES)
    probe = ("import importlib, sys\n"
             f"for name in {names!r}:\n"
             "    module = importlib.import_module(name)\n"
             "    print(name, module.__file__)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.splitlines():
        name, path = line.split(" ", 1)
        assert Path(path).resolve().is_relative_to(target.resolve()), f"{name} imported from {path}, not the install"


# The largest module and class as their seams left them (STYLE.md): one that grows past these has
# taken on another job; split it along its seam rather than raise the cap.
MAX_MODULE_LINES = 592
MAX_CLASS_LINES = 305


@pytest.mark.parametrize("module", sorted(MODULES))
def test_rooms_of_one_job(module):
    source = MODULES[module].read_text()
    cap = MAX_MODULE_LINES
    assert len(source.splitlines()) <= cap, (
        f"{module} has {len(source.splitlines())} lines (at most {cap}): split it along a seam")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_CLASS_LINES, f"{module}.{node.name} has {lines} lines (at most {MAX_CLASS_LINES})"
