"""Where kernelgen's inputs and outputs live, and every environment variable it reads
(read here and nowhere else).

| variable | default | meaning |
| --- | --- | --- |
| KERNELGEN_CACHE_DIR | ~/.cache/kernelgen (or $XDG_CACHE_HOME/kernelgen) | where built kernels live |
| KERNELGEN_LOCK_TIMEOUT | 600 | seconds to wait for another process building the same kernel |
| KERNELGEN_JOBS | number of CPU cores | parallel builds (CLI `warm`, test warm-up, the tuner) |
| KERNELGEN_TUNE | 0 | 1: the first call of each signature (without a plan record) times the top candidates on the GPU and keeps the fastest (kernelgen.tune) |
| KERNELGEN_TUNE_TOP | 4 | how many candidates the tuner builds and times a call |
| KERNELGEN_PACK_ONCE | 1 | 0: kernels that pack their weights pack them on every call, instead of once per weight version (kernelgen/packs.py) |
| KERNELGEN_ARCHIVE_SECRET | (none) | file holding the secret `cache export` signs and `cache import` verifies archives with |
| CXX | c++ | the host C++ compiler (torch's builder honours it too) |
| CUDA_HOME, CUDA_PATH | the nvcc on PATH, then /usr/local/cuda | the CUDA toolkit (looked up in torch's order, since torch's builder compiles) |

Values are read when asked for (not at import), so a test or a launcher can set them
before the first call.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _positive(name: str, text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a valid {kind.__name__}") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be positive")
    return value


def cache_dir() -> Path:
    explicit = os.environ.get("KERNELGEN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "kernelgen"


def lock_timeout() -> float:
    return float(_positive("KERNELGEN_LOCK_TIMEOUT", os.environ.get("KERNELGEN_LOCK_TIMEOUT", "600"), float))


def jobs() -> int:
    text = os.environ.get("KERNELGEN_JOBS")
    if text is None:
        return os.cpu_count() or 1
    return int(_positive("KERNELGEN_JOBS", text, int))


def tune() -> bool:
    """KERNELGEN_TUNE: whether an untuned call is tuned on its first use."""
    text = os.environ.get("KERNELGEN_TUNE", "0").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"KERNELGEN_TUNE={text!r}: say 1 (tune each call on first use) or 0")


def pack_once() -> bool:
    """KERNELGEN_PACK_ONCE: whether a kernel's packed weights are kept with the weight (packs.py)."""
    text = os.environ.get("KERNELGEN_PACK_ONCE", "1").strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"KERNELGEN_PACK_ONCE={text!r}: say 1 (pack a weight once per version) or 0 (every call)")


def tune_top() -> int:
    """KERNELGEN_TUNE_TOP: candidates the tuner times a call."""
    return int(_positive("KERNELGEN_TUNE_TOP", os.environ.get("KERNELGEN_TUNE_TOP", "4"), int))


def cuda_home(nvcc: str | None = None) -> Path | None:
    """The CUDA toolkit: $CUDA_HOME, $CUDA_PATH, the one holding the nvcc on PATH, /usr/local/cuda.

    nvcc: the nvcc PATH finds, for a caller that has looked it up already (None: look).
    """
    for name in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(name)
        if value:
            return Path(value)
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc:  # os.path.realpath: Path.resolve makes the same walk, then one more stat
        return Path(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    default = Path("/usr/local/cuda")
    return default if default.exists() else None


def template_dir() -> Path:
    """The templates shipped with the package, or the checkout's `templates/`.

    Here rather than in render.py so that a warm process, which checks the templates'
    sizes and mtimes (plans.py) but renders nothing, need not import the renderer.
    """
    here = os.path.dirname(os.path.realpath(__file__))
    for candidate in (os.path.join(here, "templates"), os.path.join(os.path.dirname(here), "templates")):
        if os.path.isfile(os.path.join(candidate, "binding.cpp.j2")):
            return Path(candidate)
    raise FileNotFoundError(f"kernelgen's templates are missing (looked in {os.path.join(here, 'templates')} and "
                            f"{os.path.join(os.path.dirname(here), 'templates')}); reinstall the package")


def archive_secret() -> str | None:
    """The file KERNELGEN_ARCHIVE_SECRET names (None where unset): the default of --secret."""
    return os.environ.get("KERNELGEN_ARCHIVE_SECRET") or None


def host_compiler() -> str:
    return os.environ.get("CXX") or "c++"
