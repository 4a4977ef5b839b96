"""Cache faults and tampering (issue 54, items 5-12), with real processes: a crash is a failure.

Each child process computes a convolution with kernelgen and with F.conv2d and prints whether
they agree; the tests damage the cache between runs the way an editor, a full disk, a second
process or another user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    import torch, torch.nn.functional as F, kernelgen
    torch.manual_seed(0)
    out = []
    for xs, ws, pad in {calls!r}:
        x, w = torch.randn(*xs), torch.randn(*ws)
        y = kernelgen.conv2d(x, w, padding=pad)
        ref = F.conv2d(x, w, padding=pad)
        out.append(bool(y.shape == ref.shape and torch.allclose(y, ref, rtol=1e-4, atol=1e-4)))
    print(json.dumps(dict(kernelgen.stats(), agree=out)))
""")

A = ((2, 3, 11, 11), (5, 3, 3, 3), 1)
B = ((1, 4, 20, 20), (6, 4, 5, 5), 0)


def run(root: Path, *calls, check: bool = True) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), calls=list(calls))],
                       env=dict(os.environ, KERNELGEN_CACHE_DIR=str(root)), capture_output=True, text=True,
                       timeout=300)
    if check:
        assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
        return json.loads(r.stdout.splitlines()[-1])
    return {"rc": r.returncode, "stderr": r.stderr, "stdout": r.stdout}


def _records(root: Path) -> list[Path]:
    return sorted((root / "plans").glob("*.json"))


# -- item 5: plan and index records are checked against the call ------------------------------------

def test_edited_plan_sizes_are_not_trusted(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    (rec,) = _records(root)
    data = json.loads(rec.read_text())
    for i in (3, 4, 5, 6):  # P, Q, H, W
        data["call"][i] *= 8
    rec.write_text(json.dumps(data))
    assert run(root, A)["agree"] == [True]


def test_a_plan_naming_another_entry_is_not_trusted(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    first = set(_records(root))
    assert run(root, B)["agree"] == [True]
    (ra,), (rb,) = first, set(_records(root)) - first
    da, db = json.loads(ra.read_text()), json.loads(rb.read_text())
    da["key"], db["key"] = db["key"], da["key"]
    ra.write_text(json.dumps(da))
    rb.write_text(json.dumps(db))
    assert run(root, A, B)["agree"] == [True, True]
    # the same, the sizes edited to match the other entry's call
    da["call"], db["call"] = db["call"], da["call"]
    ra.write_text(json.dumps(da))
    rb.write_text(json.dumps(db))
    assert run(root, A, B)["agree"] == [True, True]


def test_swapped_index_records_are_not_trusted(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A, B)["agree"] == [True, True]
    ia, ib = sorted((root / "index").glob("*.json"))
    ta, tb = ia.read_text(), ib.read_text()
    ia.write_text(tb)
    ib.write_text(ta)
    for rec in _records(root):  # so the index is what finds the entries
        rec.unlink()
    stats = run(root, A, B)
    assert stats["agree"] == [True, True]


# -- item 8: verified.json cannot be fooled by putting the mtime back ----------------------------------

def _cli(root: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kernelgen", *args], cwd=str(REPO), capture_output=True, text=True,
                          env=dict(os.environ, KERNELGEN_CACHE_DIR=str(root)), timeout=300)


def test_an_in_place_rewrite_with_the_mtime_put_back_is_caught(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    assert run(root, A)["compiles"] == 0  # (verified.json now names the .so)
    (entry,) = (root / "entries").iterdir()
    (so,) = entry.glob("*.so")
    st = so.stat()
    data = bytearray(so.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte changed, written in place
    with open(so, "r+b") as f:
        f.write(data)
    os.utime(so, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert so.stat().st_mtime_ns == st.st_mtime_ns and so.stat().st_ino == st.st_ino
    info = _cli(root, "cache", "info", entry.name[:16])
    assert info.returncode != 0 and "sha256" in info.stdout, info.stdout
    doctor = _cli(root, "doctor", "--verify", "--json")
    assert entry.name[:16] in doctor.stdout and json.loads(doctor.stdout)["ok"] is False
    again = run(root, A)
    assert again["agree"] == [True] and again["compiles"] == 1


# -- item 9: a full disk ------------------------------------------------------------------------------

# Runs before CHILD in the same process: every write, file creation and mkdir under the cache
# fails with ENOSPC, as on a full disk (no mount needed, so it runs anywhere).
# Whether a path lies in the test's cache: what the fault scripts below make fail.
UNDER_CACHE = textwrap.dedent("""
    import os
    _root = os.path.realpath(os.environ["KERNELGEN_CACHE_DIR"])
    def _ours(path):
        try:
            return os.path.realpath(os.fspath(path)).startswith(_root)
        except TypeError:
            return False
""")

FULL_DISK = UNDER_CACHE + textwrap.dedent("""
    import builtins, errno, io, os
    def _full(path):
        raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path))
    _open, _os_open, _mkdir = builtins.open, os.open, os.mkdir
    def open_(file, mode="r", *a, **k):
        if _ours(file) and any(c in mode for c in "wax+"):
            _full(file)
        return _open(file, mode, *a, **k)
    def os_open(path, flags, *a, **k):
        if _ours(path) and (flags & (os.O_WRONLY | os.O_APPEND) or flags & os.O_CREAT and not os.path.exists(path)):
            _full(path)
        return _os_open(path, flags, *a, **k)
    def mkdir(path, *a, **k):
        if _ours(path) and not os.path.isdir(path):
            _full(path)
        return _mkdir(path, *a, **k)
    builtins.open = io.open = open_
    os.open, os.mkdir = os_open, mkdir
""")


def run_full(root: Path, *calls) -> subprocess.CompletedProcess:
    code = FULL_DISK + CHILD.format(repo=str(REPO), calls=list(calls))
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, KERNELGEN_CACHE_DIR=str(root)),
                          capture_output=True, text=True, timeout=300)


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(".tmp")) + \
        sorted(str(p.relative_to(root)) for p in (root / "staging").iterdir())


@pytest.mark.parametrize("forget", ["nothing", "plans", "plans_and_index", "verified"])
def test_a_full_disk_never_breaks_a_hit(tmp_path, forget):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    if forget in ("plans", "plans_and_index"):
        for p in (root / "plans").glob("*.json"):
            p.unlink()
    if forget == "plans_and_index":
        for p in (root / "index").glob("*.json"):
            p.unlink()
    if forget == "verified":
        for p in (root / "entries").glob("*/verified.json"):
            p.unlink()
    r = run_full(root, A)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1])["agree"] == [True]
    assert _leftovers(root) == []


def test_a_full_disk_on_a_miss_says_so(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    r = run_full(root, B)
    assert r.returncode == 1
    assert "CacheError" in r.stderr and "no space left for the kernelgen cache" in r.stderr, r.stderr[-3000:]
    assert _leftovers(root) == []


# -- item 10: clear under a running process, and rm -rf of the cache -----------------------------------

BUSY = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {repo!r})
    import torch, torch.nn.functional as F, kernelgen
    from kernelgen import functional, kernels
    torch.manual_seed(0)
    calls = {calls!r}
    errors, agree, n = [], 0, 0
    deadline = time.monotonic() + {seconds}
    while time.monotonic() < deadline or n < len(calls):
        xs, ws, pad = calls[n % len(calls)]
        n += 1
        kernels.clear_memo(); functional.clear_plans()  # every call goes to the disk
        x, w = torch.randn(*xs), torch.randn(*ws)
        try:
            agree += bool(torch.allclose(kernelgen.conv2d(x, w, padding=pad), F.conv2d(x, w, padding=pad),
                                         rtol=1e-4, atol=1e-4))
        except Exception as exc:
            errors.append(repr(exc)[:300])
    print(json.dumps(dict(calls=n, agree=agree, errors=errors)))
""")

CLEARER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from kernelgen.cache import Cache
    from kernelgen.cache_admin import clear
    end = time.monotonic() + {seconds}
    while time.monotonic() < end:
        clear(Cache(os.environ["KERNELGEN_CACHE_DIR"]))
        time.sleep(0.01)
""")


def test_clear_while_another_process_loads_and_builds(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A, B)["agree"] == [True, True]
    env = dict(os.environ, KERNELGEN_CACHE_DIR=str(root))
    clearer = subprocess.Popen([sys.executable, "-c", CLEARER.format(repo=str(REPO), seconds=8)], env=env)
    try:
        r = subprocess.run([sys.executable, "-c", BUSY.format(repo=str(REPO), calls=[A, B], seconds=8)], env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        clearer.wait(timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["errors"] == [] and out["agree"] == out["calls"] >= 2, out


# Runs before CHILD: each temporary under the cache is deleted just before it is renamed into place,
# as `cache clear` in another process can (the interleaving made certain rather than waited for).
CLEARED_MID_WRITE = textwrap.dedent("""
    import os
    _root, _replace = os.path.realpath(os.environ["KERNELGEN_CACHE_DIR"]), os.replace
    def replace(src, dst, *a, **k):
        if str(src).endswith(".tmp") and os.path.realpath(str(src)).startswith(_root):
            os.unlink(src)
        return _replace(src, dst, *a, **k)
    os.replace = replace
""")


def test_temporaries_cleared_mid_write_do_not_fail_a_call(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    for p in list((root / "plans").glob("*.json")) + list((root / "index").glob("*.json")):
        p.unlink()  # so the call writes both again
    code = CLEARED_MID_WRITE + CHILD.format(repo=str(REPO), calls=[A])
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, KERNELGEN_CACHE_DIR=str(root)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1])["agree"] == [True]


def test_clear_leaves_temporaries_being_written(tmp_path):
    from kernelgen.cache import Cache
    from kernelgen.cache_admin import clear

    root = tmp_path / "cache"
    cache = Cache(root)
    cache.ensure()
    (root / "plans").mkdir()
    young, old = root / "index" / ".a.json.1.abc.tmp", root / "plans" / ".b.json.1.abc.tmp"
    young.write_text("{}")
    old.write_text("{}")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    clear(cache)
    assert young.exists() and not old.exists()


RMRF = textwrap.dedent("""
    import json, shutil, sys, os
    sys.path.insert(0, {repo!r})
    import torch, torch.nn.functional as F, kernelgen
    out = []
    for xs, ws, pad in {calls!r}:
        shutil.rmtree(os.environ["KERNELGEN_CACHE_DIR"])  # under the running process
        x, w = torch.randn(*xs), torch.randn(*ws)
        out.append(bool(torch.allclose(kernelgen.conv2d(x, w, padding=pad), F.conv2d(x, w, padding=pad),
                                       rtol=1e-4, atol=1e-4)))
    print(json.dumps(out))
""")


def test_a_removed_cache_directory_is_made_again(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    r = subprocess.run([sys.executable, "-c", RMRF.format(repo=str(REPO), calls=[B, ((1, 2, 6, 6), (3, 2, 3, 3), 1)])],
                       env=dict(os.environ, KERNELGEN_CACHE_DIR=str(root)), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == [True, True]
    assert (root / "entries").is_dir() and len(list((root / "entries").iterdir())) == 1


# -- item 12: clear and prune on a read-only cache ------------------------------------------------------

# Runs before the CLI in the same process: the cache's filesystem is read-only (EROFS), which holds
# for root too (mode bits do not stop root, so chmod cannot make the test's cache read-only).
READ_ONLY = UNDER_CACHE + textwrap.dedent("""
    import errno, os, shutil, sys
    sys.path.insert(0, {repo!r})
    def _ro(path):
        raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
    def wrap(fn, writes=lambda *a, **k: True):
        def inner(path, *a, **k):
            if _ours(path) and writes(path, *a, **k):
                _ro(path)
            return fn(path, *a, **k)
        return inner
    _access = os.access
    os.access = lambda path, mode, *a, **k: False if _ours(path) and mode & os.W_OK else _access(path, mode, *a, **k)
    os.open = wrap(os.open, lambda p, flags, *a, **k: flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    for name in ("unlink", "remove", "rmdir", "mkdir", "rename", "replace"):
        setattr(os, name, wrap(getattr(os, name)))
    from kernelgen.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("args", [["cache", "clear"], ["cache", "prune", "--max-size", "0"],
                                  ["cache", "prune", "--older-than", "0s"]])
def test_clear_and_prune_on_a_read_only_cache_say_what_is_wrong(tmp_path, args):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    r = subprocess.run([sys.executable, "-c", READ_ONLY.format(repo=str(REPO)), *args],
                       env=dict(os.environ, KERNELGEN_CACHE_DIR=str(root)), capture_output=True, text=True,
                       timeout=300)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode != 0 and "read-only" in r.stderr, (r.returncode, r.stderr)
    assert len(list((root / "entries").iterdir())) == 1


# -- item 11: staging cleanup decides liveness by the key's lock, not by a PID ----------------------------

HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
""")


def test_a_build_in_another_pid_namespace_is_not_swept(tmp_path):
    from kernelgen.cache import Cache

    cache = Cache(tmp_path / "cache")
    cache.ensure()
    key = "ab" * 32
    # a builder in another container: a PID that does not exist here, holding the key's lock
    staging = cache.root / "staging" / f"{key}.999999.deadbeef"
    staging.mkdir()
    (staging / "main.cpp").write_text("// being built")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(cache.root / "locks" / f"{key}.lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cache._sweep_staging()
        assert staging.is_dir(), "a live build (its key's lock held) was swept"
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    cache._sweep_staging()  # the builder is gone (its lock released): its leftovers go
    assert not staging.exists()


# -- item 6: every directory code is loaded from is checked, without following links, at each load ------

def test_an_entries_directory_writable_by_others_is_refused(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    (root / "entries").chmod(0o777)
    r = run(root, A, check=False)
    assert r["rc"] == 1 and "CacheError" in r["stderr"] and "writable by other users" in r["stderr"], r["stderr"]


@pytest.mark.parametrize("damage", ["entry_mode", "so_mode", "so_symlink", "entry_symlink", "so_owner"])
def test_an_entry_not_ours_alone_is_rebuilt_not_loaded(tmp_path, damage):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    (entry,) = (root / "entries").iterdir()
    (so,) = entry.glob("*.so")
    if damage == "entry_mode":
        entry.chmod(0o777)
    elif damage == "so_mode":
        so.chmod(0o666)
    elif damage == "so_symlink":
        elsewhere = tmp_path / so.name
        so.rename(elsewhere)
        so.symlink_to(elsewhere)
    elif damage == "entry_symlink":
        elsewhere = tmp_path / "elsewhere"
        entry.rename(elsewhere)
        entry.symlink_to(elsewhere)
    else:
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(so, 12345, 12345)
    again = run(root, A)
    assert again["agree"] == [True] and again["compiles"] == 1


def test_a_root_swapped_for_a_link_under_a_running_process_is_refused(tmp_path):
    root = tmp_path / "cache"
    assert run(root, A)["agree"] == [True]
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        import torch, kernelgen
        from kernelgen import functional, kernels
        from kernelgen.errors import CacheError
        root = os.environ["KERNELGEN_CACHE_DIR"]
        x, w = torch.randn(2, 3, 11, 11), torch.randn(5, 3, 3, 3)
        kernelgen.conv2d(x, w, padding=1)
        cache = kernels.default_cache()
        os.rename(root, root + ".real")      # the checked root swapped for a link to another directory
        os.symlink(root + ".real", root)
        kernels._memo.clear(); kernels._by_key.clear(); functional.clear_plans()  # (the Cache object stays)
        try:
            kernelgen.conv2d(x, w, padding=1)
        except CacheError as exc:
            print("refused:", exc)
        else:
            print("loaded")
    """)
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, KERNELGEN_CACHE_DIR=str(root)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("refused:") and "symbolic link" in r.stdout, r.stdout
