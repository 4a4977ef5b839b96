"""`nhwc_tma`: dense channels_last convolution on Hopper, its input gathered by the TMA's im2col mode.

One implicit GEMM over the whole batch (templates/cuda/nhwc_tma.cu.j2), with the output channels
as wgmma's M and the pixels as its N: D[COUT x pixel] = W[COUT x K] . im2col[K x pixel], K = (r,
s, channel). Where `nhwc` has every thread compute addresses and issue cp.async for its rows of
each k-tile, here one producer warp issues two Tensor Memory Accelerator copies a k-tile: the
weights' box, and the im2col box of `block_p` pixels x 128 bytes of one tap's channels, which the
hardware gathers, zero-fills in the padding and lays in wgmma's 128-byte swizzle. Consumer
warpgroups wait on mbarriers, multiply, and release their slot; no block barrier in the loop.

Tiles: `block_co` output channels a block (64 a consumer warpgroup along them); `block_p` pixels
a block, split between `wgn` warpgroups along them (wgmma's N is block_p / wgn); `stages` ring
slots; `min_blocks` blocks an SM the launch bounds ask for; `round_smem` (TF32 channels_last) the
warps that round each landed slot's pixels in shared memory instead of a rounded copy of the
input (0: the copy); `persist` a grid of the blocks that fit the card, each walking tiles, its
output staged apart from the ring (0: one block a tile); `wres` (persistent, one block of output
channels) the weights loaded once a block and kept in shared memory, so a slot holds only the
pixels; `pipes` 2 (with `wres`) two producer/ring/consumer pipelines a block over that copy;
`halo` (stride 1) tiles of `block_p` pixels of one output row whose slot holds the tile's whole
window of the input (kernel rows x block_p + the kernel's width in pixels, 128 bytes of channels),
loaded once as a tiled 4-D box and read by every tap from its own row and column of the window,
so each input pixel crosses L2 about three times where im2col moves it nine; the weights' boxes
then come through a ring of `wstages` slots (or stay resident with `wres`); `a_regs`
(channels_last) the GEMM turned round: the pixels are wgmma's M, `block_p / 64` consumer
warpgroups of 64 pixels each load their A fragments from the landed slot into registers (one
ldmatrix a k-step, rounding TF32 as they go, so TF32 needs neither the rounded copy nor rounding
warps), wgmma's N is `block_co` and reads only the weights from shared memory, and each warp
stages its own 16 pixel rows in shared memory, apart from the ring, and writes them out as 16-byte
vectors (`wgn` stays 1).

NCHW calls (layout 'nchw') take one more pass, as in `nhwc`: the input is transposed into the
workspace as dense NHWC (rounded for TF32), and the epilogue writes each output channel's pixel
pairs straight to the NCHW output.

It serves sm_90a, groups of one, TF32 and 16-bit (wgmma truncates float32 operands, so a TF32
input is rounded into the workspace first, and strict float32 stays with `nhwc`'s 3xTF32), input
and output channels in whole 16-byte chunks, and windows the TMA's im2col box can describe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, element_size, first_fit, target

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

CORNER = 127  # the TMA's im2col corners and tap offsets of a 4-D tensor: 8-bit signed
BLOCK_P = (128, 256, 64, 112, 56, 96, 80)  # pixels a block (the first, the default)
HALO_MIN_Q = 112  # output rows at least this long take halo tiles by default (56 measured even or slower)
# a_regs layers of fewer 128-pixel tiles than half the GPU's SMs take 64-pixel ones; other layers of
# so few tiles split their reduction in two
SPLIT_MIN_K_TILES = 8  # (where it has this many k-tiles or more, an even number)
# Deep splits: a layer of fewer tiles than half the SMs whose reduction is DEEP_SPLIT_MIN_K_TILES
# k-tiles or more (a weight gradient's: few outputs, each a sum over a batch's pixels) splits it
# into up to two blocks an SM, DEEP_SPLIT_MIN_A_SPLIT k-tiles a split or more, the largest count
# of DEEP_SPLITS that divides it.
DEEP_SPLIT_MIN_K_TILES, DEEP_SPLIT_MIN_A_SPLIT = 256, 16
DEEP_SPLITS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SHORT_1X1_K_TILES = 5  # channels_last 1x1 layers of at most this many k-tiles walk tiles (short_1x1)


def k_tiles(spec: "ConvSpec") -> int:
    """The reduction's k-tiles: one a kernel tap and 128 bytes of its input channels."""
    kh, kw = spec.kernel_size
    return kh * kw * -(-spec.in_channels * element_size(spec) // 128)


def deep_splits(spec: "ConvSpec", tiles: int, sms: int) -> int:
    """The splits of a reduction-bound layer of `tiles` output tiles on `sms` SMs (DEEP_SPLIT_*),
    or 1 where it is not one."""
    kt = k_tiles(spec)
    if 2 * tiles >= sms or kt < DEEP_SPLIT_MIN_K_TILES:
        return 1
    want = -(-2 * sms // tiles)
    return max((s for s in DEEP_SPLITS if s <= want and kt % s == 0 and kt // s >= DEEP_SPLIT_MIN_A_SPLIT), default=1)


def short_1x1(spec: "ConvSpec") -> bool:
    """A channels_last 1x1 layer at stride 1 whose reduction is at most SHORT_1X1_K_TILES k-tiles
    (16-bit: 320 input channels, float32: 160): bound by its movement, which persistent blocks
    overlap from one tile to the next (default_tiles)."""
    return (spec.layout == "nhwc" and spec.kernel_size == (1, 1) and spec.stride == (1, 1)
            and k_tiles(spec) <= SHORT_1X1_K_TILES)


def _window(spec: "ConvSpec", bp: int) -> tuple[int, int]:
    """`halo`'s window of a tile of `bp` pixels of an output row: input rows x pixels."""
    (kh, kw), (dh, dw) = spec.kernel_size, spec.dilation
    return (kh - 1) * dh + 1, bp + (kw - 1) * dw


def halo_block_p(q: int, multiple: int) -> int:
    """`halo` tiles' pixels for output rows of q: the block_p (up to 128, a multiple of `multiple`)
    whose tiles cover a row with the fewest idle pixels, then the widest (224: 112, 130: 80)."""
    sizes = [v for v in BLOCK_P if v <= 128 and v % multiple == 0]
    return min(sizes, key=lambda v: (-(-q // v) * v, -v))


def reg_cap(threads: int, blocks: int) -> int:
    """Registers a thread may use when `blocks` blocks of `threads` share an SM's 65536: ptxas
    counts warps in fours and registers in eights (672 threads, two blocks: 40)."""
    return min(255, 65536 // (blocks * -(-threads // 128) * 128) // 8 * 8)


def _regs(wn: int, ncw: int, rw: int) -> int:
    """Registers a thread needs: wgmma's N / 2 accumulators and 16 more, or 26 more for the tile
    classes where ptxas asked for them at two blocks an SM (scratch sweep of 75 tile choices with
    ptxas 13.0: N 256 asked 154; N 128 with 2 consumer warpgroups and 2 rounding warps 90, where 0
    or 1 fit 80; N 64 with 4 warpgroups 58; N 32 with 4 and 4 rounding warps 42, where 2 fit 48)."""
    more = wn >= 256 or (ncw >= 2 and rw >= 2) or (ncw >= 4 and (wn >= 64 or rw >= 4))
    return max(wn // 2 + (26 if more else 16), 48)


def _areg_regs(bco: int) -> int:
    """`a_regs` tiles: wgmma's N / 2 accumulators, two k-tiles' A fragments (32) and 50 more for
    addresses and the staged epilogue (ptxas 13.0: 114 at N 64, 138 at N 128)."""
    return bco // 2 + 82


@dataclass(frozen=True)
class NhwcTmaFamily(Family):
    def layout(self, spec: "ConvSpec", tiles: Mapping[str, int]) -> dict[str, int]:
        """Compile-time constants of a tile choice (the template static_asserts the same)."""
        bco, bp, wgn, stages = tiles["block_co"], tiles["block_p"], tiles["wgn"], tiles["stages"]
        pipes, wres, areg = tiles.get("pipes", 1), tiles.get("wres", 0), tiles.get("a_regs", 0) == 1
        esize = element_size(spec)
        ncw = bp // 64 if areg else bco // 64 * wgn
        rounders = 32 * tiles.get("round_smem", 0)  # its rounding warps' threads
        halo = tiles.get("halo", 0) == 1
        hb, wb = _window(spec, bp)
        wslots = tiles.get("wstages", 4) if halo and not wres else 0  # the weights' ring
        wring = wslots * bco * 128
        if halo:  # a slot holds a tile's window, 1 KB-aligned
            slot = -(-hb * wb * 128 // 1024) * 1024
        else:  # the pixels (and the weights' box)
            slot = bp * 128 + (0 if wres else bco * 128)
        # the output tile, 16 bytes of padding a row (a_regs: 8 elements)
        staged = bp * (bco + (8 if areg else 16 // esize)) * esize
        own = (tiles.get("persist", 0) == 1 or areg) and spec.layout == "nhwc"  # staged apart from the ring
        resident = k_tiles(spec) * bco * 128 if wres else 0  # the weights, kept for every tile
        return {"BCO": bco, "BP": bp, "WGN": wgn, "STAGES": stages, "PIPES": pipes,
                "NTH": pipes * (128 * ncw + 32) + rounders, "HB": hb, "WB": wb,
                # 1 KB more to start the ring on a swizzle pattern
                "SMEM_BYTES": resident + pipes * (wring + stages * slot + (staged if own else 0)) + 1024,
                "STAGED": 0 if own or spec.layout == "nchw" else staged, "RING": stages * slot,
                # the mbarriers (three a slot, the weights', two a weights' ring slot and one
                # more such pair), in static shared memory
                "STATIC": 8 * ((2 * pipes + 1) * stages + 1) + 16 * (pipes * wslots + 1),
                "REGS": _areg_regs(bco) if areg else _regs(bp // wgn, ncw, tiles.get("round_smem", 0))}

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        vec = 16 // element_size(spec)
        if spec.groups != 1:
            raise Unsupported("nhwc_tma serves dense layers (groups=1)")
        if spec.dtype == "float32" and spec.math == "ieee":
            raise Unsupported("nhwc_tma: strict float32 needs 3xTF32, which nhwc runs (wgmma would truncate)")
        if spec.in_channels % vec or spec.out_channels % vec:
            raise Unsupported(f"nhwc_tma needs input and output channels in whole 16-byte chunks ({vec} for "
                              f"{spec.dtype}), got {spec.in_channels} -> {spec.out_channels}")
        (kh, kw), (dh, dw) = spec.kernel_size, spec.dilation
        if max((kh - 1) * dh, (kw - 1) * dw, *spec.padding) > CORNER:
            raise Unsupported(f"nhwc_tma: the TMA's im2col box reaches {CORNER} pixels at most (kernel extent "
                              f"{(kh - 1) * dh + 1} x {(kw - 1) * dw + 1}, padding {spec.padding})")
        if max(spec.stride) > 8:
            raise Unsupported(f"nhwc_tma: the TMA steps 8 pixels at most (stride {spec.stride})")
        self.check_tiles(spec, dict(spec.tiles), device)

    def check_tiles(self, spec: "ConvSpec", tiles: Mapping[str, int], device: "Device") -> None:
        lay = self.layout(spec, tiles)
        if tiles.get("round_smem", 0) and not (spec.dtype == "float32" and spec.layout == "nhwc"):
            raise Unsupported("nhwc_tma: round_smem rounds TF32 channels_last inputs (16-bit needs no rounding, and "
                              "an NCHW input is rounded in its transpose)")
        persist, wres, pipes = tiles.get("persist", 0), tiles.get("wres", 0), tiles.get("pipes", 1)
        if tiles.get("a_regs", 0):
            if spec.layout != "nhwc":
                raise Unsupported("nhwc_tma: a_regs tiles write channels_last rows (an NCHW call's input is rounded "
                                  "in its transpose)")
            if tiles.get("round_smem", 0) or tiles["wgn"] != 1:
                raise Unsupported("nhwc_tma: a_regs tiles round TF32 in their fragment loads and split the pixels "
                                  "into warpgroups of 64 themselves (round_smem=0, wgn=1)")
            if tiles["block_p"] % 64 or tiles["block_co"] > 256:
                raise Unsupported(f"nhwc_tma: a_regs tiles take 64 pixels a warpgroup and wgmma N up to 256 (got "
                                  f"block_p {tiles['block_p']}, block_co {tiles['block_co']})")
        if tiles.get("halo", 0):
            if spec.stride != (1, 1):
                raise Unsupported(f"nhwc_tma: halo tiles read every tap from one window, which needs stride 1 "
                                  f"(got {spec.stride})")
            if lay["STAGES"] < 2:
                raise Unsupported("nhwc_tma: halo tiles need two window slots or more (the next window loads while "
                                  "this one is read)")
            if lay["WB"] > 256 or lay["HB"] > 256:
                raise Unsupported(f"nhwc_tma: a halo window of {lay['HB']} x {lay['WB']} pixels exceeds the TMA's "
                                  "box (256 a side)")
        splits = tiles.get("splits", 1)
        if splits > 1:
            if persist or tiles.get("halo", 0):
                raise Unsupported("nhwc_tma: split reductions run one block a tile and a k-tile a slot (persist=0, "
                                  "halo=0)")
            if k_tiles(spec) % splits or k_tiles(spec) < 2 * splits:
                raise Unsupported(f"nhwc_tma: {k_tiles(spec)} k-tiles cannot be split {splits} ways (the same number, "
                                  "two or more, a split)")
        if wres and not persist:
            raise Unsupported("nhwc_tma: resident weights (wres) need persistent blocks (persist=1)")
        if wres and spec.out_channels > lay["BCO"]:
            raise Unsupported(f"nhwc_tma: resident weights (wres) hold one block of output channels ({lay['BCO']}), "
                              f"the layer has {spec.out_channels}")
        if pipes > 1 and not (wres and tiles.get("round_smem", 0) == 0):
            raise Unsupported("nhwc_tma: two pipelines a block share resident weights (wres=1) and round nothing")
        if lay["BP"] % lay["WGN"] or (lay["BP"] // lay["WGN"]) % 8 or lay["BP"] // lay["WGN"] > 256:
            raise Unsupported(f"nhwc_tma: {lay['BP']} pixels cannot be split into {lay['WGN']} wgmma N of 8-256")
        if spec.dtype != "float32" and (lay["BP"] // lay["WGN"]) % 16:
            raise Unsupported(f"nhwc_tma: 16-bit tiles stage pixels in pairs of 8 (wgmma N {lay['BP'] // lay['WGN']} is "
                              "not a multiple of 16)")
        if lay["NTH"] > 1024:
            raise Unsupported(f"nhwc_tma: {lay['NTH']} threads exceed a block's 1024 ({lay['BCO'] // 64 * lay['WGN']} "
                              "consumer warpgroups and the producer warp)")
        if lay["SMEM_BYTES"] + lay["STATIC"] > device.smem_block:
            raise Unsupported(f"nhwc_tma: {lay['SMEM_BYTES']} bytes of shared memory exceed {device.smem_block}")
        if lay["STAGED"] > lay["RING"]:
            raise Unsupported(f"nhwc_tma: the staged output tile ({lay['STAGED']} bytes) does not fit the ring")
        blocks = tiles.get("min_blocks", 1)
        if (persist and tiles.get("round_smem", 0) and lay["BP"] // lay["WGN"] == 128
                and reg_cap(lay["NTH"], blocks) == 128):
            # ptxas 13.0 spilled 376 bytes in exactly these (three of 186 accepted classes; the
            # same tiles at caps of 96 and 168 build spill-free)
            raise Unsupported("nhwc_tma: persistent TF32 tiles with rounding warps and wgmma N 128 spill at a cap of "
                              "128 registers")
        if lay["REGS"] > reg_cap(lay["NTH"], blocks):
            raise Unsupported(f"nhwc_tma: {blocks} blocks of {lay['NTH']} threads of ~{lay['REGS']} registers exceed "
                              "the SM's 65536 (wgmma's accumulators stay in registers)")
        if blocks * (lay["SMEM_BYTES"] + 1024) > device.smem_sm:
            raise Unsupported(f"nhwc_tma: {blocks} blocks of {lay['SMEM_BYTES']} bytes of shared memory exceed the SM's")

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """64 output channels a block where the layer has no more, else 128; 128 pixels in one
        warpgroup along them; the deepest ring (up to 6) that lets two blocks share an SM with three
        slots or more, else one block's. Then, each where it fits (measured: docs/selection.md,
        nhwc_tma):

        halo: channels_last, stride 1, 64 output channels and output rows of HALO_MIN_Q pixels or
        more take halo tiles (16-bit with the weights resident and three windows, TF32 with its
        rounding warps and two), a row cut into the fewest tiles that idle the fewest pixels. Rows
        of 56, 128 output channels and NCHW calls gained nothing from them.

        16-bit channels_last tiles of 64 output channels walk tiles: with the weights resident in
        two pipelines a block where they fit (64 input channels of a 3x3: 72 KB), else in one deep
        pipeline, else persistent blocks that load the weights' box with each k-tile.

        round_smem: 4 rounding warps for TF32 channels_last tiles of 64 output channels, else the
        rounded copy (on 128-channel tiles the rounding warps cost the second block an SM).

        a_regs: TF32 channels_last layers of more than 64 output channels, persistent, 128 pixels
        in two warpgroups, or one block a tile of 64 pixels in one where 128-pixel tiles would
        number fewer than half the SMs.

        splits: one block a tile of 128 output channels (16-bit channels_last, and NCHW calls)
        where the layer has fewer than half the SMs of them, split in two along an even
        reduction of SPLIT_MIN_K_TILES k-tiles or more, so that twice the blocks share the work.
        Deep splits (deep_splits; not yet measured, derived from the SMs a launch would leave
        idle): a layer of fewer tiles than half the SMs over a reduction of 256 k-tiles or more,
        as a weight gradient is (ResNet-50's 3x3 64->64 at batch 64: 5 tiles, 3136 k-tiles),
        splits it into up to two blocks an SM (32 ways there), whatever its tiles.

        short_1x1 layers (channels_last 1x1, stride 1, reductions of up to SHORT_1X1_K_TILES
        k-tiles) walk tiles (persist), 16-bit ones of 129-256 output channels in one block of 256:
        a tile's few k-tiles leave a block of its own mostly waiting on its loads and stores."""
        device = target(problem.device)
        fixed = dict(fixed or {})
        tf32_cl = spec.dtype == "float32" and spec.layout == "nhwc"
        wide_cl = spec.dtype != "float32" and spec.layout == "nhwc"
        # (forced a_regs tiles keep one block a tile: 16-bit ones that walk spill at 168 registers)
        short = short_1x1(spec) and fixed.get("a_regs", 0) == 0
        bco = fixed.get("block_co", 64 if spec.out_channels <= 64 else
                        256 if short and wide_cl and 128 < spec.out_channels <= 256 else 128)
        rounders = 4 if tf32_cl and bco == 64 and not fixed.get("a_regs", 0) else 0
        base = {"block_co": bco, "block_p": 128, "wgn": 1, "round_smem": rounders}
        # channels_last rows of HALO_MIN_Q pixels or more, stride 1, 64 output channels: halo tiles
        # (16-bit with the weights resident) where they fit
        walks = []
        if (spec.layout == "nhwc" and spec.stride == (1, 1) and bco == 64 and problem.Q >= HALO_MIN_Q
                and fixed.get("halo", 1) == 1):
            halo = {"persist": 1, "halo": 1, "block_p": halo_block_p(problem.Q, 8 if tf32_cl else 16)}
            walks.append({**halo, "wres": 1, "pipes": 1} if wide_cl else halo)
        # TF32 channels_last layers of more than 64 output channels: a_regs tiles that walk, or one
        # block a tile of 64 pixels where 128-pixel tiles would leave over half of an H100's SMs idle
        if tf32_cl and spec.out_channels > 64 and fixed.get("a_regs", 1) == 1:
            few = -(-problem.N * problem.P * problem.Q // 128) * -(-spec.out_channels // bco) < device.sms // 2
            walks.append({"a_regs": 1, "round_smem": 0, **({"persist": 0, "block_p": 64} if few else {"persist": 1})})
        # 16-bit channels_last tiles of 64 output channels: resident weights in two pipelines, else
        # in one, else persistent blocks that load the weights' box a k-tile
        walks += ([{"persist": 1, "wres": 1, "pipes": 2}, {"persist": 1, "wres": 1}, {"persist": 1}]
                  if wide_cl and bco == 64 else [{"a_regs": 0, "persist": 1}] if short else [{"a_regs": 0}])
        def depths(cand_base: dict) -> tuple[tuple[int, int], ...]:
            if cand_base.get("halo"):  # window slots: TF32's 2 measured ahead of 3, 16-bit's 3 of 2
                return ((1, 2), (1, 3)) if tf32_cl else ((1, 3), (1, 2))
            if cand_base.get("wres"):
                return ((1, 8), (1, 7), (1, 6), (1, 5), (1, 4), (1, 3))
            return ((2, 6), (2, 5), (2, 4), (2, 3), (1, 6), (1, 5), (1, 4), (1, 3), (1, 2))

        tiles = -(-problem.N * problem.P * problem.Q // 128) * -(-spec.out_channels // bco)
        splits = 1
        if fixed.get("persist", 0) == 0:  # (a split reduction runs one block a tile)
            splits = deep_splits(spec, tiles, device.sms)
            if (splits == 1 and bco > 64 and not tf32_cl and tiles < device.sms // 2
                    and k_tiles(spec) >= SPLIT_MIN_K_TILES and k_tiles(spec) % 2 == 0):
                splits = 2
        if splits > 1:
            walks = [{"splits": splits, **walk} for walk in walks]
        bases = [{**base, **walk, **fixed} for walk in walks]
        if bases[0].get("splits", 1) > 1:  # a split reduction runs one block a tile, a k-tile a slot
            bases = [{**b, "persist": 0, "halo": 0, "wres": 0, "pipes": 1, **fixed} for b in bases]
        if bco == 256 and "block_co" not in fixed:  # where forced tiles leave no room for 256: 128
            bases += [{**b, "block_co": 128} for b in bases]
        return first_fit(lambda c: self.check_tiles(spec, c, device), [(b, depths(b)) for b in bases], fixed)

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        t = dict(spec.tiles)
        lay = self.layout(spec, t)
        esize = element_size(spec)
        kt = k_tiles(spec)
        areg = t.get("a_regs", 0) == 1
        splits = t.get("splits", 1)
        return {"BCO": lay["BCO"], "BP": lay["BP"], "WGN": lay["WGN"], "AREG": areg,
                "WN": 64 if areg else lay["BP"] // lay["WGN"], "STAGES": lay["STAGES"],
                "SMEM_BYTES": lay["SMEM_BYTES"], "MIN_BLOCKS": t["min_blocks"],
                "PACKED_BYTES": spec.out_channels * kt * 128,  # the packed weights, kept with the weight
                # the call's scratch: room for a dense copy of the input (TF32 rounds it; 16-bit
                # inputs the TMA cannot address are copied), then (split reductions) each split's
                # float32 partial sums, from a 256-byte boundary
                "WORKSPACE_BYTES": 256 if splits > 1 else 0,
                "WORKSPACE_PER_INPUT": esize, "WORKSPACE_PER_OUTPUT": 4 * splits if splits > 1 else 0}


nhwc_tma = NhwcTmaFamily(
    name="nhwc_tma", device="cuda", template="cuda/nhwc_tma.cu.j2", layouts=("nhwc", "nchw"), archs=("sm_90a",),
    dtypes=("float32", "float16", "bfloat16"), tf32=True, engine="wgmma", nchw_copy=True, epilogue=True,
    scale=True,
    tiles={"block_co": (64, 128, 256), "block_p": BLOCK_P, "wgn": (1, 2), "stages": (4, 2, 3, 5, 6, 7, 8),
           "min_blocks": (1, 2), "round_smem": (0, 1, 2, 4), "persist": (0, 1), "wres": (0, 1),
           "pipes": (1, 2), "halo": (0, 1), "wstages": (4, 2, 6, 8), "a_regs": (0, 1),
           "splits": (1, *DEEP_SPLITS)},
)

FAMILIES = (nhwc_tma,)
