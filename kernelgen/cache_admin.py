"""See and control what is in a kernel cache: list, inspect, prune, clear, export, import.

Everything here goes through the cache's own rules (cache.py): an entry is removed
under its key's lock by renaming it out of `entries/` first, so a reader sees a whole
entry or none; an imported entry is verified in a staging directory and renamed into
place whole.

Export writes a tar.gz of complete entries (manifest, .so and rendered sources, no
build byproducts) with an archive manifest of every file's size and sha256. Import
trusts nothing in the archive: every member name must be exactly
`kernelgen-export.json` or `entries/<64 hex>/<plain file name>` and a regular file (no
absolute paths, no '..', no links or devices), or the whole archive is rejected
before anything is written. Each entry is then checked against the archive manifest,
against its own manifest (the .so's size and sha256), against the local toolchain
(kernelgen, Python, torch, CUDA, compilers, arch, flags: an entry built by another is
never served, so it is skipped with the reason) and against the key this kernelgen
computes for its spec (templates that differ would render other code).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tarfile
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from ._version import __version__
from .cache import MANIFEST, Cache, InvalidEntry, cache_key, file_sha256, lookup_key
from .errors import CacheError, KernelgenError
from .spec import ConvSpec
from .toolchain import Toolchain

ARCHIVE_MANIFEST = "kernelgen-export.json"
ARCHIVE_SIGNATURE = "kernelgen-export.sig"  # HMAC-SHA256 of the archive manifest, which lists every file's sha256
ARCHIVE_FORMAT = 1
MAX_MEMBER_BYTES = 1 << 31  # a kernel .so is a few MB; anything near this is not one of ours
MAX_ARCHIVE_BYTES = 1 << 34  # 16 GiB in all: thousands of kernels
MAX_ARCHIVE_MEMBERS = 50_000
MAX_MANIFEST_BYTES = 64 << 20
_MAC_CONTEXT = b"kernelgen-archive-v1\0"
_KEY = r"[0-9a-f]{64}"
_FILE_MEMBER = re.compile(rf"entries/({_KEY})/([A-Za-z0-9_][A-Za-z0-9_.-]{{0,200}})")
_DIR_MEMBER = re.compile(rf"entries(/{_KEY})?/?")

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000 ** 4,
               "tib": 1 << 40}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# What a truncated or corrupt gzip/tar stream raises (gzip.BadGzipFile is an OSError).
_READ_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error)


class ArchiveError(KernelgenError, ValueError):
    """An archive that must not be imported at all (unreadable, malformed or hostile)."""


# ---------------------------------------------------------------------------- parsing


def parse_size(text: str) -> int:
    """Bytes in '500M', '2G', '1.5GiB', '100k', '4096' (K/M/G/T are powers of 1024; KB/MB/GB powers of 1000)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}; expected a number with an optional unit, e.g. 500M, 2G, 1.5GiB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_age(text: str) -> float:
    """Seconds in '90s', '30m', '12h', '7d', '2w' (a bare number is seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not m:
        raise ValueError(f"invalid age {text!r}; expected a number with a unit s, m, h, d or w, e.g. 7d or 12h")
    return float(m.group(1)) * _AGE_UNITS[m.group(2) or "s"]


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for limit, unit, div in ((120, "s", 1), (7200, "m", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / div:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


# ---------------------------------------------------------------------------- listing


@dataclass
class EntryInfo:
    """One complete entry, as `cache ls` shows it."""

    key: str
    family: str
    summary: str
    device: str
    arch: str
    size: int
    created: float
    last_used: float
    path: Path
    manifest: dict = field(repr=False)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {"key": self.key, "family": self.family, "summary": self.summary, "device": self.device,
                "arch": self.arch, "size": self.size, "created": self.created, "last_used": self.last_used,
                "age_seconds": round(now - self.created, 1), "path": str(self.path),
                "spec": self.manifest.get("spec")}


def _dir_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def list_entries(cache: Cache) -> list[EntryInfo]:
    """Every complete entry of `cache` (the .so is not hashed: see `entry_details`)."""
    out = []
    for entry in cache.entries():
        m = entry.manifest
        tc = m.get("toolchain") or {}
        created = float(m.get("created") or 0.0)
        try:
            last_used = (entry.path / "last_used").stat().st_mtime
        except OSError:
            last_used = created
        out.append(EntryInfo(key=entry.key, family=str(m.get("family", "?")), summary=str(m.get("summary", "?")),
                             device=str(tc.get("device", "?")), arch=str(tc.get("arch", "?")),
                             size=_dir_size(entry.path), created=created, last_used=last_used, path=entry.path,
                             manifest=m))
    return out


def resolve_key(cache: Cache, prefix: str) -> str:
    """The full key of the one entry whose key starts with `prefix` (KeyError otherwise, saying why)."""
    prefix = prefix.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{1,64}", prefix):
        raise KeyError(f"{prefix!r} is not a key: keys are 64 hex digits (a unique prefix will do)")
    base = cache.root / "entries"
    matches = sorted(p.name for p in base.iterdir() if p.name.startswith(prefix)) if base.is_dir() else []
    if not matches:
        raise KeyError(f"no entry with key {prefix} in {cache.root} (see `kernelgen cache ls`)")
    if len(matches) > 1:
        raise KeyError(f"key prefix {prefix} is ambiguous: {', '.join(k[:16] for k in matches[:5])}...; "
                       f"give more digits")
    return matches[0]


def entry_details(cache: Cache, key: str) -> dict[str, Any]:
    """Everything about one entry: manifest (full spec, toolchain), paths, and whether it verifies."""
    key = resolve_key(cache, key)
    path = cache.entry_dir(key)
    try:
        entry = cache.read_entry(key, verify_so=True, rehash=True)
        status = "ok"
        manifest = entry.manifest
    except (InvalidEntry, FileNotFoundError) as exc:
        status = f"not usable: {exc}"
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            manifest = {}
    sources = [str(path / s) for s in manifest.get("sources", []) if isinstance(s, str) and "/" not in s]
    return {"key": key, "path": str(path), "status": status, "summary": manifest.get("summary"),
            "family": manifest.get("family"), "spec": manifest.get("spec"), "toolchain": manifest.get("toolchain"),
            "sources": sources, "so": manifest.get("so"), "created": manifest.get("created"),
            "build_seconds": manifest.get("build_seconds"), "size": _dir_size(path)}


# ---------------------------------------------------------------------------- removing


def _remove_entry(cache: Cache, key: str) -> bool:
    """Take `key`'s entry out under its lock: rename it away (readers see all or nothing), then delete."""
    target = cache.entry_dir(key)
    with cache.lock(key):
        trash = cache.root / "staging" / f"trash.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(target, trash)
        except FileNotFoundError:
            return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _drop_stale_index(cache: Cache) -> None:
    """Index files pointing at entries that are gone (only a wasted lookup, but clutter)."""
    for path in (cache.root / "index").glob("*.json"):
        key = cache.index_get(path.name[:-len(".json")])
        if key is None or not cache.entry_dir(key).is_dir():
            with contextlib.suppress(OSError):
                path.unlink()
    for path in (cache.root / "plans").glob("*.json"):  # plan records (plans.py) name entries too
        try:
            key = json.loads(path.read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            key = None
        if not isinstance(key, str) or not re.fullmatch(_KEY, key) or not cache.entry_dir(key).is_dir():
            with contextlib.suppress(OSError):
                path.unlink()


def _young(path: Path, seconds: float = 3600.0) -> bool:
    """Whether `path` was modified within `seconds` (False if it is gone)."""
    try:
        return time.time() - path.lstat().st_mtime < seconds
    except OSError:
        return False


def _writable(cache: Cache, verb: str) -> None:
    """Raise a CacheError saying what is wrong where the cache cannot be changed (a read-only disk
    or directory), rather than failing half-way with a traceback."""
    cache.ensure()
    if not cache.writable:
        raise CacheError(f"cannot {verb} the kernelgen cache {cache.root}: it is read-only (for you, or its "
                         f"filesystem); nothing was removed. Run this as its owner, or on a writable copy")


@contextlib.contextmanager
def _removing(cache: Cache, verb: str) -> Iterator[None]:
    """Turn a permission or read-only error met while removing into a CacheError naming the file."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise CacheError(f"cannot {verb} the kernelgen cache {cache.root}: {exc.strerror} ({exc.filename}); "
                             f"part of it may already be removed") from None
        raise


def clear(cache: Cache) -> int:
    """Remove every entry, index file, plan record and failed build; returns the number of entries removed."""
    _writable(cache, "clear")
    with _removing(cache, "clear"):
        return _clear(cache)


def _clear(cache: Cache) -> int:
    removed = 0
    base = cache.root / "entries"
    for path in sorted(base.iterdir()) if base.is_dir() else ():
        if re.fullmatch(_KEY, path.name) and path.is_dir() and not path.is_symlink():
            removed += _remove_entry(cache, path.name)
    for sub in ("index", "plans", "failed"):
        if not (cache.root / sub).is_dir():
            continue
        for path in (cache.root / sub).iterdir():
            if path.name.endswith(".tmp") and _young(path):
                continue  # another process is writing it: its rename would fail (left over: removed later)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
    return removed


def prune(cache: Cache, max_size: int | None = None, older_than: float | None = None,
          dry_run: bool = False, now: float | None = None) -> list[EntryInfo]:
    """Remove entries not used for `older_than` seconds, then the least recently used ones
    until the entries total at most `max_size` bytes. Returns what was (or, with
    dry_run, would be) removed."""
    if max_size is None and older_than is None:
        raise ValueError("prune needs --max-size, --older-than or both")
    if dry_run:
        cache.ensure()
    else:
        _writable(cache, "prune")
    now = time.time() if now is None else now
    entries = sorted(list_entries(cache), key=lambda e: e.last_used)  # least recently used first
    doomed = [e for e in entries if older_than is not None and now - e.last_used > older_than]
    if max_size is not None:
        kept = [e for e in entries if e not in doomed]
        total = sum(e.size for e in kept)
        for e in kept:
            if total <= max_size:
                break
            doomed.append(e)
            total -= e.size
    if not dry_run:
        with _removing(cache, "prune"):
            doomed = [e for e in doomed if _remove_entry(cache, e.key)]
            _drop_stale_index(cache)
    return doomed


# ---------------------------------------------------------------------------- signing


def new_secret(path: str | Path) -> None:
    """Write a fresh random 256-bit secret (hex) to `path`, readable by its owner only; refuses to
    overwrite a file."""
    import secrets

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def read_secret(path: str | Path) -> bytes:
    """The secret in `path` (ArchiveError if it is missing, too short, or readable by others)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ArchiveError(f"cannot read the archive secret {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        data = f.read(4096).strip()
    if st.st_mode & 0o077:
        raise ArchiveError(f"the archive secret {path} is readable by other users (mode {oct(st.st_mode & 0o777)}); "
                           f"run `chmod 600 {path}`")
    if len(data) < 32:
        raise ArchiveError(f"the archive secret {path} holds {len(data)} bytes; use at least 32 "
                           f"(`kernelgen cache keygen FILE` writes one)")
    return data


def _mac(secret: bytes, manifest: bytes) -> str:
    import hmac

    return hmac.new(secret, _MAC_CONTEXT + manifest, hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------------- export


def export(cache: Cache, archive: str | Path, keys: Sequence[str] | None = None,
           secret: bytes | None = None) -> list[str]:
    """Write the verified entries (all, or those of `keys`/prefixes) to a tar.gz; returns their keys.

    Only the manifest, the .so and the rendered sources go in; the archive manifest
    lists every file's size and sha256. Entries that do not verify are left out. With a `secret`
    (read_secret), the archive manifest is signed (HMAC-SHA256), so an importer holding the same
    secret knows the archive came from someone who holds it and was not changed since.
    """
    wanted = {resolve_key(cache, k) for k in keys} if keys else None
    chosen: list[tuple[str, list[Path]]] = []
    for info in list_entries(cache):
        if wanted is not None and info.key not in wanted:
            continue
        try:
            entry = cache.read_entry(info.key, verify_so=True)
        except (InvalidEntry, FileNotFoundError):
            continue
        names = [MANIFEST, entry.manifest["so"]["file"]]
        names += [s for s in entry.manifest.get("sources", []) if isinstance(s, str) and _FILE_MEMBER.fullmatch(
            f"entries/{info.key}/{s}") and (entry.path / s).is_file()]
        chosen.append((info.key, [entry.path / n for n in dict.fromkeys(names)]))
    manifest = {"format": ARCHIVE_FORMAT, "kernelgen": __version__, "created": time.time(), "entries": {
        key: {"files": {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in files}}
        for key, files in chosen}}
    archive = Path(archive)
    tmp = archive.with_name(f".{archive.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            data = json.dumps(manifest, indent=1, sort_keys=True).encode()
            _add_bytes(tar, ARCHIVE_MANIFEST, data)
            if secret is not None:
                sig = {"alg": "hmac-sha256", "mac": _mac(secret, data)}
                _add_bytes(tar, ARCHIVE_SIGNATURE, json.dumps(sig).encode())
            for key, files in chosen:
                for p in files:
                    with open(p, "rb") as f:
                        _add_bytes(tar, f"entries/{key}/{p.name}", f, p.stat().st_size)
        os.replace(tmp, archive)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return [key for key, _ in chosen]


def _add_bytes(tar: tarfile.TarFile, name: str, data, size: int | None = None) -> None:
    import io

    info = tarfile.TarInfo(name)
    info.mode = 0o644
    info.mtime = int(time.time())
    if isinstance(data, bytes):
        info.size = len(data)
        data = io.BytesIO(data)
    else:
        info.size = size
    tar.addfile(info, data)


# ---------------------------------------------------------------------------- import


@dataclass
class ImportOutcome:
    key: str
    status: str  # 'imported', 'present' (already there), 'skipped' (not for this machine), 'failed' (corrupt)
    reason: str = ""
    summary: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "status": self.status, "reason": self.reason, "summary": self.summary}


def _check_members(tar: tarfile.TarFile) -> tuple[dict[str, tarfile.TarInfo], dict[str, dict[str, tarfile.TarInfo]]]:
    """(archive-manifest member by name, {key: {file name: member}}); ArchiveError on anything else."""
    top: dict[str, tarfile.TarInfo] = {}
    files: dict[str, dict[str, tarfile.TarInfo]] = {}
    seen: set[str] = set()
    total = 0
    for m in tar:  # (one header at a time: the caps stop a hostile archive before it is all read)
        name = m.name
        total += m.size
        if len(seen) >= MAX_ARCHIVE_MEMBERS or total > MAX_ARCHIVE_BYTES:
            raise ArchiveError(f"the archive holds more than {MAX_ARCHIVE_MEMBERS} files or "
                               f"{human_size(MAX_ARCHIVE_BYTES)}; refusing it")
        if name in seen:
            raise ArchiveError(f"member {name!r} appears twice in the archive")
        seen.add(name)
        if m.isdir() and _DIR_MEMBER.fullmatch(name):
            continue
        if not m.isfile():
            kind = "a link" if (m.issym() or m.islnk()) else "a device or special file" if (
                m.isdev() or m.isfifo()) else "not a regular file"
            raise ArchiveError(f"member {name!r} is {kind}; a kernelgen archive holds regular files only")
        if m.size > MAX_MEMBER_BYTES:
            raise ArchiveError(f"member {name!r} is {m.size} bytes, more than any kernel; refusing the archive")
        if name in (ARCHIVE_MANIFEST, ARCHIVE_SIGNATURE):
            if m.size > MAX_MANIFEST_BYTES:
                raise ArchiveError(f"{name} is {m.size} bytes; refusing the archive")
            top[name] = m
            continue
        match = _FILE_MEMBER.fullmatch(name)
        if not match:
            raise ArchiveError(f"member {name!r} is not a kernelgen cache file (expected {ARCHIVE_MANIFEST} or "
                               f"entries/<key>/<file>; absolute paths, '..' and subdirectories are refused)")
        files.setdefault(match.group(1), {})[match.group(2)] = m
    if ARCHIVE_MANIFEST not in top:
        raise ArchiveError(f"the archive has no {ARCHIVE_MANIFEST}: it was not written by `kernelgen cache export`")
    return top, files


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    try:
        return tar.extractfile(member).read()  # type: ignore[union-attr]
    except (OSError, AttributeError, tarfile.TarError) as exc:
        raise ArchiveError(f"unreadable {member.name}: {exc}") from None


def _check_signature(tar: tarfile.TarFile, top: dict[str, tarfile.TarInfo], data: bytes, secret: bytes | None,
                     trust_unsigned: bool) -> None:
    """Refuse an archive whose signature does not match `secret`, or an unsigned (or unverifiable)
    one unless `trust_unsigned`: an archive carries binaries, and its checksums are its own."""
    sig_member = top.get(ARCHIVE_SIGNATURE)
    if sig_member is None:
        if trust_unsigned:
            return
        raise ArchiveError("the archive is not signed. An archive carries compiled code that kernelgen did not "
                           "build here, and its checksums are its own: sign exports with `--secret FILE` and "
                           "import with the same secret, or pass --trust-unsigned for an archive you trust")
    if secret is None:
        if trust_unsigned:
            return
        raise ArchiveError("the archive is signed, but no secret was given to check it: pass --secret FILE "
                           "(or --trust-unsigned)")
    import hmac

    try:
        sig = json.loads(_member_bytes(tar, sig_member))
        mac = sig["mac"] if isinstance(sig, dict) and sig.get("alg") == "hmac-sha256" else None
    except (ValueError, KeyError, TypeError):
        mac = None
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, data)):
        raise ArchiveError("the archive's signature does not match your secret: it was signed with another "
                           "secret, or changed after it was signed")


def _read_archive_manifest(data: bytes, files: dict[str, dict[str, tarfile.TarInfo]]) -> dict[str, dict[str, dict]]:
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise ArchiveError(f"unreadable {ARCHIVE_MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT \
            or not isinstance(manifest.get("entries"), dict):
        raise ArchiveError(f"{ARCHIVE_MANIFEST} is not a kernelgen export of format {ARCHIVE_FORMAT}")
    listed = manifest["entries"]
    for key, members in files.items():
        entry = listed.get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
            raise ArchiveError(f"entries/{key}/ is in the archive but not in its manifest")
        extra = sorted(set(members) - set(entry["files"]))
        if extra:
            raise ArchiveError(f"entries/{key}/{extra[0]} is in the archive but not in its manifest")
    return listed


def _toolchain_from(d: Any) -> Toolchain:
    return Toolchain(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _toolchain_problem(tc: dict, local: Toolchain) -> str | None:
    """Why an entry built by `tc` would not be served here, or None."""
    # Without local compilers their versions are unknown: the runtime fields decide (as Cache does).
    mine = json.loads(json.dumps(local.to_dict() if local.compilers_known else local.runtime_dict()))
    diffs = [f"{k} {tc.get(k)!r} in the archive, {mine[k]!r} here" for k in mine if tc.get(k) != mine[k]]
    return "built by another toolchain: " + "; ".join(diffs) if diffs else None


def import_archive(cache: Cache, archive: str | Path, archs: Sequence[str] | None = None,
                   secret: bytes | None = None, trust_unsigned: bool = False) -> list[ImportOutcome]:
    """Import the entries of a `kernelgen cache export` archive into `cache`.

    archs: CUDA targets to accept (default: the local GPU's, or every arch where no GPU
        is visible, e.g. while building a container image).
    secret: the secret the archive must be signed with (read_secret); an unsigned archive, or a
        signed one without a secret to check it, is refused unless `trust_unsigned`. The
        checksums inside an archive are its own: only a signature says who made it.
    Raises ArchiveError, before writing anything, when the archive is unreadable or any
    member is not a plain cache file. Per entry the outcome says 'imported',
    'present', 'skipped' (another toolchain or arch, or other kernelgen sources) or
    'failed' (a checksum mismatch: corrupted or tampered).
    """
    from .render import render
    from .toolchain import current

    cache.ensure()
    if not cache.writable:
        raise ArchiveError(f"the cache directory {cache.root} is not writable")
    if archs is None:
        archs = _local_gpu_archs()
    try:
        tar = tarfile.open(archive, "r:*")
    except _READ_ERRORS as exc:
        raise ArchiveError(f"cannot read {archive}: {exc}") from None
    outcomes: list[ImportOutcome] = []
    staging = cache.root / "staging" / f"import.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    with tar:
        try:
            top, files = _check_members(tar)
            data = _member_bytes(tar, top[ARCHIVE_MANIFEST])
            _check_signature(tar, top, data, secret, trust_unsigned)
            listed = _read_archive_manifest(data, files)
        except _READ_ERRORS as exc:
            raise ArchiveError(f"cannot read {archive}: {exc}") from None
        (staging / "entries").mkdir(parents=True, mode=0o700)
        try:
            for key in sorted(listed):
                if not re.fullmatch(_KEY, str(key)):
                    outcomes.append(ImportOutcome(str(key)[:64], "failed", "not a cache key"))
                    continue
                try:
                    outcomes.append(_import_one(cache, tar, staging, key, listed[key], files.get(key, {}), archs,
                                                current, render))
                except _READ_ERRORS as exc:  # truncated mid-way: what was imported stays, the rest fails
                    outcomes.append(ImportOutcome(key, "failed", f"import failed: {exc}"))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return outcomes


def _local_gpu_archs() -> list[str] | None:
    import torch

    from .toolchain import arch_for_capability

    if not torch.version.cuda or not torch.cuda.is_available():
        return None
    return sorted({arch_for_capability(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})


def _import_one(cache: Cache, tar: tarfile.TarFile, staging: Path, key: str, listed: dict,
                members: dict[str, tarfile.TarInfo], archs, current, render) -> ImportOutcome:
    expected = listed.get("files") if isinstance(listed, dict) else None
    if not isinstance(expected, dict) or MANIFEST not in expected:
        return ImportOutcome(key, "failed", "the archive manifest lists no files for this entry")
    missing = sorted(set(expected) - set(members))
    if missing:
        return ImportOutcome(key, "failed", f"{missing[0]} is listed in the archive manifest but missing")
    entry_dir = staging / "entries" / key
    entry_dir.mkdir(mode=0o700)
    for name, member in members.items():
        want = expected[name]
        got_size, got_sha = _extract(tar, member, entry_dir / name)
        if not isinstance(want, dict) or got_size != want.get("size") or got_sha != want.get("sha256"):
            return ImportOutcome(key, "failed", f"{name} does not match the archive manifest's size and sha256 "
                                               f"(corrupted or tampered)")
    try:
        entry = Cache(staging, lock_timeout=cache.lock_timeout).read_entry(key, verify_so=True)
    except (InvalidEntry, FileNotFoundError) as exc:
        return ImportOutcome(key, "failed", f"the entry does not verify: {exc}")
    m = entry.manifest
    summary = str(m.get("summary", ""))
    tc = m.get("toolchain")
    try:
        spec = ConvSpec.from_dict(m["spec"])
        device, arch = tc["device"], tc["arch"]
        local = current(device, arch if device == "cuda" else None)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        return ImportOutcome(key, "skipped", f"cannot be used by this kernelgen: {exc}", summary)
    if device == "cuda" and archs is not None and arch not in archs:
        return ImportOutcome(key, "skipped", f"built for {arch}; accepted here: {', '.join(archs)}", summary)
    problem = _toolchain_problem(tc, local)
    if problem:
        return ImportOutcome(key, "skipped", problem, summary)
    if cache_key(spec, render(spec), _toolchain_from(tc)) != key:
        return ImportOutcome(key, "skipped", "this kernelgen renders different source for its spec (another "
                                             "version or templates); it would never be served", summary)
    with cache.lock(key):
        target = cache.entry_dir(key)
        try:
            cache.read_entry(key, local, verify_so=True)
            return ImportOutcome(key, "present", "already in the cache", summary)
        except (InvalidEntry, FileNotFoundError):
            pass
        if target.exists():  # an unusable entry: replace it whole
            trash = cache.root / "staging" / f"trash.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            os.rename(target, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(entry_dir, target)
    cache.index_put(lookup_key(spec, local), key)
    return ImportOutcome(key, "imported", "", summary)


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path) -> tuple[int, str]:
    """Copy one member to `dest` (a path we built from validated names), hashing it."""
    src = tar.extractfile(member)
    if src is None:
        raise ArchiveError(f"member {member.name!r} has no data")
    h = hashlib.sha256()
    size = 0
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as out:
        for block in iter(lambda: src.read(1 << 20), b""):
            h.update(block)
            size += len(block)
            out.write(block)
    return size, h.hexdigest()


__all__ = ["ArchiveError", "EntryInfo", "ImportOutcome", "clear", "entry_details", "export", "human_age",
           "human_size", "import_archive", "list_entries", "new_secret", "parse_age", "parse_size", "prune",
           "read_secret", "resolve_key"]
