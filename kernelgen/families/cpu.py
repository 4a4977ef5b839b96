"""The CPU family: an OpenMP direct convolution, compiled by the host compiler.

It needn't beat oneDNN; it makes kernelgen run on a machine without a GPU through the
same render -> compile -> cache -> call pipeline, which is what lets CI exercise it
for real. It takes any strides, so it never copies the input.
"""

from __future__ import annotations

from .base import Family

cpu_direct = Family(
    name="cpu_direct", device="cpu", template="cpu/direct.cpp.j2", layouts=("any",),
    dtypes=("float32", "float16", "bfloat16", "float64"), tiles={},
    wide_weights=True,
)

FAMILIES = (cpu_direct,)
