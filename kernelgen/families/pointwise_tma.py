"""`pointwise_tma`: 1x1 convolutions of NCHW inputs on Hopper, read where they lie by the TMA.

Per image, out[n] = W . X[n] with the pixels as wgmma's M and the output channels as its N
(templates/cuda/pointwise_tma.cu.j2): D[pixel x COUT] = X[n]^T . W^T. An NCHW plane is the
pixel-major (M-major) form of X[n]^T, which wgmma cannot read from shared memory in TF32, so
the consumer warpgroups load their A fragments from the landed boxes themselves (rounding TF32
as they go) and wgmma reads only the weights from shared memory. One producer warp lands each
k-tile's input boxes (BK channels x `block_p` pixels, 128-byte swizzle) and, unless they are
resident (`wres`), the weights' box, into a `stages`-deep ring handed over by mbarriers. The
epilogue writes each output channel's pixel pairs straight to the NCHW output.

Where the other families transpose an NCHW input into a workspace (`nhwc`, `nhwc_tma`) or
gather it with per-thread copies (`pointwise`), this reads each input element once through the
TMA and writes each output element once.

Tiles: `block_co` output channels a tile (wgmma's N); `block_p` pixels of one image's plane a
tile, 64 a consumer warpgroup; `stages` ring slots; `min_blocks` blocks an SM the launch bounds
ask for; `wres` the weights loaded once a block and kept in shared memory (one block of output
channels); `splits` the reduction's k-tiles split between that many blocks a tile (blockIdx.y),
each writing float32 partial sums to the workspace in the output's NCHW order, and a second
kernel adding them up in split order and applying the epilogue (split_choice says when).
Blocks are persistent: a grid of those that fit the card, each walking tiles (with splits, the
grid's share of the card a split).

It serves sm_90a, groups of one, 1x1 kernels at stride 1 without padding, TF32 and 16-bit, and
(at launch) planes whose pixel count fills whole 16-byte chunks, which the TMA's strides need.
The TMA also needs the input to start on a 16-byte boundary (`aligned_input`): kernelgen.conv2d
copies a view that does not. (Addressing such a view from the boundary before it, with rows that
overlap by the offset, encodes but stops the H100 with an illegal instruction.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, check_dense_1x1, element_size, first_fit, target
from .nhwc_tma import k_tiles, reg_cap  # (a 1x1's k-tiles: 128 bytes of channels each)

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

WRES_MAX = 64 * 1024  # resident weights up to this many bytes (the rest of shared memory is the ring)
SPLITS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)  # the `splits` a tile's reduction may take
# Split reductions (split_choice; derived, not measured: docs/selection.md, pointwise_tma): a layer
# of fewer tiles than half the SMs whose reduction is SPLIT_MIN_K_TILES k-tiles or more (nhwc_tma's
# threshold) splits it so that its blocks fill up to one an SM, SPLIT_MIN_A_SPLIT k-tiles a split
# or more (the shortest split nhwc_tma measured paying: 8 k-tiles in two).
SPLIT_MIN_K_TILES, SPLIT_MIN_A_SPLIT = 8, 4


def split_k_tiles(kt: int, splits: int) -> int:
    """k-tiles a split takes (the last may take fewer): split i takes KTS * i .. KTS * (i + 1) - 1."""
    return -(-kt // splits)


def split_choice(spec: "ConvSpec", tiles: int, sms: int) -> int:
    """The splits of a layer of `tiles` output tiles on `sms` SMs: 1 where it has half the SMs of
    tiles or more, or a reduction of fewer than SPLIT_MIN_K_TILES k-tiles; else the most of SPLITS
    that keeps tiles x splits within the SMs (one block an SM: the default rings take all of its
    shared memory) with SPLIT_MIN_A_SPLIT k-tiles a split on average and no split empty."""
    kt = k_tiles(spec)
    if 2 * tiles >= sms or kt < SPLIT_MIN_K_TILES:
        return 1
    return max(s for s in SPLITS if s * tiles <= sms and kt >= s * SPLIT_MIN_A_SPLIT
               and split_k_tiles(kt, s) * (s - 1) < kt)


def plane_fits(spec: "ConvSpec", pixels: int) -> bool:
    """Whether the TMA can address planes of `pixels` (their rows of bytes whole 16-byte chunks)."""
    return pixels * element_size(spec) % 16 == 0


@dataclass(frozen=True)
class PointwiseTmaFamily(Family):
    def layout(self, spec: "ConvSpec", tiles: Mapping[str, int]) -> dict[str, int]:
        """Compile-time constants of a tile choice (the template static_asserts the same)."""
        bco, bp, stages, wres = tiles["block_co"], tiles["block_p"], tiles["stages"], tiles.get("wres", 0)
        slot = bp * 128 + (0 if wres else bco * 128)  # the input boxes (and the weights' box)
        resident = k_tiles(spec) * bco * 128 if wres else 0
        ncw = bp // 64
        return {"BCO": bco, "BP": bp, "STAGES": stages, "NTH": 128 * ncw + 32,
                "SMEM_BYTES": resident + stages * slot + 1024,  # 1 KB more to start on a swizzle pattern
                "STATIC": 8 * (2 * stages + 1),  # the mbarriers
                # accumulators and 76 more (ptxas 13.0: 90 at N 64, 133-137 at N 128): two sets of A
                # fragments, addresses, the epilogue
                "REGS": bco // 2 + 76}

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        check_dense_1x1(self.name, spec)
        if spec.dtype == "float32" and spec.math == "ieee":
            raise Unsupported("pointwise_tma: strict float32 needs 3xTF32, which wgmma and nhwc run (wgmma would "
                              "truncate)")
        self.check_tiles(spec, dict(spec.tiles), device)

    def check_tiles(self, spec: "ConvSpec", tiles: Mapping[str, int], device: "Device") -> None:
        # (first: a split that cannot be is the reason, whatever the ring)
        splits = tiles.get("splits", 1)
        if splits > 1:
            if tiles.get("wres", 0):
                raise Unsupported("pointwise_tma: split reductions load the weights' box with each k-tile (wres=0): "
                                  "resident weights would hold every split's k-tiles")
            kt = k_tiles(spec)
            if split_k_tiles(kt, splits) * (splits - 1) >= kt:
                raise Unsupported(f"pointwise_tma: {kt} k-tiles cannot be split {splits} ways ({split_k_tiles(kt, splits)}"
                                  " a split would leave the last one none)")
        lay = self.layout(spec, tiles)
        if tiles.get("wres", 0) and spec.out_channels > lay["BCO"]:
            raise Unsupported(f"pointwise_tma: resident weights (wres) hold one block of output channels "
                              f"({lay['BCO']}), the layer has {spec.out_channels}")
        if lay["SMEM_BYTES"] + lay["STATIC"] > device.smem_block:
            raise Unsupported(f"pointwise_tma: {lay['SMEM_BYTES']} bytes of shared memory exceed {device.smem_block}")
        blocks = tiles.get("min_blocks", 1)
        if lay["REGS"] > reg_cap(lay["NTH"], blocks):
            raise Unsupported(f"pointwise_tma: {blocks} blocks of {lay['NTH']} threads of ~{lay['REGS']} registers "
                              "exceed the SM's 65536 (wgmma's accumulators stay in registers)")
        if blocks * (lay["SMEM_BYTES"] + 1024) > device.smem_sm:
            raise Unsupported(f"pointwise_tma: {blocks} blocks of {lay['SMEM_BYTES']} bytes of shared memory exceed "
                              "the SM's")

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """64 output channels a tile where the layer has no more, else 128; 128 pixels (two consumer
        warpgroups); the reduction split (split_choice) where the layer has few tiles for the
        GPU's SMs; the weights resident where they fit WRES_MAX, the layer has one block of
        output channels and no split; the deepest ring (up to 8) with one block an SM, or two
        blocks with three slots or more."""
        device = target(problem.device)
        if not plane_fits(spec, problem.H * problem.W):
            raise Unsupported(f"pointwise_tma: planes of {problem.H} x {problem.W} pixels are not whole 16-byte "
                              "chunks, which the TMA's strides need")
        fixed = dict(fixed or {})
        bco = fixed.get("block_co", 64 if spec.out_channels <= 64 else 128)
        bp = fixed.get("block_p", 128)
        tiles = problem.N * -(-problem.H * problem.W // bp) * -(-spec.out_channels // bco)
        splits = fixed.get("splits", split_choice(spec, tiles, device.sms) if not fixed.get("wres", 0) else 1)
        wres = int(splits == 1 and spec.out_channels <= bco and k_tiles(spec) * bco * 128 <= WRES_MAX)
        base = {"block_co": bco, "block_p": bp, "wres": wres, "splits": splits, **fixed}
        depths = ((1, 8), (1, 7), (1, 6), (2, 4), (2, 3), (1, 5), (1, 4), (1, 3), (1, 2))
        return first_fit(lambda c: self.check_tiles(spec, c, device), [(base, depths)], fixed)

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        t = dict(spec.tiles)
        lay = self.layout(spec, t)
        wbytes = spec.out_channels * k_tiles(spec) * 128
        splits = t.get("splits", 1)
        return {"BCO": lay["BCO"], "BP": lay["BP"], "STAGES": lay["STAGES"], "SMEM_BYTES": lay["SMEM_BYTES"],
                "MIN_BLOCKS": t["min_blocks"],
                "PACKED_BYTES": wbytes,  # the packed weights, kept with the weight
                # split reductions: each split's float32 partial sums of the whole output
                "WORKSPACE_PER_OUTPUT": 4 * splits if splits > 1 else 0}


pointwise_tma = PointwiseTmaFamily(
    name="pointwise_tma", device="cuda", template="cuda/pointwise_tma.cu.j2", layouts=("nchw",), archs=("sm_90a",),
    dtypes=("float32", "float16", "bfloat16"), tf32=True, aligned_input=True, engine="wgmma",
    epilogue=True, scale=True, tiles={"block_co": (128, 64, 256), "block_p": (128, 64, 192), "stages": (4, 2, 3, 5, 6, 7, 8),
           "min_blocks": (1, 2), "wres": (0, 1), "splits": SPLITS},
)

FAMILIES = (pointwise_tma,)
