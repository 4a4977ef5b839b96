"""Compile rendered sources into an importable extension module, in a given directory.

This module knows nothing about caching: `cache.py` decides where and whether to
build; here we only turn sources into a `.so` with torch's `load_inline`.

The binding includes only Python.h and the kernels only CUDA's headers, and we pass
`no_implicit_headers=True`, so neither unit parses torch's headers: that is what
keeps a cold build at a few seconds instead of half a minute.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from .errors import CompileError

if TYPE_CHECKING:
    from .render import Rendered
    from .toolchain import Toolchain


class Built:
    """A freshly built module, the .so it came from, and how long the build took."""

    __slots__ = ("module", "path", "seconds")

    def __init__(self, module: ModuleType, path: Path, seconds: float):
        self.module = module
        self.path = path
        self.seconds = seconds


def so_name(name: str) -> str:
    return f"{name}.so"


def build(rendered: "Rendered", toolchain: "Toolchain", name: str, directory: Path) -> Built:
    """Build `rendered` as extension module `name` inside `directory` (which must exist)."""
    from torch.utils.cpp_extension import load_inline

    is_cuda = rendered.cuda is not None
    if is_cuda != (toolchain.device == "cuda"):
        raise ValueError(f"sources for {'cuda' if is_cuda else 'cpu'} given a {toolchain.device} toolchain")
    start = time.perf_counter()
    try:
        module = load_inline(
            name=name,
            cpp_sources=[rendered.cpp],
            cuda_sources=[rendered.cuda] if is_cuda else None,
            extra_cflags=list(toolchain.cflags),
            extra_cuda_cflags=list(toolchain.cuda_cflags) if is_cuda else None,
            extra_ldflags=list(toolchain.ldflags),
            build_directory=str(directory),
            with_cuda=is_cuda,
            is_python_module=True,
            no_implicit_headers=True,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        raise CompileError(f"kernelgen failed to build {name} ({toolchain.describe()})",
                           source_dir=str(directory), log=str(exc)) from exc
    path = directory / so_name(name)
    if not path.is_file():
        raise CompileError(f"build of {name} reported success but wrote no {path.name}", source_dir=str(directory))
    return Built(module=module, path=path, seconds=time.perf_counter() - start)
