"""CPU-tier tests of the `grouped_nhwc` family (channels_last groups of 2-16 input channels): no
GPU needed.

What they cover: which calls it can serve (grouped layers of 2-16 input channels a group in
channels_last, and in NCHW through the input's transpose, in exact float32 FMAs) and which it
cannot, that its refusals name the reason, its default tiles and their shared-memory limit, and
(with nvcc) that every dtype and shape of input run lowers with the loads it should, 16-byte
streaming stores and within its registers (a word or two of spill at most). Which family the
selector picks for a call is measured, not asserted here.
"""

from __future__ import annotations

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import get_family
from kernelgen.families.groupwise_nhwc import MAX_CIN_G, SMEM_BUDGET, smem_bytes
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("grouped_nhwc")


def _params(groups, cin_g, cout_g=None, kernel=3, stride=1, padding=1, dilation=1, dtype="float32", bias=False):
    cout_g = cin_g if cout_g is None else cout_g
    return dict(in_channels=groups * cin_g, out_channels=groups * cout_g, kernel_size=kernel, stride=stride,
                padding=padding, dilation=dilation, groups=groups, dtype=dtype, bias=bias)


def _choose(groups, cin_g, hw, n=32, channels_last=True, math="tf32", family="grouped_nhwc", tiles=None,
            **kw):
    """The spec `family` (this one by default) runs a grouped call with on a nominal H100."""
    params = _params(groups, cin_g, **kw)
    P, Q = ConvSpec(**params).output_size(*hw)
    problem = Problem(N=n, H=hw[0], W=hw[1], P=P, Q=Q, device=nominal("sm_90a"))
    return select.choose(params, "cuda", problem, channels_last, math, family=family, tiles=tiles)


# ResNeXt-50 32x4d's grouped 3x3s at batch 32 (benchmarks/bench_layers.py).
RX50 = {"l1": (4, (56, 56)), "l2": (8, (28, 28)), "l3": (16, (14, 14))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("layer", ["l1", "l2", "l3"])
@pytest.mark.parametrize("channels_last", [True, False])
def test_serves_resnext_groups_in_exact_float32_in_both_layouts(layer, dtype, channels_last):
    # float32 FMAs: a TF32 call computes exactly (math 'ieee'); NCHW through the input's transpose
    cin_g, hw = RX50[layer]
    for math in ("tf32", "ieee"):
        spec = _choose(32, cin_g, hw, dtype=dtype, math=math, channels_last=channels_last)
        assert spec.layout == ("nhwc" if channels_last else "nchw") and spec.math == "ieee"
        FAM.check(spec, nominal("sm_89"))


def test_serves_groups_the_tensor_core_families_cannot_take():
    # 4 output channels a group (not whole n8 tiles), 7x7 taps of 8 channels, 12 bf16 channels (not
    # whole 16-byte chunks)
    for cin_g, kw in ((8, dict(cout_g=4)), (8, dict(kernel=7, padding=3)), (12, dict(cout_g=16, dtype="bfloat16"))):
        for channels_last in (True, False):
            FAM.check(_choose(8, cin_g, (28, 28), channels_last=channels_last, **kw))


def test_depthwise_and_dense_layers_are_not_served():
    with pytest.raises(ConvArgumentError, match="grouped convolutions of 2-16 input channels"):
        _choose(16, 1, (20, 20), family="grouped_nhwc")  # depthwise: depthwise_nhwc's
    with pytest.raises(ConvArgumentError, match="grouped convolutions"):
        _choose(1, 8, (20, 20), family="grouped_nhwc")  # one group
    with pytest.raises(ConvArgumentError, match=f"got groups=4 with {MAX_CIN_G + 1} a group"):
        _choose(4, MAX_CIN_G + 1, (20, 20), family="grouped_nhwc")


def test_output_groups_must_fill_or_divide_a_vector():
    # 6 output channels a group against vectors of 4 (float32) or 8 (bf16)
    for dtype, vec in (("float32", 4), ("bfloat16", 8)):
        with pytest.raises(ConvArgumentError, match=f"fill whole vectors of {vec} or divide one"):
            _choose(4, 4, (20, 20), cout_g=6, dtype=dtype, family="grouped_nhwc")
    assert _choose(4, 4, (20, 20), cout_g=24, family="grouped_nhwc").family == "grouped_nhwc"
    assert _choose(4, 4, (20, 20), cout_g=2, dtype="bfloat16", family="grouped_nhwc").family == "grouped_nhwc"


def test_default_tiles_and_their_shared_memory():
    t = dict(_choose(32, 4, (56, 56)).tiles)
    assert t == {"block_c": 4, "vec_q": 4, "rows": 2, "threads": 256, "min_blocks": 0}
    # two groups of 2 channels: one float32 vector a pixel, so one a block
    assert dict(_choose(2, 2, (20, 20), family="grouped_nhwc").tiles)["block_c"] == 1
    # 7x7 taps of 16 channels: 4 bf16 vectors would stage 100 KB; the default halves to fit
    spec = _choose(4, 16, (30, 30), kernel=7, padding=3, dtype="bfloat16", family="grouped_nhwc")
    assert smem_bytes(spec, dict(spec.tiles)) <= SMEM_BUDGET
    assert dict(spec.tiles)["block_c"] == 1
    # a forced block_c that does not fit is refused with the reason, never shrunk
    with pytest.raises(ConvArgumentError, match="choose a smaller block_c"):
        _choose(4, 16, (30, 30), kernel=7, padding=3, dtype="bfloat16", family="grouped_nhwc",
                tiles={"block_c": 8})


def test_check_refuses_with_a_reason_for_every_unsupported_dtype_and_layout():
    base = ConvSpec(**_params(4, 4), device="cuda", layout="nhwc", family="grouped_nhwc")
    with pytest.raises(Unsupported, match="dtype float64"):
        FAM.check(base.replace(dtype="float64"))
    FAM.check(base.replace(layout="nchw"))  # its input transposed into the workspace
    with pytest.raises(Unsupported, match="layout any"):
        FAM.check(base.replace(layout="any"))


# -- lowering: one spec per run of input and dtype ----------------------------------------------

LOWER = [
    # (name, params, tiles, the vector path's input load, whether the element-wise path must keep
    # to the slack too: its loads of a wide window of long runs (17 pixels of 12 channels, 7 of 16)
    # outgrow the registers; it serves only inputs off a 16-byte boundary or with odd strides)
    ("f32-g4", _params(8, 4), None, "ld.global.nc.v4.u32", True),                 # 16-byte runs
    ("bf16-g8-bias", _params(4, 8, bias=True, dtype="bfloat16"), None, "ld.global.nc.v4.u32", True),
    ("f16-g4-out2", _params(8, 4, cout_g=2, dtype="float16"), None, "ld.global.nc.v4.u32", True),  # 2 groups a vector
    ("f32-g3-out2", _params(8, 3, cout_g=2), None, "ld.global.nc.v2.u32", True),  # runs of 6: 8-byte loads
    ("bf16-g6-strided", _params(4, 6, cout_g=8, kernel=(5, 3), stride=2, padding=(2, 1), dtype="bfloat16"),
     {"block_c": 2, "vec_q": 8, "rows": 1, "threads": 64}, "ld.global.nc.u32", False),  # runs of 6: 3 x 4 bytes
    ("bf16-g16-7x7", _params(4, 16, kernel=7, padding=3, dtype="bfloat16"), None, "ld.global.nc.v4.u32", False),
]


# Left to its own occupancy target (the default min_blocks 0, measured faster than asking for one
# block an SM), ptxas may trade a word or two of spill for another block an SM; more than this is
# a kernel outgrowing its registers.
SPILL_SLACK = 16


def _spills(report: str) -> dict[bool, int]:
    """Bytes ptxas spills (stores) in the vector (True) and element-wise (False) kernel."""
    out, vector = {}, None
    for line in report.splitlines():
        if "Function properties for" in line:
            vector = "ILb1E" in line
        elif "spill stores" in line and vector is not None:
            out[vector] = int(line.split("bytes stack frame,")[1].split("bytes spill stores")[0])
    return out


@pytest.mark.compile
@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name, params, tiles, load, element_fits", LOWER, ids=[c[0] for c in LOWER])
def test_lowers_with_its_loads_and_vector_stores_within_registers(name, params, tiles, load, element_fits, tmp_path):
    P, Q = ConvSpec(**params).output_size(30, 31)
    spec = select.choose(params, "cuda", Problem(N=2, H=30, W=31, P=P, Q=Q, device=nominal("sm_90a")), True,
                         "ieee", family="grouped_nhwc", tiles=tiles)
    text, report = lower(spec, tmp_path)
    spills = _spills(report)  # both input paths are built
    assert set(spills) == {True, False}, report
    assert spills[True] <= SPILL_SLACK, report
    if element_fits:
        assert spills[False] <= SPILL_SLACK, report
    assert "st.global.cs.v4.u32" in text  # the vector path's 16-byte streaming stores
    assert load in text


NCHW_LOWER = [
    # (name, params, the output run's streaming store: 4 pixels a thread, 16 bytes in float32)
    ("f32-g4", _params(8, 4), "st.global.cs.v4.u32"),
    ("bf16-g4-bias", _params(8, 4, bias=True, dtype="bfloat16"), "st.global.cs.v2.u32"),
]


@pytest.mark.compile
@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name, params, store", NCHW_LOWER, ids=[c[0] for c in NCHW_LOWER])
def test_nchw_calls_lower_with_the_transpose_and_runs_of_pixels(name, params, store, tmp_path):
    P, Q = ConvSpec(**params).output_size(30, 32)
    spec = select.choose(params, "cuda", Problem(N=2, H=30, W=32, P=P, Q=Q, device=nominal("sm_90a")), False,
                         "ieee", family="grouped_nhwc")
    assert spec.layout == "nchw"
    text, report = lower(spec, tmp_path)
    assert "kg_nhwc_transpose" in text  # the input's transpose into the workspace
    # three kernels: vector loads with runs of pixels or element-wise stores, and element-wise loads
    kernels = [line for line in report.splitlines() if "Function properties for" in line and "groupwise" in line]
    assert len(kernels) == 3, report
    assert max(_spills(report).values()) <= SPILL_SLACK, report
    assert store in text
