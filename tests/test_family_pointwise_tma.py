"""CPU-tier tests of the `pointwise_tma` family (1x1 NCHW convolutions read by the TMA, wgmma with
register-held pixel fragments, sm_90a): no GPU needed.

What they cover: which calls it can serve (dense NCHW 1x1 layers at stride 1 in TF32 and 16-bit,
on planes the TMA can address, on sm_90a) and which it cannot (strides, padding, strict float32,
planes of part 16-byte chunks, targets before Hopper, channels_last), that its refusals name the
reason, that default and forced tiles fit and agree with the template's layout, and (with nvcc)
that every dtype lowers to wgmma with A from registers fed by tiled TMA copies through
mbarriers, with no spills. Split reductions: their legal values and refusals, which layers the
family splits (batch-1 layers on 14 x 14 planes, on the SMs the Problem's GPU reports) and which
it keeps whole, their workspace, and (with nvcc) that split kernels and their final pass compile
without spills. Which family the selector picks for a call is measured, not asserted here.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError
from kernelgen.families import get_family
from kernelgen.families.nhwc_tma import reg_cap
from kernelgen.families.pointwise_tma import SPLIT_MIN_A_SPLIT, SPLITS, split_choice
from kernelgen.render import render
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("pointwise_tma")


def _choose(x, w, dtype="float32", math="tf32", stride=1, padding=0, family="pointwise_tma", tiles=None,
            arch="sm_90a", bias=False, channels_last=False, wide_dram=False):
    """The spec `family` (this one by default) runs the call with, on a nominal GPU of target `arch`
    (wide_dram: its larger-memory part)."""
    params = dict(in_channels=x[1], out_channels=w[0], kernel_size=w[2:], stride=stride, padding=padding,
                  dilation=1, groups=1, dtype=dtype, bias=bias)
    P, Q = ConvSpec(**params).output_size(x[2], x[3])
    problem = Problem(N=x[0], H=x[2], W=x[3], P=P, Q=Q, device=nominal(arch, wide_dram=wide_dram))
    return select.choose(params, "cuda", problem, channels_last, math if dtype == "float32" else "ieee",
                         family=family, tiles=tiles)


L1 = dict(x=(32, 256, 56, 56), w=(64, 256, 1, 1))  # ResNet-50's 256 -> 64
L2 = dict(x=(32, 512, 28, 28), w=(128, 512, 1, 1))
WIDE = dict(x=(8, 1024, 64, 64), w=(256, 1024, 1, 1))
C87 = dict(x=(16, 64, 1024, 1024), w=(128, 64, 1, 1))


@pytest.mark.parametrize("layer", [L1, L2, WIDE, dict(x=(32, 256, 14, 14), w=(1024, 256, 1, 1)),
                                   dict(x=(32, 128, 56, 56), w=(512, 128, 1, 1)),
                                   dict(x=(32, 96, 56, 56), w=(96, 96, 1, 1))])
def test_serves_nchw_1x1_layers_on_sm_90a_whose_planes_are_whole_chunks(layer):
    for dtype in ("float32", "bfloat16", "float16"):
        aligned = layer["x"][2] * layer["x"][3] * (4 if dtype == "float32" else 2) % 16 == 0
        for wide in (False, True):  # the H100 and the H200
            if aligned:
                FAM.check(_choose(**layer, dtype=dtype, wide_dram=wide), nominal("sm_90a", wide_dram=wide))
            else:
                with pytest.raises(ConvArgumentError, match="16-byte chunks"):
                    _choose(**layer, dtype=dtype, wide_dram=wide)
    with pytest.raises(ConvArgumentError, match="strict float32"):  # 3xTF32 elsewhere
        _choose(**layer, math="ieee")
    for arch in ("sm_80", "sm_89", "sm_90"):  # (wgmma and the TMA need the 'a' target)
        with pytest.raises(ConvArgumentError, match="runs on sm_90a"):
            _choose(**layer, arch=arch)
    with pytest.raises(ConvArgumentError, match="takes layouts"):  # NCHW only
        _choose(**layer, channels_last=True)


@pytest.mark.parametrize("layer", [
    C87,  # 64 input channels on large planes
    dict(x=(2, 64, 64, 64), w=(128, 64, 1, 1)),
    dict(x=(32, 144, 56, 56), w=(24, 144, 1, 1)),  # under one wgmma N of outputs
    dict(x=(8, 256, 512, 512), w=(32, 256, 1, 1)),
    dict(x=(32, 16, 56, 56), w=(144, 16, 1, 1)),  # half a k-tile of float32 channels
    dict(x=(32, 64, 56, 56), w=(64, 64, 1, 1)),
    dict(x=(8, 48, 63, 64), w=(64, 48, 1, 1)),  # 4032 pixels; 48 16-bit channels: 3/4 of a k-tile
    dict(x=(32, 24, 56, 56), w=(144, 24, 1, 1)),  # 16-bit: 3/8 of a k-tile
])
def test_serves_short_reductions_and_narrow_outputs_too(layer):
    for dtype in ("float32", "bfloat16", "float16"):
        spec = _choose(**layer, dtype=dtype)
        assert spec.layout == "nchw"
        FAM.check(spec, nominal("sm_90a"))


def test_plans_read_the_gpu_off_the_device(monkeypatch):
    """functional reads the GPU a CUDA call plans for once per device (kernelgen.device.of), and
    meta planning for CUDA takes the current GPU; an explicit planning target (kernelgen warm
    --arch) outranks it; a machine without a GPU plans with none (the families then size for a
    nominal H100)."""
    import types

    import torch

    from kernelgen import device as kg_device
    from kernelgen import functional

    seen = []
    real = select.ranked
    monkeypatch.setattr(select, "ranked", lambda params, dev, problem, *a, **kw: seen.append(problem.device)
                        or real(params, dev, problem, *a, **kw))
    x = torch.empty(*C87["x"], device="meta")
    w = torch.empty(*C87["w"], device="meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    functional.spec_for(x, w, None, device="cuda")
    assert seen[-1] is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    h200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=141 << 30,
                                 multi_processor_count=132, shared_memory_per_block_optin=227 << 10,
                                 shared_memory_per_multiprocessor=228 << 10, regs_per_multiprocessor=65536,
                                 L2_cache_size=60 << 20, memory_clock_rate=3_200_000, memory_bus_width=6144,
                                 clock_rate=1_980_000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: h200)
    kg_device.of.cache_clear()
    try:
        functional.spec_for(x, w, None, device="cuda")
        gpu = seen[-1]
        assert (gpu.name, gpu.arch, gpu.sms, gpu.key, gpu.source) == ("NVIDIA H200", "sm_90a", 132, "nvidia-h200",
                                                                       "device")
        assert gpu.dram_bytes_s == 2 * 3_200_000e3 * 6144 / 8 and gpu.l2_bytes == 60 << 20
        with functional.planning_for("sm_90a"):
            functional.spec_for(x, w, None, device="cuda")
            assert seen[-1] == nominal("sm_90a")
            with functional.planning_for("sm_80", wide_dram=True):  # (no larger part of sm_80)
                functional.spec_for(x, w, None, device="cuda")
                assert seen[-1] == nominal("sm_80")
            with functional.planning_for(nominal("sm_89")):
                functional.spec_for(x, w, None, device="cuda")
                assert seen[-1] == nominal("sm_89")
        with functional.planning_for("sm_90a", wide_dram=True):
            functional.spec_for(x, w, None, device="cuda")
            assert seen[-1] == nominal("sm_90a", wide_dram=True) and seen[-1].name == "NVIDIA H200"
    finally:
        kg_device.of.cache_clear()


def test_refusals_name_the_reason():
    with pytest.raises(ConvArgumentError, match="1x1 kernels at stride 1 without padding"):
        _choose(L2["x"], (128, 512, 3, 3), padding=1, family="pointwise_tma")
    with pytest.raises(ConvArgumentError, match="1x1 kernels at stride 1 without padding"):
        _choose(**L2, stride=2, family="pointwise_tma")
    with pytest.raises(ConvArgumentError, match="1x1 kernels at stride 1 without padding"):
        _choose(**L2, padding=1, family="pointwise_tma")
    with pytest.raises(ConvArgumentError, match="strict float32"):
        _choose(**L2, math="ieee", family="pointwise_tma")
    with pytest.raises(ConvArgumentError, match="sm_90a"):
        _choose(**L2, arch="sm_80", family="pointwise_tma")
    with pytest.raises(ConvArgumentError, match="16-byte chunks"):  # 7 x 7 planes of bf16: 98 bytes
        _choose((32, 2048, 7, 7), (512, 2048, 1, 1), dtype="bfloat16", family="pointwise_tma")
    with pytest.raises(ConvArgumentError, match="takes layouts"):
        _choose(**L2, channels_last=True, family="pointwise_tma")
    with pytest.raises(ConvArgumentError, match="one block of output channels"):
        _choose(**L2, family="pointwise_tma", tiles={"block_co": 64, "wres": 1})
    with pytest.raises(ConvArgumentError, match="registers"):  # 256 accumulators a thread and more
        _choose(**WIDE, family="pointwise_tma", tiles={"block_co": 256, "block_p": 128, "stages": 2})
    with pytest.raises(ConvArgumentError, match="shared memory"):
        _choose(**WIDE, family="pointwise_tma", tiles={"block_co": 256, "block_p": 192, "stages": 8})
    params = dict(in_channels=64, out_channels=64, kernel_size=1, stride=1, padding=0, dilation=1, groups=2,
                  dtype="bfloat16", bias=False)
    with pytest.raises(ConvArgumentError, match="dense layers"):
        select.choose(params, "cuda", Problem(4, 8, 8, 8, 8, device=nominal("sm_90a")), False, "ieee",
                      family="pointwise_tma")


@pytest.mark.parametrize("layer", [L1, L2, WIDE, C87, dict(x=(2, 16, 12, 12), w=(80, 16, 1, 1))])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_tiles_fit_and_agree_with_the_layout(layer, dtype):
    spec = _choose(**layer, dtype=dtype, family="pointwise_tma")
    t = dict(spec.tiles)
    lay = FAM.layout(spec, t)
    assert lay["SMEM_BYTES"] + lay["STATIC"] <= nominal().smem_block
    assert t["min_blocks"] * (lay["SMEM_BYTES"] + 1024) <= nominal().smem_sm
    assert lay["REGS"] <= reg_cap(lay["NTH"], t["min_blocks"])
    esize = 4 if dtype == "float32" else 2
    k_tiles = -(-spec.in_channels * esize // 128)
    # the weights stay resident where they are one block of output channels of 64 KB or less
    assert t["wres"] == int(spec.out_channels <= t["block_co"] and k_tiles * t["block_co"] * 128 <= 64 * 1024)
    ctx = spec.template_context()
    assert (ctx["BCO"], ctx["BP"], ctx["SMEM_BYTES"]) == (t["block_co"], t["block_p"], lay["SMEM_BYTES"])
    assert ctx["PACKED_BYTES"] == spec.out_channels * k_tiles * 128  # the packed weights


def test_resident_weights_where_they_fit():
    assert dict(_choose(**C87, family="pointwise_tma").tiles)["wres"] == 1  # 2 k-tiles x 128 outputs: 32 KB
    assert dict(_choose(**L1, family="pointwise_tma").tiles)["wres"] == 1  # 8 k-tiles x 64: 64 KB
    assert dict(_choose(**L2, family="pointwise_tma").tiles)["wres"] == 0  # 16 k-tiles x 128: 256 KB
    assert dict(_choose(**WIDE, family="pointwise_tma").tiles)["wres"] == 0  # two blocks of outputs


@pytest.mark.nvcc
@pytest.mark.compile
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("layer,dtype,bias,tiles", [
    (C87, "float32", True, None),  # resident weights
    (L2, "bfloat16", False, None),  # the weights' ring
    (L1, "float16", True, {"block_p": 64, "min_blocks": 2, "stages": 4}),
    (WIDE, "float32", False, {"block_co": 256, "block_p": 64}),
    (WIDE, "bfloat16", True, {"block_co": 64, "block_p": 192, "stages": 3}),
])
def test_lowers_to_wgmma_with_register_fragments_without_spills(layer, dtype, bias, tiles, tmp_path):
    spec = _choose(**layer, dtype=dtype, bias=bias, family="pointwise_tma", tiles=tiles)
    text, report = lower(spec, tmp_path)
    t = dict(spec.tiles)
    ab = {"float32": "tf32.tf32", "bfloat16": "bf16.bf16", "float16": "f16.f16"}[dtype]
    k = 8 if dtype == "float32" else 16
    assert f"wgmma.mma_async.sync.aligned.m64n{t['block_co']}k{k}.f32.{ab}" in text
    # the input's 3-D boxes, the weights' 2-D ones, mbarriers; no mma.sync, no per-thread copies
    assert "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in text
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in text
    assert "mbarrier.try_wait.parity" in text and "mma.sync" not in text and "cp.async.cg" not in text
    assert ("cvt.rna.tf32.f32" in text) == (dtype == "float32")  # (the weights' repack)
    # TF32 fragments: the two-instruction rounding that leaves the bits wgmma ignores
    assert bool(re.search(r"@p add\.u32 (%r\d+), \1, 0x1000;", text)) == (dtype == "float32")
    # the main kernel and the weight repack; ptxas serialises no wgmma for the register fragments
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 2, report
    assert "serialized" not in report, report


def test_the_call_hands_it_an_aligned_input():
    # a view that starts between two 16-byte boundaries is copied first (functional._run)
    from kernelgen.functional import _PREP, _prep_name

    assert _PREP[_prep_name(_choose(**L2, family="pointwise_tma"))] == 3
    assert _prep_name(_choose(**L2, family="pointwise")) == "nchw"
    assert _prep_name(_choose(dict(x=(2, 64, 8, 8))["x"], (64, 64, 3, 3), padding=1, channels_last=True,
                              family="nhwc_tma")) == "nhwc"


def test_a_forced_ring_outside_the_defaults_is_tried():
    t = dict(_choose(**L1, family="pointwise_tma", tiles={"block_co": 64, "block_p": 64, "min_blocks": 2,
                                                          "stages": 5}).tiles)
    assert (t["min_blocks"], t["stages"]) == (2, 5)


def test_strided_nchw_1x1_layers_run_on_their_sampled_view():
    """select.sampled_1x1: an NCHW 1x1 layer with a stride and no padding is planned as the
    stride-1 layer of input[..., ::sh, ::sw] on CUDA; padding, groups, channels_last, a forced
    family and the CPU keep the call as it is."""
    import torch

    from kernelgen.functional import spec_for

    x = torch.empty(32, 256, 56, 56, device="meta")
    w = torch.empty(512, 256, 1, 1, device="meta")
    spec, call = spec_for(x, w, None, stride=2, device="cuda")
    assert spec.stride == (1, 1) and call.sample == (2, 2)
    assert (call.H, call.W, call.P, call.Q) == (28, 28, 28, 28)
    spec, call = spec_for(x[..., :55], w, torch.empty(512, device="meta"), stride=(2, 3), device="cuda")
    assert spec.stride == (1, 1) and spec.bias and call.sample == (2, 3) and (call.H, call.W) == (28, 19)
    spec, call = spec_for(x[0], w, None, stride=2, device="cuda")  # unbatched
    assert call.unbatched and call.sample == (2, 2) and call.N == 1
    # (a 1x1 weight in channels_last is contiguous too: F.conv2d's output stays NCHW, and the rule applies)
    kept = [spec_for(x, w, None, stride=2, padding=1, device="cuda"),
            spec_for(x.contiguous(memory_format=torch.channels_last), w, None, stride=2, device="cuda"),
            spec_for(x, torch.empty(512, 128, 1, 1, device="meta"), None, stride=2, groups=2, device="cuda"),
            spec_for(x, w, None, stride=2, device="cuda", family="nhwc"),
            spec_for(x, w, None, stride=2, device="cpu"),
            spec_for(x, torch.empty(512, 256, 3, 3, device="meta"), None, stride=2, device="cuda")]
    for spec, call in kept:
        assert spec.stride == (2, 2) and call.sample is None


# ---- split reductions -----------------------------------------------------------------------------

# The batch-1 NCHW 1x1 layers of ResNet-50 and RegNetY-1.6GF on 14 x 14 planes (float32: 784-byte
# planes, which the TMA addresses), with their k-tiles and 128 x 128 tiles (two pixel blocks of a
# 196-pixel plane x output-channel blocks). The census's c0231 is one more of the same shape.
NET_14 = {
    "resnet50.layer3.conv1": ((1, 1024, 14, 14), (256, 1024, 1, 1)),
    "resnet50.layer3.conv3": ((1, 256, 14, 14), (1024, 256, 1, 1)),
    "resnet50.layer4.0.conv1": ((1, 1024, 14, 14), (512, 1024, 1, 1)),
    "resnet50.layer3.0.downsample (sampled)": ((1, 512, 14, 14), (1024, 512, 1, 1)),
    "regnet_y_1_6gf.trunk_output.block3.f.a": ((1, 336, 14, 14), (336, 336, 1, 1)),
    "regnet_y_1_6gf.trunk_output.block4.0.f.a": ((1, 336, 14, 14), (888, 336, 1, 1)),
    "census c0231.pw": ((1, 768, 14, 14), (1536, 768, 1, 1)),
}
# The same networks' 7 x 7 1x1 layers: a 49-pixel plane is 196 float32 bytes (98 in 16 bits), not
# whole 16-byte chunks, so the TMA cannot address it and this family never serves them (they plan
# to nhwc_tma, whose NCHW path transposes the input and already splits).
NET_7 = {
    "resnet50.layer4.conv1": ((1, 2048, 7, 7), (512, 2048, 1, 1)),
    "resnet50.layer4.conv3": ((1, 512, 7, 7), (2048, 512, 1, 1)),
    "regnet_y_1_6gf.trunk_output.block4.f.a": ((1, 888, 7, 7), (888, 888, 1, 1)),
}


def _k_tiles(spec) -> int:
    return -(-spec.in_channels * (4 if spec.dtype == "float32" else 2) // 128)


@pytest.mark.parametrize("name", sorted(NET_14))
@pytest.mark.parametrize("wide", [False, True], ids=["h100", "h200"])
def test_batch_1_layers_on_14x14_planes_split_their_reduction(name, wide):
    x, w = NET_14[name]
    spec = _choose(x, w, wide_dram=wide)
    t, sms = dict(spec.tiles), nominal("sm_90a", wide_dram=wide).sms
    tiles = -(-x[2] * x[3] // t["block_p"]) * -(-w[0] // t["block_co"])
    assert t["splits"] > 1 and t["wres"] == 0, spec.summary()
    # within one block an SM, SPLIT_MIN_A_SPLIT k-tiles a split or more, no split empty
    kt, kts = _k_tiles(spec), -(-_k_tiles(spec) // t["splits"])
    assert tiles * t["splits"] <= sms and kt >= SPLIT_MIN_A_SPLIT * t["splits"] and kts * (t["splits"] - 1) < kt
    FAM.check(spec, nominal("sm_90a", wide_dram=wide))


def test_the_split_counts_of_the_network_layers():
    """The rule's arithmetic on an H100's 132 SMs (docs/selection.md, pointwise_tma)."""
    got = {name: dict(_choose(*NET_14[name]).tiles)["splits"] for name in NET_14}
    assert got == {"resnet50.layer3.conv1": 8,  # 4 tiles, 32 k-tiles: 8 a split x 4 would exceed 4 a split
                   "resnet50.layer3.conv3": 2,  # 16 tiles, 8 k-tiles: 4 a split
                   "resnet50.layer4.0.conv1": 8,  # 8 tiles, 32 k-tiles
                   "resnet50.layer3.0.downsample (sampled)": 4,  # 16 tiles, 16 k-tiles
                   "regnet_y_1_6gf.trunk_output.block3.f.a": 2,  # 6 tiles, 11 k-tiles: 6 + 5
                   "regnet_y_1_6gf.trunk_output.block4.0.f.a": 2,  # 14 tiles, 11 k-tiles
                   "census c0231.pw": 5}  # 24 tiles, 24 k-tiles: 5 x 24 = 120 blocks, 5 + 5 + 5 + 5 + 4


@pytest.mark.parametrize("name", sorted(NET_7))
def test_7x7_planes_are_not_this_familys(name):
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(ConvArgumentError, match="16-byte chunks"):
            _choose(*NET_7[name], dtype=dtype)


@pytest.mark.parametrize("layer", [L1, L2, WIDE, C87, dict(x=(32, 1024, 14, 14), w=(512, 1024, 1, 1)),
                                   dict(x=(9, 1024, 14, 14), w=(512, 1024, 1, 1))])  # 72 tiles: over half of 132
def test_layers_of_many_tiles_keep_one_split(layer):
    for dtype in ("float32", "bfloat16"):
        if layer["x"][2] * layer["x"][3] * (4 if dtype == "float32" else 2) % 16 == 0:  # (planes it serves)
            assert dict(_choose(**layer, dtype=dtype).tiles)["splits"] == 1


def test_the_split_rule_starts_under_half_the_sms():
    assert dict(_choose((8, 1024, 14, 14), (512, 1024, 1, 1)).tiles)["splits"] == 2  # 64 tiles: two of 16 k-tiles
    assert dict(_choose((9, 1024, 14, 14), (512, 1024, 1, 1)).tiles)["splits"] == 1  # 72


def test_short_reductions_keep_one_split():
    # 4 tiles but 4 float32 k-tiles (128 channels): under nhwc_tma's 8, too short to split
    assert dict(_choose((1, 128, 14, 14), (256, 128, 1, 1)).tiles)["splits"] == 1
    assert dict(_choose((1, 256, 14, 14), (256, 256, 1, 1)).tiles)["splits"] == 2  # 8 k-tiles: two of 4


def test_splits_follow_the_gpus_sms():
    """split_choice reads the SMs off the Problem's GPU: fewer SMs, fewer splits (and none where
    the layer's tiles are half of them)."""
    x, w = NET_14["resnet50.layer4.0.conv1"]  # 8 tiles, 32 k-tiles
    params = dict(in_channels=x[1], out_channels=w[0], kernel_size=1, stride=1, padding=0, dilation=1, groups=1,
                  dtype="float32", bias=False)
    for sms, splits in ((132, 8), (40, 5), (24, 3), (16, 1)):
        gpu = dataclasses.replace(nominal("sm_90a"), sms=sms)
        spec = select.choose(params, "cuda", Problem(1, 14, 14, 14, 14, device=gpu), False, "tf32",
                             family="pointwise_tma")
        assert dict(spec.tiles)["splits"] == splits, sms
    spec = ConvSpec(**params, device="cuda", layout="nchw", math="tf32", family="pointwise_tma")
    assert split_choice(spec, tiles=8, sms=132) == 8 and split_choice(spec, tiles=66, sms=132) == 1


def test_split_values_and_refusals():
    x, w = NET_14["resnet50.layer4.0.conv1"]  # 32 k-tiles
    for splits in SPLITS:  # legal where ceil(32 / splits) a split leaves the last split a k-tile or more
        if -(-32 // splits) * (splits - 1) < 32:
            t = dict(_choose(x, w, tiles={"splits": splits}).tiles)
            assert t["splits"] == splits and t["wres"] == 0
        else:  # (10 and 12: 4 and 3 a split)
            with pytest.raises(ConvArgumentError, match=f"cannot be split {splits} ways"):
                _choose(x, w, tiles={"splits": splits})
    with pytest.raises(ConvArgumentError, match="not allowed"):
        _choose(x, w, tiles={"splits": 32})  # (a legal split of 32 k-tiles, not a value of SPLITS)
    with pytest.raises(ConvArgumentError, match="resident weights|wres"):
        _choose((1, 256, 14, 14), (64, 256, 1, 1), tiles={"splits": 2, "wres": 1})
    # 9 k-tiles (288 channels) in 4: 3 a split would leave the last none
    with pytest.raises(ConvArgumentError, match="cannot be split 4 ways"):
        _choose((1, 288, 14, 14), (256, 288, 1, 1), tiles={"splits": 4})
    assert dict(_choose((1, 288, 14, 14), (256, 288, 1, 1), tiles={"splits": 3}).tiles)["splits"] == 3
    assert dict(_choose((1, 288, 14, 14), (256, 288, 1, 1), tiles={"splits": 5}).tiles)["splits"] == 5  # 2,2,2,2,1
    with pytest.raises(ConvArgumentError, match="cannot be split"):  # one k-tile
        _choose((2, 16, 12, 12), (80, 16, 1, 1), tiles={"splits": 2})
    # forced resident weights choose no split
    assert dict(_choose((1, 1024, 14, 14), (64, 1024, 1, 1), tiles={"wres": 0}).tiles)["splits"] > 1
    with pytest.raises(ConvArgumentError):  # (32 k-tiles x 64 outputs: 256 KB, which never stays resident)
        _choose((1, 1024, 14, 14), (64, 1024, 1, 1), tiles={"wres": 1})
    assert dict(_choose((1, 256, 14, 14), (64, 256, 1, 1), tiles={"wres": 1}).tiles)["splits"] == 1


def test_split_workspace_holds_each_splits_float32_sums():
    x, w = NET_14["resnet50.layer4.0.conv1"]
    for splits in (1, 2, 8):
        for dtype in ("float32", "bfloat16"):
            spec = _choose(x, w, dtype="float32", tiles={"splits": splits}) if dtype == "float32" else \
                spec_with(_choose(x, w, tiles={"splits": splits}), dtype)
            ctx = spec.template_context()
            assert (ctx["WORKSPACE_BYTES"], ctx["WORKSPACE_PER_INPUT"]) == (0, 0)
            assert ctx["WORKSPACE_PER_OUTPUT"] == (4 * splits if splits > 1 else 0)
            assert f'"KG_WORKSPACE_PER_OUTPUT", {ctx["WORKSPACE_PER_OUTPUT"]})' in render(spec).cpp
    # kernels.workspace_bytes for a loaded module of 8 splits: 32 bytes an output element
    from kernelgen import kernels

    spec = _choose(x, w)
    module = type("M", (), {"KG_WORKSPACE_PER_OUTPUT": spec.template_context()["WORKSPACE_PER_OUTPUT"]})
    kernels._workspace["test-key"] = kernels._workspace_of(module)
    try:
        assert kernels.workspace_bytes("test-key", 1024 * 196, 512 * 196) == 8 * 4 * 512 * 196
    finally:
        kernels._workspace.pop("test-key")


def spec_with(spec, dtype):
    """`spec` in another dtype, its tiles kept (16-bit math is exact: 'ieee')."""
    return dataclasses.replace(spec, dtype=dtype, math="ieee")


def test_an_unsplit_spec_renders_no_split_code():
    cuda = render(_choose(**L2)).cuda
    assert "SPLITS" not in cuda and "kg_pw_reduce" not in cuda and "part" not in cuda.split("struct Params")[1][:600]
    split = render(_choose(*NET_14["resnet50.layer4.0.conv1"])).cuda
    assert "constexpr int SPLITS = 8;" in split and "kg_pw_reduce<<<" in split and "dim3((unsigned)grid, SPLITS)" in split


@pytest.mark.nvcc
@pytest.mark.compile
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("name,dtype,bias,epilogue,tiles", [
    ("resnet50.layer4.0.conv1", "float32", False, {}, None),  # 8 splits of 4 k-tiles
    ("regnet_y_1_6gf.trunk_output.block3.f.a", "float32", True,
     dict(activation="relu", residual=True, scale=True), None),  # 6 + 5 k-tiles, every epilogue term
    ("resnet50.layer4.0.conv1", "bfloat16", True, dict(activation="silu", scale=True), {"splits": 3}),  # 6,6,4
    ("census c0231.pw", "float16", False, dict(activation="gelu", residual=True), {"splits": 4, "block_co": 64}),
])
def test_split_kernels_compile_without_spills(name, dtype, bias, epilogue, tiles, tmp_path):
    x, w = NET_14[name]
    x = (x[0], x[1], 16, 16) if dtype != "float32" else x  # (16-bit planes of 196 pixels are not whole chunks)
    spec = _choose(x, w, dtype=dtype, bias=bias, tiles=tiles)
    spec = dataclasses.replace(spec, **epilogue)
    FAM.check(spec, nominal("sm_90a"))
    assert dict(spec.tiles)["splits"] > 1
    text, report = lower(spec, tmp_path)
    assert "wgmma.mma_async" in text and ".entry _ZN2kg12kg_pw_reduce" in text
    # the main kernel, the weight repack and the final pass
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 3, report
    assert "serialized" not in report, report
