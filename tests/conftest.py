"""Shared fixtures (the tiny model written once per session, the demo's assets once per session or,
under scripts/test.sh, once per suite run; a local Ray cluster) and the test tiers.

Layout (tests/project/test_tests_layout.py checks it): tests/<folder>/ holds the tests of
async_grpo/<folder>/ and of that subsystem's spine files (vllm_worker, logprob_worker: inference/;
vllm_registry: routing/; vllm_experience_batcher: batching/; trainer_core: trainer/;
worker_dispatcher, local_cluster: launch/; setup_model: model/; grpo_loss and the packing: algo/);
tests/system/ the whole-system runs and the benchmarks' checks; tests/project/ the checks on the
repository itself. What several modules share is in tests/support/ (`support.<module>`: no test
module imports another), the programs the tests start in tests/programs/, the reward plug-ins the
verifier pool imports by name in tests/plugins/ (pyproject.toml puts tests/ and tests/plugins on
pytest's path).

Tiers (markers; scripts/test.sh runs each in its own pytest process, `--fast` only the first):
- fast (no marker): pure and single-process: no child process, no Ray, no process group.
- ray: uses the session's local Ray cluster (applied from the `ray_local` fixture).
- vllm: starts a real vLLM engine.
- distributed: launches torch.distributed process groups (torchrun or spawned ranks).
- system: starts child processes: whole programs (local_cluster.py, `ray start`, scripts,
  benchmarks, pip), sandboxed programs, verifier process pools.
- gpu: needs a CUDA device. Without CUDA these tests are deselected, and the run's summary says
  how many ("N gpu tests deselected: no CUDA"); `scripts/test.sh --gpu` runs this tier alone.
A test with several markers runs in the last tier of that list that it carries (see TIER_ORDER).
An unmarked test that starts a process, Ray or a process group fails with a line saying which
marker it needs, so a slow test cannot slip into the fast tier unseen.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness import SUITE_TIMELINE_ENV
from support.paths import REPO_ROOT
from support.ray_session import ensure_session_ray, start_session_ray, stop_session_ray

TIER_ORDER = ("ray", "vllm", "distributed", "system", "gpu")
"""The tier markers, cheapest first; scripts/test.sh selects on them in this order."""
FIXTURE_TIERS = {"ray_local": "ray"}
"""Markers that follow from a fixture a test uses."""
TIER_MANIFEST_ENV = "GRPO_TEST_TIER_MANIFEST"
"""When set (scripts/test.sh sets it for the fast tier, which collects the whole suite): a file to
write `<tier> <test file>` lines to, one per file and tier it holds tests of, so the later tiers'
pytest processes collect only their own files (~11 CPU-s a collection of the whole suite, ~3-6
for one tier's files)."""


def tier_of(item: pytest.Item) -> str:
    """The tier a test runs in: the last of TIER_ORDER that it carries, "fast" when none."""
    return next((m for m in reversed(TIER_ORDER) if item.get_closest_marker(m)), "fast")


def pytest_sessionstart(session: pytest.Session) -> None:
    """This pytest process computes its own tensors (references, packed losses, tiny models) on one
    intra-op thread: they are a few KB each, and scripts/test.sh runs two lanes of tiers on the
    machine's cores, where a second thread only spins and waits for the other lane (the fast tier
    alone on 2 cores: 50.5 -> 46.5 CPU-s). The processes the tests start keep their own settings."""
    import torch

    torch.set_num_threads(1)


def _write_tier_manifest(path: Path, items: list[pytest.Item]) -> None:
    lines = sorted({f"{tier_of(item)} {item.path.relative_to(REPO_ROOT)}" for item in items})
    path.write_text("".join(line + "\n" for line in lines))


_GPU_DESELECTED = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in FIXTURE_TIERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
    if manifest := os.environ.get(TIER_MANIFEST_ENV):
        _write_tier_manifest(Path(manifest), items)
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _cuda_available():
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config.stash[_GPU_DESELECTED] = len(gpu)


def _timeline(event: str, nodeid: str) -> None:
    """When scripts/suite_profile.py runs the suite: append `<unix time> start|end <node id>` to
    the file it names (one pair per test, setup to teardown), so that it can say which tests were
    running while the machine's cores stood idle."""
    if path := os.environ.get(SUITE_TIMELINE_ENV):
        with open(path, "a") as timeline:  # one short append per line: the lanes' processes do not interleave
            timeline.write(f"{time.time():.3f} {event} {nodeid}\n")


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _timeline("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    _timeline("end", nodeid)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared demo cluster (support.cluster) once the next test is in a module that does
    not share it, so it never idles beside the next module's own cluster."""
    shared = sys.modules.get("support.cluster")  # not imported: no demo cluster to stop
    if shared is not None and (nextitem is None or nextitem.path.name not in shared.SHARED_CLUSTER_MODULES):
        shared.stop_demo_cluster()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """An interrupted or failed session stops the shared demo cluster too."""
    shared = sys.modules.get("support.cluster")
    if shared is not None:
        shared.stop_demo_cluster()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Say how many gpu tests a machine without CUDA left out: deselected, never silently."""
    count = config.stash.get(_GPU_DESELECTED, 0)
    if count:
        terminalreporter.write_line(f"{count} gpu tests deselected: no CUDA")


@pytest.fixture(autouse=True)
def _fast_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In the fast tier, a test that starts a child process, Ray or a process group fails (at its
    end: the start itself goes ahead, since refusing it inside a pool's thread would hang the test)."""
    if any(request.node.get_closest_marker(marker) for marker in TIER_ORDER):
        yield
        return
    import multiprocessing.process

    # platform.uname() runs `uname -p` once per process and caches it; vLLM's import calls it. Run
    # it before watching, so the guard does not blame whichever test happens to import vLLM first.
    platform.processor()
    seen: dict[str, str] = {}

    def watch(owner: Any, name: str, what: str, needs: str) -> None:
        original = getattr(owner, name)

        def watched(*args: Any, **kwargs: Any) -> Any:
            seen.setdefault(what, needs)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)

    watch(subprocess.Popen, "__init__", "starts a child process", "system")
    watch(multiprocessing.process.BaseProcess, "start", "starts a child process", "system")
    if "ray" in sys.modules:
        watch(sys.modules["ray"], "init", "starts Ray", "ray (or use the ray_local fixture)")
    if "torch.distributed" in sys.modules:
        watch(sys.modules["torch.distributed"], "init_process_group", "starts a process group", "distributed")
    yield
    if seen:
        what = ", ".join(seen)
        pytest.fail(f"{request.node.nodeid} {what} but has no tier marker: mark it (or its module's pytestmark) "
                    f"{' / '.join(sorted(set(seen.values())))} (tests/conftest.py lists the tiers)", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tiny Qwen2 (untied embeddings), written once and loaded via from_pretrained."""
    from async_grpo.demo_assets.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with tied input/output embeddings (as Qwen2.5 0.5B/1.5B)."""
    from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-tied"), TinyModelConfig(tie_word_embeddings=True))


@pytest.fixture(scope="session")
def mha_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model without grouped-query attention (as many kv heads as query heads)."""
    from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-mha"), TinyModelConfig(num_kv_heads=4))


@pytest.fixture(scope="session")
def sliding_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model with a 7-token sliding window on its second layer (Qwen2's max_window_layers)."""
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 7, 1
    config.layer_types = None  # re-derived from the three fields above
    config = type(config)(**config.to_dict())
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("tiny-qwen2-sliding")
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


# Set by scripts/test.sh to a folder of its own run: the tiers' pytest processes (both lanes) then
# share one build of the demo's assets (~22 CPU-s each on 2 cores) instead of one each.
SHARED_ASSETS_ENV = "GRPO_TEST_SHARED_ASSETS"


def _prepare_demo(out: Path) -> None:
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "prepare_demo.py"), "--out_dir", str(out),
                    "--num_prompts", "500"], check=True, cwd=REPO_ROOT, timeout=900)


def _shared_demo_assets(root: Path) -> Path:
    """root/demo, built by the first process that asks (the others wait on the lock); a build that
    did not finish leaves no `complete` mark and is made again."""
    import fcntl

    out = root / "demo"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "complete").is_file():
            _prepare_demo(out)
            (out / "complete").touch()
    return out


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's starting model (its format warm-up only) and arithmetic prompts, made once per
    session by scripts/prepare_demo.py (once per suite run under scripts/test.sh) and shared by the
    end-to-end modules. Tests read them and never write there."""
    shared = os.environ.get(SHARED_ASSETS_ENV)
    if shared:
        return _shared_demo_assets(Path(shared))
    out = tmp_path_factory.mktemp("demo-assets")
    _prepare_demo(out)
    return out


@pytest.fixture(scope="session")
def ray_local():
    """A private local Ray cluster bound to 127.0.0.1, dashboard off, project code importable."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    start_session_ray()
    yield ray
    stop_session_ray()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that uses ray_local finds the session's cluster running, also after a LocalCluster
    test set it aside (support.ray_session): it is started again here, only when needed."""
    if "ray_local" in getattr(item, "fixturenames", ()):
        ensure_session_ray()

