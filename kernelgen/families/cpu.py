"""The CPU family: an OpenMP direct convolution, compiled by the host compiler.

It needn't beat oneDNN; it makes kernelgen run on a machine without a GPU through the
same render -> compile -> cache -> call pipeline, which is what lets CI exercise it
for real. It takes any strides, so it never copies the input.

Tiles: `cout_block` output channels a task, which read each input row once for all of them
(1 or 4); two configurations, so the tuner's whole path (build, check, time, keep, reuse) runs
on a machine without a GPU too.
"""

from __future__ import annotations

from .base import Family

cpu_direct = Family(
    name="cpu_direct", device="cpu", template="cpu/direct.cpp.j2", layouts=("any",), archs=(),
    dtypes=("float32", "float16", "bfloat16", "float64"), tiles={"cout_block": (1, 4)},
    wide_weights=True, epilogue=True, scale=True,
)

FAMILIES = (cpu_direct,)
