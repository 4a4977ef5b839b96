"""Test tiers: pure (no compiler), compile (host compiler / nvcc), gpu (a CUDA device).

GPU tests skip without CUDA; nvcc tests skip without nvcc. Every test runs against a
private cache directory so nothing touches the user's ~/.cache/kernelgen.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import kernelgen.functional as functional
import kernelgen.kernels as kernels

HAS_CUDA = torch.cuda.is_available()
HAS_NVCC = shutil.which("nvcc") is not None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_nvcc = pytest.mark.skip(reason="needs nvcc on PATH")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "nvcc" in item.keywords and not HAS_NVCC:
            item.add_marker(skip_nvcc)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    """One cache shared by the numerics tests, so each spec compiles once per run: a new one, or
    the directory KERNELGEN_TEST_CACHE names, kept across runs (benchmarks/gpu_all.sh points it at
    the GPU host's .kgcache, so that a second call on a warm machine compiles only what changed;
    entries and plan records are keyed by kernelgen's sources, so an edit is a miss, not a stale hit).
    Tests that count compiles from an empty cache take `fresh_cache` instead."""
    chosen = os.environ.get("KERNELGEN_TEST_CACHE")
    if chosen:
        root = Path(chosen)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return root
    return tmp_path_factory.mktemp("kernelgen-cache")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(session_cache):
    # Session-wide, so module-scoped fixtures (the GPU tier's parallel warm-up) see it too.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERNELGEN_CACHE_DIR", str(session_cache))
        yield


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A cache directory of this test's own, with in-process memos cleared."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(root))
    kernels.clear_memo()
    functional.clear_plans()
    yield root
    kernels.clear_memo()
    functional.clear_plans()
