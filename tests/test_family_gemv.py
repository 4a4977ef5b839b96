"""CPU-tier tests of the `gemv` family (each output's reduction spread over a block): no GPU
needed.

What they cover: that it can serve every spec (any kernel, stride, padding, dilation, groups,
dtype, layout) on every target, the one limit on its tiles and the reason it names, that its own
first choice fills the GPU on the layers it is for, that the cost model sees its idle lanes, and
(with nvcc) that it lowers without spills, with 16-byte loads where the channels allow them and
none where they do not. Which family the selector picks for a call is measured, not asserted here.
"""

from __future__ import annotations

import re

import pytest

from kernelgen import select
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import get_family
from kernelgen.spec import ConvSpec
from family_args import params as _params, problem as _problem
from lowering import NVCC, lower

FAM = get_family("gemv")
TARGETS = (("sm_90a", False), ("sm_90a", True), ("sm_80", False), ("sm_86", False), ("sm_89", False))


def _spec(cin, cout, tiles, **kw):
    return ConvSpec(**_params(cin, cout, **kw), device="cuda", layout="any", math="ieee", family="gemv",
                    tiles=tuple(tiles.items()))


@pytest.mark.parametrize("layer", [
    dict(p=_params(2048, 512, bias=True), N=1, H=1, W=1),  # a squeeze-excitation 1x1
    dict(p=_params(120, 30, dtype="bfloat16"), N=16, H=1, W=1),
    dict(p=_params(512, 85, (3, 3), padding=1), N=1, H=14, W=14),
    dict(p=_params(58, 9, (3, 3), dtype="float16", padding=(1, 2), dilation=2), N=2, H=9, W=11),
    dict(p=_params(32, 32, (3, 3), groups=32, stride=2, padding=1, dtype="float64"), N=3, H=7, W=5),
    dict(p=_params(24, 48, (1, 7), groups=4, stride=(1, 2), padding=(0, 3)), N=1, H=17, W=17),
    dict(p=_params(3, 64, (11, 11), stride=4, padding=2), N=2, H=63, W=63),
])
def test_serves_every_kind_of_layer_on_every_target(layer):
    for arch, wide in TARGETS:
        for channels_last in (False, True):
            problem = _problem(layer["p"], layer["N"], layer["H"], layer["W"], arch, wide)
            spec = select.choose(layer["p"], "cuda", problem, channels_last, "tf32", family="gemv")
            assert spec.layout == "any" and spec.math == "ieee"  # exact float32: it has no TF32 path
            FAM.check(spec, problem.device)
            assert FAM.candidates(spec, problem)[0] == spec  # its own first choice comes first


def test_a_thread_keeps_at_most_32_sums_and_says_so():
    with pytest.raises(Unsupported, match="32 sums a thread"):
        FAM.check(_spec(64, 64, dict(block_co=16, block_px=4, warps=4)))
    FAM.check(_spec(64, 64, dict(block_co=16, block_px=2, warps=4)))
    params = _params(64, 64)
    with pytest.raises(ConvArgumentError, match="32 sums a thread"):
        select.choose(params, "cuda", _problem(params, 8, 1, 1), False, "ieee", family="gemv",
                      tiles=dict(block_co=16, block_px=8))


@pytest.mark.parametrize("cin,cout,N,H,kernel", [(2048, 512, 1, 1, (1, 1)), (960, 240, 1, 1, (1, 1)),
                                                 (174, 696, 64, 1, (1, 1)), (512, 85, 1, 14, (3, 3)),
                                                 (120, 30, 8, 1, (1, 1))])
def test_first_choice_fills_the_gpu_where_the_channels_allow(cin, cout, N, H, kernel):
    for arch, wide in TARGETS:
        params = _params(cin, cout, kernel, padding=kernel[0] // 2)
        problem = _problem(params, N, H, H, arch, wide)
        spec = select.choose(params, "cuda", problem, True, "ieee", family="gemv")
        t = dict(spec.tiles)
        pixels = N * problem.P * problem.Q
        assert t["block_px"] == min(8, 1 << (pixels - 1).bit_length())  # no pixel slot idle below 8
        assert t["block_co"] * t["block_px"] <= 32
        blocks = FAM.tiles_of(spec, problem)
        # twice the SMs in blocks, unless one output channel a block is already the least
        assert blocks >= 2 * problem.device.sms or t["block_co"] == 1
        loads = cin * kernel[0] * kernel[1] // (4 if cin % 4 == 0 else 1)  # float32: 4 a 16-byte load
        assert t["warps"] == (8 if loads >= 256 else 4 if loads >= 128 else 2)  # a load a thread or more


def test_cost_model_sees_the_idle_lanes_of_short_reductions():
    """A depthwise 3x3 (nine products an output) leaves most of a block's lanes idle; a
    squeeze-excitation 1x1 of 2048 inputs keeps them busy, its loads costing more than its FMAs."""
    def ratio(spec, problem):
        useful = 2.0 * problem.N * problem.P * problem.Q * spec.out_channels * spec.cin_per_group * 9
        return FAM.work(spec, problem) / useful

    dw = _params(256, 256, (3, 3), padding=1, groups=256)
    problem = _problem(dw, 8, 28, 28)
    assert ratio(select.choose(dw, "cuda", problem, False, "ieee", family="gemv"), problem) > 20
    se = _params(2048, 512)
    problem = _problem(se, 1, 1, 1)
    spec = select.choose(se, "cuda", problem, False, "ieee", family="gemv")
    assert 1 < FAM.work(spec, problem) / (2.0 * 2048 * 512) < 4


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("cin,cout,kernel,dtype,tiles,arch,vector", [
    (2048, 512, (1, 1), "float32", dict(block_co=2, block_px=1, warps=8), "sm_90a", True),
    (120, 30, (1, 1), "bfloat16", dict(block_co=4, block_px=8, warps=2), "sm_90a", True),
    (512, 85, (3, 3), "float16", dict(block_co=4, block_px=8, warps=4), "sm_80", True),
    (64, 64, (1, 1), "float64", dict(block_co=16, block_px=2, warps=4), "sm_90a", True),
    (58, 9, (3, 3), "float32", dict(block_co=8, block_px=4, warps=8), "sm_80", False),  # 58: no whole 16 bytes
])
def test_lowers_without_spills_with_16_byte_loads_where_channels_allow(cin, cout, kernel, dtype, tiles, arch,
                                                                       vector, tmp_path):
    spec = _spec(cin, cout, tiles, kernel=kernel, dtype=dtype, padding=kernel[0] // 2, bias=True)
    ptx, report = lower(spec, tmp_path, arch=arch)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and not any(spills), report
    sixteen = r"ld\.global(\.nc)?\.(v4\.[bfu]32|v2\.[bfu]64)"  # 16 bytes a load
    assert bool(re.search(sixteen, ptx)) == vector
    assert ptx.count(".entry") == (3 if vector else 2)  # the 16-byte instance only where it can run
