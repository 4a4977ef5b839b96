"""`wgmma`: dense and grouped convolution in NCHW on Hopper's warpgroup MMA (sm_90a).

Per image and group, the implicit GEMM D[COUT_G x pixels] = W[COUT_G x K] . im2col[K x pixels]
runs as `wgmma.mma_async` with both operands read by the tensor cores straight from shared
memory (templates/cuda/wgmma.cu.j2): TF32 for float32 when TF32 is allowed, bf16/fp16 with
float32 accumulation. Strict float32 runs 3xTF32: each operand is staged as a pair of TF32
values (its rounding, and the rounding of the rest), and each k-step issues three wgmmas
(small.big + big.small + big.big), about float32's accuracy (~5e-7 relative on the cases)
at three times TF32's tensor work and twice its shared memory; over reductions longer than
FLUSH_K each stage sums apart and is added to the total with round-to-nearest adds.

A block is BLOCK_M output channels (one warpgroup of 128 threads per 64) x a TILE_P x TILE_Q
patch of output pixels; each warpgroup issues one m64 x TILE_Q wgmma per output row and k-step.
The input halo sits in shared memory as 16-byte rows of CPV consecutive channels (4 float32,
8 bf16/fp16) per pixel, so the im2col operand of kernel tap (r, s) is a descriptor into the
halo moved by (r, s) pixels: no im2col copy. That needs a column stride of 1.

A stage holds BLOCK_K input channels and all kernel rows (full_kh=1) or one; stages run
through a ring of `nbuf` shared-memory slots, `nbuf - 2` ahead of the MMAs. When one stage
covers the whole reduction the weights stay resident (a block keeps one group and m-block
and strides over its pixel tiles) and the ring holds only input halos. The weights are
repacked once per call into the workspace, in shared-memory order and TF32-rounded (3xTF32:
both halves, each stage's pair contiguous), so a stage copies them with 16-byte cp.async or,
under a producer warpgroup, one bulk copy.

The block may also be warp-specialised (tile `ws=1`): a third warpgroup, the producer,
stages every stage's input into the ring (and, when the weights are not resident, starts the
stage's weight copy on the bulk-copy engine) and hands each slot over through mbarriers,
while the consumer warpgroups only issue MMAs and store; no block-wide barrier stands in the
main loop. With one stage per tile the consumers start half a tile apart, so one's MMAs run
under the other's epilogue. Where a consumer's accumulators outgrow the launch's even share
of registers (1 x 256 tiles), the producer gives some back (setmaxnreg). One-row tiles of one
stage (16-bit, and TF32 with its weights in the consumers' registers) also build a kernel that
writes whole 128-byte lines: the launch deals blocks whole output rows, and each channel's row
carries its unfinished last line from one tile to the next (measured: docs/selection.md,
wgmma). A tuner may give a consumer two sets of accumulators (tile `acc2=1`), so
that its next tile's MMAs run under this tile's epilogue.

Layout constants come from `layout()`, the one place `check_tiles` and the template take
them from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, no_fit, staged_row, target

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

# Registers a thread may need: accumulators + staged input rows + this much for addresses (the
# ws producer 16 more: case 56 bf16's, with both of its input paths, spilled with 128 and not
# with 136).
REG_OVERHEAD = 48
# The ws producer's group path beside its groups: addresses, cursor and loop state; with several
# stages a tile STAGE_REGS more (the stage's weight copy, the stage within the tile: case 56
# TF32's two sets spilled 40 bytes with 128 registers, none with 152).
GROUP_REGS = 32
STAGE_REGS = 24
# A strip's producer walks rows, not tiles (its cursor keeps the tile, the row within it and its new
# rows): two sets of groups spilled 68 bytes with 96 registers and none with 112 (case 63 TF32
# with acc2, ptxas), where the register split makes the estimate binding.
STRIP_REGS = 16
MAX_REGS = 255
REG_FILE = 65536  # 32-bit registers per SM
# 3xTF32 over a reduction longer than this sums each stage apart (FLUSH): wgmma accumulates by
# truncation, up to 2^-23 of the running sum lost per wgmma, three wgmmas per k-step of 8; 256 is
# 96 truncations, a few 1e-6 at most (measured: docs/selection.md, wgmma).
FLUSH_K = 256
# float32 reductions from this long (TF32, strict) up to 512 that do not fit one stage try a
# producer warpgroup first (default_tiles): where it began to win (TF32 from 216; 3xTF32 lost at
# 216 and won from 288; measured: docs/selection.md, wgmma).
SHORT_WS_K = {"tf32": 216, "ieee": 256}
# strip=1: blocks of a band keep pace through a progress counter each, after the packed weights
# in the workspace; a grid of more blocks runs unpaced.
MAXPROG = 1024


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WgmmaFamily(Family):
    def layout(self, spec: "ConvSpec", tiles: Mapping[str, int] | None = None) -> dict[str, object]:
        """Derived compile-time constants (UPPERCASE, as the template receives them)."""
        t = dict(spec.tiles if tiles is None else tiles)
        (kh, kw), (sh, _sw), (dh, dw) = spec.kernel_size, spec.stride, spec.dilation
        cpv = 4 if spec.dtype == "float32" else 8  # channels per 16-byte shared-memory row
        bm, tp, tq, ck = t["block_m"], t["tile_p"], t["tile_q"], t["block_k"]
        kr = kh if t["full_kh"] else 1
        nch = ck // cpv
        cch = _ceil(spec.cin_per_group, ck)
        spt = cch * (kh // kr)
        mb = _ceil(spec.cout_per_group, bm)
        wres = spt == 1  # blocks keep one (group, m-block): its weights stay resident
        xr = (tp - 1) * sh + (kr - 1) * dh + 1
        xq = tq + (kw - 1) * dw
        xvec = nch * xr * xq
        wvec = kr * kw * nch * bm
        nbuf = t["nbuf"]
        # Strict float32: 3xTF32 (SPLIT3), every operand staged twice (its TF32 rounding and the
        # rounding of the rest); over reductions longer than FLUSH_K, per-stage partial sums.
        split = spec.dtype == "float32" and spec.math == "ieee"
        nspl = 2 if split else 1
        k_total = spec.cin_per_group * kh * kw
        flush = split and spt > 1 and k_total > FLUSH_K
        # a_regs (float32, resident weights): weights live in the consumers' registers as wgmma A
        # fragments (4 a k-step): TF32 all of them, 3xTF32 the small ones (the big ones stay in
        # shared memory).
        areg = bool(t.get("a_regs", 0))
        nks = kr * kw * nch // 2  # wgmma k-steps a stage
        # strip=1: blocks walk down 128-column strips and the ring's slots hold input rows (one
        # each), so that a strip's next tile loads SH new rows, not its whole halo.
        strip = bool(t.get("strip", 0))
        slot = nch * xq if strip else nspl * ((0 if wres else wvec) + xvec)
        smem = 16 * (((nspl - 1 if areg else nspl) * wvec if wres else 0) + nbuf * slot)
        ws = bool(t.get("ws", 0))  # warp-specialised: one producer warpgroup stages the input
        ncon = 128 * (bm // 64)  # consumer threads: one warpgroup per 64 output channels
        nth = ncon + (128 if ws else 0)
        ntp = 128 if ws else nth  # threads that stage the input
        xpt = _ceil(xvec, ntp)
        # Staged epilogue (stage_out=1): per warp 16 rows (channels) of one output row, or of
        # all TP output rows with overlap=1 (they leave under the next tile's MMAs).
        overlap = bool(t.get("overlap", 0))
        esz = 4 if spec.dtype == "float32" else 2
        # One-row tiles of one stage under a producer also get a kernel that writes whole 128-byte
        # lines (LINES: each row carries its unfinished last line to the row's next tile), so their
        # staging rows hold a line's shift, not a chunk's: 16-bit, and float32 with its weights in
        # registers (their shared memory is what makes room for 168-element rows).
        lines = (bool(t.get("stage_out", 0)) and ws and wres and tp == 1 and not overlap and not strip
                 and (esz == 2 or (areg and not split)))
        esrs = staged_row(tq + (128 - 16) // esz if lines else tq, esz)
        epi = (ncon // 32) * (tp if overlap else 1) * 16 * esrs * esz if t.get("stage_out", 0) else 0
        # ws with several stages a tile stages its output in the ring instead (RSTAGE): each
        # consumer warpgroup in the slot of one of the tile's last stages, held until it is out.
        rstage = bool(epi) and ws and not wres and spt >= bm // 64 and 4 * 16 * esrs * esz <= 16 * slot
        if rstage:
            epi = 0
        smem += epi + (16 * nbuf if ws else 0)  # ws: a full and an empty mbarrier per ring slot
        xasync = bool(t.get("async_x", 0)) and spec.dtype == "float32"  # no prefetch registers
        # Registers a thread may need: accumulators, staged input rows, each row's offset (one
        # stage per tile), and REG_OVERHEAD for addresses. ws: the producer holds the rows (4 * cpv
        # per group of cpv columns, x_groups; or two sets of rows, 16-bit unaligned) and offsets,
        # a consumer the accumulators.
        # acc2=1 (one stage a tile under a producer): two sets, the next tile's MMAs run under this
        # tile's epilogue.
        acc2 = bool(t.get("acc2", 0))
        acc = tp * tq // 2 * (2 if flush or acc2 else 1) + (4 * nks if areg else 0)  # (and the A fragments)
        xsets = 1
        if ws:
            # The producer's two input paths: 16-byte groups (4 * cpv registers per group of cpv
            # columns, x_groups; two sets where they fit: 16-bit with one stage per tile, float32
            # with several) and rows (two sets of rows for 16-bit), both with each row's offset
            # when a tile takes one stage. With TF32 weights in the consumers' registers the group
            # path is estimated as what it needs, GROUP_REGS beside its groups and offsets (ptxas,
            # case 63: 64 group registers and 26 offsets; 112 registers spilled 80 bytes, 128
            # none), which leaves the consumers their 184. Elsewhere the estimate stays the larger
            # one it was measured with: it also decides which tiles fit, and the smaller one let
            # 24->128 3x1 TF32 take the producer, which lost (measured: docs/selection.md, wgmma).
            lxr = 1 if strip else xr  # input rows a load covers
            xg = _ceil(nch * lxr * _ceil(xq, cpv), ntp)
            rows = 0 if xasync else 8 * xpt
            offs = 2 * _ceil(nch * lxr * xq, ntp) if wres else 0
            beside = offs + REG_OVERHEAD + 16  # offsets and addresses
            if wres and areg and not split:
                prod = max(4 * cpv * xg + GROUP_REGS + offs, rows + beside)
            else:
                prod = max(4 * cpv * xg, rows) + beside
            share = REG_FILE // nth // 8 * 8
            # Two sets where they gained (measured: docs/selection.md, wgmma): 16-bit one-stage
            # tiles and float32 one-row tiles over several stages; not float32 one-stage tiles,
            # float32 two-row tiles, or 16-bit over several stages (its producer short of registers).
            two = 8 * cpv * xg + GROUP_REGS + (0 if wres else STAGE_REGS) + (STRIP_REGS if strip else 0)
            if two <= share and ((cpv == 8 or strip) if wres else (xasync and tp == 1)):
                xsets = 2
                prod = max(two, rows + beside)
            regs, pregs, cregs = max(acc + REG_OVERHEAD, prod), 0, 0
            if nth * regs > REG_FILE:
                # setmaxnreg: the producer keeps what it needs, the consumers share the rest of the
                # launch's registers (each thread's even share, in multiples of 8). Only that way
                # round: ptxas refuses a producer "decrease" above the kernel's own count.
                pregs = max(24, 8 * _ceil(prod, 8))
                cregs = min(MAX_REGS + 1, (nth * share - 128 * pregs) // ncon // 8 * 8)
                if pregs < share and acc + REG_OVERHEAD <= cregs:
                    regs = acc + REG_OVERHEAD
                else:
                    pregs = cregs = 0  # no split helps: `regs` stays over the budget
        else:
            regs = acc + (0 if xasync else 4 * xpt) + (2 * xpt if wres else 0) + REG_OVERHEAD
            pregs = cregs = 0
        return {
            "CPV": cpv, "BM": bm, "NWG": bm // 64, "NTH": nth, "WS": ws, "NTP": ntp, "TP": tp, "TQ": tq, "CK": ck,
            "NCH": nch, "KR": kr, "RSTAGES": kh // kr, "SPT": spt, "MB": mb, "WRES": wres, "XR": xr, "XQ": xq,
            "XVEC": xvec, "WVEC": wvec, "NBUF": nbuf, "STAGE_OUT": bool(t.get("stage_out", 0)), "ESRS": esrs,
            "XASYNC": xasync, "XSETS": xsets, "OVERLAP": overlap, "SPLIT3": split, "FLUSH": flush, "AREG": areg,
            "EPI_BYTES": epi, "RSTAGE": rstage, "LINES": lines, "STRIP": strip, "ACC2": acc2, "SMEM_BYTES": smem,
            "MINB": t["min_blocks"], "PREGS": pregs, "CREGS": cregs,
            "PACKED_BYTES": 16 * spec.groups * mb * spt * nspl * wvec,  # kept with the weight
            "WORKSPACE_BYTES": 4 * MAXPROG if strip else 0,  # the call's strip progress counters
            "MAXPROG": MAXPROG,
            # per thread (ws with a register split: a consumer's, within CREGS)
            "REGS": regs,
        }

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        lay = self.layout(spec)
        return {k: v for k, v in lay.items() if k != "REGS"}

    # -- what can be served --------------------------------------------------------
    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        if spec.stride[1] != 1:
            raise Unsupported(f"wgmma needs a column stride of 1 (got stride {spec.stride}); use igemm")
        if spec.out_channels * spec.cin_per_group * spec.kernel_size[0] * spec.kernel_size[1] >= 2**31:
            raise Unsupported("weights with 2^31 or more elements")
        if spec.tiles:
            self.check_tiles(spec, dict(spec.tiles), device)

    def check_tiles(self, spec: "ConvSpec", t: Mapping[str, int], device: "Device") -> None:
        """Raise Unsupported if tiles `t` cannot compute `spec` (shared memory, registers)."""
        lay = self.layout(spec, t)
        cpv = lay["CPV"]
        if t["block_k"] % (2 * cpv):
            raise Unsupported(f"block_k={t['block_k']} must be a multiple of {2 * cpv} for {spec.dtype} "
                              f"(one wgmma k-step: two 16-byte chunks)")
        if spec.kernel_size[0] % lay["KR"]:
            raise Unsupported("kernel rows per stage must divide the kernel height")
        if lay["CREGS"] and t["min_blocks"] > 1:
            raise Unsupported("a ws register split (setmaxnreg) needs min_blocks=1")
        if lay["AREG"] and not (spec.dtype == "float32" and lay["WRES"]):
            raise Unsupported("a_regs=1 needs float32 with the whole reduction in one stage "
                              "(block_k covering the input channels of a group, full_kh=1)")
        if lay["STRIP"] and not (lay["WS"] and lay["WRES"] and t["tile_p"] == 1 and spec.dtype == "float32"
                                 and not lay["SPLIT3"] and lay["XASYNC"]):
            raise Unsupported("strip=1 needs TF32 one-row tiles of one stage under a producer (ws=1, tile_p=1, "
                              "async_x=1, block_k covering the input channels of a group, full_kh=1)")
        # A strip's producer hands a cp.async row over only once the next row's copies are issued
        # into a free slot: the ring holds the rows a consumer keeps while it waits, and one more.
        # Those are a tile's, or with acc2 two tiles' (the next one's new rows all XR at an image's top).
        keep = lay["XR"] * (2 if lay["ACC2"] else 1)
        if lay["STRIP"] and t["nbuf"] <= keep:
            raise Unsupported(f"strip=1{' with acc2=1' if lay['ACC2'] else ''} needs a ring slot for each of "
                              f"{keep} input rows and one more (nbuf > {keep})")
        if lay["ACC2"] and not (lay["WS"] and lay["SPT"] == 1 and not lay["FLUSH"]):
            raise Unsupported("acc2=1 needs one stage a tile under a producer (ws=1, block_k covering the input "
                              "channels of a group, full_kh=1)")
        if lay["WS"] and lay["OVERLAP"]:
            raise Unsupported("ws=1 and overlap=1 are exclusive")
        if lay["OVERLAP"] and not (lay["WRES"] and lay["STAGE_OUT"]):
            raise Unsupported("overlap=1 needs stage_out=1 and the whole reduction in one stage (block_k "
                              "covering the input channels of a group, full_kh=1)")
        if t["tile_p"] * t["tile_q"] > 256:
            raise Unsupported(f"a {t['tile_p']}x{t['tile_q']} pixel tile holds more than 128 accumulators "
                              f"per thread")
        if lay["XR"] * lay["XQ"] * 16 >= 1 << 18:
            raise Unsupported("the input halo is too large for a wgmma descriptor offset")
        if lay["SMEM_BYTES"] > device.smem_block:
            raise Unsupported(f"tiles need {lay['SMEM_BYTES']} bytes of shared memory (> {device.smem_block}); "
                              f"shrink block_k, nbuf or the pixel tile")
        if t["min_blocks"] * (lay["SMEM_BYTES"] + 1024) > device.smem_sm:
            raise Unsupported(f"min_blocks={t['min_blocks']} blocks of {lay['SMEM_BYTES']} bytes of shared "
                              f"memory do not fit one SM")
        if lay["REGS"] > MAX_REGS or (not lay["CREGS"] and t["min_blocks"] * lay["NTH"] * lay["REGS"] > REG_FILE):
            raise Unsupported(f"tiles need about {lay['REGS']} registers per thread; shrink the pixel tile "
                              f"or block_k")

    # -- heuristics -------------------------------------------------------------------
    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Tiles for a problem shape (measured: docs/selection.md, wgmma).

        - Only on sm_90a (wgmma is Hopper's); elsewhere this family declines.
        - block_m: 128 (two warpgroups sharing every staged input row) above 64 output
          channels per group, else 64.
        - tile_q: 128 output columns (the wgmma N), 64 for rows of 64 or fewer.
        - The reduction: first the whole of CIN_G and all kernel rows in one stage (weights
          resident, blocks persistent over tiles: the memory-bound 1x1 and small-CIN k x k
          cases) in 4 or 3 ring slots; else two k-steps of channels (16 float32 / 32 bf16)
          per stage in 3 slots; else one k-step (8 / 16) in 4 or 3 slots. Each with all
          kernel rows if they fit, else one kernel row per stage (5x7 weights for 16
          float32 channels are 286 KB).
        - tile_p x tile_q: long reductions first try 1 x 256 (one m64n256 wgmma per weight
          k-step) where 256-column tiles waste no more of a row than 128-column ones; then 2
          output rows (256 pixels: each staged weight feeds twice the MMAs), else 1.
        - stage_out: the staged epilogue first for short reductions (memory-bound), last for
          long ones; async_x=1 (cp.async input) for float32.
        - ws (warp specialisation): first for short reductions held in one stage, with
          1-row tiles and the deepest ring that fits (6 slots down to 3): a producer
          warpgroup stages the input while the two consumer warpgroups' MMAs and stores run
          half a tile apart. Long reductions try it first too, in the same shapes as
          without: the producer also starts each stage's weight copy and runs up to two
          stages ahead, with no block-wide barrier (a 1 x 256 tile's 128 accumulators a
          consumer thread take the producer's spare registers, setmaxnreg). There the staged
          epilogue comes first where it can stage in the ring (RSTAGE: each consumer
          warpgroup in the slot of one of the tile's last stages).
        - float32 reductions of SHORT_WS_K (TF32 216, strict 256) to 511 that do not fit one
          stage (24-56 channels 3x3, 8 channels 7x7, 16 channels 5x5 or 5x3) take the producer
          too, over several stages a tile: two-row tiles first, but one-row ones for 128 output
          channels whose stages hold two k-steps or more and whose input rows take 4-byte
          copies (a padding or width that is not a multiple of 4). 16-bit keeps its order (one
          stage without a producer where it fits).
        - Strict float32 (3xTF32) takes the same order; its operand pairs fill shared memory
          twice as fast, and its per-stage partial sums double a long reduction's
          accumulators (no 1 x 256 or 2 x 128 tiles there). Short reductions (one stage a
          tile) first keep the small weights in the consumers' registers (a_regs=1), then try
          64-column producer tiles, staged and then stored from the fragments.
        - TF32 keeps its weights in shared memory by default. A tuner may force a_regs=1 on
          one-stage tiles: all weights in the consumers' registers as wgmma A fragments (4
          registers a k-step), which frees their shared memory for the whole-line epilogue's
          longer staging rows (LINES); it paid on case 63, not on smaller layers.
        - strip (TF32 reductions under SHORT_WS_K, a kernel taller than its row stride): first, in the
          deepest ring of input rows that fits (10 slots down to 3, more than a tile's rows: the
          producer hands a row over once the next one's copies are in a free slot): blocks walk down
          128-column strips of a band of rows and each tile loads only its new input rows (one
          at stride 1, not its whole halo), so the producer keeps up and looks further ahead.
          Where output rows do not start on 32-byte sectors the band's blocks keep pace
          (strip_pace in the template). Only narrow rows that do not start on sectors lost, so
          those keep row order unless a row is 8 strips or more.
        - acc2: a consumer keeps two sets of accumulators and issues its next tile's MMAs before
          it stores this one (and, on paced strips, before it waits for its band). By default only
          for 3xTF32 with its weights in registers (a_regs=1), 128 output channels a block, 64-column
          tiles of rows wider than 64 and a kernel of several taps: there a tile's three-fold MMAs
          run under the epilogue of the tile before it; outside that rule it lost.
          The loop keeps each set in fixed registers by taking two tiles a turn, which doubles the
          epilogue's code, and the second set costs the producer registers. A tuner may force it
          anywhere it fits.
        - overlap: never by default (even or slower on case 63). It stages all of a tile's rows
          and stores them under the next tile's MMAs. A tuner may force it (one stage per tile
          and stage_out=1 only).
        The first candidate that passes check_tiles wins.
        """
        device = target(problem.device)
        if spec.dtype not in self.dtypes:  # the selector asks for tiles before the family's check
            raise Unsupported(f"wgmma does not serve dtype {spec.dtype}")
        cpv = 4 if spec.dtype == "float32" else 8
        kstep = 2 * cpv
        split = spec.dtype == "float32" and spec.math == "ieee"  # 3xTF32: twice the shared memory
        bm = 128 if spec.cout_per_group > 64 else 64
        tq = 128 if problem.Q > 64 else 64
        full_ck = _ceil(spec.cin_per_group, kstep) * kstep
        # (channels per stage, all kernel rows?, ring slots to try)
        reductions = [(full_ck, 1, (4, 3))]
        reductions += [(2 * kstep, full, (3,)) for full in (1, 0) if 2 * kstep < full_ck]
        reductions += [(kstep, full, (4, 3)) for full in (1, 0) if kstep < full_ck or full == 0]
        # Short reductions are memory-bound: the staged epilogue first, whatever the rest costs.
        # Long ones are compute-bound and keep their ring slots (measured: docs/selection.md, wgmma).
        k_total = spec.cin_per_group * spec.kernel_size[0] * spec.kernel_size[1]
        # Pixel tiles (rows, columns). Compute-bound ones try a whole 256-column row first where
        # rows are wide enough that 256-column tiles waste no more of a row than 128-column ones:
        # one m64n256 wgmma reads a stage's weights once for 256 pixels, not twice (measured on
        # case 56: docs/selection.md, wgmma).
        pixels = [(2, tq), (1, tq)]
        if k_total >= 512 and problem.Q > 128 and _ceil(problem.Q, 256) * 256 <= _ceil(problem.Q, 128) * 128:
            pixels.insert(0, (1, 256))
        shapes = [(r, tp, tqs, nb) for r in reductions for tp, tqs in pixels for nb in r[2]]
        # Candidates: (stage_out, ws, reduction, tile_p, tile_q, nbuf, a_regs, strip).
        if k_total < 512:
            order = [(1, 1, reductions[0], 1, tq, nb, 0, 0) for nb in (6, 5, 4, 3)]
            kh, dh, sh = spec.kernel_size[0], spec.dilation[0], spec.stride[0]
            qt = _ceil(problem.Q, tq)
            if (spec.dtype == "float32" and not split and k_total < SHORT_WS_K["tf32"] and (kh - 1) * dh + 1 > sh
                    and (problem.Q % 8 == 0 or qt >= 8)):
                # Strips (strip=1) first where a tile shares input rows with the one above it, and
                # the output rows start on 32-byte sectors or are wide (see the docstring).
                order = [(1, 1, reductions[0], 1, tq, nb, 0, 1) for nb in (10, 8, 6, 5, 4, 3)] + order
            if split:
                # The resident weight pair leaves less room: the small weights in registers first,
                # then 64-column tiles, stored from the fragments last.
                order = [(1, 1, reductions[0], 1, tqs, nb, 1, 0) for tqs in (tq, 64) for nb in (6, 5, 4, 3)] + order
                order += [(so, 1, reductions[0], 1, 64, nb, 0, 0) for so in (1, 0) for nb in (6, 5, 4, 3)]
            if spec.dtype == "float32" and k_total >= SHORT_WS_K[spec.math]:
                # float32 that does not fit one stage: a producer warpgroup first, as for long
                # reductions; one-row tiles first only where two consumer warpgroups share a tile,
                # a stage holds two k-steps or more, and the input rows do not start and end on 16
                # bytes (the producer's 4-byte copies, two stages in flight). Every reduction's
                # preferred tile shape comes before any reduction's other one (measured on 16->128
                # 3x5 TF32: docs/selection.md, wgmma).
                xgroup = spec.padding[1] % cpv == 0 and problem.W % cpv == 0  # the launch's pr.xgroup
                pref = {r: pixels if bm == 64 or xgroup or r[0] <= kstep else pixels[::-1] for r in reductions}
                order += [(so, 1, r, *pref[r][i], nb, 0, 0) for so in (1, 0) for i in (0, 1) for r in reductions
                          for nb in r[2]]
            order += [(so, 0, *shape, 0, 0) for so in (1, 0) for shape in shapes]
        else:
            order = [(so, 1, *shape, 0, 0) for so in (1, 0) for shape in shapes]
            order += [(so, 0, *shape, 0, 0) for shape in shapes for so in (0, 1)]
        forced_ws = (fixed or {}).get("ws")
        reasons: list[str] = []
        for stage, ws, (ck, full, _slots), tp, tqs, nbuf, areg, strip in order:
            if ck > 128 or (k_total >= 512 and ws and forced_ws == 0):
                continue  # (a caller who forces ws=0 gets the order without a producer)
            cand = {"block_m": bm, "tile_p": tp, "tile_q": tqs, "block_k": ck, "full_kh": full, "nbuf": nbuf,
                    "min_blocks": 1, "stage_out": stage, "async_x": int(spec.dtype == "float32"),
                    "overlap": 0, "ws": ws, "a_regs": areg, "strip": strip, **(fixed or {})}
            try:
                self.check_tiles(spec, cand, device)
            except Unsupported as exc:
                reasons.append(str(exc))
                continue
            if (k_total >= 512 and cand["ws"] and cand["stage_out"] and "stage_out" not in (fixed or {})
                    and not self.layout(spec, cand)["RSTAGE"]):
                continue  # long ws reductions: staged output measured only when staged in the ring
            if (split and cand["a_regs"] and cand["block_m"] == 128 and cand["tile_q"] == 64 and problem.Q > 64
                    and spec.kernel_size[0] * spec.kernel_size[1] > 1 and "acc2" not in (fixed or {})):
                # 3xTF32 with its weights in registers, 128 channels over 64-column tiles of a kernel
                # of several taps: the same tile with two accumulator sets, where they fit.
                try:
                    self.check_tiles(spec, {**cand, "acc2": 1}, device)
                    return {**cand, "acc2": 1}
                except Unsupported:
                    pass
            return cand
        raise Unsupported(no_fit(fixed, reasons))


wgmma = WgmmaFamily(
    name="wgmma", template="cuda/wgmma.cu.j2", device="cuda", layouts=("nchw",), archs=("sm_90a",),
    dtypes=("float32", "float16", "bfloat16"), tf32=True, engine="wgmma", row_tile=64, epilogue=True,
    scale=True,
    tiles={"block_m": (64, 128), "tile_p": (1, 2, 4), "tile_q": (64, 128, 256),
           "block_k": tuple(range(8, 129, 8)), "full_kh": (0, 1), "nbuf": tuple(range(3, 17)),
           "min_blocks": (1, 2), "stage_out": (0, 1), "async_x": (0, 1), "overlap": (0, 1), "ws": (0, 1),
           "a_regs": (0, 1), "strip": (0, 1), "acc2": (0, 1)},
)

FAMILIES = (wgmma,)
