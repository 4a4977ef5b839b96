"""CPU-tier tests of the `pointwise_tma` family (1x1 NCHW convolutions read by the TMA, wgmma with
register-held pixel fragments, sm_90a): no GPU needed.

What they cover: which calls it can serve (dense NCHW 1x1 layers at stride 1 in TF32 and 16-bit,
on planes the TMA can address, on sm_90a) and which it cannot (strides, padding, strict float32,
planes of part 16-byte chunks, targets before Hopper, channels_last), that its refusals name the
reason, that default and forced tiles fit and agree with the template's layout, and (with nvcc)
that every dtype lowers to wgmma with A from registers fed by tiled TMA copies through
mbarriers, with no spills. Which family the selector picks for a call is measured, not asserted
here.
"""

from __future__ import annotations

import re

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError
from kernelgen.families import get_family
from kernelgen.families.nhwc_tma import reg_cap
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
