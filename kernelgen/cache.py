"""The on-disk kernel cache: keys, entries, locks.

Layout under the cache root (created 0700, and refused if another user owns it or
others may write it):

    entries/<key>/      a complete entry: sources, the built .so, manifest.json (written last),
                        verified.json (the .so's identity when its sha256 was last checked)
    index/<lookup>.json  spec + templates + toolchain -> key, so a hit needs no rendering
    plans/<name>.json    call signature -> key (plans.py), so a warm call needs no selection
    staging/            where entries are built before being renamed into place whole
    locks/<key>.lock     one OS lock per key (released by the kernel if a builder dies)
    failed/<key>/        sources and log of the last failed build of a key

An entry is served only if its manifest exists, names the same key and toolchain,
and the .so matches the manifest's size and sha256. Anything else is a logged
rebuild. A hit imports the .so directly: no compiler, no ninja, no load_inline.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import math
import os
import shutil
import stat
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterator

from . import config
from ._version import ABI_VERSION
from .config import template_dir  # noqa: F401 (part of this module's API)

if TYPE_CHECKING:
    from .build import Built
    from .render import Rendered
    from .spec import ConvSpec
    from .toolchain import Toolchain

log = logging.getLogger("kernelgen")

MANIFEST = "manifest.json"
# manifest fields read by `cache ls/info/prune/export` and `doctor`, and their types (a wrong one
# makes the entry invalid rather than breaking those commands)
_MANIFEST_TYPES = {"spec": {}, "toolchain": {}, "summary": "", "family": "", "sources": [], "so": {}}
VERIFIED = "verified.json"  # inode, size, mtime, ctime and sha256 of the .so when it was last hashed
FORMAT = 1


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def cache_key(spec: ConvSpec, rendered: Rendered, toolchain: Toolchain) -> str:
    """sha256 of the spec, the rendered source, the toolchain (versions, arch, flags) and the ABI."""
    return _sha256_json({"spec": spec.to_dict(), "source": rendered.digest,
                         "toolchain": toolchain.to_dict(), "abi": ABI_VERSION})


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """sha256 of the Python that shapes rendering (spec, render, families)."""
    here = Path(__file__).resolve().parent
    files = [here / "spec.py", here / "render.py"] + sorted((here / "families").glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        data = f.read_bytes()
        h.update(f.name.encode() + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def lookup_key(spec: ConvSpec, toolchain: Toolchain) -> str:
    """What determines the rendered source and the binary's use, computed without rendering.

    It leaves out the compilers' versions (the toolchain's runtime fields only), so a
    machine without compilers finds shipped entries; `read_entry` then checks the
    entry's full toolchain wherever the local one is known.
    """
    from .render import template_digest

    return _sha256_json({"spec": spec.to_dict(), "templates": template_digest(), "code": code_digest(),
                         "toolchain": toolchain.runtime_dict(), "abi": ABI_VERSION})


def module_name(key: str) -> str:
    """A fresh module name for a build of `key`: the key plus a nonce.

    torch's load_inline remembers every name it built in this process and silently
    skips a second build of the same name and sources (even in another directory), so
    each build gets a name of its own; the manifest records which one an entry holds.
    """
    return f"kg_{key}_{uuid.uuid4().hex[:8]}"


class Entry:
    """A complete entry on disk: its key, directory and manifest."""

    __slots__ = ("key", "path", "manifest")

    def __init__(self, key: str, path: Path, manifest: dict):
        self.key = key
        self.path = path
        self.manifest = manifest

    @property
    def so_path(self) -> Path:
        return self.path / self.manifest["so"]["file"]


class InvalidEntry(Exception):
    """An entry on disk that must not be served (reason in the message)."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_error(message: str) -> Exception:
    from .errors import CacheError  # imported here: a process served from the cache never raises it

    return CacheError(message)


def render(spec: ConvSpec) -> Rendered:
    """kernelgen.render.render, imported when first needed: a process served from the cache renders nothing."""
    from . import render as renderer

    return renderer.render(spec)


def build(rendered: Rendered, toolchain: Toolchain, name: str, directory: Path) -> Built:
    """kernelgen.build.build, imported when first needed: a process served from the cache never builds."""
    from . import build as builder

    return builder.build(rendered, toolchain, name, directory)


def _import_so(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise InvalidEntry(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Cache:
    """A cache rooted at `root` (default: config.cache_dir())."""

    def __init__(self, root: Path | str | None = None, lock_timeout: float | None = None):
        self.root = Path(root) if root is not None else config.cache_dir()
        self.lock_timeout = config.lock_timeout() if lock_timeout is None else lock_timeout
        self._checked = False
        self._root_id: tuple[int, int] | None = None
        self._root_link = False
        self.writable = True

    # -- the directory -----------------------------------------------------------------
    def ensure(self) -> None:
        """Create the root (0700) or check it is ours and private; find out whether it is writable."""
        if self._checked:
            return
        try:
            st = os.stat(self.root)
        except OSError:
            try:
                self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            except PermissionError:
                if not self.root.is_dir():
                    raise _cache_error(f"cannot create the kernelgen cache directory {self.root}; "
                                       f"set KERNELGEN_CACHE_DIR to a directory you can write") from None
            st = self.root.stat()
        if not stat.S_ISDIR(st.st_mode):
            self.root.mkdir(exist_ok=True)  # raises FileExistsError, naming the path
        if st.st_uid not in (os.getuid(), 0):
            raise _cache_error(f"the kernelgen cache directory {self.root} is owned by uid {st.st_uid}, not by you "
                               f"(uid {os.getuid()}); loading code from it would run another user's binaries. "
                               f"Set KERNELGEN_CACHE_DIR to a directory of your own.")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise _cache_error(f"the kernelgen cache directory {self.root} is writable by other users "
                               f"(mode {stat.filemode(st.st_mode)}); run `chmod 700 {self.root}` or set "
                               f"KERNELGEN_CACHE_DIR to a private directory.")
        self._root_id = (st.st_dev, st.st_ino)
        self._root_link = os.path.islink(self.root)  # (a root configured as a link stays one)
        self.writable = os.access(self.root, os.W_OK)
        if self.writable:
            # One directory listing instead of five mkdir calls that fail with EEXIST:
            # this runs in every process's first call.
            with os.scandir(self.root) as it:
                present = {e.name for e in it if e.is_dir()}
            for sub in ("entries", "index", "staging", "locks", "failed"):
                if sub not in present:
                    (self.root / sub).mkdir(exist_ok=True, mode=0o700)  # a file of that name raises
        self._checked = True

    def entry_dir(self, key: str) -> Path:
        return self.root / "entries" / key

    # -- reading -----------------------------------------------------------------------
    def read_entry(self, key: str, toolchain: Toolchain | None = None, verify_so: bool = True,
                   expect: dict | None = None, spec: ConvSpec | None = None, rehash: bool = False) -> Entry:
        """The complete, verified entry for `key`; InvalidEntry (or FileNotFoundError) otherwise.

        toolchain: the entry must have been built by it (its runtime fields, where the
            local compilers are unknown). expect: toolchain fields that must match (the
            cheap subset a plan record's caller can name without building a Toolchain).
            spec: the entry must have been built for it (an index record found the key; a swapped
            or edited one would otherwise load another convolution's kernel).
            rehash: hash the .so even where verified.json says this very file was hashed before.
        """
        path = self.entry_dir(key)
        try:
            manifest = json.loads((path / MANIFEST).read_bytes())
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:
            raise InvalidEntry(f"unreadable manifest ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("key") != key:
            raise InvalidEntry("manifest does not belong to this key or format")
        if toolchain is not None:
            theirs = manifest.get("toolchain")
            if toolchain.compilers_known:
                ours = json.loads(json.dumps(toolchain.to_dict()))
            else:  # no compilers here: the runtime fields decide
                ours = json.loads(json.dumps(toolchain.runtime_dict()))
                theirs = {k: v for k, v in theirs.items() if k in ours} if isinstance(theirs, dict) else theirs
            if theirs != ours:
                raise InvalidEntry("built by another toolchain")
        if expect:
            theirs = manifest.get("toolchain")
            if not isinstance(theirs, dict) or any(theirs.get(k) != v for k, v in expect.items()):
                raise InvalidEntry("built by another toolchain")
        created = manifest.get("created", 0)
        if (isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created)
                or any(not isinstance(manifest.get(f, d), type(d)) for f, d in _MANIFEST_TYPES.items())):
            raise InvalidEntry("manifest fields of the wrong type")
        name = manifest.get("name")
        if not isinstance(name, str) or not name.startswith(f"kg_{key}_") or not name.isidentifier():
            raise InvalidEntry("manifest names no valid module")
        if spec is not None and manifest.get("spec") != json.loads(spec.to_json()):
            raise InvalidEntry("built for another convolution than the one asked for")
        entry = Entry(key=key, path=path, manifest=manifest)
        so = manifest.get("so") or {}
        if not isinstance(so, dict) or isinstance(so.get("size"), bool) or not isinstance(so.get("size"), int) \
                or not isinstance(so.get("sha256"), str):
            raise InvalidEntry("manifest names no valid .so")
        if not isinstance(so.get("file"), str) or "/" in so["file"] or so["file"].startswith("."):
            raise InvalidEntry("manifest names no valid .so")
        if verify_so:
            try:
                st = entry.so_path.stat()
            except FileNotFoundError:
                raise InvalidEntry(f"{so['file']} is missing") from None
            if st.st_size != so.get("size"):
                raise InvalidEntry(f"{so['file']} is {st.st_size} bytes, the manifest says {so.get('size')} "
                                   f"(truncated?)")
            # Hashing the .so is the slowest part of a warm start: skip it when the file is
            # the very one a previous process hashed (same inode, size, mtime and ctime: a
            # rewrite in place can put the mtime back, not the ctime).
            seen = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, so.get("sha256")]
            try:
                verified = not rehash and json.loads((path / VERIFIED).read_bytes()) == seen
            except (OSError, ValueError):
                verified = False
            if not verified:
                if file_sha256(entry.so_path) != so.get("sha256"):
                    raise InvalidEntry(f"{so['file']} does not match the manifest's sha256 (foreign or corrupted)")
                if self.writable:
                    with contextlib.suppress(OSError):
                        _atomic_write(path / VERIFIED, json.dumps(seen))
        return entry

    def load(self, key: str, toolchain: Toolchain | None, expect: dict | None = None,
             spec: ConvSpec | None = None) -> ModuleType:
        """Import the verified entry `key` (see read_entry for toolchain, expect and spec). The module's
        KG_SPEC is the manifest's spec (a dict), for callers that hold only a key (plan records)."""
        entry = self.read_entry(key, toolchain, expect=expect, spec=spec)
        self._check_code_path(entry)
        try:
            module = _import_so(entry.manifest["name"], entry.so_path)
        except ImportError as exc:
            raise InvalidEntry(f"cannot import {entry.so_path.name}: {exc}") from None
        if getattr(module, "KG_ABI", None) != ABI_VERSION:
            raise InvalidEntry("module's ABI revision does not match")
        module.KG_SPEC = entry.manifest.get("spec")
        if self.writable:
            with contextlib.suppress(OSError):
                (entry.path / "last_used").touch()
        return module

    def _check_code_path(self, entry: Entry) -> None:
        """Before importing `entry`'s .so: the root, entries/, the entry and the .so itself are ours
        (or root's), not writable by others, and not symbolic links (lstat: a link swapped in since
        the root was checked is seen). A few lstat calls, once per kernel and process. The root or
        entries/ failing is a CacheError (nothing under it may be run); the entry, an InvalidEntry
        (rebuilt by us)."""
        try:
            st = os.lstat(self.root)
            if stat.S_ISLNK(st.st_mode):
                if not self._root_link:
                    raise _cache_error(f"the kernelgen cache directory {self.root} was replaced by a symbolic link "
                                       f"since it was checked; refusing to load code through it")
                st = os.stat(self.root)
            if (st.st_dev, st.st_ino) != self._root_id:  # made again (rm -rf) or swapped: check it afresh
                self._checked = False
                self.ensure()
            sub = os.lstat(self.root / "entries")
        except FileNotFoundError:
            raise InvalidEntry("the cache directory is gone") from None
        _private(self.root / "entries", sub, _cache_error)
        for path, want in ((entry.path, stat.S_ISDIR), (entry.so_path, stat.S_ISREG)):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                raise InvalidEntry(f"{path.name} is gone") from None
            if not want(st.st_mode):
                raise InvalidEntry(f"{path} is not a plain {'directory' if want is stat.S_ISDIR else 'file'} "
                                   f"(a symbolic link?)")
            _private(path, st, InvalidEntry)

    def entries(self) -> Iterator[Entry]:
        """Every complete entry (manifest present), without hashing the .so files."""
        base = self.root / "entries"
        if not base.is_dir():
            return
        for path in sorted(base.iterdir()):
            with contextlib.suppress(InvalidEntry, FileNotFoundError, OSError):
                yield self.read_entry(path.name, verify_so=False)

    # -- the index: spec -> key without rendering -------------------------------------------
    def index_get(self, lookup: str) -> str | None:
        try:
            key = json.loads((self.root / "index" / f"{lookup}.json").read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            return None
        return key if isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key) else None

    def index_put(self, lookup: str, key: str) -> None:
        """Best effort: the index only saves a render next time, so a full or read-only disk must
        not fail the call that found or built the entry."""
        if self.writable:
            try:
                _atomic_write(self.root / "index" / f"{lookup}.json", json.dumps({"key": key}))
            except OSError as exc:
                log.debug("kernelgen: cannot write the index record %s (%s)", lookup[:16], exc)

    # -- locking -------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Hold the OS lock of `key`; a process killed while holding it releases it."""
        path = self.root / "locks" / f"{key}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + self.lock_timeout
            delay = 0.02
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise
                if time.monotonic() > deadline:
                    raise _cache_error(f"timed out after {self.lock_timeout:.0f} s waiting for the lock {path}, "
                                       f"held by another process building the same kernel; raise "
                                       f"KERNELGEN_LOCK_TIMEOUT or find that process")
                time.sleep(delay)
                delay = min(delay * 1.5, 0.5)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    # -- the whole path ------------------------------------------------------------------
    def get(self, spec: ConvSpec, toolchain: Toolchain,
            on_compile: Callable[[ConvSpec, str, Built], None] | None = None) -> tuple[ModuleType, str, bool]:
        """(module, key, compiled) for `spec`: from disk if a valid entry exists, else built."""
        self.ensure()
        lookup = lookup_key(spec, toolchain)
        key = self.index_get(lookup)
        if key is not None:
            module = self._try_load(key, toolchain, spec=spec)
            if module is not None:
                return module, key, False
        rendered = render(spec)
        key = cache_key(spec, rendered, toolchain)
        module = self._try_load(key, toolchain, spec=spec)
        if module is not None:
            self.index_put(lookup, key)
            return module, key, False
        if self.writable and not (self.root / "locks").is_dir():  # removed under us (rm -rf): make it again
            self._checked = False
            self.ensure()
        if not self.writable:
            log.warning("kernelgen cache %s is read-only: building %s in a temporary directory "
                        "(it will not be kept)", self.root, spec.summary())
            with tempfile.TemporaryDirectory(prefix="kernelgen-") as tmp:
                log.debug("kernelgen: compiling %s for %s (not cached)", spec.summary(), toolchain.arch)
                built = build(rendered, toolchain, module_name(key), Path(tmp))
                if on_compile:
                    on_compile(spec, key, built)
                return built.module, key, True
        try:
            with self.lock(key):
                module = self._try_load(key, toolchain, quiet=False, spec=spec)  # built by another process meanwhile?
                if module is not None:
                    self.index_put(lookup, key)
                    return module, key, False
                built = self._build_entry(spec, rendered, toolchain, key)
        except OSError as exc:
            if exc.errno in _NO_ROOM:
                raise _no_room(self.root, exc) from exc
            raise
        self.index_put(lookup, key)
        if on_compile:
            on_compile(spec, key, built)
        return built.module, key, True

    def _try_load(self, key: str, toolchain: Toolchain, quiet: bool = True,
                  spec: ConvSpec | None = None) -> ModuleType | None:
        """The entry's module, or None. Only the check made under the lock reports a bad entry."""
        try:
            return self.load(key, toolchain, spec=spec)
        except FileNotFoundError:
            return None
        except InvalidEntry as exc:
            if not quiet:
                log.warning("kernelgen cache entry %s is not usable (%s); rebuilding it", key[:16], exc)
            return None

    def _build_entry(self, spec: ConvSpec, rendered: Rendered, toolchain: Toolchain, key: str) -> Built:
        """Build in staging, verify, write the manifest last, rename into place. Caller holds the lock."""
        self._sweep_staging(held=key)
        staging = self.root / "staging" / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        staging.mkdir(mode=0o700)
        name = module_name(key)
        log.debug("kernelgen: compiling %s for %s (key %s)", spec.summary(), toolchain.arch, key[:16])
        try:
            built = build(rendered, toolchain, name, staging)
        except Exception:
            failed = self.root / "failed" / key
            shutil.rmtree(failed, ignore_errors=True)
            try:
                os.rename(staging, failed)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        so = built.path
        manifest = {
            "format": FORMAT, "key": key, "name": name, "family": spec.family,
            "spec": spec.to_dict(), "summary": spec.summary(), "toolchain": toolchain.to_dict(),
            "source_digest": rendered.digest, "created": time.time(), "build_seconds": round(built.seconds, 3),
            "so": {"file": so.name, "size": so.stat().st_size, "sha256": file_sha256(so)},
            "sources": ["main.cpp"] + (["cuda.cu"] if rendered.cuda is not None else []),
        }
        try:
            _atomic_write(staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        target = self.entry_dir(key)
        if target.is_symlink():  # (not ours to follow: replaced by ours)
            target.unlink()
        elif target.exists():  # an invalid entry we decided to replace
            shutil.rmtree(target, ignore_errors=True)
        os.rename(staging, target)
        built.path = target / so.name
        # (DEBUG: a call's compile is logged once, at INFO, by functional._log_plan; warm and tune
        # draw their own progress)
        log.debug("kernelgen: compiled %s for %s in %.1f s (key %s)", spec.summary(), toolchain.arch,
                  built.seconds, key[:16])
        return built

    def _sweep_staging(self, held: str | None = None) -> None:
        """Remove staging directories nobody is building in (a builder killed mid-build).

        A build's directory is named after its key, and its builder holds the key's lock until the
        build is renamed into place: a lock we can take means no process, in this PID namespace
        or another sharing the cache, is building there. (A process ID says nothing across
        containers.) Other leftovers (an interrupted import, an entry's trash) carry no lock and
        are removed once a day old. `held`: a key whose lock the caller holds (its leftovers go)."""
        base = self.root / "staging"
        for path in base.iterdir() if base.is_dir() else ():
            key = path.name.split(".")[0]
            if key == held:
                shutil.rmtree(path, ignore_errors=True)
            elif len(key) == 64 and all(c in "0123456789abcdef" for c in key):
                with self._try_lock(key) as free:
                    if free:
                        shutil.rmtree(path, ignore_errors=True)
            elif _age(path) > 86400:
                shutil.rmtree(path, ignore_errors=True)

    @contextlib.contextmanager
    def _try_lock(self, key: str) -> Iterator[bool]:
        """Hold `key`'s lock if it is free now (True), else yield False at once. (Held by this very
        process through another descriptor counts as taken: flock locks are per open file.)"""
        try:
            fd = os.open(self.root / "locks" / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False
                return
            yield True
        finally:
            os.close(fd)


def _private(path: Path, st: os.stat_result, error: Callable[[str], Exception]) -> None:
    """Raise error(...) unless `st` (an lstat of `path`) is a directory or file of ours (or root's)
    that others cannot write, and not a symbolic link."""
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{path} is a symbolic link; kernelgen loads code only from its own directories")
    if st.st_uid not in (os.getuid(), 0):
        raise error(f"{path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); loading code from it "
                    f"would run another user's binaries")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise error(f"{path} is writable by other users (mode {stat.filemode(st.st_mode)}); run "
                    f"`chmod go-w {path}` or `kernelgen cache clear`")


def _age(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except OSError:
        return 0.0


def _atomic_write(path: Path, text: str) -> None:
    """Write `path` whole or not at all; a failed write (a full disk) leaves no temporary behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def _no_room(root: Path, exc: OSError) -> Exception:
    return _cache_error(f"no space left for the kernelgen cache {root} ({exc.strerror}: {exc.filename}); free some "
                        f"space, run `kernelgen cache prune --max-size SIZE`, or set KERNELGEN_CACHE_DIR to "
                        f"another disk")


__all__ = ["Cache", "Entry", "InvalidEntry", "cache_key", "lookup_key", "module_name", "template_dir"]
