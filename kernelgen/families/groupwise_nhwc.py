"""Group-wise convolution on CUDA in channels_last, where a group has few input channels:
`depthwise_nhwc` (groups == in_channels, any channel multiplier) and `grouped_nhwc` (2-16
input channels a group, as ResNeXt's 32 groups of 4-16).

The template (templates/cuda/groupwise_nhwc.cu.j2) is a stencil that runs along channels,
which channels_last keeps contiguous: a thread owns 16 bytes of output channels (VEC: 4
float32, 8 bf16/fp16) of `vec_q` adjacent output pixels of a row and walks `rows` rows down;
per kernel row it loads the input pixels its strip spans, the run of input channels its
outputs read (their groups' channels, 16 bytes a load), and reads the overlap with the next
row again from L1. The block's taps sit in shared memory as [tap][input channel][output
channel]; the products are float32 FMAs (no tensor cores: a group's reduction of 4-16
channels a tap is too thin for them). The NCHW `depthwise` family stages a plane's window in
shared memory instead; in channels_last a plane is not contiguous, so this one is separate.

NCHW calls (layout 'nchw') take one more pass: the input is transposed into the workspace as
dense NHWC (KG_WORKSPACE_PER_INPUT bytes an input element), and each output channel's pixels of
a strip are written to its NCHW plane as one run. It serves NCHW grouped layers of narrow
groups, whose NCHW alternative (igemm) runs a thin reduction on tensor cores.

Tile parameters (every combination is a valid kernel where its taps fit in shared memory):
    block_c  channel vectors a block (lanes fastest); a warp's loads and stores are runs
             of block_c * 16 bytes;
    vec_q    output pixels of a row a thread;
    rows     output rows a thread, one after another;
    threads  threads a block (threads / block_c strips);
    min_blocks  blocks an SM the launch bounds ask for (caps the registers a thread); 0 asks
             for none, and ptxas aims at an occupancy of its own (a 1 lets it take more).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ..errors import ConvArgumentError, Unsupported
from .base import Family, target
# The NCHW family's table (float64 too: the selector asks every family for tiles before its
# check refuses the dtype) and its shape checks (groups, and the tap limit every stencil unrolls).
from .depthwise import ELEMENT_BYTES, check_depthwise, check_taps

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

ACC_BYTES = 4  # float accumulators (and staged taps) for every dtype
# The block's taps live in static shared memory.
SMEM_BUDGET = 48 * 1024

TILES: Mapping[str, tuple[int, ...]] = {
    # First values are the smallest footprint, so a spec that fits with them fits at all.
    "block_c": (1, 2, 4, 8, 16, 32),
    "vec_q": (1, 2, 4, 8),
    "rows": (1, 2, 4, 8),
    "threads": (64, 128, 256, 512),
    "min_blocks": (0, 1, 2, 3, 4),
}


def vec_of(dtype: str) -> int:
    """Output channels a thread owns: 16 bytes of them."""
    return 16 // ELEMENT_BYTES[dtype]


def smem_bytes(spec: "ConvSpec", tiles: Mapping[str, int]) -> int:
    kh, kw = spec.kernel_size
    return kh * kw * spec.cin_per_group * tiles["block_c"] * vec_of(spec.dtype) * ACC_BYTES


# grouped_nhwc serves groups of at most this many input channels: a thread's products grow with
# them (kh * kw * CIN_G * VEC FMAs an output pixel), and past 16 the tensor cores of `nhwc` win
# (see GroupedNhwcFamily).
MAX_CIN_G = 16
# The kernel-row loop is unrolled while a row of a thread's products stays this short (FMAs);
# beyond it, the unrolled code outgrows the instruction cache.
UNROLL_FMAS = 2304


def _fitting_block_c(spec: "ConvSpec", block_c: int) -> int:
    """block_c, halved while the block's taps do not fit in shared memory."""
    while block_c > 1 and smem_bytes(spec, {"block_c": block_c}) > SMEM_BUDGET:
        block_c //= 2
    return block_c


def _check_smem(name: str, spec: "ConvSpec") -> None:
    tiles = dict(spec.tiles)  # a spec always names every tile (unnamed ones take their first value)
    need = smem_bytes(spec, tiles)
    if need > SMEM_BUDGET:
        raise Unsupported(f"{name} tiles {tiles} stage {need} bytes of taps; at most "
                          f"{SMEM_BUDGET} (choose a smaller block_c)")


@dataclass(frozen=True)
class GroupwiseNhwcFamily(Family):
    """What both channels_last group-wise families share: the template, tiles and defaults."""

    name: str = "groupwise_nhwc"
    device: str = "cuda"
    template: str = "cuda/groupwise_nhwc.cu.j2"
    epilogue: bool = True
    scale: bool = True  # (the taps times the scale as they are converted to the accumulator's type)
    layouts: tuple[str, ...] = ("nhwc", "nchw")
    # float64 calls are never channels_last on CUDA (F.conv2d returns them contiguous).
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    tiles: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: dict(TILES))
    engine: str = "fma"
    nchw_copy: bool = True

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

        (measured: docs/selection.md, depthwise_nhwc and grouped_nhwc)
        """
        fixed = dict(fixed or {})
        vec = vec_of(spec.dtype)
        cvec = -(-spec.out_channels // vec)
        if cvec < 8:
            block_c = 1 << (cvec - 1).bit_length()
        else:
            block_c = min((32, 16, 8), key=lambda bc: (-(-cvec // bc) * bc - cvec, -bc))
        block_c = _fitting_block_c(spec, block_c)
        vec_q = 4
        while vec_q > 1 and vec_q // 2 >= max(problem.Q, 1):
            vec_q //= 2
        rows = 2 if spec.kernel_size[0] >= 7 else 1
        # A forced tile replaces its default (block_c <= 32 divides every thread count).
        return {**{"block_c": block_c, "vec_q": vec_q, "rows": rows, "threads": 256, "min_blocks": 0}, **fixed}

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        tiles = dict(spec.tiles)
        need = smem_bytes(spec, tiles)
        if need > SMEM_BUDGET:
            raise ConvArgumentError(f"{self.name} tiles {tiles} stage {need} bytes of taps for "
                                    f"{spec.summary()}; at most {SMEM_BUDGET} (choose a smaller block_c)")
        kh, kw = spec.kernel_size
        fmas = kh * kw * spec.cin_per_group * vec_of(spec.dtype) * tiles["vec_q"]
        # The template recomputes the size and static_asserts that the two agree; NCHW calls
        # transpose their input into the workspace.
        return {"GWN_SMEM_BYTES": need, "UNROLL_KH": fmas <= UNROLL_FMAS,
                "WORKSPACE_PER_INPUT": ELEMENT_BYTES[spec.dtype] if spec.layout == "nchw" else 0}


@dataclass(frozen=True)
class DepthwiseNhwcFamily(GroupwiseNhwcFamily):
    """Depthwise channels_last: one input channel a group, any multiplier."""

    name: str = "depthwise_nhwc"

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        check_depthwise(self.name, spec)
        _check_smem(self.name, spec)


@dataclass(frozen=True)
class GroupedNhwcFamily(GroupwiseNhwcFamily):
    """Narrow groups in channels_last: 2 to MAX_CIN_G input channels a group, whose output
    channels a group fill whole vectors or divide one (so a vector reads one run of input)."""

    name: str = "grouped_nhwc"

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Depthwise's tiles, with 4 channel vectors a block (fewer where a pixel has fewer) and
        2 rows a thread.

        Narrow groups multiply each input vector by CIN_G taps a channel, read from shared
        memory: with 4 vectors a block, the 8 strips of a warp read the same taps (a broadcast),
        where 32 vectors a warp read 32 different ones (measured: docs/selection.md,
        depthwise_nhwc and grouped_nhwc).
        """
        tiles = super().default_tiles(spec, problem)
        cvec = -(-spec.out_channels // vec_of(spec.dtype))
        tiles.update(block_c=_fitting_block_c(spec, min(4, 1 << (cvec - 1).bit_length())), rows=2)
        return {**tiles, **dict(fixed or {})}

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        cin_g, cout_g, vec = spec.cin_per_group, spec.cout_per_group, vec_of(spec.dtype)
        if spec.groups < 2 or not 2 <= cin_g <= MAX_CIN_G:
            raise Unsupported(f"{self.name} serves grouped convolutions of 2-{MAX_CIN_G} input channels a group, "
                              f"got groups={spec.groups} with {cin_g} a group")
        if cout_g % vec and vec % cout_g:
            raise Unsupported(f"{self.name} needs output channels a group ({cout_g}) that fill whole vectors of "
                              f"{vec} or divide one ({spec.dtype})")
        check_taps(self.name, spec)
        _check_smem(self.name, spec)


FAMILIES = (DepthwiseNhwcFamily(), GroupedNhwcFamily())
