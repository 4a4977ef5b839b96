"""A forward convolution bound by its reduction: few output pixels, each a long sum, split between blocks.

That is the shape of a lowered weight gradient (kernelgen/gradients.py: the input as (Cg, G*N, H, W),
dY as the kernel (O, N, P, Q)): Cg x KH x KW output pixels of O channels, each a sum of N x P x Q
terms (16 million for KernelBench's case 87). The families that give each tile its whole reduction
run such a layer as a handful of blocks; this one splits the reduction into `splits` ranges of
k-steps, one block each per output tile, and adds the ranges' float32 (float64) partial sums with
a second kernel in a fixed order, so a call's bits never change from run to run.

GEMM view, per group: rows = output pixels (batch x P x Q), columns = the group's output channels,
reduction = (input channel, tap row, tap column). Both operands are read through the call's
strides (layout 'any'), with the lanes of a warp along whichever index of each operand lies
closest in memory (the reduction's columns for NCHW tensors, the rows' batch or dY's channels for
channels_last ones), decided per launch. Where those rows (columns) lie one element apart from a
16-byte boundary, a batch (dY's channels of a group) a whole number of 16-byte runs and every other
stride a multiple of one, a thread loads a run of 16 / element-size rows for one k at once
(p.a_vec, p.b_vec: the launch decides each operand from its pointer, strides and sizes; elsewhere
element by element, the same staged values). Tensor cores (mma.sync) for TF32 and 16-bit, FFMA for
strict float32, DFMA for float64. The fused epilogue (scale, bias, residual, activation) is applied
where the splits' sums are added, the one place the output is written.

Depthwise mode (tiles dw_rows > 0, groups_block > 0): a depthwise weight gradient lowers to 9 rows
and one column a group, which a GEMM tile leaves ~99% idle; here a block takes groups_block
consecutive groups x up to dw_rows rows over one split, each thread summing rows x multiplier
outputs in FFMA (DFMA) registers over its slice of the split's terms, then a fixed-order block
reduction into the same workspace, which the same final kernel adds.
Whether it should run a call is the selector's to decide (costmodel.py, docs/selection.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, no_fit, target

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem

BK = 32  # reduction terms a k-step stages
NTH = 256  # threads a block
MIN_CHUNK = 2048  # terms a split sums at least (its staging and partial sums amortised)
BLOCKS_PER_SM = 2  # what the splits aim to fill: two blocks an SM
# The splits' partial sums that default_tiles allows a call (the workspace grows with them).
WORKSPACE_CAP = 256 << 20
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Depthwise mode (dw_rows > 0): a block takes groups_block consecutive groups x up to dw_rows rows
# (all of a depthwise weight gradient's KH x KW x Cg) over one split, FFMA (DFMA) in registers.
DW_ROWS = (0, 1, 2, 4, 9, 16, 25, 36, 49)
GROUPS_BLOCK = (0, 32, 8)
DW_COUT_MAX = 4  # output channels a group the mode serves (a depthwise multiplier)
DW_CH = 8  # accumulators a thread hands to the block's reduction at a time


def _acc_bytes(spec: "ConvSpec") -> int:
    return 8 if spec.dtype == "float64" else 4


def _esize(spec: "ConvSpec") -> int:
    return {"float64": 8, "float32": 4}.get(spec.dtype, 2)


def mma(spec: "ConvSpec") -> bool:
    """Whether the configuration multiplies on tensor cores (TF32, bf16, fp16)."""
    return spec.dtype in ("float16", "bfloat16") or (spec.dtype == "float32" and spec.math == "tf32")


def vector_runs(rows: int, esize: int) -> int:
    """Threads a k of the 16-byte load path: a tile's `rows` (block_m of A, block_n of B) in runs
    of 16 / esize consecutive rows (one 16-byte load each), up to 8 runs a k (a warp: 8 runs x 4 k,
    128 contiguous bytes a k where the tile's rows lie dense); fewer where the tile has fewer runs."""
    return min(rows * esize // 16, 8)


def skew(rows: int, esize: int) -> int:
    """Elements each group of 8 staged rows lies past the last, beyond its rows' LDK. Without it a
    16-byte load's run of rows stored one element a row (a k column) puts every run of a warp on
    the same banks (8 rows x 20 words of 16-bit elements are 160 words, a multiple of 32): 8-way
    conflicts in 16 bits, 4-way in float32. With 32 / runs elements (float64: 16 / runs) the runs
    a store instruction covers fall on disjoint banks, while a fragment's (or the scalar path's) 8
    rows share one group and keep their banks."""
    return (16 if esize == 8 else 32) // vector_runs(rows, esize)


def layout(spec: "ConvSpec", block_m: int, block_n: int) -> dict[str, int]:
    """The tile's constants, shared by the checks and the template: warps over rows and columns
    (MMA), the staged row's length, each tile's skew and the shared memory. A staged row of 4-byte
    elements is 36 words and of 2-byte ones 20: the eight rows of a fragment load fall on different
    banks."""
    warps_n = 4 if (block_m, block_n) == (64, 64) else 2
    es = _esize(spec)
    ldk = {8: BK + 2, 4: BK + 4, 2: BK + 8}[es]
    skew_a, skew_b = skew(block_m, es), skew(block_n, es)
    tiles = block_m * ldk + block_m // 8 * skew_a + block_n * ldk + block_n // 8 * skew_b
    smem = (3 * block_m + block_n) * 8 + 2 * tiles * es
    return {"WARPS_M": NTH // 32 // warps_n, "WARPS_N": warps_n, "LDK": ldk, "SKEW_A": skew_a, "SKEW_B": skew_b,
            "SMEM_BYTES": smem}


def dw_acc_max(spec: "ConvSpec") -> int:
    """Accumulators a thread of the depthwise mode may keep (rows x multiplier): 64 float32,
    32 float64 (two registers each), so that two blocks of 256 an SM do not spill."""
    return 32 if spec.dtype == "float64" else 64


def dw_layout(spec: "ConvSpec", dw_rows: int, groups_block: int) -> dict[str, int]:
    """The depthwise mode's constants: threads a group (slices of the reduction), accumulators a
    thread, and the shared memory (the rows' offsets, the terms' eight steps and the rows' bounds, then one round of the
    block's reduction)."""
    smem = 3 * dw_rows * 8 + 80 + NTH * DW_CH * _acc_bytes(spec)
    return {"DW_SLICES": NTH // groups_block, "DW_ACC": dw_rows * spec.cout_per_group, "DW_SMEM": smem}


def inner_fraction(spec: "ConvSpec", problem: "Problem") -> float:
    """The share of a lowered conv's terms (the forward's output pixels) at which every row's tap
    (the forward's KH x KW, problem.P x problem.Q) reads inside the input: the kernel's bounds-free
    path. Per axis: the taps pp (of spec's kernel, step the dilation) where the first row's window
    (-padding) and the last one's ((P - 1) x stride - padding) both land inside."""
    def axis(k, s, d, pad, rows, size):
        lo, hi = -pad, (rows - 1) * s - pad
        return sum(1 for pp in range(k) if lo + pp * d >= 0 and hi + pp * d < size) / k
    kh, kw = spec.kernel_size
    return (axis(kh, spec.stride[0], spec.dilation[0], spec.padding[0], problem.P, problem.H)
            * axis(kw, spec.stride[1], spec.dilation[1], spec.padding[2], problem.Q, problem.W))


def depthwise_mode(spec: "ConvSpec") -> bool:
    return dict(spec.tiles).get("dw_rows", 0) > 0


def reduction(spec: "ConvSpec") -> int:
    kh, kw = spec.kernel_size
    return spec.cin_per_group * kh * kw


DW_REACH = 1 << 30  # the depthwise mode's rows and columns: 32-bit ints (its launch refuses more)


def dw_reach_fits(spec: "ConvSpec", problem: "Problem") -> bool:
    """Whether the depthwise mode's 32-bit row and column indices hold the call: every window's
    first row (column), plus a tap's reach, plus the input's extent, under DW_REACH (what its
    launch checks, settled here, at plan time)."""
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel_size, spec.stride, spec.dilation
    top, _, left, _ = spec.padding
    reach_h = (problem.P - 1) * sh + top + (kh - 1) * dh + problem.H
    reach_w = (problem.Q - 1) * sw + left + (kw - 1) * dw + problem.W
    return reach_h < DW_REACH and reach_w < DW_REACH


@dataclass(frozen=True)
class WgradFamily(Family):
    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        t = dict(spec.tiles)
        dwr, gb = t.get("dw_rows", 0), t.get("groups_block", 0)
        if (dwr > 0) != (gb > 0):
            raise Unsupported(f"wgrad: the depthwise mode takes dw_rows and groups_block together "
                              f"(got dw_rows={dwr}, groups_block={gb})")
        if dwr:
            if spec.cout_per_group > DW_COUT_MAX:
                raise Unsupported(f"wgrad: the depthwise mode serves up to {DW_COUT_MAX} output channels a group, "
                                  f"not {spec.cout_per_group}")
            acc = dwr * spec.cout_per_group
            if acc > dw_acc_max(spec):
                raise Unsupported(f"wgrad: the depthwise mode keeps {dwr} rows x {spec.cout_per_group} output "
                                  f"channels = {acc} {spec.dtype} accumulators a thread; at most "
                                  f"{dw_acc_max(spec)} fit its registers")
            if (t["block_m"], t["block_n"]) != (64, 16):
                raise Unsupported("wgrad: the depthwise mode has no GEMM tile; its block_m and block_n are "
                                  "64 and 16")
            return
        lay = layout(spec, t["block_m"], t["block_n"])
        if mma(spec) and ((t["block_m"] // lay["WARPS_M"]) % 16 or (t["block_n"] // lay["WARPS_N"]) % 8):
            raise Unsupported(f"wgrad: a {t['block_m']} x {t['block_n']} tile does not split into whole MMA tiles "
                              f"over {lay['WARPS_M']} x {lay['WARPS_N']} warps")
        if lay["SMEM_BYTES"] > device.smem_block:
            raise Unsupported(f"wgrad: a {t['block_m']} x {t['block_n']} {spec.dtype} tile stages "
                              f"{lay['SMEM_BYTES']} bytes of shared memory; a block of {device.name} takes "
                              f"{device.smem_block}")

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        t = dict(spec.tiles)
        dwr, gb = t.get("dw_rows", 0), t.get("groups_block", 0)
        dw = dw_layout(spec, dwr, gb) if dwr else {"DW_SLICES": 0, "DW_ACC": 0, "DW_SMEM": 0}
        return {**layout(spec, t["block_m"], t["block_n"]), **dw, "DW_CH": DW_CH,
                "MMA": mma(spec) and not dwr, "BK": BK, "NTH": NTH,
                # each split's partial sums of every output element, in the accumulator's type
                "WORKSPACE_PER_OUTPUT": t["splits"] * _acc_bytes(spec)}

    @staticmethod
    def _tiles(spec: "ConvSpec", problem: "Problem", block_m: int, block_n: int) -> int:
        rows = problem.N * problem.P * problem.Q
        return -(-rows // block_m) * -(-spec.cout_per_group // block_n) * spec.groups

    @staticmethod
    def _dw_tiles(spec: "ConvSpec", problem: "Problem", dw_rows: int, groups_block: int) -> int:
        rows = problem.N * problem.P * problem.Q
        return -(-spec.groups // groups_block) * -(-rows // dw_rows)

    @staticmethod
    def _splits(spec: "ConvSpec", problem: "Problem", tiles: int) -> int:
        """The count of SPLITS that keeps MIN_CHUNK terms a split and the partial sums within
        WORKSPACE_CAP and runs the reduction in the fewest waves of two blocks an SM per unit of
        work (ceil(blocks / slots) / splits; the fewer splits on a tie)."""
        device = target(problem.device)
        slots = BLOCKS_PER_SM * device.sms
        outputs = problem.N * problem.P * problem.Q * spec.out_channels
        red = reduction(spec)
        allowed = [s for s in SPLITS if s == 1 or (red // s >= MIN_CHUNK
                                                   and s * outputs * _acc_bytes(spec) <= WORKSPACE_CAP)]
        return min(allowed, key=lambda s: (-(-tiles * s // slots) / s, s))

    @staticmethod
    def wants_depthwise(spec: "ConvSpec", problem: "Problem") -> bool:
        """The depthwise mode's layers: up to DW_COUT_MAX output channels a group (a GEMM tile's
        16 columns at most a quarter used) and all of a group's rows in one thread's registers."""
        rows = problem.N * problem.P * problem.Q
        return spec.cout_per_group <= DW_COUT_MAX and rows * spec.cout_per_group <= dw_acc_max(spec)

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """The mode first: depthwise (dw_rows, groups_block > 0) where wants_depthwise() holds and
        the forced tiles allow it (or force it), else the GEMM tile.

        GEMM: columns the narrowest tile of 16, 32 or 64 that holds the group's output channels
        (64 past that); rows 128 where that pads the rows no more than 64 would, else 64 (a tile
        that does not fit the GPU's shared memory falls back to 64).
        Depthwise: dw_rows the fewest of DW_ROWS that hold the rows (else the most the
        accumulators allow), groups_block 32 or 8, whichever runs fewer terms a thread over its
        waves (ceil(blocks / slots) x groups_block x terms a split; 32 on a tie).
        Splits (both): see _splits."""
        fixed = dict(fixed or {})
        device = target(problem.device)
        rows = max(problem.N * problem.P * problem.Q, 1)
        forced_dw = fixed.get("dw_rows", 0) > 0 or fixed.get("groups_block", 0) > 0
        forced_gemm = (fixed.get("dw_rows", 1) == 0 or fixed.get("groups_block", 1) == 0
                       or fixed.get("block_m", 64) != 64 or fixed.get("block_n", 16) != 16)
        if forced_dw and not dw_reach_fits(spec, problem):
            raise Unsupported(f"wgrad: the depthwise mode indexes the input's rows and columns in 32 bits "
                              f"(under {DW_REACH}); a {problem.H} x {problem.W} input reaches past that")
        if forced_dw or (not forced_gemm and spec.cout_per_group <= DW_COUT_MAX
                         and self.wants_depthwise(spec, problem) and dw_reach_fits(spec, problem)):
            out = self._default_dw(spec, problem, fixed, rows)
        else:
            out = self._default_gemm(spec, problem, fixed, rows, device)
        cand = spec.replace(family=self.name, tiles=tuple(out.items()))
        try:
            self.check_shape(cand, device)
        except Unsupported as exc:
            raise Unsupported(no_fit(fixed, [str(exc)])) from None
        return out

    def _default_gemm(self, spec, problem, fixed, rows, device) -> dict[str, int]:
        bn = fixed.get("block_n", next((v for v in (16, 32, 64) if spec.cout_per_group <= v), 64))
        if "block_m" in fixed:
            bm = fixed["block_m"]
        else:
            bm = 128 if -(-rows // 128) * 128 <= -(-rows // 64) * 64 else 64
            if layout(spec, bm, bn)["SMEM_BYTES"] * 2 > device.smem_sm:
                bm = 64
        splits = fixed["splits"] if "splits" in fixed else self._splits(spec, problem,
                                                                        self._tiles(spec, problem, bm, bn))
        return {"block_m": bm, "block_n": bn, "splits": splits,
                "dw_rows": fixed.get("dw_rows", 0), "groups_block": fixed.get("groups_block", 0)}

    def _default_dw(self, spec, problem, fixed, rows) -> dict[str, int]:
        cap = max(dw_acc_max(spec) // max(spec.cout_per_group, 1), 1)
        if "dw_rows" in fixed:
            dwr = fixed["dw_rows"]
        else:
            fits = [v for v in DW_ROWS if v and v <= cap]
            dwr = next((v for v in fits if v >= rows), fits[-1] if fits else 1)
        device = target(problem.device)
        slots = BLOCKS_PER_SM * device.sms
        red = reduction(spec)

        def plan(gb):
            splits = fixed["splits"] if "splits" in fixed else self._splits(
                spec, problem, self._dw_tiles(spec, problem, dwr, gb))
            blocks = self._dw_tiles(spec, problem, dwr, gb) * splits
            return -(-blocks // slots) * gb * -(-red // splits), splits

        gbs = [fixed["groups_block"]] if fixed.get("groups_block", 0) else [32, 8]
        gb = min(gbs, key=lambda v: (plan(v)[0], -v))
        return {"block_m": fixed.get("block_m", 64), "block_n": fixed.get("block_n", 16),
                "splits": plan(gb)[1], "dw_rows": dwr, "groups_block": gb}

    # -- the cost model's view (costmodel.py; the derivation is in docs/selection.md) ---------------
    def cost_class(self, spec: "ConvSpec") -> str:
        return "mma" if mma(spec) and not depthwise_mode(spec) else "fma"

    def tiles_of(self, spec: "ConvSpec", problem: "Problem") -> int:
        t = dict(spec.tiles)
        if depthwise_mode(spec):
            return self._dw_tiles(spec, problem, t["dw_rows"], t["groups_block"]) * t["splits"]
        return self._tiles(spec, problem, t["block_m"], t["block_n"]) * t["splits"]

    def work(self, spec: "ConvSpec", problem: "Problem") -> float:
        """Flops of the unit it multiplies on, issue slots included: whole tiles (rows to block_m,
        the group's columns to block_n) over whole k-steps, plus what its threads issue besides
        the products, converted to flops at the unit's rate per issue slot (a lane's share of the
        SM's four warp instructions a clock: 16 TF32 flops on Hopper, 32 16-bit, 2 FMA flops):
        LOAD_ISSUE slots for every staged element, and the shared loads feeding the MMA
        fragments (or the FMAs' operands). docs/selection.md has the arithmetic."""
        if depthwise_mode(spec):
            return self._dw_work(spec, problem)
        t = dict(spec.tiles)
        bm, bn, splits = t["block_m"], t["block_n"], t["splits"]
        ks = -(-reduction(spec) // BK)
        steps = float(-(-ks // splits) * splits)  # k-steps every split's block walks, summed
        tiles = self._tiles(spec, problem, bm, bn)
        macs = 2.0 * tiles * bm * bn * steps * BK
        device = target(problem.device)
        unit = "fma" if not mma(spec) else "f16" if spec.dtype in ("float16", "bfloat16") else "tf32"
        per_slot = device.peak_flops(unit) / (device.sms * device.clock_hz * 4 * 32)
        slots = (bm + bn) * BK * LOAD_ISSUE  # a k-step's staging, a block's lane slots
        lay = layout(spec, bm, bn)
        if mma(spec):
            k = 8 if spec.dtype == "float32" else 16
            mt, nt = bm // lay["WARPS_M"] // 16, bn // lay["WARPS_N"] // 8
            slots += NTH * (BK // k) * (4 * mt + 2 * nt)  # fragment loads, every lane of every warp
        else:
            rm = bm * bn // NTH // 4
            slots += NTH * BK * (rm + 4)  # each k: rm + 4 operand loads a thread for its rm x 4 FMAs
        return macs + tiles * steps * slots * per_slot

    def _dw_work(self, spec: "ConvSpec", problem: "Problem") -> float:
        """The depthwise mode's issue slots as FMA flops (2 a slot): every thread of every block
        walks its terms of the split (the groups padded to groups_block, the rows to dw_rows),
        each term DW_TERM_ISSUE slots (its decode and offsets), DW_LOAD_ISSUE a dY load for each
        output channel of the group, and for each row DW_ROW_FAST where every row's tap of the
        term lies inside the input (inner_fraction of the terms), else DW_ROW_ISSUE (its bounds
        tests too), plus one FFMA an output channel; then the block's reduction, two slots
        an accumulator of every thread and one a slice it adds. docs/selection.md has the
        arithmetic."""
        t = dict(spec.tiles)
        dwr, gb, splits = t["dw_rows"], t["groups_block"], t["splits"]
        mult = spec.cout_per_group
        blocks = self._dw_tiles(spec, problem, dwr, gb) * splits
        terms = -(-reduction(spec) // splits)  # a split's terms, every group of the block
        inner = inner_fraction(spec, problem)
        per_term = (DW_TERM_ISSUE + DW_INNER_ISSUE + DW_LOAD_ISSUE * mult
                    + dwr * (inner * DW_ROW_FAST + (1 - inner) * DW_ROW_ISSUE + mult))
        walk = float(blocks) * gb * terms * per_term
        acc = dwr * mult
        reduce = float(blocks) * (2 * NTH * acc + gb * acc * (NTH // gb))
        device = target(problem.device)
        per_slot = device.peak_flops("fma") / (device.sms * device.clock_hz * 4 * 32)
        return (walk + reduce) * per_slot

    def traffic(self, spec: "ConvSpec", problem: "Problem") -> float:
        """DRAM bytes: the input once and the weight once (the column tiles' re-reads of the input
        and the row tiles' of the weight come from L2 at a third of the cost), the partial sums
        written and read back, the output once. Depthwise mode: the passes over row chunks past
        the first re-read x and dY (from L2, a third)."""
        from ..spec import ELEMENT_BYTES

        t = dict(spec.tiles)
        e = ELEMENT_BYTES[spec.dtype]
        kh, kw = spec.kernel_size
        rows = problem.N * problem.P * problem.Q
        x = problem.N * spec.in_channels * problem.H * problem.W
        w = spec.out_channels * spec.cin_per_group * kh * kw
        y = rows * spec.out_channels
        if t.get("dw_rows", 0):  # depthwise: each pass of dw_rows rows reads the group's x and dY again
            passes = -(-rows // t["dw_rows"])
            rereads = (x + w) * (passes - 1) * e / 3.0
        else:
            col_tiles = -(-spec.cout_per_group // t["block_n"])
            row_tiles = -(-rows // t["block_m"])
            rereads = (x * (col_tiles - 1) + w * (row_tiles - 1)) * e / 3.0
        return float((x + w + y) * e + rereads + 2 * t["splits"] * y * _acc_bytes(spec))


# Issue slots a staged element takes from its thread: its k's offsets are shared by the thread's
# elements of a k-step, so per element the row's three shared loads, two adds, two bounds tests,
# the global load, the select and the shared store: about 10 (the B operand's fewer, counted alike).
LOAD_ISSUE = 10
# The depthwise mode's issue slots a thread (work), counted from its PTX (3x3, float32, 9 rows): a
# term's loop test and its steps to the next (two 64-bit offsets, a column and a row carry, each
# predicated: 22) and its dY base (3); the test whether every row's tap lies inside the input (8);
# a dY element's address and load (3); a row's 64-bit address (2) and load where the term is
# inside (3), else also its two 32-bit adds, the bounds tests and the branch (8); and an FFMA an
# output channel besides.
DW_TERM_ISSUE = 25
DW_INNER_ISSUE = 8
DW_LOAD_ISSUE = 3
DW_ROW_FAST = 3
DW_ROW_ISSUE = 8


wgrad = WgradFamily(
    name="wgrad", device="cuda", template="cuda/wgrad.cu.j2", layouts=("any",),
    dtypes=("float32", "float16", "bfloat16", "float64"),
    tiles={"block_m": (64, 128), "block_n": (64, 32, 16), "splits": SPLITS, "dw_rows": DW_ROWS,
           "groups_block": GROUPS_BLOCK},
    tf32=True, wide_weights=True, engine="mma", epilogue=True, scale=True,
)

FAMILIES = (wgrad,)
