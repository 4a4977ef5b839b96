"""The registry of kernel families. Each module here defines one or more `Family`."""

from __future__ import annotations

import importlib

from ..errors import ConvArgumentError
from .base import Family

# module name -> names of the Family objects it exports (module attribute FAMILIES).
_MODULES = ("direct", "gemv", "depthwise", "depthwise_planes", "groupwise_nhwc", "grouped_mma", "gemm", "wgmma", "nhwc", "nhwc_tma", "pointwise_tma", "pointwise_tile", "stem_nhwc",
            "wgrad", "cpu")

_registry: dict[str, Family] | None = None


def all_families() -> dict[str, Family]:
    """name -> Family, for every registered family."""
    global _registry
    if _registry is None:
        reg: dict[str, Family] = {}
        for mod in _MODULES:
            for fam in importlib.import_module(f"{__name__}.{mod}").FAMILIES:
                reg[fam.name] = fam
        _registry = reg
    return _registry


def get_family(name: str) -> Family:
    fams = all_families()
    if name not in fams:
        raise ConvArgumentError(f"unknown kernel family {name!r}; known families are {sorted(fams)}")
    return fams[name]


__all__ = ["Family", "all_families", "get_family"]
