"""Depthwise convolution on CUDA, NCHW: `groups == in_channels`, any channel multiplier.

The template (templates/cuda/depthwise.cu.j2) is a bandwidth-bound stencil: a block
stages the input window of a BLOCK_P x BLOCK_Q output tile of one plane in shared
memory (16-byte cp.async loads when rows are aligned) and each thread sweeps ROWS
output rows of its columns, keeping a rolling window of input rows in registers.

Tile parameters (every combination is a valid kernel):
    block_q  output columns per tile (lanes cover consecutive columns);
    rows     output rows per thread;
    threads  threads per block: min(block_q, threads) across a row, the rest stacked,
             so a tile is BLOCK_P = rows * threads / min(block_q, threads) rows tall;
    stages   1: one tile per block; 2: persistent blocks that prefetch the next tile's
             window while computing the current one (double-buffered shared memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ..errors import ConvArgumentError, Unsupported
from .base import Family, target

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

# Kernel taps are held in registers by every thread (and the row loop unrolls over them):
# beyond 9x9 the register file spills, so bigger depthwise kernels go to the general family.
MAX_TAPS = 81
# Shared memory per block the tiles stay within: under what every target can opt into (99 KiB on
# sm_86/sm_89), so that on the H100 two blocks or more share an SM; checked against the GPU too.
SMEM_BUDGET = 96 * 1024

# Output columns a lane owns side by side (at most; the template uses fewer when a thread has
# fewer columns): 16-bit types read shared memory and store in 4/8-byte words of them, so a
# thread issues about as few instructions per byte as float32 does with one column (one column
# per lane left bf16 instruction-bound); float32 gains nothing from it (measured:
# docs/selection.md, depthwise).
COLUMN_VECTOR = {"float32": 1, "float16": 4, "bfloat16": 4, "float64": 1}

TILES: Mapping[str, tuple[int, ...]] = {
    # First values are the smallest window, so a spec that fits with them fits at all.
    "block_q": (8, 16, 32, 64, 128, 256, 512),
    "rows": (1, 2, 4, 8, 16),
    "threads": (64, 128, 256, 512),
    "stages": (1, 2),
}


def geometry(spec: "ConvSpec", tiles: Mapping[str, int]) -> dict[str, int]:
    """The tile's shape and shared-memory size, by the template's own formulas."""
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel_size, spec.stride, spec.dilation
    block_q, rows, threads, stages = tiles["block_q"], tiles["rows"], tiles["threads"], tiles["stages"]
    threads_q = min(block_q, threads)
    block_p = rows * (threads // threads_q)
    tile_h = (block_p - 1) * sh + (kh - 1) * dh + 1
    tile_w = (block_q - 1) * sw + (kw - 1) * dw + 1
    esize = ELEMENT_BYTES[spec.dtype]
    vec = 16 // esize
    srow = (tile_w + 2 * (vec - 1)) // vec * vec
    return {"block_p": block_p, "block_q": block_q, "tile_h": tile_h, "tile_w": tile_w,
            "smem_bytes": stages * tile_h * srow * esize}


def check_depthwise(name: str, spec: "ConvSpec") -> None:
    """What every depthwise family needs: one input channel a group, and at most MAX_TAPS taps
    (each kernel holds and unrolls them)."""
    if spec.groups != spec.in_channels:
        raise Unsupported(f"{name} needs groups == in_channels, got groups={spec.groups} with "
                          f"in_channels={spec.in_channels}")
    check_taps(name, spec)


def check_taps(name: str, spec: "ConvSpec") -> None:
    """At most MAX_TAPS kernel taps: the stencil kernels hold and unroll them."""
    kh, kw = spec.kernel_size
    if kh * kw > MAX_TAPS:
        raise Unsupported(f"{name} holds and unrolls the kernel's taps: {kh}x{kw} has {kh * kw} taps, "
                          f"at most {MAX_TAPS} are served")


def _tiles_of(spec: "ConvSpec") -> dict[str, int]:
    return dict(spec.tiles)


@dataclass(frozen=True)
class DepthwiseFamily(Family):
    """Depthwise NCHW: see the module docstring."""

    name: str = "depthwise"
    device: str = "cuda"
    template: str = "cuda/depthwise.cu.j2"
    epilogue: bool = True
    scale: bool = True  # (the taps times the scale as they are converted to the accumulator's type)
    layouts: tuple[str, ...] = ("nchw",)
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")
    tiles: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: dict(TILES))
    engine: str = "fma"

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        check_depthwise(self.name, spec)
        smem = geometry(spec, _tiles_of(spec))["smem_bytes"]
        if smem > min(SMEM_BUDGET, device.smem_block):
            raise Unsupported(f"depthwise tiles {_tiles_of(spec)} need {smem} bytes of shared memory for this "
                              f"kernel/stride/dilation; at most {min(SMEM_BUDGET, device.smem_block)} are used "
                              "(choose smaller tiles)")

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Tiles for a problem shape (measured: docs/selection.md, depthwise).

        block_q: the column tile that loads the fewest window columns in all, counting
            the unused columns of a ragged last tile and each tile's (kw-1)*dw halo (ties:
            the wider tile). Q = 510 or 512 gives one 512-wide tile per row band. Tiles of
            8 or 16 columns only where one covers the row (planes up to 16 wide).
        threads: block_q / COLUMN_VECTOR clipped to [64, 256]: each lane owns COLUMN_VECTOR
            adjacent columns (4 for 16-bit types, so 128 threads for a 512-wide tile; 256 for
            float32), enough warps for the loads in flight, small enough to fit several
            blocks per SM.
        rows: 8 per thread (a rolling window of 8 output rows reads (8*sh + (kh-1)*dh)
            window rows: ~1.25 reads per input row for 3x3), fewer when the plane is
            shorter than a band, or when the whole problem would not give every SM
            a few tiles.
        stages: 1. The persistent double-buffered variant was slower than one tile per block
            at every tiling tried: ~5 resident blocks per SM already overlap one block's
            loads with another's math, and the persistent loop adds a barrier per tile.
        Then rows, block_q and threads shrink until the window fits in shared memory.
        """
        (kh, kw), (sh, sw), (dh, dw) = spec.kernel_size, spec.stride, spec.dilation
        Q, P = max(problem.Q, 1), max(problem.P, 1)
        halo_w = (kw - 1) * dw

        def loaded_columns(bq: int) -> tuple[int, int]:
            n = -(-Q // bq)
            return n * ((bq - 1) * sw + halo_w + 1), -bq

        # Tiles narrower than a warp (8, 16) only where one covers the whole row: elsewhere the
        # column count can favour them (a stride-2 row of 56 loads 119 columns in 8-wide tiles,
        # 129 in one 64-wide) while each warp then reads and writes short scattered runs
        # (measured: docs/selection.md, depthwise).
        block_q = min((bq for bq in TILES["block_q"] if bq >= 32 or bq >= Q), key=loaded_columns)
        threads = max(TILES["threads"][0], min(256, block_q // COLUMN_VECTOR[spec.dtype]))
        threads_p = threads // min(block_q, threads)
        rows = 8
        while rows > 1 and threads_p * (rows // 2) >= P:
            rows //= 2

        def ntiles(rows_: int, bq: int, th: int) -> int:
            bp = rows_ * (th // min(bq, th))
            return problem.N * spec.out_channels * -(-P // bp) * -(-Q // bq)

        while rows > 1 and ntiles(rows, block_q, threads) < 4 * target(problem.device).sms:
            rows //= 2
        tiles = {"block_q": block_q, "rows": rows, "threads": threads, "stages": 1}
        # Shrink until the window fits (big kernels, strides or dilations); the loop ends at
        # the first value of every tile parameter, the smallest window there is.
        while geometry(spec, tiles)["smem_bytes"] > SMEM_BUDGET:
            if tiles["rows"] > 1:
                tiles["rows"] //= 2
            elif tiles["threads"] > max(tiles["block_q"], TILES["threads"][0]):  # stacked thread rows
                tiles["threads"] //= 2
            elif tiles["block_q"] > TILES["block_q"][0]:
                tiles["block_q"] //= 2
            else:
                break  # the smallest window; check_shape names the problem
        return tiles

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        geo = geometry(spec, _tiles_of(spec))
        if geo["smem_bytes"] > SMEM_BUDGET:
            raise ConvArgumentError(f"depthwise tiles {_tiles_of(spec)} need {geo['smem_bytes']} bytes of shared "
                                    f"memory for {spec.summary()}; at most {SMEM_BUDGET} (choose smaller tiles)")
        # The template recomputes this size and static_asserts that the two agree.
        return {"DW_SMEM_BYTES": geo["smem_bytes"], "DW_CV": COLUMN_VECTOR[spec.dtype]}


FAMILIES = (DepthwiseFamily(),)
