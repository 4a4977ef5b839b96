"""CUDA architecture names: which target a GPU gets, and the nvcc flags for a target.

Kept apart from toolchain.py so the hot path can name a GPU's target without
importing the toolchain machinery.
"""

from __future__ import annotations

import re


def arch_flags(arch: str) -> tuple[str, ...]:
    """nvcc target flags for 'sm_90a', 'sm_90', 'sm_80', ..."""
    m = re.fullmatch(r"sm_(\d+)(a?)", arch)
    if not m:
        raise ValueError(f"unknown CUDA architecture {arch!r}; expected a name like sm_80, sm_90 or sm_90a")
    num, suffix = m.groups()
    return (f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}",)


def arch_for_capability(major: int, minor: int) -> str:
    # Hopper's arch-specific instructions (wgmma, setmaxnreg) need the 'a' target;
    # sm_90a code runs on every compute-capability-9.0 part.
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
