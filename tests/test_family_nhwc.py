"""CPU-tier tests of the `nhwc` family (channels_last implicit GEMM on mma.sync): no GPU needed.

What they cover: which calls it can serve (channels_last ones, groups of any number of channels,
and NCHW ones through the input's transpose) and which it cannot, that its refusals name the
reason, that default and forced tiles fit and agree with the template's layout, and (with
nvcc) that every dtype and precision lowers to tensor-core MMAs fed by cp.async, with no spills,
and 16-bit wgmma tiles store whole 16-byte rows. Which family the selector picks for a call is
measured, not asserted here.
"""

from __future__ import annotations


import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError
from kernelgen.families import get_family
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("nhwc")


def _choose(x, w, dtype="float32", math="tf32", stride=1, padding=0, groups=1, channels_last=True,
            family="nhwc", tiles=None, arch="sm_90a"):
    """The spec `family` (this one by default; None: the selector's choice) runs the call with, on a
    nominal GPU of target `arch`."""
    params = dict(in_channels=x[1], out_channels=w[0], kernel_size=w[2:], stride=stride, padding=padding,
                  dilation=1, groups=groups, dtype=dtype, bias=False)
    probe = ConvSpec(**params)
    P, Q = probe.output_size(x[2], x[3])
    problem = Problem(N=x[0], H=x[2], W=x[3], P=P, Q=Q, device=nominal(arch))
    return select.choose(params, "cuda", problem, channels_last, math if dtype == "float32" else "ieee",
                         family=family, tiles=tiles)


# ResNet-50's layers at batch 32 (benchmarks/bench_layers.py).
R50 = {
    "l1.3x3": dict(x=(32, 64, 56, 56), w=(64, 64, 3, 3), padding=1),
    "l2.3x3.s2": dict(x=(32, 128, 56, 56), w=(128, 128, 3, 3), stride=2, padding=1),
    "l2.down.s2": dict(x=(32, 256, 56, 56), w=(512, 256, 1, 1), stride=2),
    "l4.3x3": dict(x=(32, 512, 7, 7), w=(512, 512, 3, 3), padding=1),
    "l4.1x1": dict(x=(32, 2048, 7, 7), w=(512, 2048, 1, 1)),
}


SMALL_PLANES = ("l2.3x3.s2", "l2.down.s2", "l4.3x3", "l4.1x1")  # output planes of 28 x 28 and 7 x 7


def _nhwc(*args, **kw):
    """The `nhwc` family's own choice of tiles."""
    return _choose(*args, **kw, family="nhwc")


@pytest.mark.parametrize("name", sorted(R50))
@pytest.mark.parametrize("dtype,math", [("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "ieee"),
                                        ("float16", "ieee")])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "sm_89"])
def test_serves_resnet_layers_in_both_layouts_on_every_target(name, dtype, math, arch):
    for channels_last in (True, False):  # NCHW: the input transposed into the workspace
        spec = _choose(**R50[name], dtype=dtype, math=math, channels_last=channels_last, arch=arch)
        assert spec.layout == ("nhwc" if channels_last else "nchw") and spec.math == math
        FAM.check(spec, nominal(arch))
        assert FAM.layout(spec, dict(spec.tiles))["SMEM_BYTES"] <= nominal(arch).smem_block


def test_serves_grouped_nchw_layers_of_whole_chunks():
    for groups, cin_g in ((32, 16), (8, 64)):
        spec = _choose((32, 512, 14, 14), (512, cin_g, 3, 3), groups=groups, padding=1, channels_last=False)
        assert spec.layout == "nchw" and spec.groups == groups


@pytest.mark.parametrize("x, w, kw, padded", [
    ((8, 32, 28, 28), (32, 1, 3, 3), dict(groups=32, padding=1), 4),  # depthwise: one channel a group
    ((8, 3, 224, 224), (64, 3, 7, 7), dict(stride=2, padding=3), 4),   # a stem's 3 float32 channels
    ((8, 4, 28, 28), (64, 4, 3, 3), dict(dtype="bfloat16"), 8),       # 4 bf16 channels: half a chunk
    ((8, 12, 28, 28), (64, 12, 3, 3), dict(dtype="bfloat16"), 16),
    ((8, 64, 28, 28), (63, 64, 3, 3), {}, 64),                        # an odd number of outputs
])
def test_serves_any_number_of_channels(x, w, kw, padded):
    # channels a group that are not whole 16-byte chunks are read from a copy padded with zeros
    for channels_last in (True, False):
        spec = _choose(x, w, channels_last=channels_last, **kw)
        ctx = FAM.context(spec)
        assert ctx["CIN_GP"] == padded
        # (NCHW: the transpose's copy; TF32 wgmma tiles: the rounded one)
        copied = padded != spec.cin_per_group or not channels_last or ctx["ROUND_COPY"]
        assert (ctx["WORKSPACE_PER_INPUT"] > 0) == copied
    with pytest.raises(ConvArgumentError, match="dtype float64"):
        _choose(x, w, **{**kw, "dtype": "float64", "math": "ieee"})


def test_tiles_without_a_family_pick_a_family_that_has_them():
    # only nhwc has `chunks`: taken with `tiles=` alone, in either layout
    spec = _choose((32, 24, 56, 56), (144, 24, 1, 1), dtype="bfloat16", tiles={"chunks": 4}, family=None)
    assert spec.family == "nhwc" and dict(spec.tiles)["chunks"] == 4
    spec = _choose(**R50["l1.3x3"], channels_last=False, tiles={"chunks": 4}, family=None)
    assert spec.family == "nhwc" and spec.layout == "nchw"
    # several families have `block_m`: whichever is chosen has it, and holds it
    spec = _choose(**R50["l1.3x3"], channels_last=False, tiles={"block_m": 128}, family=None)
    assert "block_m" in get_family(spec.family).tiles and dict(spec.tiles)["block_m"] == 128
    with pytest.raises(ConvArgumentError, match="has no tile parameter"):
        _choose(**R50["l1.3x3"], tiles={"no_such_tile": 1}, family=None)


def test_refusals_say_why():
    with pytest.raises(ConvArgumentError, match="registers"):
        _choose(**R50["l2.3x3.s2"], family="nhwc", tiles={"block_m": 256, "block_n": 128, "chunks": 8, "wg": 0})
    with pytest.raises(ConvArgumentError, match="cannot share"):
        _choose(**R50["l1.3x3"], family="nhwc", tiles={"block_m": 64, "block_n": 128, "chunks": 2, "wg": 0})
    # wgmma: Hopper only, no 3xTF32, accumulators that cannot spill, 256-channel tiles its own
    with pytest.raises(ConvArgumentError, match="needs sm_90a"):
        _choose(**R50["l1.3x3"], family="nhwc", tiles={"wg": 1}, arch="sm_80")
    with pytest.raises(ConvArgumentError, match="mma.sync only"):
        _choose(**R50["l1.3x3"], math="ieee", family="nhwc", tiles={"wg": 1})
    with pytest.raises(ConvArgumentError, match="accumulators stay in registers"):
        _choose(**R50["l1.3x3"], family="nhwc", tiles={"wg": 1, "block_m": 128, "block_n": 256, "min_blocks": 2})
    with pytest.raises(ConvArgumentError, match="256-channel tiles"):
        _choose(**R50["l1.3x3"], family="nhwc", tiles={"wg": 0, "block_n": 256})
    # shared memory: a ring that fits the H100's 227 KB a block but not the L40S's 99 KB
    tiles = {"wg": 0, "block_m": 128, "block_n": 128, "chunks": 8, "stages": 4}
    spec = _choose(**R50["l4.3x3"], dtype="bfloat16", family="nhwc", tiles=tiles)
    assert nominal("sm_89").smem_block < FAM.layout(spec, dict(spec.tiles))["SMEM_BYTES"] <= nominal().smem_block
    with pytest.raises(ConvArgumentError, match="bytes of shared memory exceed"):
        _choose(**R50["l4.3x3"], dtype="bfloat16", family="nhwc", tiles=tiles, arch="sm_89")


@pytest.mark.parametrize("name", sorted(R50))
@pytest.mark.parametrize("dtype,math", [("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "ieee")])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_89"])
def test_default_tiles_fit_and_fill_the_card(name, dtype, math, arch):
    device = nominal(arch)
    spec = _nhwc(**R50[name], dtype=dtype, math=math, arch=arch)
    t = dict(spec.tiles)
    lay = FAM.layout(spec, t)
    assert lay["SMEM_BYTES"] <= device.smem_block
    assert lay["REGS"] * lay["NTH"] * t["min_blocks"] <= device.regs_sm
    x, w = R50[name]["x"], R50[name]["w"]
    P, Q = ConvSpec(x[1], w[0], w[2:], R50[name].get("stride", 1), R50[name].get("padding", 0)).output_size(x[2], x[3])
    blocks = -(-x[0] * P * Q // t["block_m"]) * -(-w[0] // t["block_n"])
    if dtype == "float32" and math == "ieee":
        assert t["block_m"] == 64 and t["wg"] == 0  # mma.sync, with room for the k-tile sums
    if t["wg"]:  # wgmma: 128 pixels, channels halved only while under half a wave
        assert t["block_m"] == 128 and (blocks >= device.sms // 2 or t["block_n"] == 64) and t["stages"] >= 3
    else:  # two waves, or the smallest tiles
        assert blocks >= device.sms or (t["block_m"], t["block_n"]) == (64, 64)
    # the template's context carries the same constants; the packed weights are kept with the
    # weight, the call's scratch holds only an input's copy
    ctx = spec.template_context()
    assert ctx["SMEM_BYTES"] == lay["SMEM_BYTES"] and ctx["NTH"] == lay["NTH"]
    esize = 4 if dtype == "float32" else 2
    wbytes = w[0] * w[1] * w[2] * w[3] * esize
    assert ctx["PACKED_BYTES"] == wbytes and ctx["WORKSPACE_BYTES"] == 0
    if FAM.round_copy(spec):  # wgmma on TF32 read 4 times or more: a rounded input copy
        assert ctx["WORKSPACE_PER_INPUT"] == 4
    else:
        assert ctx["WORKSPACE_PER_INPUT"] == 0
    if name in SMALL_PLANES:  # NCHW: the call's scratch holds the transposed input
        ctx = _nhwc(**R50[name], dtype=dtype, math=math, channels_last=False, arch=arch).template_context()
        assert ctx["PACKED_BYTES"] == wbytes and ctx["WORKSPACE_BYTES"] == 0
        assert ctx["WORKSPACE_PER_INPUT"] == esize


def test_few_channels_take_short_k_tiles():
    # 16 float32 channels fill four 16-byte chunks; 8 bf16 channels one (the smallest k-tile is two)
    assert dict(_nhwc((8, 16, 64, 64), (64, 16, 3, 3), padding=1).tiles)["chunks"] == 4
    assert dict(_nhwc((8, 8, 64, 64), (64, 8, 3, 3), dtype="bfloat16", padding=1).tiles)["chunks"] == 2
    assert dict(_nhwc(**R50["l1.3x3"]).tiles)["chunks"] == 8


def test_wgmma_on_hopper_for_tf32_and_16_bit_rows_of_eight_chunks():
    for dtype in ("float32", "bfloat16", "float16"):
        assert dict(_nhwc(**R50["l4.3x3"], dtype=dtype).tiles)["wg"] == 1
        assert dict(_nhwc(**R50["l4.3x3"], dtype=dtype, arch="sm_80").tiles)["wg"] == 0
    assert dict(_nhwc(**R50["l4.3x3"], math="ieee").tiles)["wg"] == 0  # 3xTF32 stays on mma.sync
    assert dict(_nhwc((8, 16, 64, 64), (64, 16, 3, 3), padding=1).tiles)["wg"] == 0  # rows of 4 chunks
    # 52 blocks of 128 x 128 on 32 x 7 x 7: halved to 64 channels; 98 on 14 x 14 keep 128
    assert dict(_nhwc(**R50["l4.3x3"]).tiles)["block_n"] == 64
    assert dict(_nhwc((32, 256, 14, 14), (256, 256, 3, 3), padding=1).tiles)["block_n"] == 128
    # a ring of 3 (two blocks an SM) for short reductions, 4 for long ones
    assert dict(_nhwc(**R50["l2.down.s2"]).tiles)["stages"] == 3
    assert dict(_nhwc(**R50["l4.3x3"]).tiles)["stages"] == 4
    # tiles only mma.sync takes keep it
    assert dict(_nhwc(**R50["l1.3x3"], tiles={"stages": 2}).tiles)["wg"] == 0


def test_wgmma_rounds_a_copy_of_channels_last_tf32_inputs_read_four_times_or_more():
    assert FAM.round_copy(_nhwc(**R50["l4.3x3"]))  # 9 taps
    assert FAM.round_copy(_nhwc(**R50["l4.1x1"]))  # 8 blocks across 512 channels
    assert not FAM.round_copy(_nhwc(**R50["l2.down.s2"]))  # 1x1 stride 2: a quarter of the input, once
    assert not FAM.round_copy(_nhwc(**R50["l2.3x3.s2"]))  # 9 taps over stride 2 x 2: 2.25 reads
    assert not FAM.round_copy(_nhwc(**R50["l4.3x3"], channels_last=False))  # the transpose rounds
    assert not FAM.round_copy(_nhwc(**R50["l4.3x3"], dtype="bfloat16"))
    assert not FAM.round_copy(_nhwc(**R50["l4.3x3"], tiles={"wg": 0}))


def test_forced_tiles_hold():
    spec = _choose(**R50["l1.3x3"], family="nhwc", tiles={"block_m": 256, "block_n": 64, "stages": 2})
    t = dict(spec.tiles)
    assert (t["block_m"], t["block_n"], t["stages"]) == (256, 64, 2)
    assert FAM.layout(spec, t)["NTH"] == 256




@pytest.mark.nvcc
@pytest.mark.compile
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("name,dtype,math,bias,tiles,cl", [
    ("l1.3x3", "float32", "tf32", False, None, True), ("l1.3x3", "float32", "ieee", True, None, True),
    ("l1.3x3", "bfloat16", "ieee", True, None, True), ("l2.down.s2", "float16", "ieee", False, None, True),
    ("l4.3x3", "float32", "tf32", True, None, True),
    ("l2.3x3.s2", "bfloat16", "ieee", False, {"block_m": 256, "block_n": 64}, True),
    ("l1.3x3", "float32", "tf32", False, {"block_m": 64, "block_n": 32, "stages": 2}, True),
    # NCHW calls: the input transpose and the NCHW epilogue
    ("l4.3x3", "float32", "tf32", True, None, False), ("l4.1x1", "float32", "ieee", False, None, False),
    ("l2.3x3.s2", "bfloat16", "ieee", True, None, False), ("l2.down.s2", "float16", "ieee", False, None, False),
    # the mma.sync path where wgmma is the default
    ("l4.3x3", "bfloat16", "ieee", True, {"wg": 0}, True), ("l4.1x1", "float32", "tf32", False, {"wg": 0}, False),
    # wgmma: rows of 4 and 2 chunks (64- and 32-byte swizzles), 256-channel and 256-pixel tiles
    ("l1.3x3", "float32", "tf32", False, {"wg": 1, "chunks": 4, "block_n": 256, "block_m": 64}, True),
    ("l1.3x3", "bfloat16", "ieee", False, {"wg": 1, "chunks": 2, "block_m": 256, "block_n": 64}, True),
    ("l2.down.s2", "float32", "tf32", True, None, True),  # TF32 rounded in shared memory, not copied
])
def test_lowers_to_mma_sync_fed_by_cp_async_without_spills(name, dtype, math, bias, tiles, cl, tmp_path):
    spec = _choose(**R50[name], dtype=dtype, math=math, family="nhwc", tiles=tiles, channels_last=cl)
    spec = spec.replace(bias=bias)
    assert spec.layout == ("nhwc" if cl else "nchw")
    text, report = lower(spec, tmp_path)
    ab = {"float32": "tf32.tf32", "bfloat16": "bf16.bf16", "float16": "f16.f16"}[dtype]
    t = dict(spec.tiles)
    if t["wg"]:
        assert f"wgmma.mma_async.sync.aligned.m64n{t['block_n']}k{8 if dtype == 'float32' else 16}.f32.{ab}" in text
        assert "mma.sync" not in text and "fence.proxy.async.shared::cta" in text
    else:
        shape = "m16n8k8" if dtype == "float32" else "m16n8k16"
        assert f"mma.sync.aligned.{shape}.row.col.f32.{ab}.f32" in text and "wgmma" not in text
    assert "cp.async.cg.shared.global" in text
    assert ("cvt.rna.tf32.f32" in text) == (dtype == "float32")
    # the repack (and, over 1x1, the one that reads NCHW's dense weights through shared memory),
    # the main loop's two input paths, (NCHW) the input transpose and (wgmma on a channels_last
    # TF32 input) the rounding copy, none spilling
    rounds = FAM.round_copy(spec)
    assert not rounds or (cl and t["wg"] == 1 and dtype == "float32" and math == "tf32")
    taps = spec.kernel_size != (1, 1)
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 3 + (not cl) + rounds + taps, report
    assert ("kg_nhwc_transpose" in text) == (not cl) and ("kg_nhwc_round" in text) == rounds
    assert ("kg_repack_oihw" in text) == taps
    if dtype != "float32":
        # wgmma's 16-bit channels_last tiles leave through shared memory as 16-byte row vectors
        # (STAGE_Y; these tiles all fit the ring); the others store fragments' channel pairs.
        assert ("st.global.v4" in text) == bool(t["wg"] and cl), text.count("st.global.v4")
