"""Depthwise convolution of small NCHW planes on CUDA: `groups == in_channels`, any channel
multiplier.

The template (templates/cuda/depthwise_planes.cu.j2) gives a block `planes` whole input planes,
consecutive in (image, channel) order. A dense NCHW input holds them as one run of elements,
which the block loads with 16-byte copies into shared memory beside the taps of its output
planes; its threads then compute the outputs in their flat order, so that a warp writes whole
lines. `depthwise` instead gives a block one tile of one plane, which on planes of a few dozen
elements leaves every block waiting on a handful of short loads (h100.md, "Depthwise on small
NCHW planes").

The input planes are sized at run time: the kernel reserves `planes * H * W` elements of shared
memory and refuses, naming the tile, a plane the device cannot hold that many of. It is a
candidate only for planes that fit (`default_tiles` refuses the others).

Tile parameters:
    planes   input planes a block (output planes: planes * multiplier);
    threads  threads a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, target
from .depthwise import ELEMENT_BYTES, check_depthwise

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

TILES: Mapping[str, tuple[int, ...]] = {
    # First values are the smallest footprint, so a spec that fits with them fits at all.
    "planes": (1, 2, 4, 8, 16, 32, 64),
    "threads": (64, 128, 256, 512),
}

# The taps (and biases) of a block's output planes, in the accumulator type.
TAPS_LIMIT = 32 * 1024
# The input run the default tiles stage a block: planes that need more go to `depthwise`.
RUN_LIMIT = 48 * 1024
# The run the default tiles aim at (bytes): enough loads in flight a block, several blocks an SM.
RUN_TARGET = 16 * 1024
# Blocks the default tiles keep at least an SM, halving `planes` for small batches.
BLOCKS_PER_SM = 2


def taps_bytes(spec: "ConvSpec", planes: int) -> int:
    """Shared memory for the taps and biases of `planes` input planes' outputs (16-byte multiple),
    by the template's own formula."""
    kh, kw = spec.kernel_size
    acc = 8 if spec.dtype == "float64" else 4
    return (planes * spec.cout_per_group * (kh * kw + 1) * acc + 15) // 16 * 16


def run_bytes(spec: "ConvSpec", planes: int, h: int, w: int) -> int:
    """Shared memory for the input run of `planes` planes of h x w, with the template's slack."""
    esize = ELEMENT_BYTES[spec.dtype]
    return (planes * h * w + 2 * (16 // esize)) * esize


@dataclass(frozen=True)
class DepthwisePlanesFamily(Family):
    """Depthwise NCHW, whole planes a block: see the module docstring."""

    name: str = "depthwise_planes"
    device: str = "cuda"
    template: str = "cuda/depthwise_planes.cu.j2"
    epilogue: bool = True
    scale: bool = True  # (the taps times the scale as they are converted to the accumulator's type)
    layouts: tuple[str, ...] = ("nchw",)
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")
    tiles: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: dict(TILES))
    engine: str = "fma"

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        check_depthwise(self.name, spec)
        planes = dict(spec.tiles)["planes"]
        need = taps_bytes(spec, planes)
        if need > TAPS_LIMIT:
            raise Unsupported(f"{self.name}: the taps of {planes} planes x {spec.cout_per_group} outputs need {need} "
                              f"bytes of shared memory, at most {TAPS_LIMIT} (choose fewer planes)")

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Tiles for a problem shape.

        planes: the most (a power of two) whose input run stays within RUN_TARGET bytes and
            whose taps fit, halved while the batch's planes make fewer than BLOCKS_PER_SM blocks an SM;
            at least one. A plane over RUN_LIMIT is refused (Unsupported): the tiles of
            `depthwise` serve it.
        threads: 256, fewer where a block has fewer outputs than that (at least 64); 512 lost.

        (measured: docs/selection.md, depthwise_planes)
        """
        device = target(problem.device)
        h, w = max(problem.H, 1), max(problem.W, 1)
        if run_bytes(spec, 1, h, w) > RUN_LIMIT:
            raise Unsupported(f"{self.name}: a plane of {h} x {w} needs {run_bytes(spec, 1, h, w)} bytes of shared "
                              f"memory, the tiles stage at most {RUN_LIMIT}")
        planes = TILES["planes"][0]
        for value in TILES["planes"]:
            if run_bytes(spec, value, h, w) <= RUN_TARGET and taps_bytes(spec, value) <= TAPS_LIMIT:
                planes = value
        while planes > 1 and -(-max(problem.N, 1) * spec.in_channels // planes) < BLOCKS_PER_SM * device.sms:
            planes //= 2
        outputs = planes * spec.cout_per_group * max(problem.P, 1) * max(problem.Q, 1)
        threads = 256
        while threads > TILES["threads"][0] and threads // 2 >= outputs:
            threads //= 2
        return {"planes": planes, "threads": threads}

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        # The template recomputes this size and static_asserts that the two agree.
        return {"DWP_TAPS_BYTES": taps_bytes(spec, dict(spec.tiles)["planes"])}


FAMILIES = (DepthwisePlanesFamily(),)
