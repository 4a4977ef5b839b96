"""Depthwise convolution on CUDA, channels_last: `groups == in_channels`, any channel multiplier.

The template (templates/cuda/depthwise_nhwc.cu.j2) is a bandwidth-bound stencil that runs
along channels, which channels_last keeps contiguous: a thread owns 16 bytes of output
channels (VEC: 4 float32, 8 bf16/fp16) of `vec_q` adjacent output pixels of a row
and walks `rows` rows down; per kernel row it loads the input pixels its strip spans, one
vector load each, and reads the overlap with the next row again from L1. The block's taps sit
in shared memory as [tap][channel]. The NCHW `depthwise` family stages a plane's window in
shared memory instead; in channels_last a plane is not contiguous, so this one is separate.

Tile parameters (every combination is a valid kernel where its taps fit in shared memory):
    block_c  channel vectors a block (lanes fastest); a warp's loads and stores are runs
             of block_c * 16 bytes;
    vec_q    output pixels of a row a thread;
    rows     output rows a thread, one after another;
    threads  threads a block (threads / block_c strips).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ..errors import ConvArgumentError, Unsupported
from .base import Family
# The NCHW family's table (float64 too: the dispatcher asks every family for tiles before its
# check refuses the dtype) and its shape check (groups, and the tap limit both kernels unroll).
from .depthwise import ELEMENT_BYTES, check_depthwise

if TYPE_CHECKING:  # pragma: no cover
    from ..spec import ConvSpec, Problem

ACC_BYTES = 4  # float accumulators (and staged taps) for every dtype
# The block's taps live in static shared memory.
SMEM_LIMIT = 48 * 1024

TILES: Mapping[str, tuple[int, ...]] = {
    # First values are the smallest footprint, so a spec that fits with them fits at all.
    "block_c": (1, 2, 4, 8, 16, 32),
    "vec_q": (1, 2, 4, 8),
    "rows": (1, 2, 4, 8),
    "threads": (64, 128, 256, 512),
}


def vec_of(dtype: str) -> int:
    """Output channels a thread owns: 16 bytes of them."""
    return 16 // ELEMENT_BYTES[dtype]


def smem_bytes(spec: "ConvSpec", tiles: Mapping[str, int]) -> int:
    kh, kw = spec.kernel_size
    return kh * kw * tiles["block_c"] * vec_of(spec.dtype) * ACC_BYTES


@dataclass(frozen=True)
class DepthwiseNhwcFamily(Family):
    """Depthwise channels_last: see the module docstring."""

    name: str = "depthwise_nhwc"
    device: str = "cuda"
    template: str = "cuda/depthwise_nhwc.cu.j2"
    layouts: tuple[str, ...] = ("nhwc",)
    # float64 calls are never channels_last on CUDA (F.conv2d returns them contiguous).
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    tiles: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: dict(TILES))

    def check_shape(self, spec: "ConvSpec") -> None:
        check_depthwise(self.name, spec)
        tiles = dict(spec.tiles)  # a spec always names every tile (unnamed ones take their first value)
        need = smem_bytes(spec, tiles)
        if need > SMEM_LIMIT:
            raise Unsupported(f"depthwise_nhwc tiles {tiles} stage {need} bytes of taps; at most "
                              f"{SMEM_LIMIT} (choose a smaller block_c)")

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Tiles for a problem shape.

        block_c: the channel tile of 8, 16 or 32 vectors (runs of 128-512 bytes) that leaves
            the fewest vectors idle in the last tile (ties: the wider); all of a pixel's vectors
            when they are fewer than 8 (rounded up to a power of two). Halved while the taps do
            not fit in shared memory.
        vec_q: 4 output pixels a thread (a 3x3 row of 4 loads 6 input pixels), fewer only on
            rows narrower than that.
        rows: 2 for kernels of 7 rows or more, else 1.
        threads: 256.

        Measured on H100, channels_last, batch 32, ms against F.conv2d in the same process
        (forced tiles; vec_q x rows): MobileNetV2's 3x3s (32 channels on 112 x 112, 96 at
        stride 2, 144 on 56 x 56, 384 on 14 x 14, 960 on 7 x 7) ran fastest or within noise of
        it at 4x1 in float32 and bf16 (32 channels on 112 x 112, float32: 4x1 0.056, 4x2 0.058,
        8x1 0.057, 2x1 0.059, F.conv2d 0.052; one pixel a thread, 1x1, took 0.081 where 4x1 took
        0.061). ConvNeXt's 7x7 (96 channels on 56 x 56) took 4x2:
        float32 0.090 (4x1 0.099, 8x1 0.089, 2x1 0.121; F.conv2d 0.19), bf16 0.097 (4x1 0.119;
        F.conv2d 0.083). EfficientNet's 5x5 stride 2 (144 on 56 x 56): 4x1 0.052 / 0.042,
        4x2 0.056 / 0.045. 128 or 512 threads and two or more blocks an SM forced by launch
        bounds did not help on the whole; neither did issuing every kernel row's loads before
        the first is used (more registers).
        """
        fixed = dict(fixed or {})
        vec = vec_of(spec.dtype)
        cvec = -(-spec.out_channels // vec)
        if cvec < 8:
            block_c = 1 << (cvec - 1).bit_length()
        else:
            block_c = min((32, 16, 8), key=lambda bc: (-(-cvec // bc) * bc - cvec, -bc))
        while block_c > 1 and smem_bytes(spec, {"block_c": block_c}) > SMEM_LIMIT:
            block_c //= 2
        vec_q = 4
        while vec_q > 1 and vec_q // 2 >= max(problem.Q, 1):
            vec_q //= 2
        rows = 2 if spec.kernel_size[0] >= 7 else 1
        # A forced tile replaces its default (block_c <= 32 divides every thread count).
        return {**{"block_c": block_c, "vec_q": vec_q, "rows": rows, "threads": 256}, **fixed}

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        need = smem_bytes(spec, dict(spec.tiles))
        if need > SMEM_LIMIT:
            raise ConvArgumentError(f"depthwise_nhwc tiles {dict(spec.tiles)} stage {need} bytes of taps for "
                                    f"{spec.summary()}; at most {SMEM_LIMIT} (choose a smaller block_c)")
        # The template recomputes this size and static_asserts that the two agree.
        return {"DWN_SMEM_BYTES": need}


FAMILIES = (DepthwiseNhwcFamily(),)
