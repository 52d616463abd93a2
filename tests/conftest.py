"""Shared fixtures: the tiny model and the demo's assets written once per session, and a local
Ray cluster."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TEST_NAMESPACE = "grpo-tests"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tiny Qwen2 (untied embeddings), written once and loaded via from_pretrained."""
    from tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with tied input/output embeddings (as Qwen2.5 0.5B/1.5B)."""
    from tiny_model import TinyModelConfig, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-tied"), TinyModelConfig(tie_word_embeddings=True))


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's starting model (its format warm-up only) and arithmetic prompts, made once per
    session by scripts/prepare_demo.py and shared by the end-to-end modules."""
    repo_root = Path(__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("demo-assets")
    subprocess.run([sys.executable, str(repo_root / "scripts" / "prepare_demo.py"), "--out_dir", str(out),
                    "--num_prompts", "500"], check=True, cwd=repo_root, timeout=900)
    return out


def _start_session_ray() -> None:
    from local_cluster import init_local_ray

    init_local_ray(num_cpus=max(4, os.cpu_count() or 1), namespace=TEST_NAMESPACE, log_to_driver=True)


@pytest.fixture(scope="session")
def ray_local():
    """A private local Ray cluster bound to 127.0.0.1, dashboard off, project code importable."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _start_session_ray()
    yield ray
    ray.shutdown()


@contextlib.contextmanager
def session_ray_set_aside() -> Iterator[None]:
    """Inside the block this process holds no Ray connection, so a LocalCluster can start its own
    head in it (a process holds one connection); the session's cluster (ray_local) is started
    again after it, if there was one, for the modules that come later in the same run."""
    import ray

    had_session_ray = ray.is_initialized()
    if had_session_ray:
        ray.shutdown()
    try:
        yield
    finally:
        if had_session_ray and not ray.is_initialized():
            _start_session_ray()
