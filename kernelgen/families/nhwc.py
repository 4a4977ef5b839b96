"""`nhwc`: dense and grouped convolution as one GEMM over the batch on tensor cores (mma.sync):
channels_last calls, and NCHW calls on small planes.

One implicit GEMM per group over the whole batch (templates/cuda/nhwc.cu.j2):
D[pixel x COUT_G] = im2col[pixel x K] . W[K x COUT_G], with pixel = (n, p, q) running over every
image, so small planes (ResNet's 7 x 7 and 14 x 14) fill whole tiles, and K = (r, s, channel).
A pixel's channels are contiguous in channels_last, so each row of a k-tile (BK channels of one
kernel tap) is one 16-byte-aligned run: cp.async copies it, zero-filled in the padding and past
the group's channels. The weights are repacked per call into the workspace as
[COUT][KH][KW][CIN_G]. Any stride, dilation and padding, any number of channels; float32 (TF32,
or strict as 3xTF32), bfloat16 and float16.

Channels a group that are not whole 16-byte chunks (RegNet's 1044 -> 185, a stem's 3) are read
from a copy of the input in the workspace, each group's channels padded with zeros to whole
chunks (cin_padded), against weights repacked with zeros there too: one more pass over the input,
and then every k-tile row is a whole aligned run again. An odd number of output channels a group
leaves a channel at a time.

NCHW calls (layout 'nchw') take one more pass: the input is transposed into the workspace as dense NHWC, after the weights, and the
epilogue writes NCHW output directly. The workspace then grows with the input
(KG_WORKSPACE_PER_INPUT bytes an input element). wgmma (tile wg) on a dense channels_last
TF32 input where it is read four times or more takes a rounded copy there the same way
(round_copy): wgmma reads operands as they lie in shared memory and would truncate them; other
inputs are rounded in shared memory as each k-tile lands.

Tiles: `block_m` pixels x `block_n` output channels a block; `chunks` 16-byte chunks of
channels a k-tile row (BK = chunks * 16 bytes of one tap's channels); `stages` k-tiles in the
cp.async ring; `min_blocks` blocks an SM the launch bounds ask for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, element_size, target

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

REG_OVERHEAD = 32  # addresses, loop state, bias and the loader's place in the reduction


def cin_padded(spec: "ConvSpec") -> int:
    """A group's input channels rounded up to whole 16-byte chunks: where they are not whole
    already, the kernel reads a copy of the input padded with zeros so (the template's PADDED)."""
    vec = 16 // element_size(spec)
    return -(-spec.cin_per_group // vec) * vec


@dataclass(frozen=True)
class NhwcFamily(Family):
    def layout(self, spec: "ConvSpec", tiles: Mapping[str, int]) -> dict[str, int]:
        """Compile-time constants of a tile choice (the template static_asserts the same)."""
        bm, bn, kc, stages = tiles["block_m"], tiles["block_n"], tiles["chunks"], tiles["stages"]
        wg = tiles.get("wg", 0) == 1
        if wg:  # a warp takes 16 rows (a quarter of its warpgroup's 64) against all BN channels
            wtm, wtn = 16, bn
        else:
            wtm, wtn = (64 if bm >= 128 else 32), min(32, bn)
        warps_m, warps_n = max(bm // wtm, 1), max(bn // wtn, 1)
        nth = 32 * warps_m * warps_n
        mi, ni = wtm // 16, wtn // 8
        strict = spec.dtype == "float32" and spec.math == "ieee"
        # Registers a thread needs: accumulators (and 3xTF32's k-tile sums), the fragments of a
        # k-step (3xTF32: their two halves; wgmma reads shared memory), and four per input row it
        # copies (image offset, row, column); ptxas measured 150-200 for 4-warp 128 x 64 mma.sync
        # tiles, which the estimate covers.
        frags = 0 if wg else (mi * 4 + ni * 2)
        regs = (mi * ni * 4 + frags) * (2 if strict else 1) + 4 * (bm * kc // nth) + REG_OVERHEAD
        return {"VEC": 16 // element_size(spec), "BM": bm, "BN": bn, "KC": kc, "STAGES": stages,
                "WARPS_M_": warps_m, "WARPS_N_": warps_n, "NTH": nth,
                # wgmma: 1 KB more, to start the ring on a whole 1024-byte swizzle pattern
                "SMEM_BYTES": stages * (bm + bn) * kc * 16 + (1024 if wg else 0), "REGS": regs}

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        if spec.groups > 65535:
            raise Unsupported(f"nhwc launches one grid layer per group, at most 65535; got {spec.groups}")
        self.check_tiles(spec, dict(spec.tiles), device)

    def check_tiles(self, spec: "ConvSpec", tiles: Mapping[str, int], device: "Device") -> None:
        lay = self.layout(spec, tiles)
        if tiles.get("wg", 0) == 1:
            if spec.dtype == "float32" and spec.math == "ieee":
                raise Unsupported("nhwc: strict float32 (3xTF32) runs on mma.sync only (wg=0)")
            if tiles["block_m"] % 64 or tiles["stages"] < 3:
                raise Unsupported("nhwc: wgmma takes 64 pixels a warpgroup and a ring of three k-tiles or more")
            # wgmma's accumulators cannot spill: ptxas refuses the kernel instead (needs 90 for 512
            # threads of 64 x 128 slices, 154 for 256 of 64 x 256)
            blocks = tiles.get("min_blocks", 1)
            if lay["REGS"] * lay["NTH"] * blocks > device.regs_sm:
                raise Unsupported(f"nhwc: {blocks} blocks of {lay['NTH']} threads of ~{lay['REGS']} registers exceed "
                                  "the SM's 65536 (wgmma's accumulators stay in registers)")
        elif tiles["block_n"] > 128:
            raise Unsupported("nhwc: 256-channel tiles are wgmma's (wg=1)")
        if lay["BM"] * lay["KC"] % lay["NTH"] or lay["NTH"] % lay["KC"]:
            raise Unsupported(f"nhwc: {lay['NTH']} threads cannot share {lay['BM']} rows of {lay['KC']} chunks")
        if lay["REGS"] * lay["NTH"] > device.regs_sm:
            raise Unsupported(f"nhwc: {lay['NTH']} threads of ~{lay['REGS']} registers exceed the SM's 65536")
        if lay["SMEM_BYTES"] > device.smem_block:
            raise Unsupported(f"nhwc: {lay['SMEM_BYTES']} bytes of shared memory exceed {device.smem_block}")

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Tiles from the shape.

        chunks: the fewest that still hold a tap's channels when those are few (16 float32
        channels fill 4 chunks), else 8 (128 bytes a row).

        wg (wgmma) on sm_90a, for TF32 and 16-bit rows of 8 chunks: 128 pixels x 128 channels
        (64 where the group has no more), halved in channels while the grid is under half a
        wave; a ring of 3 k-tiles (two blocks an SM) for reductions under 32 k-tiles, else 4.
        A producer warpgroup, 256-pixel blocks and three blocks an SM were tried and lost
        (measured: docs/selection.md, nhwc).

        Otherwise mma.sync: tiles of 128 pixels x up to 128 channels, smaller while the grid is
        under two waves; stages: the deepest ring that lets two blocks share an SM. Strict
        float32 (3xTF32, mma.sync only) keeps 64-pixel tiles (its k-tile sums double the
        accumulators).
        """
        device = target(problem.device)
        esize = element_size(spec)
        strict = spec.dtype == "float32" and spec.math == "ieee"
        row_bytes = cin_padded(spec) * esize
        kc = 8 if row_bytes >= 128 else 4 if row_bytes >= 64 else 2
        cout = spec.cout_per_group
        m = problem.N * problem.P * problem.Q

        def blocks(bm_: int, bn_: int) -> int:
            return -(-m // bm_) * -(-cout // bn_) * spec.groups

        fixed = dict(fixed or {})
        # (forced tiles that only mma.sync takes keep it)
        wg_fits = fixed.get("stages", 3) >= 3 and fixed.get("block_m", 64) % 64 == 0
        wg = fixed.get("wg", 1 if device.arch == "sm_90a" and not strict and kc == 8 and wg_fits else 0)
        if wg == 1 and device.arch != "sm_90a":
            raise Unsupported(f"nhwc: wgmma (wg=1) needs sm_90a (target {device.arch})")
        if wg == 1:
            bm, bn = 128, 128 if cout > 64 else 64
            while blocks(bm, bn) < device.sms // 2 and bn > 64:
                bn //= 2
            bk = fixed.get("chunks", kc) * 16 // esize  # channels a k-tile
            kt = spec.kernel_size[0] * spec.kernel_size[1] * -(-spec.cin_per_group // bk)
            stage_order = (3, 4) if kt < 32 else (4, 3)
        else:
            bn = 128 if cout >= 128 else 64 if cout > 32 else 32
            bm = 64 if strict else 128
            while blocks(bm, bn) < 2 * device.sms and (bm > 64 or bn > 64):
                if bm > 64:
                    bm //= 2
                else:
                    bn //= 2
            stage_order = (4, 3, 2)
        fitting, reasons = [], []
        for kc_ in dict.fromkeys((kc, 4, 8)):  # the preferred chunk count, then the others once
            for stages in stage_order:
                cand = {"block_m": bm, "block_n": bn, "chunks": kc_, "stages": stages, "wg": wg, **fixed}
                try:
                    self.check_tiles(spec, cand, device)
                except Unsupported as exc:
                    reasons.append(str(exc))
                    continue
                lay = self.layout(spec, cand)
                two = 2 * (lay["SMEM_BYTES"] + 1024) <= device.smem_sm and lay["REGS"] * lay["NTH"] * 2 <= device.regs_sm
                fitting.append((cand, two))
            if fitting:
                break
        # mma.sync: two blocks an SM first (stable: deepest ring first); wgmma: stage_order's
        for cand, two in fitting if wg == 1 else sorted(fitting, key=lambda c: not c[1]):
            cand.setdefault("min_blocks", 2 if two else 1)
            return cand
        raise Unsupported(f"no tile configuration fits ({reasons[0]})")

    def cost_class(self, spec: "ConvSpec") -> str:
        return "wgmma" if dict(spec.tiles).get("wg", 0) == 1 else "mma"

    def traffic(self, spec: "ConvSpec", problem: "Problem") -> float:
        """The base's bytes, and a padded copy of the input as an NCHW call's transpose costs."""
        base = super().traffic(spec, problem)
        if spec.layout == "nhwc" and cin_padded(spec) != spec.cin_per_group:
            base += 2.0 * problem.N * spec.in_channels * problem.H * problem.W * element_size(spec)
        return base

    def round_copy(self, spec: "ConvSpec") -> bool:
        """Whether wgmma on a channels_last TF32 input rounds a copy of it first (else each k-tile
        is rounded in shared memory): where blocks read each input element four times or more
        (taps over the stride's area, times blocks across the output channels); inputs read once
        or twice are rounded faster in shared memory (measured: docs/selection.md, nhwc)."""
        t = dict(spec.tiles)
        if not (t["wg"] == 1 and spec.layout == "nhwc" and spec.dtype == "float32" and spec.math == "tf32"):
            return False
        if cin_padded(spec) != spec.cin_per_group:  # the padded copy is rounded as it is made
            return False
        (kh, kw), (sh, sw) = spec.kernel_size, spec.stride
        return kh * kw * -(-spec.cout_per_group // t["block_n"]) >= 4 * sh * sw

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        ctx = dict(self.layout(spec, dict(spec.tiles)))
        ctx.pop("REGS")
        (kh, kw) = spec.kernel_size
        ctx["MIN_BLOCKS"] = dict(spec.tiles)["min_blocks"]
        cinp = ctx["CIN_GP"] = cin_padded(spec)
        # The packed weights (kept with the weight); the call's scratch holds (NCHW calls, padded
        # channels) the input's copy, where a padded copy takes CIN_GP elements for every CIN_G.
        ctx["PACKED_BYTES"] = spec.out_channels * kh * kw * cinp * element_size(spec)
        ctx["ROUND_COPY"] = self.round_copy(spec)
        copy = spec.layout == "nchw" or ctx["ROUND_COPY"] or cinp != spec.cin_per_group
        ctx["WORKSPACE_PER_INPUT"] = -(-element_size(spec) * cinp // spec.cin_per_group) if copy else 0
        return ctx


nhwc = NhwcFamily(
    name="nhwc", device="cuda", template="cuda/nhwc.cu.j2", layouts=("nhwc", "nchw"),
    dtypes=("float32", "float16", "bfloat16"), tf32=True, engine="mma", nchw_copy=True, epilogue=True,
    scale=True,
    tiles={"block_m": (128, 64, 256), "block_n": (128, 64, 32, 256), "chunks": (8, 4, 2), "stages": (3, 4, 2),
           "min_blocks": (1, 2), "wg": (0, 1)},
)

FAMILIES = (nhwc,)
