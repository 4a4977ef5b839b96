"""CPU-tier tests of the `wgmma` family (Hopper warpgroup MMA): no GPU needed.

What they cover: which specs and targets it accepts (column stride 1, sm_90a), that its layout
constants agree with each other, that default tiles fit the SM, and (with nvcc) that the
rendered CUDA lowers to wgmma.mma_async with no spills and no serialised wgmma. Which family the
selector picks for a call is measured, not asserted here.
"""

from __future__ import annotations

import re

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import get_family
from kernelgen.families.wgmma import FLUSH_K
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("wgmma")
SMEM_BLOCK = nominal().smem_block  # the H100's (the H200's too)

# The KernelBench cases the family is for, and the two memory-bound ones it can also serve.
CASES = {
    "56": dict(x=(8, 64, 512, 256), w=(128, 64, 5, 7)),
    "63": dict(x=(16, 16, 1024, 1024), w=(128, 16, 3, 3)),
    "87": dict(x=(16, 64, 1024, 1024), w=(128, 64, 1, 1)),
}


def _choose(x, w, dtype="float32", math="tf32", stride=1, padding=0, groups=1, arch="sm_90a", family="wgmma",
            tiles=None, wide_dram=False):
    """The spec `family` (this one by default) runs an NCHW call with, on a nominal GPU of target
    `arch` (wide_dram: its larger-memory part)."""
    params = dict(in_channels=x[1], out_channels=w[0], kernel_size=w[2:], stride=stride, padding=padding,
                  dilation=1, groups=groups, dtype=dtype, bias=False)
    probe = ConvSpec(**params)
    P, Q = probe.output_size(x[2], x[3])
    problem = Problem(N=x[0], H=x[2], W=x[3], P=P, Q=Q, device=nominal(arch, wide_dram=wide_dram))
    return select.choose(params, "cuda", problem, False, math if dtype == "float32" else "ieee", family=family,
                         tiles=tiles)


@pytest.mark.parametrize("case", sorted(CASES))
def test_serves_the_cases_in_every_precision_on_hopper_only(case):
    for dtype, math in (("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "ieee"), ("float16", "ieee")):
        for wide in (False, True):  # the H100 and the H200
            spec = _choose(**CASES[case], dtype=dtype, math=math, wide_dram=wide)
            assert spec.layout == "nchw" and spec.math == math
            FAM.check(spec, nominal("sm_90a", wide_dram=wide))
        for arch in ("sm_80", "sm_89", "sm_90"):  # (wgmma needs the 'a' target)
            with pytest.raises(ConvArgumentError, match="runs on sm_90a"):
                _choose(**CASES[case], dtype=dtype, math=math, arch=arch)
    with pytest.raises(ConvArgumentError, match="dtype float64"):
        _choose(**CASES[case], dtype="float64", math="ieee")


def test_default_tiles_of_the_cases():
    # 63 (16x3x3): staged epilogue and cp.async input.
    spec63 = _choose(**CASES["63"])
    assert dict(spec63.tiles)["stage_out"] == 1 and dict(spec63.tiles)["async_x"] == 1
    # compute-bound: ring slots first, the output staged in the ring's held slots
    assert FAM.layout(_choose(**CASES["56"]))["RSTAGE"]


@pytest.mark.parametrize("x,w,stride,padding", [
    # float32 first layers (padded to a k-step), narrow outputs, rows of any width, a row stride
    ((16, 3, 512, 512), (64, 3, 3, 3), 1, 1),
    ((8, 3, 512, 512), (64, 3, 5, 5), 1, 2),
    ((16, 2, 256, 256), (64, 2, 3, 3), 1, 1),
    ((16, 4, 512, 512), (64, 4, 3, 3), 1, 1),
    ((32, 3, 224, 224), (64, 3, 3, 3), 1, 1),
    ((16, 3, 256, 256), (16, 3, 3, 3), 1, 1),
    ((16, 3, 512, 512), (64, 3, 1, 1), 1, 0),
    ((16, 8, 512, 512), (64, 8, 3, 1), 1, (1, 0)),
    ((16, 8, 512, 512), (64, 8, 3, 3), (2, 1), 1),
    ((16, 12, 512, 512), (64, 12, 3, 3), 1, 1),
    ((8, 64, 512, 512), (16, 64, 3, 3), 1, 1),
    ((16, 8, 512, 512), (16, 8, 7, 7), 1, 3),
    ((8, 256, 512, 512), (32, 256, 1, 1), 1, 0),
    # a column stride: not its (the halo's columns are read in a row)
    ((32, 3, 224, 224), (32, 3, 3, 3), 2, 1),
    ((32, 3, 224, 224), (64, 3, 7, 7), 2, 3),
])
def test_serves_first_layers_and_narrow_outputs_at_column_stride_1(x, w, stride, padding):
    column_stride = stride if isinstance(stride, int) else stride[1]
    for dtype, math in (("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "ieee")):
        if column_stride == 1:
            spec = _choose(x, w, dtype=dtype, math=math, stride=stride, padding=padding)
            FAM.check(spec, nominal())
            assert FAM.layout(spec)["SMEM_BYTES"] <= SMEM_BLOCK
        else:
            with pytest.raises(ConvArgumentError, match="column stride of 1"):
                _choose(x, w, dtype=dtype, math=math, stride=stride, padding=padding)


def test_refusals_say_why():
    with pytest.raises(Exception, match="sm_90a"):
        _choose(**CASES["56"], arch="sm_80", family="wgmma")
    with pytest.raises(Exception, match="column stride"):
        _choose(**CASES["56"], stride=(1, 2), family="wgmma")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype,math", [("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "ieee"),
                                        ("float16", "ieee")])
def test_forced_tiles_fit_and_layout_agrees(case, dtype, math):
    spec = _choose(**CASES[case], dtype=dtype, math=math, family="wgmma")
    lay = FAM.layout(spec)
    # 3xTF32 stages every operand twice (its TF32 rounding, then the rounding of the rest).
    nspl = 2 if lay["SPLIT3"] else 1
    assert lay["SPLIT3"] == (dtype == "float32" and math == "ieee")
    assert lay["SMEM_BYTES"] <= SMEM_BLOCK
    # Shared memory: resident weights (or none), the ring of stage slots (16-byte rows) and the
    # staged epilogue's rows (16 channels per computing warp, of one output row, or of all TP with
    # overlap) and, with a producer warpgroup (ws), two mbarriers per slot.
    # Strips (strip=1): a slot holds one input row, every chunk of it.
    slot = lay["NCH"] * lay["XQ"] if lay["STRIP"] else nspl * ((0 if lay["WRES"] else lay["WVEC"]) + lay["XVEC"])
    esize = 4 if dtype == "float32" else 2
    rows = lay["TP"] if lay["OVERLAP"] else 1
    consumers = lay["NTH"] - (128 if lay["WS"] else 0)
    assert consumers == 128 * lay["NWG"] and lay["NTP"] == (128 if lay["WS"] else lay["NTH"])
    epi = consumers // 32 * rows * 16 * lay["ESRS"] * esize if lay["STAGE_OUT"] else 0
    if lay["RSTAGE"]:  # staged in the ring instead: a slot holds a warpgroup's rows
        assert lay["WS"] and not lay["WRES"] and 4 * 16 * lay["ESRS"] * esize <= 16 * slot
        epi = 0
    assert lay["EPI_BYTES"] == epi and lay["ESRS"] >= lay["TQ"] + 16 // esize
    resident = (nspl - lay["AREG"]) * lay["WVEC"] if lay["WRES"] else 0  # a_regs: TF32 or small weights in registers
    assert lay["SMEM_BYTES"] == (16 * (resident + lay["NBUF"] * slot) + epi +
                                 (16 * lay["NBUF"] if lay["WS"] else 0))
    # The packed weights are every weight, padded to whole stages and m-blocks.
    cin_g, cout = spec.cin_per_group, spec.out_channels
    kh, kw = spec.kernel_size
    assert lay["PACKED_BYTES"] >= cout * cin_g * kh * kw * esize
    assert lay["PACKED_BYTES"] == 16 * spec.groups * lay["MB"] * lay["SPT"] * nspl * lay["WVEC"]
    # (strips: the call's scratch, a progress counter for each of up to MAXPROG blocks)
    assert lay["WORKSPACE_BYTES"] == (4 * lay["MAXPROG"] if lay["STRIP"] else 0)
    assert lay["CK"] % (2 * lay["CPV"]) == 0 and lay["CK"] * esize == 16 * lay["NCH"]


def test_tile_checks_name_the_problem():
    spec = _choose(**CASES["56"], family="wgmma")
    t = dict(spec.tiles)
    with pytest.raises(Unsupported, match="block_k"):
        FAM.check_tiles(spec, {**t, "block_k": 12}, nominal())
    with pytest.raises(Unsupported, match="shared memory"):
        FAM.check_tiles(spec, {**t, "block_k": 64, "full_kh": 1}, nominal())
    with pytest.raises(Unsupported, match="accumulators"):
        FAM.check_tiles(spec, {**t, "tile_p": 4, "tile_q": 128}, nominal())
    # Overlapped stores need one stage per tile and the staged epilogue.
    with pytest.raises(Unsupported, match="overlap=1"):
        FAM.check_tiles(spec, {**t, "overlap": 1, "stage_out": 1}, nominal())
    spec63 = _choose(**CASES["63"], family="wgmma")
    with pytest.raises(Unsupported, match="overlap=1"):
        FAM.check_tiles(spec63, {**dict(spec63.tiles), "overlap": 1, "stage_out": 0}, nominal())


def test_overlapped_stores_are_forced_only():
    # 63 (16 channels x 3x3: one stage per tile) may stage all its rows and store them under the
    # next tile's MMAs, but measured no faster: the default leaves it off; forcing it fits.
    for dtype in ("float32", "bfloat16"):
        spec = _choose(**CASES["63"], dtype=dtype, family="wgmma")
        assert dict(spec.tiles)["overlap"] == 0
        forced = _choose(**CASES["63"], dtype=dtype, family="wgmma", tiles={"overlap": 1})
        lay = FAM.layout(forced)
        assert lay["OVERLAP"] and lay["STAGE_OUT"] and lay["WRES"]
        # All TP rows' staging where the same tiles without overlap stage one row.
        assert lay["EPI_BYTES"] == lay["TP"] * FAM.layout(forced, {**dict(forced.tiles), "overlap": 0})["EPI_BYTES"]


def test_short_reductions_take_the_producer_warpgroup():
    # 63 (one stage per tile) runs warp-specialised by default: a producer warpgroup stages the
    # input into a ring of 1-row tiles (TF32: of input rows, strip=1), as deep as fits, and every
    # thread keeps its even share of registers.
    for dtype, nbuf in (("float32", 10), ("bfloat16", 6)):
        spec = _choose(**CASES["63"], dtype=dtype, family="wgmma")
        t = dict(spec.tiles)
        assert (t["ws"], t["tile_p"], t["nbuf"], t["overlap"]) == (1, 1, nbuf, 0)
        assert t["strip"] == (dtype == "float32")
        lay = FAM.layout(spec)
        assert lay["WS"] and lay["NTH"] == 384 and lay["NTP"] == 128 and lay["SMEM_BYTES"] <= SMEM_BLOCK
        assert lay["WRES"] and (lay["PREGS"], lay["CREGS"]) == (0, 0)
        # Producers keep two tiles' loads in flight (two sets of groups): 16-bit halos, and a
        # strip's input rows (two groups a row); float32 halos (four groups) keep one set.
        assert lay["XSETS"] == 2 and FAM.layout(spec, {**t, "strip": 0, "nbuf": 3})["XSETS"] == (
            1 if dtype == "float32" else 2)
        # 16-bit also builds the whole-line epilogue, whose staging rows hold a line's shift
        # (64 elements); float32's resident weights (72 KB) leave no room for its 32 more.
        assert lay["LINES"] == (dtype != "float32")
        assert lay["ESRS"] >= 128 + (64 if lay["LINES"] else 4)
        if dtype == "float32":
            # TF32 weights forced into the consumers' registers (a_regs=1, 18 k-steps of 4) free
            # that shared memory for the whole-line rows: none of it resident, 4 slots fit.
            t = {**t, "strip": 0}
            on = FAM.layout(spec, {**t, "a_regs": 1, "nbuf": 4})
            assert on["AREG"] and on["LINES"] and on["ESRS"] == 168
            assert on["SMEM_BYTES"] == 16 * 4 * on["XVEC"] + 8 * 16 * 168 * 4 + 16 * 4 <= SMEM_BLOCK
            # Accumulators and A fragments (64 + 72) outgrow the even share of 168: the producer
            # (its 4 groups of 16, GROUP_REGS and 13 rows' offsets: 128) gives registers back.
            assert on["REGS"] == 64 + 72 + 48 <= on["CREGS"] == 184 and on["PREGS"] == 128
            assert 128 * on["PREGS"] + 256 * on["CREGS"] <= 384 * 168
            FAM.check_tiles(spec, {**t, "a_regs": 1, "nbuf": 4}, nominal())
            with pytest.raises(Unsupported, match="shared memory"):
                FAM.check_tiles(spec, {**t, "a_regs": 1, "nbuf": 6}, nominal())
    with pytest.raises(Unsupported, match="exclusive"):
        FAM.check_tiles(spec, {**dict(spec.tiles), "overlap": 1}, nominal())


def test_strips_hold_input_rows_and_serve_short_tf32_reductions():
    spec = _choose(**CASES["63"], family="wgmma")
    t = dict(spec.tiles)
    lay = FAM.layout(spec)
    # A slot is one input row (4 chunks x 130 columns): ten of them beside the resident weights
    # and the staging rows, where halos (three rows each) fitted three slots.
    assert lay["STRIP"] and not lay["LINES"] and lay["XR"] == 3 and lay["NBUF"] == 10
    assert lay["SMEM_BYTES"] == 16 * (lay["WVEC"] + 10 * 4 * 130) + lay["EPI_BYTES"] + 16 * 10 <= SMEM_BLOCK
    with pytest.raises(Unsupported, match="shared memory"):
        FAM.check_tiles(spec, {**t, "nbuf": 11}, nominal())
    five = _choose(x=(2, 8, 64, 256), w=(128, 8, 5, 5), family="wgmma")
    with pytest.raises(Unsupported, match="a ring slot for each"):
        FAM.check_tiles(five, {**dict(five.tiles), "strip": 1, "ws": 1, "tile_p": 1, "block_k": 8, "full_kh": 1,
                               "async_x": 1, "nbuf": 4}, nominal())
    # Strips are TF32's, under a producer, one-row tiles of one stage.
    for bad in ({"ws": 0}, {"tile_p": 2}, {"async_x": 0}):
        with pytest.raises(Unsupported, match="strip=1 needs"):
            FAM.check_tiles(spec, {**t, **bad}, nominal())
    for kw in (dict(dtype="bfloat16"), dict(math="ieee")):
        other = _choose(**CASES["63"], family="wgmma", **kw)
        assert dict(other.tiles)["strip"] == 0
        with pytest.raises(Unsupported, match="strip=1 needs"):
            FAM.check_tiles(other, {**dict(other.tiles), "strip": 1, "ws": 1, "tile_p": 1, "nbuf": 3}, nominal())
    # The default: rows on 32-byte sectors or 8 strips wide, kernels taller than the row
    # stride, reductions under SHORT_WS_K; the rest keep row order.
    strip = lambda x, w, **kw: dict(_choose(x, w, **kw).tiles).get("strip")  # noqa: E731
    assert strip((8, 16, 512, 512), (64, 16, 3, 3), padding=1) == 1
    assert strip((8, 32, 512, 512), (128, 32, 3, 1)) == 1
    assert strip((8, 16, 512, 511), (64, 16, 3, 3), padding=1) == 0  # 511 wide: 4 strips, off sectors
    assert strip((8, 16, 512, 512), (64, 16, 1, 3), padding=(0, 1)) == 0  # no row to share
    assert strip((8, 16, 512, 512), (64, 16, 3, 3), stride=(3, 1), padding=1) == 0  # row stride 3: none either
    assert strip((8, 24, 256, 256), (128, 24, 3, 3), padding=1) == 0  # 216: several stages


def test_strip_rings_keep_a_slot_beyond_what_a_consumer_holds():
    # The producer hands a cp.async row over once the next row's copies are in a free slot, so a
    # strip's ring holds a tile's XR rows and one more: nbuf == XR waited forever once a band had
    # two tiles. A 10-row kernel (XR 10) therefore no longer takes strips in the default tiles'
    # deepest ring, 10.
    spec = _choose(**CASES["63"], family="wgmma")
    t = dict(spec.tiles)
    with pytest.raises(Unsupported, match=r"3 input rows and one more \(nbuf > 3\)"):
        FAM.check_tiles(spec, {**t, "nbuf": 3}, nominal())
    FAM.check_tiles(spec, {**t, "nbuf": 4}, nominal())
    tall = _choose(x=(8, 16, 512, 513), w=(64, 16, 10, 1), family="wgmma")
    assert dict(tall.tiles)["strip"] == 0
    as_strip = {**dict(tall.tiles), "strip": 1, "ws": 1, "tile_p": 1, "async_x": 1, "block_k": 16,
                "nbuf": 10}
    assert FAM.layout(tall, as_strip)["XR"] == 10
    with pytest.raises(Unsupported, match=r"nbuf > 10"):
        FAM.check_tiles(tall, as_strip, nominal())
    FAM.check_tiles(tall, {**as_strip, "nbuf": 11}, nominal())  # (the default rings stop at 10)


def test_two_accumulator_sets_by_default_only_for_strict_128_channel_tiles_of_several_taps():
    # acc2=1: a consumer's next tile's MMAs are issued before this tile's epilogue, into a second
    # set of accumulators, which the register split pays for. By default only for 3xTF32 with its
    # weights in registers, 128 output channels over 64-column tiles, and a kernel of several taps
    # (the shapes where it measured faster); a tuner may force it, or turn it off.
    strict = dict(math="ieee")
    for x, w, padding in (((16, 16, 1024, 1024), (128, 16, 3, 3), 0), ((16, 16, 1024, 1024), (128, 16, 3, 3), 1),
                          ((8, 12, 512, 512), (128, 12, 3, 3), 1), ((8, 16, 512, 512), (256, 16, 3, 3), 1),
                          ((8, 24, 512, 512), (128, 24, 3, 1), 0), ((8, 16, 1000, 1000), (128, 16, 3, 3), 0)):
        t = dict(_choose(x, w, padding=padding, **strict).tiles)
        assert t["acc2"] == 1 and t["a_regs"] == 1 and t["block_m"] == 128 and t["tile_q"] == 64, (x, w, t)
    for x, w, padding in (((8, 16, 512, 512), (64, 16, 3, 3), 1),   # 64 channels: 128-column tiles
                          ((8, 4, 512, 512), (128, 4, 1, 3), 0),    # 128-column tiles
                          ((8, 8, 512, 512), (128, 8, 3, 3), 1),    # 128-column tiles
                          ((16, 64, 1024, 1024), (128, 64, 1, 1), 0),  # case 87: one tap
                          ((8, 16, 64, 64), (128, 16, 3, 3), 1)):    # rows of 64: not measured
        assert dict(_choose(x, w, padding=padding, **strict).tiles).get("acc2", 0) == 0, (x, w)
    for case, kw in (("63", {}), ("63", dict(dtype="bfloat16")), ("56", {}), ("56", strict),
                     ("87", dict(dtype="bfloat16")), ("87", strict)):
        assert dict(_choose(**CASES[case], **kw).tiles).get("acc2", 0) == 0, (case, kw)
    off = dict(_choose(**CASES["63"], family="wgmma", tiles={"acc2": 0}, **strict).tiles)
    assert off["acc2"] == 0 and {**off, "acc2": 1} == dict(_choose(**CASES["63"], **strict).tiles)
    # The rule reads the tile as forced: weights forced out of registers keep one set.
    assert dict(_choose(**CASES["63"], family="wgmma", tiles={"a_regs": 0}, **strict).tiles)["acc2"] == 0
    for kw in ({}, dict(dtype="bfloat16")):
        spec = _choose(**CASES["63"], family="wgmma", tiles={"acc2": 1}, **kw)
        lay = FAM.layout(spec)
        assert lay["ACC2"] and lay["REGS"] == 2 * 64 + 48 and lay["PREGS"] and lay["CREGS"] >= lay["REGS"]
        assert lay["NTH"] * lay["REGS"] > 65536  # the even share would not hold both sets
    # A strip's ring then holds two tiles' rows (the next one's all new at an image's top) and one more.
    spec = _choose(**CASES["63"], family="wgmma")
    t = {**dict(spec.tiles), "acc2": 1}
    with pytest.raises(Unsupported, match=r"acc2=1 needs a ring slot for each of 6 input rows"):
        FAM.check_tiles(spec, {**t, "nbuf": 6}, nominal())
    FAM.check_tiles(spec, {**t, "nbuf": 7}, nominal())
    # One stage a tile under a producer only.
    long = _choose(**CASES["56"], family="wgmma")
    with pytest.raises(Unsupported, match="acc2=1 needs one stage a tile"):
        FAM.check_tiles(long, {**dict(long.tiles), "acc2": 1}, nominal())
    with pytest.raises(Unsupported, match="acc2=1 needs one stage a tile"):
        FAM.check_tiles(spec, {**t, "strip": 0, "ws": 0, "nbuf": 3}, nominal())


@pytest.mark.parametrize("x, w, math, padding, expect", [
    # float32 reductions of 256-511 that do not fit one stage: a producer warpgroup over several
    # stages a tile, one-row tiles where two consumer warpgroups share a tile (128 channels).
    ((8, 32, 512, 512), (128, 32, 3, 3), "tf32", 1, (1, 1)),
    ((8, 32, 512, 512), (128, 32, 3, 3), "ieee", 1, (1, 1)),
    ((8, 48, 512, 512), (96, 48, 3, 3), "ieee", 1, (1, 1)),
    # two-row tiles where one consumer warpgroup holds them (64 channels), where the input rows
    # take the producer's 16-byte loads (padding 0, width a multiple of 4), or where a stage
    # holds one k-step (8-16 channels)
    ((8, 32, 512, 512), (64, 32, 3, 3), "tf32", 1, (1, 2)),
    ((8, 32, 512, 512), (128, 32, 3, 3), "tf32", 0, (1, 2)),
    ((8, 56, 256, 512), (128, 56, 3, 3), "tf32", 0, (1, 2)),
    ((8, 16, 512, 512), (128, 16, 5, 5), "tf32", 2, (1, 2)),
    ((8, 8, 512, 512), (128, 8, 7, 7), "tf32", 3, (1, 2)),
    ((8, 16, 512, 512), (128, 16, 5, 3), "tf32", (2, 1), (1, 2)),
    ((8, 16, 512, 512), (64, 16, 5, 5), "tf32", 2, (1, 2)),
    # 3x5 (one k-step a stage): two-row tiles over one kernel row a stage come before one-row
    # tiles holding all three (H100: 0.734 ms against 0.852)
    ((8, 16, 512, 512), (128, 16, 3, 5), "tf32", (1, 2), (1, 2)),
    # TF32 from 216 (24->128 3x3), strict from 256: below, no producer, as measured
    ((16, 24, 256, 256), (128, 24, 3, 3), "tf32", 1, (1, 1)),
    ((16, 24, 256, 256), (128, 24, 3, 3), "ieee", 1, (0, 2)),
    ((8, 64, 512, 512), (128, 64, 3, 1), "tf32", (1, 0), (0, 1)),
])
def test_short_float32_reductions_over_several_stages_take_a_producer(x, w, math, padding, expect):
    spec = _choose(x, w, math=math, padding=padding)
    t = dict(spec.tiles)
    assert (t["ws"], t["tile_p"]) == expect
    assert FAM.layout(spec)["SPT"] > 1 or t["ws"] == 0


def test_short_16_bit_reductions_keep_their_tiles():
    # bf16 of the same lengths: one stage without a producer where it fits (H100, 48->128 3x3:
    # 1.17 ms against 1.45-1.47 under a producer), as before the float32 rule.
    spec = _choose((8, 48, 512, 512), (128, 48, 3, 3), dtype="bfloat16", padding=1)
    assert dict(spec.tiles)["ws"] == 0


def test_long_reductions_take_the_producer_warpgroup_with_a_register_split():
    # 56 (20 stages a tile): the producer also copies each stage's weights, and the consumers'
    # 1 x 256 tiles (128 accumulators a thread) take the registers the producer gives back.
    for dtype, ck in (("float32", 16), ("bfloat16", 32)):
        spec = _choose(**CASES["56"], dtype=dtype, family="wgmma")
        t = dict(spec.tiles)
        assert (t["ws"], t["tile_p"], t["tile_q"], t["block_k"], t["full_kh"], t["nbuf"]) == (1, 1, 256, ck, 0, 3)
        lay = FAM.layout(spec)
        assert not lay["WRES"] and lay["SPT"] == 64 // ck * 5 and lay["NTH"] == 384
        # float32's producer holds two sets of 16-byte groups (the next stage's loads in flight
        # while this one waits for its slot): 3 groups of 4 a set, with the stage's cursor and
        # weight copy beside them; 16-bit keeps one.
        assert lay["XSETS"] == (2 if dtype == "float32" else 1)
        if dtype == "float32":
            assert (lay["PREGS"], lay["CREGS"]) == (2 * 3 * 4 * 4 + 32 + 24, 176)
        assert not lay["LINES"]
        # The staged epilogue, in the ring: no staging area of its own.
        assert t["stage_out"] == 1 and lay["RSTAGE"] and lay["EPI_BYTES"] == 0
        # The launch gives 384 threads 168 registers each; the split stays within that pool.
        assert 0 < lay["PREGS"] < 168 < lay["REGS"] <= lay["CREGS"]
        assert 128 * lay["PREGS"] + 256 * lay["CREGS"] <= 384 * 168
        assert lay["SMEM_BYTES"] == 16 * (3 * (lay["WVEC"] + lay["XVEC"]) + 3) <= SMEM_BLOCK  # ring + 6 mbarriers
        # A split needs the whole register file: no second block.
        with pytest.raises(Unsupported, match="min_blocks=1"):
            FAM.check_tiles(spec, {**t, "min_blocks": 2}, nominal())


def test_strict_float32_runs_3xtf32_with_partial_sums_over_long_reductions():
    # 56 (2240-long reduction, 40 stages a tile): per-stage partial sums double the accumulators,
    # so 1 x 128 tiles, with the consumers' registers from the producer.
    spec = _choose(**CASES["56"], math="ieee")
    t, lay = dict(spec.tiles), FAM.layout(spec)
    assert (t["ws"], t["tile_p"], t["tile_q"], t["block_k"], t["full_kh"]) == (1, 1, 128, 8, 0)
    assert lay["SPLIT3"] and lay["FLUSH"] and lay["RSTAGE"] and lay["REGS"] == 64 * 2 + 48 <= lay["CREGS"]
    with pytest.raises(Unsupported, match="registers"):
        FAM.check_tiles(spec, {**t, "tile_q": 256}, nominal())
    # 63 and 87 (one stage a tile, reductions of 144 and 64): no partial sums; the small weights
    # in the consumers' registers (4 a k-step), the big ones resident, 64-column staged tiles.
    for case, ksteps in (("63", 18), ("87", 8)):
        spec = _choose(**CASES[case], math="ieee")
        t, lay = dict(spec.tiles), FAM.layout(spec)
        assert (t["ws"], t["tile_q"], t["stage_out"], t["a_regs"]) == (1, 64, 1, 1)
        assert lay["SPLIT3"] and lay["WRES"] and lay["AREG"] and not lay["FLUSH"]
        # 63 (nine taps) also keeps two accumulator sets; 87 (one tap) one.
        assert t["acc2"] == (case == "63")
        assert lay["REGS"] == 32 * (1 + t["acc2"]) + 4 * ksteps + 48 and lay["SMEM_BYTES"] <= SMEM_BLOCK
        # Both halves in shared memory (a_regs=0): 63's pair (147 KB) leaves no room for staging.
        if case == "63":
            with pytest.raises(Unsupported, match="shared memory"):
                FAM.check_tiles(spec, {**t, "a_regs": 0}, nominal())
    # Registers hold weights only for float32 with one stage a tile.
    with pytest.raises(Unsupported, match="a_regs"):
        spec63 = _choose(**CASES["63"], dtype="bfloat16", family="wgmma")
        FAM.check_tiles(spec63, {**dict(spec63.tiles), "a_regs": 1}, nominal())
    for math in ("ieee", "tf32"):
        spec56 = _choose(**CASES["56"], math=math)
        with pytest.raises(Unsupported, match="a_regs"):
            FAM.check_tiles(spec56, {**dict(spec56.tiles), "a_regs": 1}, nominal())
    # A short reduction over several stages sums in one accumulator too; a long one does not.
    short = _choose(x=(2, 16, 40, 70), w=(128, 16, 3, 3), math="ieee", family="wgmma", tiles={"block_k": 8})
    assert FAM.layout(short)["SPT"] > 1 and 16 * 9 <= FLUSH_K and not FAM.layout(short)["FLUSH"]
    long = _choose(x=(2, 40, 40, 70), w=(128, 40, 3, 3), math="ieee", family="wgmma", tiles={"block_k": 8})
    assert FAM.layout(long)["SPT"] > 1 and 40 * 9 > FLUSH_K and FAM.layout(long)["FLUSH"]
    # TF32 and 16-bit specs never split.
    assert not FAM.layout(_choose(**CASES["56"]))["SPLIT3"]
    assert not FAM.layout(_choose(**CASES["56"], dtype="bfloat16"))["SPLIT3"]


def test_a_register_split_only_ever_moves_registers_from_the_producer():
    # ptxas refuses a producer setmaxnreg.dec above the kernel's own count: where the producer
    # needs more than its even share (big 16-bit halos staged through registers), there is no
    # split, and tiles that do not fit without one are refused.
    spec = _choose(x=(2, 64, 40, 70), w=(80, 64, 3, 3), dtype="bfloat16", stride=(2, 1), family="wgmma")
    big = {**dict(spec.tiles), "ws": 1, "block_k": 64, "full_kh": 1, "tile_p": 1, "tile_q": 64, "nbuf": 3,
           "stage_out": 0}
    assert dict(spec.tiles) != big  # the default moved on
    lay = FAM.layout(spec, big)
    assert (lay["PREGS"], lay["CREGS"]) == (0, 0) and lay["NTH"] * lay["REGS"] > 65536
    with pytest.raises(Unsupported, match="registers"):
        FAM.check_tiles(spec, big, nominal())


WG_TYPE = {"float32": "k8.f32.tf32.tf32", "bfloat16": "k16.f32.bf16.bf16", "float16": "k16.f32.f16.f16"}


@pytest.mark.nvcc
@pytest.mark.compile
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("case,dtype,tiles", [("56", "float32", None), ("56", "bfloat16", None),
                                              ("56", "float16", {"ws": 0}), ("63", "float16", None),
                                              ("63", "float32", None), ("63", "float32", {"overlap": 1}),
                                              ("63", "float32", {"a_regs": 1, "nbuf": 4, "strip": 0}),
                                              ("63", "float32", {"strip": 0, "nbuf": 3}),
                                              ("63", "float32", {"acc2": 1}), ("63", "bfloat16", {"acc2": 1}),
                                              ("87", "float32", None), ("56", "ieee", None), ("63", "ieee", None),
                                              ("87", "ieee", None), ("56", "ieee", {"ws": 0})])
def test_lowers_to_wgmma_without_spills(case, dtype, tiles, tmp_path):
    math = "ieee" if dtype == "ieee" else "tf32"  # "ieee": strict float32, 3xTF32
    dtype = "float32" if dtype == "ieee" else dtype
    spec = _choose(**CASES[case], dtype=dtype, math=math, family="wgmma", **({"tiles": tiles} if tiles else {}))
    text, report = lower(spec, tmp_path)
    tq = dict(spec.tiles)["tile_q"]
    assert f"wgmma.mma_async.sync.aligned.m64n{tq}{WG_TYPE[dtype]}" in text
    assert "0 bytes spill stores, 0 bytes spill loads" in report and " bytes spill stores" not in \
        report.replace("0 bytes spill stores", ""), report
    # No wgmma waits of ptxas's own (C7517: registers of an MMA in flight read before its wait),
    # which would serialise acc2's two sets.
    assert "C7517" not in report, report
    lay = FAM.layout(spec)
    # Per-stage partial sums start each stage with a wgmma that overwrites (scale-d 0), only there;
    # small weights held in registers are wgmma's register A operand.
    assert ("setp.ne.b32 p, 0, 0;" in text) == lay["FLUSH"]
    assert bool(re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k8\.f32\.tf32\.tf32 \{[^}]*\}, \{%r", text)) == lay["AREG"]
    # A register split is in the code where the layout asks for one, and only there.
    assert ("setmaxnreg.inc.sync.aligned.u32 %d;" % lay["CREGS"] in text) == bool(lay["CREGS"])
    assert ("setmaxnreg.dec.sync.aligned.u32 %d;" % lay["PREGS"] in text) == bool(lay["PREGS"])
    # ptxas says so when it must serialise wgmma (accumulators touched while one is in flight),
    # or wait for one where the code did not (63's overlapped stores must not).
    assert "serializ" not in report.lower() and "warpgroup.wait is injected" not in report, report
