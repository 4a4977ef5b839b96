"""`stem_nhwc`: channels_last convolutions of few input channels (first layers, such as
ResNet's 3->64 7x7 stride 2) as an implicit GEMM on tensor cores whose reduction packs every tap.

`nhwc` and `nhwc_tma` read each tap's channels as whole 16-byte chunks, so 3 input channels are
out of their reach, and a k-tile of one tap's channels would run mostly empty anyway. Here the
reduction is K = (kernel row, kernel column, channel), all of it, padded with zeros to whole MMA
k-steps (8 TF32, 16 bf16/fp16): 147 for a 7x7 RGB stem. In channels_last a pixel's window along
one kernel row is a single run of the input row, and the runs of neighbouring pixels overlap, so
a block stages the input rows its tile's windows span in shared memory once (zeros past the
edges, element by element: any strides) and reads each A fragment element at its pixel's column
times the stride plus the element's fixed offset (templates/cuda/stem_nhwc.cu.j2). The weights
are repacked per call into the workspace as [COUT][KPAD] and staged whole per block.

Tiles: `block_p` x `block_q` output rows x columns of one image a block, against `block_n` output
channels; `warps_m` x `warps_n` warps split them (each warp's share whole m16 tiles and pairs of
n8 blocks); `min_blocks` blocks an SM the launch bounds ask for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, element_size, target

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

# It serves layers of at most this many input channels: the block stages all of a pixel's
# reduction at once, which grows with the channels, and past a few channels nhwc's k-tiles of
# whole chunks are full enough.
MAX_CIN = 8
REG_OVERHEAD = 40  # tile position, table offsets, loop state, bias


def _kpad(spec: "ConvSpec") -> int:
    """The reduction (kernel rows x columns x channels) padded with zeros to whole MMA k-steps (8
    TF32, 16 bf16/fp16): the repacked weight's row."""
    kh, kw = spec.kernel_size
    kstep = 8 if spec.dtype == "float32" else 16
    return -(-kh * kw * spec.in_channels // kstep) * kstep


def _prow(order: int, r: int) -> int:
    """Fragment row r's pixel among its m16 tile's 16 (the template's prow)."""
    return (2 * r if r < 8 else 2 * (r - 8) + 1) if order == 1 else r


def _wavefronts(addrs: list[tuple[int, int]]) -> int:
    """Shared-memory wavefronts of one warp's access: (word, bytes) per lane; lanes that read the
    same word share it, different words in one bank take a wavefront each."""
    banks: dict[int, set[int]] = {}
    for word, nbytes in addrs:
        for w in range(word, word + max(nbytes // 4, 1)):
            banks.setdefault(w % 32, set()).add(w)
    return max(len(v) for v in banks.values())


@functools.lru_cache(maxsize=1024)
def _a_wavefronts(esize: int, c: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int, order: int, tq: int,
                  xpitch: int, nks: int) -> int:
    """Wavefronts of one m16 tile's A fragment loads over `nks` k-steps, rows in `order` (a
    simulation of the template's addresses; pure, so cached)."""
    k_total = kh * kw * c

    def koff(k: int) -> int:
        tap = k // c
        return 0 if k >= k_total else (tap // kw) * dh * xpitch + (tap % kw) * dw * c + k % c

    def base(r: int) -> int:
        m = _prow(order, r)
        return (m // tq) * sh * xpitch + (m % tq) * sw * c

    total = 0
    for ks in range(nks):
        for half in (0, 1):
            for ks_off in ((0, 4) if esize == 4 else (0, 1, 8, 9)):
                lanes = []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    k = ks * 8 + t + ks_off if esize == 4 else ks * 16 + 2 * t + ks_off
                    lanes.append(((base(g + 8 * half) + koff(k)) * esize // 4, esize))
                total += _wavefronts(lanes)
    return total


@functools.lru_cache(maxsize=64)
def _staged_row(esize: int, order: int, bn: int) -> int:
    """Elements from one staged output pixel to the next: whole 16-byte vectors, padded so that a
    fragment's writes (eight pixels x four lanes' pairs) take the fewest wavefronts."""
    vec = 16 // esize

    def cost(srow: int) -> int:
        lanes = [(((_prow(order, lane >> 2)) * srow + 2 * (lane & 3)) * esize // 4, 2 * esize) for lane in range(32)]
        return _wavefronts(lanes)

    return min(range(bn + vec, bn + 5 * vec, vec), key=lambda srow: (cost(srow), srow))


def _check_channels(spec: "ConvSpec") -> None:
    if spec.groups != 1 or spec.in_channels > MAX_CIN:
        raise Unsupported(f"stem_nhwc serves dense layers of at most {MAX_CIN} input channels, got "
                          f"{spec.in_channels} in {spec.groups} group(s)")


@dataclass(frozen=True)
class StemNhwcFamily(Family):
    def layout(self, spec: "ConvSpec", tiles: Mapping[str, int]) -> dict[str, int]:
        """Compile-time constants of a tile choice (the template static_asserts the same)."""
        (kh, kw), (sh, sw), (dh, dw) = spec.kernel_size, spec.stride, spec.dilation
        esize, strict = element_size(spec), spec.dtype == "float32" and spec.math == "ieee"
        tp, tq, bn = tiles["block_p"], tiles["block_q"], tiles["block_n"]
        wm, wn = tiles["warps_m"], tiles["warps_n"]
        kpad = _kpad(spec)
        nks = kpad // (8 if esize == 4 else 16)
        xrows = (tp - 1) * sh + (kh - 1) * dh + 1
        xrun = ((tq - 1) * sw + (kw - 1) * dw + 1) * spec.in_channels
        xpitch = xrun + (-xrun % 4)
        wpitch = kpad * esize // 4 + 4  # 16 bytes past a multiple of 32: ldmatrix's 8 rows on 8 bank runs
        ktab_off = bn * wpitch * 4
        x_off = ktab_off + nks * 4 * (8 if esize == 4 else 16)
        # the fragment rows' order with the fewer bank conflicts (the natural one on ties)
        shape = (esize, spec.in_channels, kh, kw, sh, sw, dh, dw)
        order = min((0, 1), key=lambda o: _a_wavefronts(*shape, o, tq, xpitch, min(nks, 4)))
        srow = _staged_row(esize, order, bn)
        smem = max(x_off + xrows * xpitch * esize, tp * tq * srow * esize)
        mi, ni = max(tp * tq // wm // 16, 1), max(bn // wn // 8, 1)
        # Registers a thread needs: accumulators (3xTF32: and their partial sums), a k-step's
        # fragments (3xTF32: their halves too) and each A row's start.
        regs = mi * ni * 4 * (2 if strict else 1) + (mi * 4 + ni * 2) * (3 if strict else 1) + 2 * mi + REG_OVERHEAD
        return {"NKS": nks, "XPITCH": xpitch, "WPITCH": wpitch, "KTAB_OFF": ktab_off, "X_OFF": x_off,
                "ORDER": order, "SROW": srow,
                "SMEM_BYTES": smem + (-smem % 16), "NTH": 32 * wm * wn, "REGS": regs}

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        _check_channels(spec)
        if spec.out_channels * _kpad(spec) >= 1 << 31:
            raise Unsupported("stem_nhwc: the repacked weight exceeds 2^31 elements")
        self.check_tiles(spec, dict(spec.tiles), device)

    def check_tiles(self, spec: "ConvSpec", tiles: Mapping[str, int], device: "Device") -> None:
        bm, bn = tiles["block_p"] * tiles["block_q"], tiles["block_n"]
        if bm % (16 * tiles["warps_m"]) or (bn // tiles["warps_n"]) % 16 or bn % tiles["warps_n"]:
            raise Unsupported(f"stem_nhwc: {bm} pixels x {bn} channels do not split into whole 16 x 16 warp tiles "
                              f"over {tiles['warps_m']} x {tiles['warps_n']} warps")
        lay = self.layout(spec, tiles)
        if lay["SMEM_BYTES"] > device.smem_block:
            raise Unsupported(f"stem_nhwc: {lay['SMEM_BYTES']} bytes of shared memory exceed {device.smem_block} "
                              "(fewer output channels or rows a block)")
        blocks = tiles["min_blocks"]
        if lay["REGS"] * lay["NTH"] * blocks > device.regs_sm or (lay["SMEM_BYTES"] + 1024) * blocks > device.smem_sm:
            raise Unsupported(f"stem_nhwc: {blocks} blocks of {lay['NTH']} threads (~{lay['REGS']} registers, "
                              f"{lay['SMEM_BYTES']} bytes of shared memory) do not fit an SM")

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Tiles from the shape: 128-pixel blocks whose rows are the narrowest of 16, 32 and 64
        columns that leaves the fewest columns of the output idle (fewer input rows staged a pixel
        than taller blocks need; 112 = 7 x 16); every output channel up to 64 a block (32 where
        there are no more); 4 x 1 warps (each warp 32 pixels against all the block's channels),
        strict float32 4 x 2 (2 x 2 at 32 channels: its fragments' halves double the registers);
        two blocks an SM where they fit, else one (measured: docs/selection.md, stem_nhwc).
        """
        device = target(problem.device)
        _check_channels(spec)  # (before any layout: the selector asks every channels_last call)
        fixed = dict(fixed or {})
        strict = spec.dtype == "float32" and spec.math == "ieee"
        q = max(problem.Q, 1)
        tq = fixed.get("block_q", min((16, 32, 64), key=lambda c: (-(-q // c) * c - q, c)))
        bn = fixed.get("block_n", 32 if spec.out_channels <= 32 else 64)
        warps = (4 if bn >= 64 else 2, 2) if strict else (4, 1)
        cand = {"block_p": max(128 // tq, 1), "block_q": tq, "block_n": bn, "warps_m": warps[0], "warps_n": warps[1], **fixed}
        reasons = []
        for blocks in ((fixed["min_blocks"],) if "min_blocks" in fixed else (2, 1)):
            try:
                self.check_tiles(spec, {**cand, "min_blocks": blocks}, device)
            except Unsupported as exc:
                reasons.append(str(exc))
                continue
            return {**cand, "min_blocks": blocks}
        raise Unsupported(f"no tile configuration fits ({reasons[0]})")

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        ctx = dict(self.layout(spec, dict(spec.tiles)))
        ctx.pop("REGS")
        ctx.pop("NTH")
        ctx["PACKED_BYTES"] = spec.out_channels * _kpad(spec) * element_size(spec)
        return ctx


stem_nhwc = StemNhwcFamily(
    name="stem_nhwc", device="cuda", template="cuda/stem_nhwc.cu.j2", layouts=("nhwc",),
    dtypes=("float32", "float16", "bfloat16"), tf32=True, engine="mma", epilogue=True, scale=True,
    tiles={"block_p": (4, 1, 2, 8, 16), "block_q": (32, 8, 16, 64, 128), "block_n": (64, 32, 128),
           "warps_m": (2, 1, 4), "warps_n": (2, 1, 4), "min_blocks": (2, 1, 3, 4)},
)

FAMILIES = (stem_nhwc,)
