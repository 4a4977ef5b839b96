"""Records of which cached kernel serves a call signature, so a warm process skips the work.

The first call with a signature (shapes, strides, dtypes, device, parameters,
precision) is validated (checks.py), its kernel chosen (select.py) and loaded or built
(cache.py). The outcome, the entry's key and the call's sizes, is recorded under
`<cache>/plans/`. A later process making the same call reads the record and imports
the entry directly: the signature was valid when recorded, so there is nothing to
re-validate, and no spec, selection or rendering is needed. A record of a tuned call
(kernelgen.tune) also keeps the measured spec and the candidates' times under "tuned", so
the same choice is rebuilt where its entry has gone.

A record's name hashes the signature together with everything that could change the
answer: kernelgen's own sources and templates (by size and mtime), the Python, torch
and CUDA versions, the GPU's target and model, and the identity of the compilers on PATH. Any
change there is a different name, hence a miss and the full path. The entry a record
names is still verified (manifest and .so checksum) before it is imported.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import sys
import uuid
from pathlib import Path

from . import config
from ._version import __version__

FORMAT = 1


def _walk(root: str, suffix: str) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of every file ending in `suffix` under `root`, sorted.

    One listing per directory and one stat per file found (DirEntry.is_dir answers from
    the listing): this runs in every process's first call.
    """
    found = []
    pending = [(root, "")]
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        pending.append((e.path, prefix + e.name + "/"))
                elif e.name.endswith(suffix):
                    st = e.stat()
                    found.append((prefix + e.name, st.st_size, st.st_mtime_ns))
    found.sort()
    return found


def _tool(name: str) -> list | None:
    """[path, device, inode, size, mtime_ns] of the executable PATH finds for `name` (None: none).

    shutil.which's answer (`name` itself if it has a directory part, else the first PATH
    entry holding an executable non-directory of that name), found with one access() per
    entry, which answers False rather than raising for the many entries that hold no such
    file, instead of which's exists/access/isdir. The stat follows symlinks, so the
    numbers are those of the real binary: switching what /usr/bin/c++ points to changes
    them, as an upgrade in place does.
    """
    if os.path.dirname(name):
        directories = [""]
    else:
        path = os.environ.get("PATH")
        if path is None:
            path = os.confstr("CS_PATH") if hasattr(os, "confstr") else os.defpath
        directories = path.split(os.pathsep) if path else []
    for directory in directories:
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK):
            try:
                st = os.stat(candidate)
            except OSError:  # removed since the access() call
                continue
            if not stat.S_ISDIR(st.st_mode):
                return [candidate, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    return None


@functools.lru_cache(maxsize=None)
def identity() -> str:
    """sha256 of what a record depends on besides the call: code, templates, the selector's measured
    tables, versions, compilers.

    The compilers are the host compiler and nvcc that PATH finds, the CUDA toolkit torch's
    builder would use, and the nvcc inside it (the one kernelgen builds with, which is not
    PATH's when CUDA_HOME names another toolkit).
    """
    import torch

    package = os.path.dirname(os.path.abspath(__file__))
    cxx, nvcc = _tool(config.host_compiler()), _tool("nvcc")
    home = config.cuda_home(nvcc[0] if nvcc else None)
    home_nvcc = _tool(os.path.join(home, "bin", "nvcc")) if home else None
    ident = [FORMAT, __version__, sys.implementation.cache_tag, torch.__version__, torch.version.cuda,
             _walk(package, ".py"), _walk(str(config.template_dir()), ".j2"), _walk(package, ".json"),
             [cxx, nvcc, home_nvcc],
             str(home) if home else None]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()


def record_name(signature: list, arch: str, gpu: str) -> str:
    """The record's name for a call signature (JSON-able) on a target `arch` and GPU model `gpu`
    (kernelgen.device.Device.key): the selector's choice, and a measured one, differ between GPUs."""
    text = json.dumps([identity(), arch, gpu, signature], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def read(root: Path, name: str) -> dict | None:
    try:
        record = json.loads((root / "plans" / f"{name}.json").read_bytes())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT else None


def write(root: Path, name: str, record: dict) -> None:
    """Atomically; best effort (a read-only cache only costs the full path next time)."""
    directory = root / "plans"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        tmp = directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp"
        tmp.write_text(json.dumps(dict(record, format=FORMAT), sort_keys=True))
        os.replace(tmp, directory / f"{name}.json")
    except OSError:
        pass
