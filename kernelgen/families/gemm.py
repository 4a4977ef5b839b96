"""Tensor-core families for dense and grouped convolution in NCHW: `pointwise` and `igemm`.

Both compute, per image and per group, the GEMM

    D[COUT_G x pixels] = W[COUT_G x K] . B[K x pixels]

on `mma.sync` tensor cores (templates/common/mma.cuh.j2 holds the one kernel both
render): m16n8k8 TF32 for float32 (MATH 'tf32': operands rounded with
cvt.rna.tf32.f32; MATH 'ieee': 3xTF32 split precision, ~1e-6 relative error),
m16n8k16 with float32 accumulation for float16 / bfloat16.

- `pointwise`: 1x1, stride 1, no padding. B is the image itself, CIN_G x (H*W), and
  pixel tiles run over the flattened plane, so small or odd planes waste nothing.
- `igemm`: any kernel, stride, dilation and padding (implicit GEMM). A block owns
  BLOCK_M output channels x a TILE_P x TILE_Q patch of output pixels; each pipeline
  stage stages BLOCK_K input channels of the input halo (all KH kernel rows when
  full_kh=1, one kernel row otherwise) and the matching weight slice in shared
  memory, and the MMA fragments read the im2col matrix straight out of the halo.

Layers of few channels (fewer channel words than a k-step's 8: float32 under 8 channels,
16-bit under 16) pack their reduction (tile `pack_k`, one stage): its words run over
(channel word, kernel tap) pairs, padded to whole k-steps only once, and each k-step's B
words come from a small table of halo offsets. A 3-channel 7x7 stem takes 19 TF32 k-steps
instead of 49 (measured: docs/selection.md, pointwise and igemm).

A stage is staged through registers (global loads for stage j+1 are in flight while
stage j's MMAs run), double-buffered in shared memory with one barrier per stage.
When one stage covers the whole reduction (CIN_G <= BLOCK_K, and all kernel rows),
the weights stay resident in shared memory and blocks are persistent, looping over
output tiles, so each block loads its weights once. There, float32 may take its input
by cp.async instead (tile `async_x`: 1 one tile ahead, 2 two tiles ahead in three buffers;
no prefetch registers; TF32 rounds each thread's own copied words in place before the barrier).
Tile indices decode with 32-bit division whenever the tile count fits 31 bits.

Epilogue (tile `stage_out`): 0 stores pairs straight from the MMA fragments; 1 stages each
warp's tile in its own shared-memory rows, shifted by each output row's misalignment, and
writes whole aligned 16-byte st.global.cs chunks (scalar ends), for any output alignment.
Both need unit-stride output pixels; a kernel falls back to scalar stores otherwise.

Shared-memory layouts (in 32-bit words; a word holds one float32 or a pair of
consecutive channels in float16/bfloat16) are computed here, in `layout()`, the one
place both `check_shape` and the template (through `context`) take them from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, no_fit, staged_row, target

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

# Accumulator floats per thread above which the compiler starts spilling.
MAX_ACC_PER_THREAD = 128
# Registers a thread may spend holding the next stage's global loads.
MAX_PREFETCH_WORDS = 96
MAX_THREADS = 512
# Registers a thread needs beyond accumulators and prefetch (fragments, addresses), roughly.
# 56, not less: case 63's 2x64 tile estimated at 121 was capped to 128 for two blocks per SM and
# spilled (measured: docs/selection.md, pointwise and igemm).
REG_OVERHEAD = 56


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(value: int, mod: int, rem: int) -> int:
    """Smallest v >= value with v % mod == rem (row strides that avoid bank conflicts)."""
    return value + (rem - value) % mod


@dataclass(frozen=True)
class GemmFamily(Family):
    flat: bool = False  # pointwise: pixel tiles over the flattened H*W plane

    # -- geometry -------------------------------------------------------------------
    def layout(self, spec: "ConvSpec", tiles: Mapping[str, int] | None = None) -> dict[str, int]:
        """Derived compile-time constants (UPPERCASE, as the template receives them).

        `tiles` defaults to the spec's own.
        """
        t = dict(spec.tiles if tiles is None else tiles)
        (kh, kw), (sh, sw), (dh, dw) = spec.kernel_size, spec.stride, spec.dilation
        epw = 1 if spec.dtype == "float32" else 2  # elements per 32-bit shared-memory word
        bm, ck = t["block_m"], t["block_k"]
        if self.flat:
            tp, tq, full = 1, t["block_n"], True
        else:
            tp, tq, full = t["tile_p"], t["tile_q"], bool(t["full_kh"])
        bn = tp * tq
        warps_m, warps_n = t["warps_m"], t["warps_n"]
        nth = 32 * warps_m * warps_n
        kp = ck // epw  # words per (kernel row, kernel column) per stage
        kr = kh if full else 1  # kernel rows per stage
        ksw = kr * kw * kp  # reduction words per stage
        # pack_k (igemm, one stage): the reduction runs over (channel word, kernel tap) pairs, KF of
        # them padded to whole k-steps, instead of a k-step of channel words per tap; a stage then
        # stages only the CW real channel words' planes (and one zero plane that the padding words
        # read). A 3-channel 7x7 stem: 19 TF32 k-steps where whole k-steps per tap take 49.
        pack = bool(t.get("pack_k", 0)) and not self.flat
        cw = _ceil(spec.cin_per_group, epw)
        kf = cw * kh * kw
        if pack:
            ksw = _ceil(kf, 8) * 8
            kp = cw + (1 if ksw > kf else 0)
        # A is [BLOCK_M][AKS] words: AKS % 8 == 4 makes fragment loads conflict-free.
        aks = _pad_to(ksw, 8, 4)
        if self.flat:
            xp, xq = 1, bn
        else:
            xp = (tp - 1) * sh + (kh - 1) * dh + 1 if full else tp
            xq = (tq - 1) * sw + (kw - 1) * dw + 1
        # B planes are [XP][XQ] words, CS apart; CS % 16 == 8 makes fragment loads conflict-free.
        cs = _pad_to(xp * xq, 16, 8)
        cchunks = _ceil(spec.cin_per_group, ck)
        kstages = cchunks * (kh // kr)
        wres = kstages == 1
        xwords = kp * cs
        wwords = bm * aks
        mt, nt = bm // warps_m // 16, bn // warps_n // 8
        # Epilogue staging (stage_out=1): the block's tile as BM x TP segments, one channel x one
        # output row of TQ pixels (pointwise: TP is 1, TQ is BN flattened pixels).
        esz = 4 if spec.dtype == "float32" else 2
        srs = staged_row(tq, esz)
        stage_out = bool(t.get("stage_out", 0))
        # async_x: float32 input stages land by cp.async (no prefetch registers); needs resident
        # weights, whose epilogue staging does not overlap the buffer being filled.
        # async_x=2 keeps two tiles in flight (three input buffers).
        xasync = bool(t.get("async_x", 0)) and epw == 1 and wres
        xdepth = int(t.get("async_x", 0)) if xasync else 1
        nxb = xdepth + 1
        # The staging has its own region after the pipeline buffers, or (cp.async input) lives in
        # the input buffer the tile's MMAs just read, in as few rounds of whole warp rows
        # (parts dividing warps_m) as fit it.
        tile_words = bm * tp * srs * esz // 4
        epi_parts, epi_in_x = 1, False
        if stage_out and xasync:
            for p in (1, 2, 4):
                if warps_m % p == 0 and tile_words // p <= xwords:
                    epi_parts, epi_in_x = p, True
                    break
        epi_words = tile_words // epi_parts if stage_out else 0
        smem_words = (wwords + nxb * xwords if wres else 2 * (wwords + xwords)) + (0 if epi_in_x else epi_words)
        # pack_k: a table of each k-step's two B offsets per lane quarter (int2 x 4), after the rest
        ktab = smem_words + (smem_words & 1)
        smem_words = ktab + ksw if pack else smem_words
        prefetch = 0 if xasync else _ceil(kp * xp * xq, nth) * epw
        prefetch += 0 if wres else _ceil(bm * ksw, nth) * epw
        if self.flat and not xasync:  # the 16-byte path loads 4 pixels per unit
            prefetch = max(prefetch, _ceil(kp * bn // 4, nth) * 4)
        # 3xTF32 over several stages sums each stage apart (see FLUSH in the template).
        flush = spec.dtype == "float32" and spec.math == "ieee" and kstages > 1
        acc = mt * nt * 4 * (2 if flush else 1)
        smem = smem_words * 4
        return {
            "FLAT": self.flat, "EPW": epw, "BM": bm, "CK": ck, "TP": tp, "TQ": tq, "BN": bn,
            "FULL": full, "NTH": nth, "WARPS_M_": warps_m, "WARPS_N_": warps_n, "MT": mt, "NT": nt,
            "KP": kp, "KR": kr, "KSW": ksw, "AKS": aks, "XP": xp, "XQ": xq, "CS": cs,
            "CCHUNKS": cchunks, "KSTAGES": kstages, "WRES": wres, "XWORDS": xwords, "WWORDS": wwords,
            "XASYNC": xasync, "XDEPTH": xdepth, "NXB": nxb, "STAGE_OUT": stage_out, "SRS": srs, "EPI_WORDS": epi_words,
            "EPI_IN_X": epi_in_x, "EPI_PARTS": epi_parts,
            "SMEM_BYTES": smem, "MB": _ceil(spec.cout_per_group, bm), "MINB": t["min_blocks"],
            "PACK": pack, "CW": cw, "KF": kf, "KTAB": ktab,
            "PREFETCH_WORDS": prefetch, "ACC_PER_THREAD": acc, "FLUSH": flush,
        }

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        lay = self.layout(spec)
        return {k: v for k, v in lay.items() if k not in ("PREFETCH_WORDS", "ACC_PER_THREAD")}

    # -- what can be served --------------------------------------------------------
    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        (kh, kw), (sh, sw) = spec.kernel_size, spec.stride
        if self.flat:
            if (kh, kw) != (1, 1):
                raise Unsupported(f"pointwise serves 1x1 kernels, not {kh}x{kw}; use igemm")
            if (sh, sw) != (1, 1) or any(spec.padding):
                raise Unsupported(f"pointwise needs stride 1 and no padding (got stride {spec.stride}, "
                                  f"padding {spec.padding}); use igemm")
        if spec.out_channels * spec.cin_per_group * kh * kw >= 2**31:
            raise Unsupported("weights with 2^31 or more elements")
        if spec.tiles:  # a spec still being chosen carries none yet
            self.check_tiles(spec, dict(spec.tiles), device)

    def check_tiles(self, spec: "ConvSpec", t: Mapping[str, int], device: "Device") -> None:
        """Raise Unsupported if tiles `t` cannot compute `spec` (registers, shared memory)."""
        lay = self.layout(spec, t)
        epw = lay["EPW"]
        if t["block_k"] % (8 * epw):
            raise Unsupported(f"block_k={t['block_k']} must be a multiple of {8 * epw} for {spec.dtype} "
                              f"(one MMA k-step)")
        if t["block_m"] % (16 * t["warps_m"]):
            raise Unsupported(f"block_m={t['block_m']} is not a multiple of 16*warps_m={16 * t['warps_m']}")
        if lay["BN"] % (8 * t["warps_n"]):
            raise Unsupported(f"the pixel tile ({lay['BN']}) is not a multiple of 8*warps_n={8 * t['warps_n']}")
        if t.get("async_x", 0) and not lay["XASYNC"]:
            raise Unsupported("async_x needs float32 and resident weights (one stage per tile)")
        if t.get("pack_k", 0):
            if self.flat:
                raise Unsupported("pack_k packs kernel taps into the reduction: igemm only, not pointwise")
            if not (lay["WRES"] and lay["FULL"]):
                raise Unsupported(f"pack_k needs the whole reduction in one stage (block_k >= {spec.cin_per_group} "
                                  f"channels and full_kh=1)")
        if lay["NTH"] > MAX_THREADS:
            raise Unsupported(f"warps_m*warps_n={lay['NTH'] // 32} warps exceed {MAX_THREADS // 32}")
        if lay["ACC_PER_THREAD"] > MAX_ACC_PER_THREAD:
            raise Unsupported(f"warp tile holds {lay['ACC_PER_THREAD']} accumulators per thread "
                              f"(> {MAX_ACC_PER_THREAD}); add warps or shrink the block")
        if lay["PREFETCH_WORDS"] > MAX_PREFETCH_WORDS:
            raise Unsupported(f"a stage needs {lay['PREFETCH_WORDS']} prefetch registers per thread "
                              f"(> {MAX_PREFETCH_WORDS}); shrink block_k or the tile, or add warps")
        if t["min_blocks"] * (lay["SMEM_BYTES"] + 1024) > device.smem_sm or t["min_blocks"] * lay["NTH"] > 2048:
            raise Unsupported(f"min_blocks={t['min_blocks']} blocks of {lay['SMEM_BYTES']} bytes of shared memory "
                              f"and {lay['NTH']} threads do not fit one SM")
        if lay["SMEM_BYTES"] > device.smem_block:
            raise Unsupported(f"tiles need {lay['SMEM_BYTES']} bytes of shared memory (> {device.smem_block}); "
                              f"shrink block_k, block_m or the pixel tile")

    # -- heuristics -------------------------------------------------------------------
    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Tiles for a problem shape (measured: docs/selection.md, pointwise and igemm).

        - block_m covers COUT_G up to 128 (32/64/128): each staged input value feeds as
          many output channels as possible; 8 warps as 2x4 (1x4 below 64 channels).
          igemm TF32 with resident weights tries cp.async input first (async_x=1, one
          block per SM).
        - Epilogue: 16-bit outputs leave through shared memory (stage_out=1, one block per
          SM), float32 straight from the fragments.
        - pointwise 16-bit: 128-pixel blocks first.
        - pointwise on large planes (at least 4096 pixels, 2^19 a call) with 128-channel blocks
          and one stage: 16 warps (4x4) and staged rows first, 256 pixels for 16-bit (register
          input), 128 for TF32 (cp.async input two tiles ahead, rows staged in the input buffer
          just read).
        - block_k takes all of CIN_G when that is at most 64 channels: the reduction is
          one stage, the weights stay resident and blocks are persistent (the
          memory-bound 1x1 and small-CIN k x k cases). pointwise rounds it up to an allowed
          block_k (48 channels: one stage of 64). Otherwise 16 channels, or 8 for float32
          kernels of 5x5 and up (smaller weight slices per stage).
        - Pixels: a long reduction (CIN_G*KH*KW >= 256: compute-bound) gets 256 pixels
          per block (not for 3xTF32, whose per-stage partial sums double the
          accumulators), i.e. a 64x64 warp tile, which halves shared-memory traffic per MMA;
          a short one gets 128 (64x32 warp tiles, fewer registers, so two blocks fit an SM
          and one stores while the other computes). igemm shapes the patch to the output
          width: 2x64 / 1x128 for wide rows (2x128 / 4x64 when long), narrower otherwise.
        - Kernel rows: all staged at once (full_kh=1) up to 3 rows, one per stage above.
        - pack_k=1 first (all channels and kernel rows in one stage) where a tap has fewer
          channel words than a k-step's 8 and packing (channel word, tap) pairs saves k-steps.
        - min_blocks=2 when the register estimate (accumulators + prefetch + 56) allows two
          256-thread blocks per SM without spilling, else 1.
        The first candidate that passes check_tiles wins.
        """
        device = target(problem.device)
        epw = 1 if spec.dtype == "float32" else 2
        cout_g, cin_g = spec.cout_per_group, spec.cin_per_group
        kh, kw = spec.kernel_size
        heavy = cin_g * kh * kw >= 256
        bm = 128 if cout_g > 64 else 64 if cout_g > 32 else 32
        kmin = 8 * epw
        full_k = _ceil(cin_g, kmin) * kmin
        if self.flat:  # one stage of an allowed block_k (48 channels: 64, zero past CIN_G)
            full_k = min((k for k in self.tiles["block_k"] if k >= full_k), default=full_k)
        candidates_k = [full_k] if full_k <= 64 else []
        small_k = 8 if (kh * kw >= 25 and epw == 1) else 16
        candidates_k += [k for k in (max(small_k, kmin), 16, 32) if k % kmin == 0 and k < full_k]
        candidates_k = list(dict.fromkeys(candidates_k)) or [kmin]
        warps_m = 2 if bm >= 64 else 1
        strict3 = spec.dtype == "float32" and spec.math == "ieee"  # 3xTF32: more registers
        bn_list = (256, 128, 64) if heavy and bm == 128 and not strict3 else (128, 64)
        if self.flat and epw == 2:
            bn_list = (128, 64)  # case 87 bf16, staged (measured: docs/selection.md, pointwise)
        tf32 = spec.dtype == "float32" and spec.math == "tf32"
        tiles: list[dict[str, int]] = []
        plane = problem.P * problem.Q
        if self.flat and bm == 128 and full_k <= 64 and plane >= 4096 and problem.N * plane >= 1 << 19:
            wide = {"block_k": full_k, "block_m": 128, "warps_m": 4, "warps_n": 4, "stage_out": 1, "min_blocks": 1}
            if epw == 2:
                tiles.append({**wide, "block_n": 256, "async_x": 0})
            elif tf32:
                tiles.append({**wide, "block_n": 128, "async_x": 2})
        # pack_k first where a tap has fewer channel words than a k-step's 8 (float32 under 8
        # channels, 16-bit under 16) and packing saves k-steps; one stage holds it all.
        cw = _ceil(cin_g, epw)
        passes = [(ck, (1, 0) if kh <= 3 else (0, 1), 0) for ck in candidates_k]
        if not self.flat and cw < 8 and _ceil(cw * kh * kw, 8) < kh * kw:
            passes.insert(0, (full_k, (1,), 1))
        for ck, fulls, pk in passes:
            # 16-bit: the staged epilogue first, in one block per SM. float32: fragment stores;
            # with resident weights, TF32 first tries 128 channels with cp.async input
            # (async_x=1), which won on case 63 only (measured: docs/selection.md, pointwise and
            # igemm).
            resident = not self.flat and ck >= cin_g and (kh <= 3 or pk == 1)
            variants: list[dict[str, int]] = []
            if epw == 2:
                variants.append({"block_m": bm, "stage_out": 1, "async_x": 0, "min_blocks": 1})
            elif resident and tf32 and bm == 128:
                variants.append({"block_m": 128, "stage_out": 0, "async_x": 1, "min_blocks": 1})
            variants.append({"block_m": bm, "stage_out": 0, "async_x": 0})
            for v in variants:
                b = v["block_m"]
                base = {"block_k": ck, "warps_m": 2 if b >= 64 else 1, "warps_n": 4, "pack_k": pk, **v}
                for bn in bn_list:
                    if self.flat:
                        tiles.append({**base, "block_n": bn})
                        continue
                    q = problem.Q
                    wide = [(2, 64), (1, 128), (4, 32)] if q > 96 else [(4, 32), (2, 64)] if q > 24 else [(8, 16)]
                    shapes = [(tp * bn // 128, tq) for tp, tq in wide if tp * bn // 128 >= 1]
                    if bn == 64:
                        shapes = [(tp // 2, tq) for tp, tq in wide if tp >= 2] + [(1, 64)]
                    for full in fulls:
                        for tp, tq in shapes:
                            tiles.append({**base, "tile_p": tp, "tile_q": tq, "full_kh": full})
        reasons: list[str] = []
        for cand in tiles:
            cand = {k: v for k, v in cand.items() if k in self.tiles}
            cand.update(fixed or {})  # forced tiles hold; the loop finds the rest around them
            if any(k not in cand for k in self.tiles if k != "min_blocks"):
                continue
            if any(v not in self.tiles[k] for k, v in cand.items()):
                continue
            lay = self.layout(spec, {**cand, "min_blocks": 1})
            if cand.get("async_x") and not lay["XASYNC"]:
                cand["async_x"] = 0  # register-staged input (16-bit words, or weights per stage)
            # Two blocks per SM (one storing while the other computes) when registers allow
            # it without spilling: 65536 registers / (2 * 256 threads) = 128 per thread.
            regs = lay["ACC_PER_THREAD"] + lay["PREFETCH_WORDS"] + REG_OVERHEAD
            if spec.dtype == "float32" and spec.math == "ieee":
                regs += lay["MT"] * 4
            if regs > 240:  # would spill even alone on the SM
                reasons.append(f"about {regs} registers a thread for {lay['ACC_PER_THREAD']} accumulators "
                               f"and {lay['PREFETCH_WORDS']} prefetch words")
                continue
            fits2 = 2 * (lay["SMEM_BYTES"] + 1024) <= device.smem_sm and regs * lay["NTH"] * 2 <= device.regs_sm
            if "min_blocks" not in cand:  # else as measured
                cand["min_blocks"] = 2 if fits2 else 1
            try:
                self.check_tiles(spec, cand, device)
            except Unsupported as exc:
                reasons.append(str(exc))
                continue
            return cand
        raise Unsupported(no_fit(fixed, reasons))


_COMMON = dict(device="cuda", layouts=("nchw",), dtypes=("float32", "float16", "bfloat16"), tf32=True, engine="mma",
               epilogue=True, scale=True)

pointwise = GemmFamily(
    name="pointwise", template="cuda/pointwise.cu.j2", flat=True,
    tiles={"block_m": (32, 64, 128), "block_n": (32, 64, 128, 256), "block_k": (8, 16, 32, 64, 128),
           "warps_m": (1, 2, 4), "warps_n": (1, 2, 4, 8), "min_blocks": (1, 2), "stage_out": (0, 1),
           "async_x": (0, 1, 2)},
    **_COMMON,
)

igemm = GemmFamily(
    name="igemm", template="cuda/igemm.cu.j2", row_tile=8,
    tiles={"block_m": (32, 64, 128), "tile_p": (1, 2, 4, 8, 16), "tile_q": (8, 16, 32, 64, 128),
           "block_k": (8, 16, 32, 64), "full_kh": (0, 1), "warps_m": (1, 2, 4), "warps_n": (1, 2, 4, 8),
           "min_blocks": (1, 2), "stage_out": (0, 1), "async_x": (0, 1, 2), "pack_k": (0, 1)},
    **_COMMON,
)

FAMILIES = (pointwise, igemm)
