"""Cache tier: racing processes, a build killed mid-way, corrupt entries, permissions, locks.

Real builds through the CPU family (about a second each); several tests start fresh
Python processes, as separate users of one cache would.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kernelgen
import kernelgen.cache as cache_mod
import kernelgen.functional as functional
import kernelgen.kernels as kernels
import kernelgen.toolchain  # noqa: F401 (the tests name kernelgen.toolchain.current)
from kernelgen.cache import Cache
from kernelgen.errors import CacheError

pytestmark = pytest.mark.compile

REPO = Path(__file__).resolve().parent.parent

# A child process: one conv2d on the CPU, then its counters and relative error as JSON.
CHILD = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {repo!r})
    import torch, torch.nn.functional as F, kernelgen
    start = float(sys.argv[1]) if len(sys.argv) > 1 else 0
    while time.time() < start:
        time.sleep(0.001)
    x = torch.randn(2, 3, 11, 11); w = torch.randn(5, 3, {k}, {k})
    y = kernelgen.conv2d(x, w, padding=1)
    ref = F.conv2d(x.double(), w.double(), padding=1)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    print(json.dumps(dict(kernelgen.stats(), err=err)))
""")


def child_script(k: int = 3) -> str:
    return CHILD.format(repo=str(REPO), k=k)


def run_child(root: Path, *args: str, k: int = 3, **popen) -> subprocess.Popen:
    env = dict(os.environ, KERNELGEN_CACHE_DIR=str(root))
    return subprocess.Popen([sys.executable, "-c", child_script(k), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finish(p: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def entry_dirs(root: Path) -> list[Path]:
    base = root / "entries"
    return sorted(base.iterdir()) if base.is_dir() else []


def test_eight_racing_processes_compile_once(tmp_path):
    root = tmp_path / "cache"
    start = time.time() + 6  # all eight wait for the same moment, after importing torch
    procs = [run_child(root, str(start)) for _ in range(8)]
    results = [finish(p) for p in procs]
    assert sum(r["compiles"] for r in results) == 1
    assert sum(r["cache_hits"] for r in results) == 7
    assert all(r["err"] < 1e-5 for r in results)
    assert len(entry_dirs(root)) == 1


def test_build_killed_mid_way_neither_hangs_nor_poisons(tmp_path):
    root = tmp_path / "cache"
    victim = run_child(root, k=5, start_new_session=True)
    staging = root / "staging"
    deadline = time.time() + 120
    while time.time() < deadline and not (staging.is_dir() and any(staging.iterdir())):
        time.sleep(0.05)
    assert staging.is_dir() and any(staging.iterdir()), "the build never started"
    time.sleep(0.3)  # inside the compiler now
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert entry_dirs(root) == [], "a killed build left an entry that could be served"
    t0 = time.time()
    result = finish(run_child(root, k=5), timeout=120)
    assert time.time() - t0 < 120
    assert result["compiles"] == 1 and result["err"] < 1e-5
    assert len(entry_dirs(root)) == 1
    assert not any(staging.iterdir()), "the dead builder's staging directory was not swept"


def _build_one(root: Path) -> Path:
    result = finish(run_child(root))
    assert result["compiles"] == 1
    (entry,) = entry_dirs(root)
    return entry


@pytest.mark.parametrize("damage", ["truncate", "foreign", "no_manifest", "bad_manifest", "other_toolchain"])
def test_damaged_entry_is_a_logged_rebuild(tmp_path, damage):
    root = tmp_path / "cache"
    entry = _build_one(root)
    so = next(entry.glob("*.so"))
    manifest = entry / "manifest.json"
    if damage == "truncate":
        so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])
    elif damage == "foreign":
        data = bytearray(so.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, different bytes
        so.write_bytes(bytes(data))
    elif damage == "no_manifest":
        manifest.unlink()
    elif damage == "bad_manifest":
        manifest.write_text("{not json")
    elif damage == "other_toolchain":
        m = json.loads(manifest.read_text())
        m["toolchain"]["torch"] = "0.0.1"
        manifest.write_text(json.dumps(m))
    p = run_child(root)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["compiles"] == 1 and result["err"] < 1e-5
    if damage != "no_manifest":  # a missing manifest is simply an incomplete entry: a miss
        assert "not usable" in err and "rebuilding" in err
    # the rebuilt entry is served from now on
    assert finish(run_child(root))["compiles"] == 0


def test_hit_imports_the_module_without_building(fresh_cache, monkeypatch):
    x, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    kernelgen.conv2d(x, w)
    kernels.clear_memo()
    functional.clear_plans()

    def no_build(*a, **k):
        raise AssertionError("a cache hit ran the builder")

    monkeypatch.setattr(cache_mod, "build", no_build)
    monkeypatch.setattr(cache_mod, "render", no_build)  # the index makes rendering unnecessary too
    before = kernelgen.stats()["cache_hits"]
    kernelgen.conv2d(x, w)
    assert kernelgen.stats()["cache_hits"] == before + 1


def test_read_only_cache_serves_hits_and_builds_misses_elsewhere(fresh_cache, monkeypatch, caplog):
    x, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    kernelgen.conv2d(x, w)
    kernels.clear_memo()
    functional.clear_plans()
    before_files = sorted(p for p in fresh_cache.rglob("*"))
    if os.geteuid() == 0:
        # root writes through any mode bits; make the cache believe what a user would see
        real_access = os.access
        monkeypatch.setattr(cache_mod.os, "access",
                            lambda p, m: False if Path(p) == fresh_cache and m == os.W_OK else real_access(p, m))
    else:
        fresh_cache.chmod(0o500)
    try:
        stats0 = kernelgen.stats()
        kernelgen.conv2d(x, w)  # served
        assert kernelgen.stats()["compiles"] == stats0["compiles"]
        with caplog.at_level(logging.WARNING, logger="kernelgen"):
            y = kernelgen.conv2d(x, torch.randn(3, 2, 1, 1))  # a miss: built in a temporary directory
        assert kernelgen.stats()["compiles"] == stats0["compiles"] + 1
        assert y.shape == (1, 3, 6, 6)
        assert "read-only" in caplog.text
        assert sorted(p for p in fresh_cache.rglob("*")) == before_files
    finally:
        fresh_cache.chmod(0o700)


def test_directory_writable_by_others_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir(mode=0o700)
    root.chmod(0o777)
    with pytest.raises(CacheError, match="writable by other users"):
        Cache(root).get(kernelgen.ConvSpec(1, 1, 1, device="cpu", family="cpu_direct"),
                        kernelgen.toolchain.current("cpu"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_directory_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(CacheError, match="owned by uid 12345"):
        Cache(root).get(kernelgen.ConvSpec(1, 1, 1, device="cpu", family="cpu_direct"),
                        kernelgen.toolchain.current("cpu"))


def test_new_directory_is_private(tmp_path):
    root = tmp_path / "new"
    Cache(root).ensure()
    assert (root.stat().st_mode & 0o777) == 0o700


def test_missing_subdirectories_are_recreated(tmp_path):
    root = tmp_path / "cache"
    Cache(root).ensure()
    (root / "locks").rmdir()
    Cache(root).ensure()
    assert (root / "locks").is_dir() and (root / "locks").stat().st_mode & 0o777 == 0o700


def test_a_file_where_the_cache_belongs_is_an_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError):
        Cache(tmp_path / "file").ensure()
    (tmp_path / "cache").mkdir(mode=0o700)
    (tmp_path / "cache" / "entries").write_text("")
    with pytest.raises(FileExistsError):
        Cache(tmp_path / "cache").ensure()


def test_lock_timeout_names_the_lock_file(tmp_path):
    root = tmp_path / "cache"
    holder = Cache(root)
    holder.ensure()
    with holder.lock("a" * 64):
        waiter = Cache(root, lock_timeout=0.3)
        with pytest.raises(CacheError, match=r"locks/a{64}\.lock"):
            with waiter.lock("a" * 64):
                pass


def test_machine_without_compilers_serves_shipped_entries(tmp_path):
    root = tmp_path / "cache"
    _build_one(root)
    env = dict(os.environ, KERNELGEN_CACHE_DIR=str(root), CXX="/nonexistent/c++")
    p = subprocess.run([sys.executable, "-c", child_script()], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["compiles"] == 0 and result["cache_hits"] == 1 and result["err"] < 1e-5


WARM_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    import torch, kernelgen
    x = torch.randn(2, 3, 11, 11); w = torch.randn(5, 3, 3, 3)
    y = kernelgen.conv2d(x, w, padding=1)
    print(json.dumps(dict(kernelgen.stats(), spec_loaded="kernelgen.spec" in sys.modules,
                          jinja_loaded="jinja2" in sys.modules,
                          modules=sorted(m for m in sys.modules if m.startswith("kernelgen")))))
""")


def test_warm_process_skips_validation_selection_and_rendering(tmp_path):
    root = tmp_path / "cache"
    env = dict(os.environ, KERNELGEN_CACHE_DIR=str(root))
    run = lambda: json.loads(subprocess.run([sys.executable, "-c", WARM_CHILD.format(repo=str(REPO))], env=env,
                                            capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    first = run()
    assert first["compiles"] == 1 and first["spec_loaded"]
    second = run()
    assert second["compiles"] == 0 and second["cache_hits"] == 1
    assert not second["spec_loaded"] and not second["jinja_loaded"]
    # nor anything else that only a miss needs: every module imported adds to a warm start
    needless = {"kernelgen." + m for m in ("spec", "checks", "select", "costmodel", "table", "tuner", "device",
                                           "families", "render", "toolchain", "build", "errors", "nn", "warm", "cli",
                                           "cache_admin")}
    assert not needless & set(second["modules"]), second["modules"]
    # a damaged record is ignored (and rewritten) rather than trusted
    for record in (root / "plans").glob("*.json"):
        record.write_text('{"format": 1, "key": "0000", "call": [], "prep": "nope"}')
    third = run()
    assert third["compiles"] == 0 and third["spec_loaded"]
    assert run()["spec_loaded"] is False


def test_plan_identity_follows_templates(tmp_path, monkeypatch):
    import shutil as _shutil

    import kernelgen.config as config
    import kernelgen.plans as plans

    copy = tmp_path / "templates"
    _shutil.copytree(config.template_dir(), copy)
    monkeypatch.setattr(config, "template_dir", lambda: copy)
    plans.identity.cache_clear()
    try:
        before = plans.identity()
        with open(copy / "cuda" / "direct.cu.j2", "a") as f:
            f.write("// an edit\n")
        plans.identity.cache_clear()
        assert plans.identity() != before  # an edited template means every record misses
    finally:
        plans.identity.cache_clear()
