"""What a binary depends on besides its source: versions, target and flags.

A `Toolchain` is part of every cache key; an entry built by another toolchain is
never served. Tool versions come from running the tools once; the answers are kept
in-process and in the cache directory keyed by the binary's path, size and mtime, so
a process served from the cache does not spawn compilers.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from . import config
from ._version import __version__
from .arch import arch_flags, arch_for_capability  # noqa: F401 (part of this module's API)

CUDA_CFLAGS_BASE = ("-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr")
CPU_CFLAGS_BASE = ("-O3", "-std=c++17", "-fopenmp", "-fno-math-errno")
CPU_LDFLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class Toolchain:
    kernelgen: str
    python: str
    platform: str
    torch: str
    torch_cuda: str
    host_compiler: str
    nvcc: str
    device: str  # 'cuda' or 'cpu'
    arch: str  # e.g. 'sm_90a' or the CPU's machine name
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...]
    ldflags: tuple[str, ...]

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def compilers_known(self) -> bool:
        """False on a machine without the compilers (a shipped cache is all it can use)."""
        return bool(self.host_compiler.partition(" ")[2].strip()) and (self.device == "cpu" or bool(self.nvcc))

    def runtime_dict(self) -> dict:
        """What a built module depends on at run time: everything but the compilers' versions.

        A machine without compilers cannot know which versions built an entry, so it
        serves entries that match on these fields alone.
        """
        d = self.to_dict()
        del d["host_compiler"], d["nvcc"]
        return d

    def describe(self) -> str:
        return (f"torch {self.torch} (CUDA {self.torch_cuda or '-'}), nvcc {self.nvcc or '-'}, "
                f"{self.host_compiler}, {self.arch}")


def _tool_version(binary: str, pattern: str) -> str:
    """First match of `pattern` in `binary --version`, memoised by the binary's identity."""
    path = shutil.which(binary)
    if path is None:
        return ""
    st = os.stat(path)
    ident = f"{os.path.realpath(path)}:{st.st_size}:{int(st.st_mtime)}"
    memo_path = config.cache_dir() / "toolchain.json"
    memo = _read_memo(memo_path)
    if ident in memo:
        return memo[ident]
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(pattern, out)
    version = m.group(0) if m else out.strip().splitlines()[0] if out.strip() else ""
    memo[ident] = version
    _write_memo(memo_path, memo)
    return version


def _read_memo(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_memo(path: Path, memo: dict) -> None:
    # Best effort: a read-only cache only costs a re-run of `--version` next time.
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not os.access(path.parent, os.W_OK):
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    home = config.cuda_home()
    nvcc = str(home / "bin" / "nvcc") if home and (home / "bin" / "nvcc").exists() else "nvcc"
    return _tool_version(nvcc, r"release [\d.]+, V[\d.]+")


@functools.lru_cache(maxsize=None)
def host_compiler_version() -> str:
    return _tool_version(config.host_compiler(), r"\d+\.\d+\.\d+")


@functools.lru_cache(maxsize=None)
def current(device: str, arch: str | None = None) -> Toolchain:
    """The toolchain that builds for `device` ('cuda' or 'cpu') here.

    arch: a CUDA target such as 'sm_80'; default: the current CUDA device's.
    """
    import torch

    common = dict(
        kernelgen=__version__,
        python=f"{sys.implementation.cache_tag}",
        platform=f"{sys.platform}-{platform.machine()}",
        torch=torch.__version__,
        torch_cuda=torch.version.cuda or "",
        host_compiler=f"{config.host_compiler()} {host_compiler_version()}",
    )
    if device == "cpu":
        return Toolchain(**common, nvcc="", device="cpu", arch=platform.machine() or "cpu",
                         cflags=CPU_CFLAGS_BASE, cuda_cflags=(), ldflags=CPU_LDFLAGS)
    if device != "cuda":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if arch is None:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is available; name a target with arch='sm_90' to build anyway")
        arch = arch_for_capability(*torch.cuda.get_device_capability())
    return Toolchain(**common, nvcc=nvcc_version(), device="cuda", arch=arch,
                     cflags=("-O3", "-std=c++17"), cuda_cflags=CUDA_CFLAGS_BASE + arch_flags(arch), ldflags=())
