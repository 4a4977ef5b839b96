"""CPU-tier tests of the `wgrad` family (a forward convolution whose reduction is split between
blocks, for the lowered weight gradient): no GPU needed.

What they cover: that it serves every dtype, layout (strided), groups and window on every target
and that its own first choice comes first; its tile limits (shared memory on the smaller parts)
and the reasons it names; that its splits keep thousands of terms each, fill the GPU where the
reduction allows and bound the workspace, whose bytes the module declares; that the selector
plans the lowered weight gradients of the KernelBench cases and of census layers onto it on a
nominal H100, and ordinary forward layers not; the 16-byte loads' kernels, their staging tiles'
banks (a model of them) and that every path lowers without spills (nvcc); the depthwise mode's legality, its choice for
depthwise weight gradients (and nowhere else) and that it lowers without spills (nvcc). Numerics and determinism are the GPU tier's
(tests/test_gpu.py: make_wgrad_cases, test_weight_grad_through_wgrad_is_bit_identical).
"""

from __future__ import annotations

import re

import pytest
import torch

from kernelgen import gradients, select
from kernelgen.device import nominal
from kernelgen.errors import Unsupported
from kernelgen.families import get_family
from kernelgen.families import wgrad as W
from kernelgen.functional import observe_meta_calls, planning_for, spec_for
from kernelgen.render import render, spec_banner_json
from kernelgen.spec import ConvSpec
from family_args import params as _params, problem as _problem
from lowering import NVCC, lower

FAM = get_family("wgrad")
TARGETS = (("sm_90a", False), ("sm_90a", True), ("sm_80", False), ("sm_86", False), ("sm_89", False))


def _spec(cin, cout, tiles, math="ieee", **kw):
    return ConvSpec(**_params(cin, cout, **kw), device="cuda", layout="any", math=math, family="wgrad",
                    tiles=tuple(tiles.items()))


def lowered(N, C, O, H, W_, k, stride=1, padding=0, dilation=1, groups=1, dtype=torch.float32, cl=False,
            precision="tf32", arch="sm_90a"):
    """The spec(s) of the kernelgen.conv2d call(s) weight_grad makes for a layer, planned on meta
    tensors for a nominal GPU of `arch`."""
    x = torch.empty(N, C, H, W_, device="meta", dtype=dtype)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    P = (H + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    Q = (W_ + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    dy = torch.empty(N, O, P, Q, device="meta", dtype=dtype)
    if cl:
        dy = dy.contiguous(memory_format=torch.channels_last)
    found = []

    def on_call(inp, w, b, s, p, d, g, prec, family, tiles, **epi):
        found.append(spec_for(inp, w, b, s, p, d, g, device="cuda", precision=prec, family=family, tiles=tiles)[0])

    with planning_for(arch), observe_meta_calls(on_call):
        gradients.weight_grad(dy, x, (O, C // groups, k, k), stride, padding, dilation, groups, precision=precision)
    return found


@pytest.mark.parametrize("layer", [
    dict(p=_params(16, 128, (1022, 1022)), N=64, H=1024, W=1024),  # case 63's weight gradient
    dict(p=_params(16, 128, (1024, 1024), dtype="bfloat16"), N=64, H=1024, W=1024),
    dict(p=_params(64, 32, (56, 56), padding=1, groups=32, dtype="float16"), N=4, H=56, W=56),
    dict(p=_params(8, 64, (14, 14), stride=2, dilation=2, dtype="float64", bias=True), N=3, H=29, W=29),
    dict(p=_params(6, 9, (5, 3), padding=(1, 2), groups=3), N=1, H=7, W=9),
])
def test_serves_every_kind_of_layer_on_every_target(layer):
    for arch, wide in TARGETS:
        for channels_last in (False, True):
            problem = _problem(layer["p"], layer["N"], layer["H"], layer["W"], arch, wide)
            spec = select.choose(layer["p"], "cuda", problem, channels_last, "tf32", family="wgrad")
            assert spec.layout == "any"
            assert spec.math == ("tf32" if spec.dtype == "float32" else "ieee")
            FAM.check(spec, problem.device)
            assert FAM.candidates(spec, problem)[0] == spec  # its own first choice comes first


def test_epilogues_are_applied_in_the_final_sum():
    spec = _spec(16, 32, dict(block_m=64, block_n=32, splits=4), kernel=(9, 9), bias=True)
    for extra in (dict(activation="gelu"), dict(residual=True), dict(scale=True)):
        FAM.check(spec.replace(**extra))
    src = render(spec.replace(activation="relu", residual=True, scale=True)).cuda
    assert "kg_epi(" in src and "epi_s[o]" in src


def test_shared_memory_limits_name_the_gpu():
    # float64 tiles of 128 x 64 stage 108 KB: an sm_86 block takes 99 KB
    spec = _spec(8, 64, dict(block_m=128, block_n=64, splits=1), dtype="float64", kernel=(9, 9))
    FAM.check(spec, nominal("sm_90a"))
    with pytest.raises(Unsupported, match="shared memory.*A10"):
        FAM.check(spec, nominal("sm_86"))
    # its own choice there falls back to 64 rows
    params = _params(8, 64, (9, 9), dtype="float64")
    problem = _problem(params, 64, 16, 16, "sm_86")
    tiles = FAM.default_tiles(_spec(8, 64, {}, dtype="float64", kernel=(9, 9)), problem)
    assert tiles["block_m"] == 64


@pytest.mark.parametrize("cin,cout,N,plane,groups", [(16, 128, 64, 1024, 1), (16, 128, 16, 1022, 1),
                                                     (8, 128, 64, 508, 1), (32, 64, 576, 56, 1),
                                                     (32, 128, 4, 56, 32), (4, 64, 64, 256, 1)])
def test_splits_fill_the_gpu_with_long_chunks_and_a_bounded_workspace(cin, cout, N, plane, groups):
    """A lowered weight gradient: batch N (= Cg), one output pixel or a few, a reduction of
    cin x plane^2 terms (the forward's batch and output plane)."""
    for arch, wide in TARGETS:
        params = _params(cin * groups, cout, (plane, plane), groups=groups)
        problem = _problem(params, N, plane, plane, arch, wide)
        spec = select.choose(params, "cuda", problem, False, "tf32", family="wgrad")
        t = dict(spec.tiles)
        red = W.reduction(spec)
        assert t["splits"] == 1 or red // t["splits"] >= W.MIN_CHUNK
        blocks = FAM.tiles_of(spec, problem)
        sms = problem.device.sms
        if red // W.MIN_CHUNK >= 2 * sms:  # reduction enough for every SM twice: the launch fills them
            assert blocks >= 1.5 * sms, (arch, t, blocks)
        outputs = N * problem.P * problem.Q * cout
        assert t["splits"] * outputs * 4 <= W.WORKSPACE_CAP


def test_workspace_is_each_splits_partial_sums_in_the_accumulators_type():
    for dtype, acc in (("float32", 4), ("bfloat16", 4), ("float16", 4), ("float64", 8)):
        spec = _spec(16, 32, dict(block_m=64, block_n=32, splits=12), dtype=dtype, kernel=(9, 9))
        ctx = spec.template_context()
        assert (ctx["WORKSPACE_BYTES"], ctx["WORKSPACE_PER_INPUT"], ctx["WORKSPACE_PER_OUTPUT"]) == (0, 0, 12 * acc)
        assert f'"KG_WORKSPACE_PER_OUTPUT", {12 * acc})' in render(spec).cpp


def test_rendered_source_carries_the_spec_and_no_caller_text():
    spec = _spec(16, 128, dict(block_m=128, block_n=64, splits=96), math="tf32", kernel=(1022, 1022), bias=True)
    out = render(spec)
    assert ConvSpec.from_dict(spec_banner_json(out.cuda)) == spec
    assert "cvt.rna.tf32.f32" in out.cuda  # TF32 rounds nearest, as the other families do
    assert "constexpr int BM = 128, BN = 64, BK = 32, NTH = 256, SPLITS = 96;" in out.cuda


def test_tiles_and_splits_are_a_function_of_the_call():
    params = _params(16, 128, (1022, 1022))
    problem = _problem(params, 16, 1024, 1024)
    base = _spec(16, 128, {}, kernel=(1022, 1022))
    assert FAM.default_tiles(base, problem) == FAM.default_tiles(base, problem)
    # forced tiles hold, the rest chosen around them
    t = FAM.default_tiles(base, problem, fixed=dict(splits=3))
    assert t["splits"] == 3


# ---- the 16-byte loads (p.a_vec, p.b_vec) and the skewed staging tiles ----------------------------

def _gemm_spec(dtype, math, bm, bn, **kw):
    return _spec(16, 64, dict(block_m=bm, block_n=bn, splits=8), dtype=dtype, math=math, kernel=(5, 5), **kw)


@pytest.mark.parametrize("dtype,math", [("bfloat16", "ieee"), ("float16", "ieee"), ("float32", "tf32"),
                                        ("float32", "ieee"), ("float64", "ieee")])
def test_rendered_kernel_carries_the_16_byte_path(dtype, math):
    spec = _gemm_spec(dtype, math, 128, 16)
    ctx, src = spec.template_context(), render(spec).cuda
    # the launch decides each operand from the call's pointers, strides and sizes; one kernel each way
    assert "p.a_vec = A_VEC_OK && p.a_kfast == 0" in src and "p.b_vec = B_VEC_OK && p.b_kfast == 0" in src
    assert "reinterpret_cast<uintptr_t>(a->x) % 16 == 0" in src and "reinterpret_cast<uintptr_t>(a->w) % 16 == 0" in src
    for av, bv in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert f"kg_wgrad_kernel<{'true' if av else 'false'}, {'true' if bv else 'false'}>" in src
    assert src.count("__ldg(reinterpret_cast<const uint4*>") == 2  # A's run and B's
    # the staging tiles: groups of 8 rows skewed, and the shared memory they take
    es = {"float64": 8, "float32": 4}.get(dtype, 2)
    assert (ctx["SKEW_A"], ctx["SKEW_B"]) == (W.skew(128, es), W.skew(16, es))
    assert f"constexpr int SKEW_A = {ctx['SKEW_A']}, SKEW_B = {ctx['SKEW_B']};" in src
    ldk = ctx["LDK"]
    tiles = 128 * ldk + 16 * ctx["SKEW_A"] + 16 * ldk + 2 * ctx["SKEW_B"]
    assert ctx["SMEM_BYTES"] == (3 * 128 + 16) * 8 + 2 * tiles * es
    # the depthwise mode loads element by element and has no GEMM kernel
    dsrc = render(_dwspec(64, 8, 1, (28, 28), {}, dtype=dtype, math=math)).cuda
    assert "p.a_vec = p.b_vec = 0;" in dsrc and "kg_wgrad_kernel<" not in dsrc


def _banks(addresses, esize):
    """Shared-memory wavefronts of one warp instruction (element addresses, one a lane) over what
    its bytes need at least; 8-byte accesses a half-warp at a time."""
    def wavefronts(addrs):  # (taken, least)
        banks = {}
        for a in addrs:
            for w in range(max(esize // 4, 1)):
                word = a * esize // 4 + w
                banks.setdefault(word % 32, set()).add(word)
        words = sum(len(v) for v in banks.values())
        return max(len(v) for v in banks.values()), max(1, -(-words * 4 // 128))
    parts = [addresses[:16], addresses[16:]] if esize == 8 and len(addresses) > 16 else [addresses]
    return sum(wavefronts(a)[0] for a in parts) / sum(wavefronts(a)[1] for a in parts)


@pytest.mark.parametrize("dtype,math", [("bfloat16", "ieee"), ("float32", "tf32"), ("float32", "ieee"),
                                        ("float64", "ieee")])
def test_skewed_tiles_keep_stores_and_fragments_on_distinct_banks(dtype, math):
    """The staged tile's row r at r * LDK + (r / 8) * skew (the kernel's srow): a 16-byte run's stores
    (one element a row, down a k column), the element path's stores (both lane mappings), the MMA
    fragments' reads and the FMA path's A reads each take the fewest wavefronts their bytes allow,
    on every tile (the FMA's B reads of 64 columns conflict 2-way, skewed or not, as before); without
    the skew the runs' stores of 16-bit rows would conflict 8-way."""
    es = {"float64": 8, "float32": 4}.get(dtype, 2)
    vec, bk, nth = 16 // es, W.BK, W.NTH
    for bm, bn in ((64, 16), (64, 32), (64, 64), (128, 16), (128, 32), (128, 64)):
        spec = _gemm_spec(dtype, math, bm, bn)
        if dtype in ("bfloat16", "float64") or math == "tf32":
            try:
                FAM.check(spec)
            except Unsupported:
                continue
        lay = W.layout(spec, bm, bn)
        ldk = lay["LDK"]

        def at(r, k, sk):
            return r * ldk + (r >> 3) * sk + k

        worst = []
        for rows, sk in ((bm, lay["SKEW_A"]), (bn, lay["SKEW_B"])):
            tpk = W.vector_runs(rows, es)
            for w in range(nth // 32):
                lanes = [t for t in range(32 * w, 32 * w + 32) if t < tpk * bk]
                for i in range(rows // vec // tpk if lanes else 0):
                    for e in range(vec):  # the runs' stores
                        worst.append(_banks([at((t % tpk + tpk * i) * vec + e, t // tpk, sk) for t in lanes], es))
                        if es == 2 and rows == bm:  # (and what they would be unskewed)
                            assert _banks([at((t % tpk + tpk * i) * vec + e, t // tpk, 0) for t in lanes], es) == 8
                for i in range(rows // 8):  # the element path's, lanes along the rows or along k
                    for kfast in (0, 1):
                        lanes = range(32 * w, 32 * w + 32)
                        worst.append(_banks([at((t // bk if kfast else t % 8) + 8 * i, t % bk if kfast else t // 8, sk)
                                             for t in lanes], es))
        if W.mma(spec):  # fragments: rows base + lane / 4 (+ 8), k = lane % 4 (pairs of 16-bit)
            for rows, warps, step, sk in ((bm, lay["WARPS_M"], 16, lay["SKEW_A"]), (bn, lay["WARPS_N"], 8, lay["SKEW_B"])):
                for base in range(0, rows, step):
                    for half in (0, 8) if step == 16 else (0,):
                        addr = [at(base + half + lane // 4, (2 if es == 2 else 1) * (lane % 4), sk) // (2 if es == 2 else 1)
                                for lane in range(32)]
                        worst.append(_banks(addr, 4 if es == 2 else es))
        else:  # FMA: a thread's rows tr + TROW i of A, columns tc + TCOL j of B, one k (broadcasts)
            tcol = bn // 4
            trow = nth // tcol
            for w in range(nth // 32):
                lanes = range(32 * w, 32 * w + 32)
                for i in range(bm // trow):
                    worst.append(_banks([at(t // tcol + trow * i, 0, lay["SKEW_A"]) for t in lanes], es))
        assert max(worst) == 1, (bm, bn, max(worst))


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype,math,bm,bn", [("bfloat16", "ieee", 128, 64), ("float16", "ieee", 64, 16),
                                              ("float32", "tf32", 128, 32), ("float32", "ieee", 64, 32),
                                              ("float64", "ieee", 64, 16)])
def test_every_path_lowers_with_16_byte_loads_and_without_spills(dtype, math, bm, bn, tmp_path):
    """Four kernels (A's and B's 16-byte path or element path), each without spills; the 16-byte
    ones load with ld.global.nc.v4."""
    ptx, report = lower(_gemm_spec(dtype, math, bm, bn), tmp_path)
    assert len(re.findall(r"Compiling entry function '\w*kg_wgrad_kernel\w*'", report)) == 4, report
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and not any(spills), report
    assert "ld.global.nc.v4" in ptx


# ---- what the selector plans (nominal H100: the H200 table's rows, no GPU) ---------------------

CASES = {  # KernelBench's, as bench_backward names them
    "case.87": dict(N=16, C=64, O=128, H=1024, W_=1024, k=1),
    "case.63": dict(N=16, C=16, O=128, H=1024, W_=1024, k=3),
    "case.56": dict(N=8, C=64, O=128, H=512, W_=256, k=5),  # (5x7 in the case: a square stand-in)
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cell", [("tf32", False, torch.float32), ("bf16", True, torch.bfloat16),
                                  ("ieee", False, torch.float32)])
def test_lowered_weight_gradients_of_the_cases_plan_to_wgrad(name, cell):
    precision, cl, dtype = cell
    specs = lowered(**CASES[name], dtype=dtype, cl=cl, precision="ieee" if precision == "ieee" else "tf32")
    assert [s.family for s in specs] == ["wgrad"], [s.summary() for s in specs]
    assert dict(specs[0].tiles)["splits"] >= 32


@pytest.mark.parametrize("layer", [
    dict(N=32, C=64, O=64, H=56, W_=56, k=3, padding=1),  # ResNet-50 layer 1's 3x3
    dict(N=32, C=3, O=64, H=224, W_=224, k=7, stride=2, padding=3),  # its stem
    dict(N=32, C=144, O=24, H=56, W_=56, k=1),  # MobileNetV2's projection
    dict(N=8, C=64, O=64, H=224, W_=224, k=3, padding=1),  # VGG's first
    dict(N=32, C=128, O=128, H=56, W_=56, k=3, padding=1, groups=32),  # ResNeXt's grouped 3x3
])
def test_lowered_weight_gradients_of_training_layers_plan_to_wgrad(layer):
    for cl, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        specs = lowered(**layer, dtype=dtype, cl=cl)
        assert [s.family for s in specs] == ["wgrad"], [s.summary() for s in specs]


@pytest.mark.parametrize("layer", [
    dict(p=_params(64, 128), N=16, H=1024, W=1024),  # case 87's forward
    dict(p=_params(16, 128, (3, 3)), N=16, H=1024, W=1024),  # case 63's
    dict(p=_params(64, 64, (3, 3), padding=1), N=32, H=56, W=56),
    dict(p=_params(512, 512, (3, 3), padding=1), N=32, H=7, W=7),
    dict(p=_params(1024, 1024, (3, 3), padding=1, groups=32), N=32, H=7, W=7),
    dict(p=_params(2048, 512), N=1, H=7, W=7),
    dict(p=_params(3, 64, (7, 7), stride=2, padding=3), N=32, H=224, W=224),
])
def test_ordinary_forward_layers_do_not_plan_to_wgrad(layer):
    for channels_last, math, dtype in ((False, "tf32", "float32"), (True, "ieee", "bfloat16")):
        params = {**layer["p"], "dtype": dtype}
        problem = _problem(params, layer["N"], layer["H"], layer["W"])
        ranked = select.ranked(params, "cuda", problem, channels_last, math)
        assert ranked[0].family != "wgrad", ranked[0].summary()
        assert "wgrad" in {s.family for s in ranked}  # (it can serve them: the selector says it should not)


# ---- the depthwise mode (dw_rows, groups_block > 0) ----------------------------------------------

def _dwspec(groups, nb, mult, kernel, tiles, dtype="float32", math="ieee", **kw):
    """The lowered conv of a depthwise layer: `groups` channels, batch `nb` (each group's input
    channels), `mult` output channels a group, the forward's dY plane as `kernel`."""
    base = dict(block_m=64, block_n=16, splits=8, dw_rows=9, groups_block=32)
    return ConvSpec(**_params(groups * nb, groups * mult, kernel, groups=groups, dtype=dtype, **kw),
                    device="cuda", layout="any", math=math, family="wgrad", tiles=tuple({**base, **tiles}.items()))


def test_depthwise_mode_legality_and_reasons():
    FAM.check(_dwspec(32, 4, 1, (56, 56), {}))
    FAM.check(_dwspec(32, 4, 4, (56, 56), dict(dw_rows=16)))  # 64 float32 sums a thread
    FAM.check(_dwspec(32, 4, 2, (56, 56), dict(dw_rows=16), dtype="float64"))  # 32 float64
    FAM.check(_dwspec(96, 4, 1, (28, 28), dict(dw_rows=49, groups_block=8), dtype="bfloat16"))
    with pytest.raises(Unsupported, match="dw_rows and groups_block together"):
        FAM.check(_dwspec(32, 4, 1, (56, 56), dict(groups_block=0)))
    with pytest.raises(Unsupported, match="dw_rows and groups_block together"):
        FAM.check(_dwspec(32, 4, 1, (56, 56), dict(dw_rows=0)))
    with pytest.raises(Unsupported, match="up to 4 output channels a group, not 5"):
        FAM.check(_dwspec(32, 4, 5, (56, 56), {}))
    with pytest.raises(Unsupported, match="25 rows x 4 output channels = 100 float32 accumulators.*at most 64"):
        FAM.check(_dwspec(32, 4, 4, (56, 56), dict(dw_rows=25)))
    with pytest.raises(Unsupported, match="36 float64 accumulators.*at most 32"):
        FAM.check(_dwspec(32, 4, 4, (56, 56), dict(dw_rows=9), dtype="float64"))
    with pytest.raises(Unsupported, match="no GEMM tile"):
        FAM.check(_dwspec(32, 4, 1, (56, 56), dict(block_m=128)))
    # the GEMM mode is the default of a spec that names neither
    assert dict(_spec(16, 32, dict(block_m=64, block_n=32, splits=4)).tiles)["dw_rows"] == 0


def test_depthwise_mode_tiles_follow_the_rows_and_the_reduction():
    for k, rows in ((3, 9), (5, 25), (7, 49)):
        params = _params(32 * 16, 32, (56, 56), groups=32, padding=k // 2)  # 32 groups, batch 16
        problem = _problem(params, 1, 56, 56)
        assert (problem.P, problem.Q) == (k, k)
        t = FAM.default_tiles(ConvSpec(**params, device="cuda", layout="any", family="wgrad"), problem)
        assert t["dw_rows"] == rows and t["groups_block"] in (8, 32) and (t["block_m"], t["block_n"]) == (64, 16)
        spec = ConvSpec(**params, device="cuda", layout="any", family="wgrad", tiles=tuple(t.items()))
        assert t["splits"] == 1 or W.reduction(spec) // t["splits"] >= W.MIN_CHUNK
        FAM.check(spec)
    # multiplier 2 with 7 x 7 taps: 98 sums a thread; multiplier 5: no depthwise mode, the GEMM tile
    for mult in (2, 5):
        params = _params(32 * 16, 32 * mult, (56, 56), groups=32, padding=3 if mult == 2 else 1)
        problem = _problem(params, 1, 56, 56)
        t = FAM.default_tiles(ConvSpec(**params, device="cuda", layout="any", family="wgrad"), problem)
        assert (t["dw_rows"], t["groups_block"]) == (0, 0), t
    # forcing either mode holds
    params = _params(32 * 16, 32, (56, 56), groups=32, padding=1)
    problem = _problem(params, 1, 56, 56)
    base = ConvSpec(**params, device="cuda", layout="any", family="wgrad")
    assert FAM.default_tiles(base, problem, fixed=dict(dw_rows=0))["groups_block"] == 0
    assert FAM.default_tiles(base, problem, fixed=dict(block_m=128))["dw_rows"] == 0
    assert FAM.default_tiles(base, problem, fixed=dict(groups_block=8))["dw_rows"] == 9
    assert FAM.default_tiles(base, problem, fixed=dict(splits=3, dw_rows=16)) == dict(
        block_m=64, block_n=16, splits=3, dw_rows=16, groups_block=FAM.default_tiles(
            base, problem, fixed=dict(splits=3, dw_rows=16))["groups_block"])


def test_depthwise_mode_is_refused_where_its_32_bit_rows_and_columns_do_not_hold_the_call():
    # Settled when the call is planned, not at its launch: a plane 2^30 rows tall plans the GEMM
    # tile, and forcing the depthwise mode there names the reason.
    params = _params(32 * 16, 32, (1, 8), groups=32, padding=(0, 1))
    base = ConvSpec(**params, device="cuda", layout="any", family="wgrad")
    small, tall = _problem(params, 1, 1, 8), _problem(params, 1, 1 << 30, 8)
    assert W.dw_reach_fits(base, small) and not W.dw_reach_fits(base, tall)
    assert FAM.default_tiles(base, small)["dw_rows"] > 0
    assert FAM.default_tiles(base, tall)["dw_rows"] == 0
    with pytest.raises(Unsupported, match="depthwise mode indexes the input's rows and columns in 32 bits"):
        FAM.default_tiles(base, tall, fixed=dict(groups_block=8))


def test_depthwise_mode_workspace_is_each_splits_partial_sums():
    for dtype, acc in (("float32", 4), ("bfloat16", 4), ("float16", 4), ("float64", 8)):
        spec = _dwspec(64, 8, 1, (28, 28), dict(splits=12), dtype=dtype)
        ctx = spec.template_context()
        assert (ctx["WORKSPACE_BYTES"], ctx["WORKSPACE_PER_INPUT"], ctx["WORKSPACE_PER_OUTPUT"]) == (0, 0, 12 * acc)
        assert ctx["DW_SMEM"] == 3 * 9 * 8 + 80 + 256 * W.DW_CH * acc
        out = render(spec).cpp
        assert f'"KG_WORKSPACE_PER_OUTPUT", {12 * acc})' in out
    src = render(_dwspec(64, 8, 2, (28, 28), {})).cuda
    assert "kg_wgrad_dw_kernel<<<" in src and "kg_wgrad_kernel<<<" not in src and "mma(" not in src.split(
        "kg_wgrad_dw_kernel(const Params p)")[1]
    assert "kg_wgrad_dw_kernel(const Params p)" not in render(_spec(16, 32, dict(block_m=64, block_n=32, splits=4))).cuda


DEPTHWISE = {  # the forward layer (N, C = O x 1/mult, H, W, k, ...) whose weight gradient is lowered
    "mv2.dw32.112": dict(N=32, C=32, O=32, H=112, W_=112, k=3, padding=1, groups=32),
    "mv2.dw144.56": dict(N=32, C=144, O=144, H=56, W_=56, k=3, padding=1, groups=144),
    "case.84": dict(N=64, C=128, O=128, H=256, W_=512, k=3, groups=128),
    "convnext.7x7": dict(N=32, C=96, O=96, H=56, W_=56, k=7, padding=3, groups=96),
    "dw.5x5.x2": dict(N=16, C=64, O=128, H=56, W_=56, k=5, padding=2, groups=64),
}


@pytest.mark.parametrize("name", sorted(DEPTHWISE))
@pytest.mark.parametrize("cell", [("tf32", False, torch.float32), ("bf16", True, torch.bfloat16)])
def test_depthwise_weight_gradients_plan_to_the_depthwise_mode(name, cell):
    precision, cl, dtype = cell
    specs = lowered(**DEPTHWISE[name], dtype=dtype, cl=cl)
    assert [s.family for s in specs] == ["wgrad"], [s.summary() for s in specs]
    t = dict(specs[0].tiles)
    assert t["dw_rows"] > 0 and t["groups_block"] > 0, specs[0].summary()


@pytest.mark.parametrize("layer", [
    dict(N=32, C=64, O=64, H=56, W_=56, k=3, padding=1),
    dict(N=32, C=128, O=128, H=56, W_=56, k=3, padding=1, groups=32),  # 4 channels a group: 36 rows x 4
    dict(N=32, C=144, O=24, H=56, W_=56, k=1),
])
def test_other_weight_gradients_keep_the_gemm_tile(layer):
    for cl, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        for s in lowered(**layer, dtype=dtype, cl=cl):
            assert s.family != "wgrad" or dict(s.tiles)["dw_rows"] == 0, s.summary()


@pytest.mark.parametrize("layer", [
    dict(p=_params(96, 96, (3, 3), padding=1, groups=96), N=32, H=56, W=56),  # forward depthwise layers
    dict(p=_params(960, 960, (3, 3), padding=1, groups=960), N=32, H=7, W=7),
    dict(p=_params(96, 192, (5, 5), padding=2, groups=96), N=8, H=28, W=28),
])
def test_forward_depthwise_layers_do_not_plan_to_wgrad(layer):
    for channels_last, math, dtype in ((False, "tf32", "float32"), (True, "ieee", "bfloat16")):
        params = {**layer["p"], "dtype": dtype}
        problem = _problem(params, layer["N"], layer["H"], layer["W"])
        assert select.choose(params, "cuda", problem, channels_last, math).family != "wgrad"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype,math,mult,rows,groups_block", [
    ("float32", "ieee", 1, 9, 32), ("float32", "tf32", 2, 9, 8), ("bfloat16", "ieee", 1, 49, 8),
    ("float16", "ieee", 2, 25, 32), ("float64", "ieee", 1, 25, 32), ("float64", "ieee", 2, 9, 8),
    ("float32", "ieee", 1, 49, 32), ("bfloat16", "ieee", 4, 9, 32),
    # at the accumulators' bound: 64 float32, 32 float64 a thread
    ("float32", "tf32", 4, 16, 8), ("float64", "ieee", 2, 16, 32), ("float16", "ieee", 4, 16, 8),
])
def test_depthwise_mode_lowers_without_spills(dtype, math, mult, rows, groups_block, tmp_path):
    """3x3, 5x5 and 7x7 taps (9, 25, 49 rows), multipliers 1, 2 and 4. NCHW- and channels_last-derived
    calls run the same kernel: the lanes' mapping is the launch's, from the strides."""
    spec = _dwspec(64, 16, mult, (56, 56), dict(dw_rows=rows, groups_block=groups_block, splits=24),
                   dtype=dtype, math=math, stride=2, dilation=1, padding=1)
    ptx, report = lower(spec, tmp_path)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and not any(spills), report
    assert "mma.sync" not in ptx  # FFMA (DFMA) only
    assert ("fma.rn.f64" if dtype == "float64" else "fma.rn.f32") in ptx
