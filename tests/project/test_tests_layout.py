"""tests/ stays laid out as the package is, read from the source files (with `ast` where imports are
concerned; nothing is imported or run):

- test modules (`test_*.py`) live in tests/<folder>/ for each package folder of async_grpo.LAYERS
  (a spine file's tests in its subsystem's folder), in tests/system/ (whole-system runs) or in
  tests/project/ (the repository itself); every package folder has its tests folder, and no two
  test files share a basename (pytest imports them by basename);
- helpers live in tests/support/ (imported as `support.<module>`), the programs the tests start in
  tests/programs/, the plug-ins the verifier pool imports by name in tests/plugins/: a test folder
  holds test modules only, and only programs have a `__main__` entry;
- no file under tests/ imports a test module, not even in the code it hands a child process;
- what the tests start or import by name is a file there: no test or support module imports a
  program or a plug-in, and every program is started by some test or support module;
- every test file a guide, a script, a benchmark or a test names by its path exists
  (benchmarks/RESULTS.md's dated entries are left as they were written);
- the gpu tier's tests are the files tests/*/test_gpu_*.py, all of them and only them: the gpu tier
  of scripts/test.sh collects those files alone.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import async_grpo
from support.paths import PROGRAMS, REPO_ROOT, TESTS

PACKAGE_FOLDERS = tuple(folder for layer in async_grpo.LAYERS for folder in layer)
TEST_FOLDERS = (*PACKAGE_FOLDERS, "system", "project")
SUPPORT, PLUGINS = TESTS / "support", TESTS / "plugins"
NON_TEST_FOLDERS = {SUPPORT: "support", PROGRAMS: "programs", PLUGINS: "plugins"}
TOP_LEVEL = ("conftest.py",)
"""The only source files directly in tests/."""
# `import test_x` / `from test_x import y`, also inside a string of code for a child process.
TEST_IMPORT = re.compile(r"^\s*(?:from|import)\s+test_\w+", re.MULTILINE)
# A path to a file under tests/ as the guides and docstrings write it (a glob allowed: tests/*/test_gpu_*.py).
TEST_PATH = re.compile(r"tests/[\w/*]+\.py")


def _sources() -> list[Path]:
    return sorted(path for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts)


def _test_modules() -> list[Path]:
    return [path for path in _sources() if path.name.startswith("test_")]


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every module `path` imports, at any depth of the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _has_main_entry(path: Path) -> bool:
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            return True
    return False


def test_test_modules_live_in_the_folders_that_mirror_the_package() -> None:
    misplaced = [str(path.relative_to(TESTS)) for path in _test_modules()
                 if path.parent.parent != TESTS or path.parent.name not in TEST_FOLDERS]
    assert not misplaced, f"{misplaced}: a test module lives in tests/<folder>/, <folder> one of {TEST_FOLDERS}"
    missing = [folder for folder in PACKAGE_FOLDERS if not list((TESTS / folder).glob("test_*.py"))]
    assert not missing, f"package folders without a tests/<folder>/ of their own: {missing}"


def test_no_two_test_files_share_a_basename() -> None:
    counts = Counter(path.name for path in _sources() if path.name != "__init__.py")
    assert not [name for name, count in counts.items() if count > 1], counts.most_common(3)


def test_helpers_programs_and_plugins_each_have_their_folder() -> None:
    stray = [str(path.relative_to(TESTS)) for path in _sources() if not path.name.startswith("test_")
             and path.parent not in NON_TEST_FOLDERS and not (path.parent == TESTS and path.name in TOP_LEVEL)]
    assert not stray, f"{stray}: helpers go to tests/support/, child programs to tests/programs/ (test folders " \
                      "hold test modules only)"
    with_main = [str(path.relative_to(TESTS)) for path in _sources()
                 if path.parent != PROGRAMS and _has_main_entry(path)]
    assert not with_main, f"{with_main} run as programs: move what they run into tests/programs/"


def test_no_file_imports_a_test_module() -> None:
    offenders = {str(path.relative_to(TESTS)): sorted(name for name in _imported_modules(path)
                                                      if name.startswith("test_")) for path in _sources()}
    assert not {k: v for k, v in offenders.items() if v}, f"shared helpers belong in tests/support/: {offenders}"
    in_child_code = [str(path.relative_to(TESTS)) for path in _sources() if TEST_IMPORT.search(path.read_text())]
    assert not in_child_code, f"{in_child_code} hand a child process code that imports a test module"


def test_programs_and_plugins_are_started_or_loaded_not_imported() -> None:
    by_name = {path.stem: folder for folder in (PROGRAMS, PLUGINS) for path in folder.glob("*.py")}
    offenders = {str(path.relative_to(TESTS)): sorted(_imported_modules(path) & set(by_name))
                 for path in _sources() if path.parent not in (PROGRAMS, PLUGINS)}
    assert not {k: v for k, v in offenders.items() if v}, f"programs are started, plug-ins loaded by name: {offenders}"
    callers = [path.read_text() for path in _sources() if path.parent != PROGRAMS]
    unstarted = [path.name for path in sorted(PROGRAMS.glob("*.py"))
                 if not any(path.name in text for text in callers)]
    assert not unstarted, f"programs no test or support module starts: {unstarted}"


def test_the_test_files_named_by_path_exist() -> None:
    naming = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
              *sorted((REPO_ROOT / "benchmarks").glob("*.py")), *sorted((REPO_ROOT / "scripts").glob("*.*")),
              *sorted(REPO_ROOT.glob("*.py")), *sorted((REPO_ROOT / "async_grpo").rglob("*.py")), *_sources()]
    missing = sorted({f"{path.relative_to(REPO_ROOT)}: {name}" for path in naming
                      for name in TEST_PATH.findall(path.read_text())
                      if not (list(REPO_ROOT.glob(name)) if "*" in name else (REPO_ROOT / name).is_file())})
    assert not missing, f"paths to test files that do not exist (moved?): {missing}"


def _marks_gpu(path: Path) -> bool:
    """Whether the file applies the gpu marker anywhere (pytest.mark.gpu, as a decorator or in pytestmark)."""
    return any(isinstance(node, ast.Attribute) and node.attr == "gpu" and isinstance(node.value, ast.Attribute)
               and node.value.attr == "mark" for node in ast.walk(ast.parse(path.read_text(), filename=str(path))))


def test_the_gpu_tier_is_the_test_gpu_files() -> None:
    gpu_named = {path for path in _test_modules() if path.name.startswith("test_gpu_")}
    gpu_marked = {path for path in _test_modules() if _marks_gpu(path)}
    assert gpu_named, "no tests/*/test_gpu_*.py file"
    assert gpu_marked == gpu_named, (f"marked gpu but not named test_gpu_*: {sorted(gpu_marked - gpu_named)}; "
                                     f"named test_gpu_* but not marked: {sorted(gpu_named - gpu_marked)}")
    assert all(path.parent.parent == TESTS for path in gpu_named), sorted(gpu_named)  # tests/<folder>/, as the glob
