"""`grouped_mma`: grouped convolution of 8-64 channels a group on tensor cores (mma.sync), for
channels_last calls and NCHW ones.

ResNeXt's wider groups (16 and 32 channels) are too wide for `grouped_nhwc`'s float32 FMAs and
too narrow for the GEMM families, which run one group's thin GEMM a block: `nhwc` gives a group
of 16 channels k-tiles of one tap (one MMA k-step each) and output tiles of 32 channels, half of
them idle. Here (templates/cuda/grouped_mma.cu.j2) a block owns a tile of output pixels of one
image and `groups_block` consecutive groups. It copies the tile's input window once into shared
memory; each warp holds its group's taps for `warp_n` output channels in registers, and walks the
tile's pixels 16 at a time, one ldmatrix and `warp_n / 8` MMAs a tap and k-step (m16n8k8 TF32,
m16n8k16 bf16 and fp16). The results are staged in shared memory and leave as 16-byte runs of a
pixel's channels (channels_last) or of a row's pixels (NCHW, where the rows allow).

An NCHW input is read where it lies by default: each channel's window rows, an element a thread
(4-byte cp.async for float32), into the same swizzled window. `transpose=1` instead transposes the
input into a channels_last workspace first and copies the window from there 16 bytes at a time.
That costs a pass over the input, which outweighs the window copy it saves except where a 16-bit
thread would load more than ELEMENT_LOADS window elements itself (default_tiles).

It serves TF32 and 16-bit calls (strict float32 stays with `grouped_nhwc`'s exact FMAs and
`nhwc`'s 3xTF32), two groups or more whose input channels fill whole MMA k-steps (8 float32, 16
bfloat16 or float16) and whose output channels whole n8 tiles, any kernel, stride, dilation and
padding whose taps fit the registers (WREG_LIMIT).

Tile parameters:
    block_p        output rows a tile
    block_q        output columns a tile
    groups_block   groups a block (its window pixel holds their channels)
    warp_n         output channels a warp, of one group (8, 16 or 32)
    m_tiles        16-pixel tiles a warp keeps in flight (1 or 2)
    min_blocks     blocks an SM the launch bounds ask for (0 asks for none)
    transpose      NCHW only: 1 reads the input through a channels_last copy in the workspace,
                   0 reads it where it lies
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, element_size, target

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

TILES: Mapping[str, tuple[int, ...]] = {
    "block_p": tuple(range(1, 33)),
    "block_q": tuple(range(1, 65)),
    "groups_block": (1, 2, 4, 8, 16),
    "warp_n": (16, 8, 32),
    "m_tiles": (1, 2),
    "min_blocks": (0, 1, 2, 3, 4),
    "transpose": (0, 1),
}

WREG_LIMIT = 96  # 32-bit registers a thread may hold taps in (a 3x3 of 16 x 16 TF32 taps: 72)
TILE_PIXELS = 128  # the default tile's output pixels, about (8 MMA row tiles a warp)
# 16-bit NCHW windows of more elements a thread than this go through the transpose; float32 copies
# by cp.async and stays in place (measured: docs/selection.md, grouped_mma).
ELEMENT_LOADS = 160
MAX_THREADS = 1024


def k_step(spec: "ConvSpec") -> int:
    """Channels an MMA k-step: m16n8k8 for TF32, m16n8k16 for the 16-bit types."""
    return 8 if spec.dtype == "float32" else 16


def window(spec: "ConvSpec", block_p: int, block_q: int) -> tuple[int, int]:
    """Input rows and columns a tile's taps reach."""
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel_size, spec.stride, spec.dilation
    return (block_p - 1) * sh + (kh - 1) * dh + 1, (block_q - 1) * sw + (kw - 1) * dw + 1


def pixel_units(spec: "ConvSpec", groups_block: int) -> int:
    """16-byte units a window pixel takes: its chunks, rounded up to 1, 2 or 4 (pixels that pack
    128-byte lines) or to whole 128-byte lines (the template's swizzle needs either)."""
    chunks = groups_block * spec.cin_per_group * element_size(spec) // 16
    return 1 << (chunks - 1).bit_length() if chunks <= 4 else -(-chunks // 8) * 8


def window_loads(spec: "ConvSpec", tiles: Mapping[str, int]) -> float:
    """Window elements a thread loads when it reads an NCHW input in place."""
    wh, ww = window(spec, tiles["block_p"], tiles["block_q"])
    threads = 32 * tiles["groups_block"] * spec.cout_per_group // tiles["warp_n"]
    return tiles["groups_block"] * spec.cin_per_group * wh * ww / threads


def smem_bytes(spec: "ConvSpec", tiles: Mapping[str, int]) -> int:
    """The window and the staged output tile, by the template's own formula: channels_last stages
    a pixel's channels a row, NCHW a channel's pixels."""
    esize = element_size(spec)
    wh, ww = window(spec, tiles["block_p"], tiles["block_q"])
    pixels, channels = tiles["block_p"] * tiles["block_q"], tiles["groups_block"] * spec.cout_per_group
    if spec.layout == "nchw":
        staged = channels * (-(-pixels * esize // 128) * 128 + 16)
    else:
        staged = pixels * (-(-channels * esize // 128) * 128 + (32 if esize == 4 else 16))
    lines = -(-wh * ww * pixel_units(spec, tiles["groups_block"]) // 8)  # the swizzle keeps a unit in its line
    return lines * 128 + staged


def tap_registers(spec: "ConvSpec", warp_n: int) -> int:
    kh, kw = spec.kernel_size
    return kh * kw * (spec.cin_per_group // k_step(spec)) * (warp_n // 8) * 2


@dataclass(frozen=True)
class GroupedMmaFamily(Family):
    name: str = "grouped_mma"
    device: str = "cuda"
    template: str = "cuda/grouped_mma.cu.j2"
    epilogue: bool = True
    scale: bool = True
    layouts: tuple[str, ...] = ("nhwc", "nchw")
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    tiles: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: dict(TILES))
    engine: str = "mma"
    tf32: bool = True

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        if spec.dtype == "float32" and spec.math != "tf32":
            raise Unsupported("grouped_mma runs TF32 or 16-bit MMAs; strict float32 is not served")
        cin_g, cout_g, step = spec.cin_per_group, spec.cout_per_group, k_step(spec)
        if spec.groups < 2 or cin_g % step or cout_g % 8:
            raise Unsupported(f"grouped_mma serves two groups or more of whole MMA k-steps of input channels ({step} "
                              f"for {spec.dtype}) and whole 8s of output channels, got groups={spec.groups} with "
                              f"{cin_g} -> {cout_g} a group")
        self.check_tiles(spec, dict(spec.tiles), device)

    def check_tiles(self, spec: "ConvSpec", tiles: Mapping[str, int], device: "Device") -> None:
        wn, gb = tiles["warp_n"], tiles["groups_block"]
        if spec.cout_per_group % wn:
            raise Unsupported(f"grouped_mma: warp_n={wn} must divide the {spec.cout_per_group} output channels a group")
        regs = tap_registers(spec, wn)
        if regs > WREG_LIMIT:
            raise Unsupported(f"grouped_mma: a warp's taps take {regs} registers a thread, at most {WREG_LIMIT} "
                              f"(choose a smaller warp_n, or the kernel is too large)")
        threads = 32 * gb * spec.cout_per_group // wn
        if threads > MAX_THREADS:
            raise Unsupported(f"grouped_mma: {threads} threads a block, at most {MAX_THREADS} (choose a smaller "
                              f"groups_block or a larger warp_n)")
        if tiles["transpose"] and spec.layout != "nchw":
            raise Unsupported("grouped_mma: transpose=1 serves NCHW calls; channels_last ones read their input "
                              "where it lies")
        if -(-spec.groups // gb) > 65535:
            raise Unsupported(f"grouped_mma: {spec.groups} groups in blocks of {gb} exceed a grid column")
        need = smem_bytes(spec, tiles)
        if need > device.smem_block:
            raise Unsupported(f"grouped_mma: tiles {dict(tiles)} need {need} bytes of shared memory, at most "
                              f"{device.smem_block} (choose a smaller tile)")

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Tiles for a problem shape.

        warp_n: 16 where its taps fit the registers, else 8 (a group's whole width where it is 8).
        groups_block: the most groups, a power of two, that 128 bytes of a window pixel hold, at
            least one and no more than the layer has.
        block_q: the whole output row up to 32 pixels, else the row cut evenly into tiles of at
            most 32; block_p: the rows that bring a tile nearest TILE_PIXELS in even bands,
            halved while the window and staging do not fit.
        m_tiles 1, min_blocks 0.
        transpose: 1 for 16-bit NCHW calls whose threads would load more than ELEMENT_LOADS
            window elements each in place, else 0.
        """
        device = target(problem.device)
        fixed = dict(fixed or {})
        P, Q = max(problem.P, 1), max(problem.Q, 1)
        wn = fixed.get("warp_n", 16 if spec.cout_per_group % 16 == 0 and tap_registers(spec, 16) <= WREG_LIMIT else 8)
        per_group = spec.cin_per_group * element_size(spec)
        fill = 1 << (max(1, 128 // per_group).bit_length() - 1)  # whole groups a 128-byte pixel holds, a power of 2
        gb = fixed.get("groups_block", min(fill, 1 << (max(spec.groups, 1).bit_length() - 1), 16))
        bq = fixed.get("block_q", Q if Q <= 32 else -(-Q // -(-Q // 32)))
        bp = fixed.get("block_p", -(-P // -(-P * bq // TILE_PIXELS)))
        bp = min(bp, TILES["block_p"][-1])
        tiles = {"block_p": bp, "block_q": min(bq, TILES["block_q"][-1]), "groups_block": gb, "warp_n": wn,
                 "m_tiles": 1, "min_blocks": 0, "transpose": 0, **fixed}
        while tiles["block_p"] > 1 and "block_p" not in fixed and smem_bytes(spec, tiles) > device.smem_block:
            tiles["block_p"] = -(-tiles["block_p"] // 2)
        if "transpose" not in fixed and spec.layout == "nchw" and spec.dtype != "float32":
            tiles["transpose"] = int(window_loads(spec, tiles) > ELEMENT_LOADS)
        return tiles

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        tiles = dict(spec.tiles)
        # The template recomputes both and static_asserts that they agree; transpose=1 takes the
        # input's size in workspace for its channels_last copy.
        transpose = bool(tiles["transpose"])
        return {"GM_SMEM_BYTES": smem_bytes(spec, tiles), "GM_WREGS": tap_registers(spec, tiles["warp_n"]),
                "TRANSPOSE": transpose, "WORKSPACE_PER_INPUT": element_size(spec) if transpose else 0}


FAMILIES = (GroupedMmaFamily(),)
