"""Fused epilogues (issue 53): kernelgen.conv2d(..., activation=, negative_slope=, residual=).

Pure tier: the spec, the key, rendering every family with an epilogue, the errors. Compile tier:
the CPU family against torch (F.conv2d then the activation, in float64) for every activation, with
and without a residual, in float32, float64 and bfloat16; residuals of any strides; the torch tools
through the operator. nvcc: one epilogue spec of every CUDA family compiles.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernelgen
from kernelgen import compiled, functional, select
from kernelgen.cache import cache_key
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import all_families, get_family
from kernelgen.render import render
from kernelgen.spec import ACTIVATIONS, ConvSpec, Problem
from kernelgen.toolchain import current
from activations import ACTS, activate



def expected(x, w, b, activation=None, negative_slope=0.01, residual=None, **kw):
    """torch's answer in float64: F.conv2d, the residual, the activation."""
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), **kw)
    if residual is not None:
        y = y + residual.double()
    return activate(y, activation, negative_slope)


def rel_err(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def test_activations_are_public_and_match_the_spec():
    assert kernelgen.ACTIVATIONS == ACTIVATIONS
    assert set(ACTIVATIONS) == set(ACTS) | {"leaky_relu"}
    assert "ACTIVATIONS" in kernelgen.__all__


# -- the spec and the key ------------------------------------------------------------------------

BASE = ConvSpec(16, 32, 3, padding=1, bias=True, family="direct")


def test_spec_canonicalises_and_checks_the_epilogue():
    assert ConvSpec(16, 32, 3, activation=None) == ConvSpec(16, 32, 3) == ConvSpec(16, 32, 3, activation="none")
    assert not BASE.epilogue and BASE.replace(residual=True).epilogue and BASE.replace(activation="gelu").epilogue
    with pytest.raises(ConvArgumentError, match="activation must be None or one of"):
        ConvSpec(16, 32, 3, activation="tanh")
    with pytest.raises(ConvArgumentError, match="activation must be None or one of"):
        ConvSpec(16, 32, 3, activation=1)
    with pytest.raises(TypeError, match="residual must be True or False"):
        ConvSpec(16, 32, 3, residual=1)
    spec = BASE.replace(activation="silu", residual=True)
    assert ConvSpec.from_dict(spec.to_dict()) == spec
    assert "+residual +silu" in spec.summary()
    ctx = spec.template_context()
    assert (ctx["ACT"], ctx["HAS_RESIDUAL"], ctx["EPILOGUE"]) == ("silu", True, True)


def test_a_spec_without_an_epilogue_keeps_its_json_and_source():
    # The epilogue's fields are left out of the JSON at their defaults, and its macros render
    # nothing: a spec without one has the key it had before epilogues existed.
    assert "activation" not in BASE.to_json() and "residual" not in BASE.to_json()
    for fam in all_families().values():
        spec = _spec_of(fam.name)
        source = render(spec).cuda or render(spec).cpp
        assert not re.search(r"fused epilogue|kg_act|\bepi_r\b|\bepi_alpha\b", source), fam.name


def test_an_epilogue_changes_the_cache_key():
    tc = current("cpu")
    plain = BASE.replace(device="cpu", family="cpu_direct", tiles=())
    keys = {cache_key(s, render(s), tc) for s in
            (plain, plain.replace(activation="relu"), plain.replace(activation="gelu"), plain.replace(residual=True),
             plain.replace(activation="relu", residual=True))}
    assert len(keys) == 5


# -- every family: can, render, compile ----------------------------------------------------------

# (N, C, K, H, W, kernel, stride, padding, groups, channels_last, dtype, math): a call each family serves
FAMILY_CALLS = {
    "direct": (2, 8, 12, 11, 13, 3, 2, 1, 2, False, "float32", "ieee"),
    "gemv": (1, 960, 240, 1, 1, 1, 1, 0, 1, False, "float32", "ieee"),
    "depthwise": (2, 32, 32, 28, 28, 3, 1, 1, 32, False, "bfloat16", "ieee"),
    "depthwise_planes": (8, 32, 32, 7, 7, 3, 1, 1, 32, False, "float32", "ieee"),
    "depthwise_nhwc": (2, 32, 32, 28, 28, 3, 1, 1, 32, True, "bfloat16", "ieee"),
    "grouped_nhwc": (2, 128, 128, 14, 14, 3, 1, 1, 32, True, "float16", "ieee"),
    "grouped_mma": (8, 256, 256, 14, 14, 3, 1, 1, 16, True, "bfloat16", "ieee"),
    "pointwise": (4, 64, 128, 32, 32, 1, 1, 0, 1, False, "bfloat16", "ieee"),
    "igemm": (4, 64, 128, 28, 28, 3, 1, 1, 1, False, "float32", "tf32"),
    "wgmma": (4, 64, 128, 64, 64, 3, 1, 1, 1, False, "bfloat16", "ieee"),
    "nhwc": (4, 64, 128, 28, 28, 3, 1, 1, 1, True, "bfloat16", "ieee"),  # (wg=1: the staged 16-bit rows)
    "nhwc_tma": (4, 64, 128, 28, 28, 3, 1, 1, 1, True, "bfloat16", "ieee"),
    "pointwise_tma": (4, 64, 128, 32, 32, 1, 1, 0, 1, False, "float32", "tf32"),
    "pointwise_tile": (4, 64, 128, 32, 32, 1, 1, 0, 1, False, "float32", "tf32"),
    "stem_nhwc": (4, 3, 32, 64, 64, 3, 2, 1, 1, True, "float16", "ieee"),
    "wgrad": (16, 16, 128, 64, 64, 62, 1, 0, 1, False, "bfloat16", "ieee"),  # (a lowered weight gradient)
    "cpu_direct": (2, 8, 12, 11, 13, 3, 2, 1, 2, False, "float32", "ieee"),
}


def _spec_of(family: str, activation: str = "none", residual: bool = False, every: bool = False,
             scale: bool = False):
    N, C, K, H, W, k, s, p, g, cl, dtype, math = FAMILY_CALLS[family]
    fam = get_family(family)
    params = dict(in_channels=C, out_channels=K, kernel_size=k, stride=s, padding=p, dilation=1, groups=g,
                  dtype=dtype, bias=True, activation=activation, residual=residual, scale=scale)
    P, Q = ConvSpec(**params).output_size(H, W)
    problem = Problem(N, H, W, P, Q, device=nominal("sm_90a") if fam.device == "cuda" else None)
    specs = select.ranked(params, fam.device, problem, cl, math, family=family, every=every)
    return specs if every else specs[0]


def test_family_calls_cover_every_family():
    assert set(FAMILY_CALLS) == set(all_families())


@pytest.mark.parametrize("family", sorted(FAMILY_CALLS))
def test_every_family_fuses_and_renders_every_epilogue(family):
    assert get_family(family).epilogue, f"{family} does not declare epilogues"
    for activation in ("none",) + ACTIVATIONS:
        for residual in (False, True):
            if activation == "none" and not residual:
                continue
            every = activation == "gelu"  # (every candidate of the family once, the first choice else)
            specs = _spec_of(family, activation, residual, every=every)
            for spec in specs if every else [specs]:
                assert (spec.activation, spec.residual) == (activation, residual)
                r = render(spec)
                source = r.cuda or r.cpp
                # stores wrapped in the epilogue (its calls end with the slope), the residual read
                assert re.search(r"epi_alpha\)", source), spec.summary()
                assert bool(re.search(r"kg_epi(_if)?\([^;]*\bepi_r\b", source)) == residual, spec.summary()
                assert ("kernel built with a residual" in source) == residual


def test_a_family_that_does_not_fuse_is_never_handed_an_epilogue(monkeypatch):
    spec = _spec_of("igemm", "relu", True)
    fam = dataclasses.replace(get_family("igemm"), epilogue=False)
    with pytest.raises(Unsupported, match="does not fuse epilogues"):
        fam.check(spec)
    # The selector skips it, and forcing it explains why.
    from kernelgen import families

    monkeypatch.setitem(families.all_families(), "igemm", fam)
    x = torch.empty(4, 64, 28, 28, device="meta")
    w = torch.empty(128, 64, 3, 3, device="meta")
    r = torch.empty(4, 128, 28, 28, device="meta")
    with functional.planning_for("sm_90a"):
        specs, _ = functional.candidates_for(x, w, None, 1, 1, device="cuda", activation="relu", residual=r,
                                             every=True)
        assert specs and all(s.family != "igemm" and s.activation == "relu" and s.residual for s in specs)
        with pytest.raises(ConvArgumentError, match="igemm does not fuse epilogues"):
            functional.spec_for(x, w, None, 1, 1, device="cuda", family="igemm", activation="relu", residual=r)


@pytest.mark.compile
@pytest.mark.nvcc
def test_one_epilogue_spec_of_every_cuda_family_compiles():
    # Each family with a residual and a different activation (every one of them somewhere), at
    # sm_90a, in parallel.

    cuda = sorted(n for n, f in all_families().items() if f.device == "cuda")
    acts = [ACTIVATIONS[i % len(ACTIVATIONS)] for i in range(len(cuda))]
    sample = [_spec_of(name, act, True) for name, act in zip(cuda, acts)]

    _assert_all_lower(sample)


def _assert_all_lower(specs) -> None:
    """Each spec rendered and lowered by nvcc (sm_90a), in parallel; the first failures named."""
    from lowering import lower

    def one(spec):
        with tempfile.TemporaryDirectory() as d:
            try:
                lower(spec, Path(d))
            except AssertionError as exc:
                return f"{spec.summary()}: {str(exc)[-1500:]}"
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [f for f in pool.map(one, specs) if f]
    assert not failures, "\n\n".join(failures[:4])


# -- the epilogue's scale (a folded BatchNorm's, float32 per output channel) ------------------------

SCALE_FAMILIES = sorted(n for n, f in all_families().items() if f.scale)


def test_every_family_applies_a_scale():
    # (the depthwise and groupwise ones, which start the sum with the bias, scale their taps instead)
    assert set(SCALE_FAMILIES) == set(all_families())


@pytest.mark.parametrize("family", SCALE_FAMILIES)
def test_every_scale_family_renders_its_candidates_with_the_scale(family):
    for activation, residual in (("none", False), ("relu", True)):
        specs = _spec_of(family, activation, residual, every=True, scale=True)
        assert specs, family
        for spec in specs:
            assert spec.scale and "+scale" in spec.summary()
            r = render(spec)
            source = r.cuda or r.cpp
            assert "epi_s[" in source and "kernel built with a scale, got none" in source, spec.summary()


def test_a_family_without_the_scale_refuses_it(monkeypatch):
    spec = _spec_of("depthwise", "relu")
    fam = dataclasses.replace(get_family("depthwise"), scale=False)
    with pytest.raises(Unsupported, match="does not apply an epilogue scale"):
        fam.check(spec.replace(scale=True))
    from kernelgen import families

    monkeypatch.setitem(families.all_families(), "depthwise", fam)
    with pytest.raises(ConvArgumentError, match="scale"):  # (forced: the selector says why)
        _spec_of("depthwise", "relu", every=True, scale=True)


def test_the_scale_is_in_the_spec_only_when_set():
    spec = _spec_of("direct")
    assert "scale" not in spec.to_json() and "+scale" not in spec.summary()
    scaled = spec.replace(scale=True)
    assert '"scale":true' in scaled.to_json() and ConvSpec.from_dict(json.loads(scaled.to_json())) == scaled
    assert render(spec).cuda != render(scaled).cuda
    with pytest.raises(TypeError, match="scale must be True or False"):
        spec.replace(scale=1)


@pytest.mark.compile
@pytest.mark.nvcc
def test_one_scale_spec_of_every_cuda_family_compiles():
    # Each scale family's first choice with the scale (and a residual and an activation on every other
    # one), at sm_90a, in parallel.

    cuda = [n for n in SCALE_FAMILIES if get_family(n).device == "cuda"]
    sample = [_spec_of(name, "silu" if i % 2 else "none", bool(i % 2), scale=True) for i, name in enumerate(cuda)]

    _assert_all_lower(sample)


# -- errors, before anything compiles ------------------------------------------------------------

def _call_args():
    x = torch.randn(2, 4, 9, 9)
    w = torch.randn(6, 4, 3, 3)
    return x, w


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(activation="tanh"), ConvArgumentError, "activation must be None or one of"),
    (dict(activation="ReLU"), ConvArgumentError, "activation must be None or one of"),
    (dict(activation=F.relu), ConvArgumentError, "activation must be None or one of"),
    (dict(activation="leaky_relu", negative_slope=float("nan")), ConvArgumentError, "finite float"),
    (dict(activation="leaky_relu", negative_slope=float("inf")), ConvArgumentError, "finite float"),
    (dict(activation="leaky_relu", negative_slope=1e39), ConvArgumentError, "float32's range"),
    (dict(activation="leaky_relu", negative_slope="0.1"), ConvArgumentError, "finite float"),
    (dict(activation="leaky_relu", negative_slope=True), ConvArgumentError, "finite float"),
    (dict(residual=torch.randn(2, 6, 9, 8)), ConvArgumentError, r"output's shape \[2, 6, 9, 9\]"),
    (dict(residual=torch.randn(6, 9, 9)), ConvArgumentError, r"output's shape \[2, 6, 9, 9\]"),
    (dict(residual=torch.randn(2, 6, 9, 9, dtype=torch.float64)), ConvArgumentError, "output's dtype torch.float32"),
    (dict(residual=torch.randn(2, 6, 9, 9, device="meta")), ConvArgumentError, "output's device cpu"),
    (dict(residual=[[1.0]]), TypeError, "argument 'residual' must be Tensor or None"),
])
def test_bad_epilogue_arguments_are_explained_before_compiling(kwargs, error, match, fresh_cache):
    x, w = _call_args()
    before = kernelgen.stats()["compiles"]
    with pytest.raises(error, match=match):
        kernelgen.conv2d(x, w, padding=1, **kwargs)
    assert kernelgen.stats()["compiles"] == before
    assert not list(fresh_cache.rglob("*.so"))


@pytest.mark.compile
def test_a_bad_slope_is_refused_on_a_planned_call_too():
    # The slope is not in the call's signature (one kernel serves every slope): each call checks it.
    x, w = _call_args()
    kernelgen.conv2d(x, w, padding=1, activation="leaky_relu", negative_slope=0.2)
    with pytest.raises(ConvArgumentError, match="finite float"):
        kernelgen.conv2d(x, w, padding=1, activation="leaky_relu", negative_slope=float("nan"))


def test_the_fake_implementation_explains_as_the_eager_call_does():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.randn(2, 4, 9, 9), torch.randn(6, 4, 3, 3)
        assert kernelgen.conv2d(x, w, padding=1, activation="gelu", residual=torch.randn(2, 6, 9, 9)).shape == \
            (2, 6, 9, 9)
        with pytest.raises(ConvArgumentError, match="output's shape"):
            kernelgen.conv2d(x, w, padding=1, residual=torch.randn(2, 6, 9, 8))
        with pytest.raises(ConvArgumentError, match="activation must be"):
            kernelgen.conv2d(x, w, padding=1, activation="swish")
        with pytest.raises(ConvArgumentError, match="finite float"):
            kernelgen.conv2d(x, w, padding=1, activation="leaky_relu", negative_slope=float("inf"))


# -- the CPU family against torch ----------------------------------------------------------------

SHAPE = dict(x=(2, 6, 11, 13), w=(10, 3, 3, 3), kw=dict(stride=(1, 2), padding=1, groups=2))
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _tensors(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*SHAPE["x"], generator=g).to(dtype)
    w = torch.randn(*SHAPE["w"], generator=g).to(dtype)
    b = torch.randn(SHAPE["w"][0], generator=g).to(dtype)
    y = F.conv2d(x.double(), w.double(), None, **SHAPE["kw"])
    r = torch.randn(*y.shape, generator=g).mul(4).to(dtype)  # a residual of the output's size
    return x, w, b, r


def _check(y, ref, dtype):
    if dtype in TOL:
        assert rel_err(y, ref) <= TOL[dtype]
    else:  # rounded once from float32: as close as rounding the exact answer, within the rules' 1.5x
        assert rel_err(y, ref) <= 1.5 * rel_err(ref.to(dtype), ref) + 1e-6


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["no_residual", "residual"])
@pytest.mark.parametrize("activation", [None, *ACTIVATIONS])
def test_cpu_epilogue_matches_torch(activation, residual, dtype):
    if activation is None and not residual:
        pytest.skip("no epilogue: test_cpu_path's")
    x, w, b, r = _tensors(dtype)
    slope = 0.125 if dtype == torch.float64 else 0.2  # (float64: a slope its float32 holds exactly)
    kw = dict(activation=activation, negative_slope=slope, residual=r if residual else None)
    y = kernelgen.conv2d(x, w, b, **SHAPE["kw"], **kw)
    ref = expected(x, w, b, **SHAPE["kw"], **kw)
    assert y.shape == ref.shape and y.dtype == dtype
    _check(y, ref, dtype)


@pytest.mark.compile
def test_float16_epilogue():
    x, w, b, r = _tensors(torch.float16)
    y = kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="hardswish", residual=r)
    _check(y, expected(x, w, b, **SHAPE["kw"], activation="hardswish", residual=r), torch.float16)


@pytest.mark.compile
def test_the_slope_is_a_run_time_argument():
    x, w, b, _ = _tensors(torch.float32)
    ys = {}
    for slope in (0.01, 0.3, -1.5, 0):
        before = kernelgen.stats()["compiles"]
        ys[slope] = kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="leaky_relu", negative_slope=slope)
        _check(ys[slope], expected(x, w, b, **SHAPE["kw"], activation="leaky_relu", negative_slope=slope),
               torch.float32)
        if slope != 0.01:
            assert kernelgen.stats()["compiles"] == before  # one kernel for every slope
    # other activations take no slope: it is neither checked nor used
    y = kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="relu", negative_slope="ignored")
    _check(y, expected(x, w, b, **SHAPE["kw"], activation="relu"), torch.float32)


@pytest.mark.compile
def test_float64_takes_the_slope_as_a_float32():
    # The kernels take the slope as a float (KgArgs.alpha): float64's leaky_relu uses the float32
    # nearest to it, as float32 calls do, where torch's float64 kernel keeps the double.
    x, w, b, _ = _tensors(torch.float64)
    y = kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="leaky_relu", negative_slope=0.01)
    f32 = float(torch.tensor(0.01, dtype=torch.float32))
    assert rel_err(y, expected(x, w, b, **SHAPE["kw"], activation="leaky_relu", negative_slope=f32)) <= 1e-12
    assert rel_err(y, expected(x, w, b, **SHAPE["kw"], activation="leaky_relu", negative_slope=0.01)) <= 1e-7


def _residual_forms(y_shape):
    N, K, P, Q = y_shape
    base = torch.randn(N, K, P, Q)
    yield "contiguous", base
    yield "channels_last", base.contiguous(memory_format=torch.channels_last)
    yield "view", torch.randn(N, K, P, 2 * Q)[..., ::2]
    yield "expanded", torch.randn(1, K, 1, Q).expand(N, K, P, Q)
    yield "negative bit", base._neg_view()


@pytest.mark.compile
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_residuals_of_any_strides(layout):
    x, w, b, _ = _tensors(torch.float32)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    y0 = F.conv2d(x, w, b, **SHAPE["kw"])
    for name, r in _residual_forms(y0.shape):
        y = kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="silu", residual=r)
        assert y.is_contiguous(memory_format=torch.channels_last) == y0.is_contiguous(memory_format=torch.channels_last)
        assert rel_err(y, expected(x, w, b, **SHAPE["kw"], activation="silu", residual=r)) <= 1e-5, name


@pytest.mark.compile
def test_unbatched_residual():
    x, w, b, _ = _tensors(torch.float32)
    x = x[0]
    r = torch.randn(10, 11, 7)
    y = kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="relu6", residual=r)
    assert y.shape == (10, 11, 7)
    assert rel_err(y, expected(x, w, b, **SHAPE["kw"], activation="relu6", residual=r)) <= 1e-5
    r_cl = torch.randn(10, 7, 11).transpose(1, 2)  # strides the unbatched output does not have
    y = kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="relu6", residual=r_cl)
    assert rel_err(y, expected(x, w, b, **SHAPE["kw"], activation="relu6", residual=r_cl)) <= 1e-5


@pytest.mark.compile
def test_an_epilogue_plan_is_served_from_its_record(fresh_cache):
    x, w, b, r = _tensors(torch.float32)
    kw = dict(SHAPE["kw"], activation="gelu", residual=r)
    y1 = kernelgen.conv2d(x, w, b, **kw)
    plain = kernelgen.conv2d(x, w, b, **SHAPE["kw"])  # a plan of its own (its own kernel)
    assert kernelgen.stats()["compiles"] >= 2
    functional.clear_plans()
    before = kernelgen.stats()["compiles"]
    y2 = kernelgen.conv2d(x, w, b, **kw)  # the plan record on disk names the epilogue's kernel
    assert kernelgen.stats()["compiles"] == before
    assert torch.equal(y1, y2) and not torch.equal(plain, y2)


@pytest.mark.compile
def test_a_residual_that_requires_grad_gets_the_gradient_through_the_activation():
    # (tests/test_epilogue_grad.py checks every activation's gradients in float64)
    x, w, b, r = _tensors(torch.float32)
    r.requires_grad_(True)
    y = kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="relu", residual=r)
    assert y.requires_grad
    y.sum().backward()
    assert torch.equal(r.grad, (y > 0).to(r.dtype))


@pytest.mark.compile
def test_empty_batch_with_a_residual():
    x, w, b, _ = _tensors(torch.float32)
    y = kernelgen.conv2d(x[:0], w, b, **SHAPE["kw"], activation="relu", residual=torch.empty(0, 10, 11, 7))
    assert y.shape == (0, 10, 11, 7)


# -- the torch tools, through the operator --------------------------------------------------------

@pytest.mark.compile
def test_torch_compile_vmap_flops_and_profiler_carry_the_epilogue():
    from torch.utils.flop_counter import FlopCounterMode

    x, w, b, r = _tensors(torch.float32)
    kw = dict(SHAPE["kw"], activation="hardswish", residual=r)
    ref = expected(x, w, b, **kw)

    fn = torch.compile(lambda x, r: kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="hardswish", residual=r),
                       fullgraph=True)
    assert rel_err(fn(x, r), ref) <= 1e-5

    xs, rs = torch.stack([x, 2 * x]), torch.stack([r, -r])
    ys = torch.vmap(lambda x, r: kernelgen.conv2d(x, w, b, **SHAPE["kw"], activation="hardswish", residual=r))(xs, rs)
    assert rel_err(ys[1], expected(2 * x, w, b, **SHAPE["kw"], activation="hardswish", residual=-r)) <= 1e-5
    shared = torch.vmap(lambda x: kernelgen.conv2d(x, w, b, **kw))(xs)
    assert rel_err(shared[0], ref) <= 1e-5

    with FlopCounterMode(display=False) as counter:
        kernelgen.conv2d(x, w, b, **kw)
    with FlopCounterMode(display=False) as plain:
        F.conv2d(x, w, b, **SHAPE["kw"])
    assert counter.get_total_flops() == plain.get_total_flops()

    with torch.profiler.profile() as prof:
        y = kernelgen.conv2d(x, w, b, **kw)
    assert any(e.name == "kernelgen::conv2d_epilogue" for e in prof.events())
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.compile
def test_a_call_without_an_epilogue_keeps_the_operators_form():
    # A plain call's graphs hold kernelgen::conv2d with the eleven inputs of before epilogues (a
    # TorchScript node holds every input of its schema, and kernelgen.onnx translates those); a
    # call with an epilogue is kernelgen::conv2d_epilogue, the three more (and a scale, last with a
    # default: a call without one holds the node of before scales).
    x, w = _call_args()
    r = torch.randn(2, 6, 9, 9)
    assert len(torch.ops.kernelgen.conv2d.default._schema.arguments) == 11
    assert [a.name for a in torch.ops.kernelgen.conv2d_epilogue.default._schema.arguments][11:] == \
        ["activation", "negative_slope", "residual", "scale"]
    nodes = []

    def backend(gm, example_inputs):
        nodes.extend((n.target, len(n.args) + len(n.kwargs)) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(lambda x: kernelgen.conv2d(x, w, padding=1), backend=backend, fullgraph=True)(x)
    torch.compile(lambda x: kernelgen.conv2d(x, w, padding=1, activation="relu", residual=r), backend=backend,
                  fullgraph=True)(x)
    assert nodes == [(torch.ops.kernelgen.conv2d.default, 11), (torch.ops.kernelgen.conv2d_epilogue.default, 14)]
    traced = torch.jit.trace(lambda x: kernelgen.conv2d(x, w, padding=1), (x,))
    assert [len(list(n.inputs())) for n in traced.graph.nodes() if n.kind() == "kernelgen::conv2d"] == [11]


def test_onnx_export_computes_the_epilogue_with_torchs_operators(monkeypatch):
    # While ONNX export captures a model, the call is F.conv2d and the epilogue torch's own ops.
    monkeypatch.setattr(compiled, "_onnx_exporting", lambda: True)
    x, w, b, r = _tensors(torch.float32)
    for act in ACTIVATIONS:
        y = compiled.call(x, w, b, SHAPE["kw"]["stride"], SHAPE["kw"]["padding"], 1, SHAPE["kw"]["groups"], None,
                          None, None, act, 0.3, r)
        assert rel_err(y, expected(x, w, b, **SHAPE["kw"], activation=act, negative_slope=0.3, residual=r)) <= 1e-5


# -- tuning and warming calls with an epilogue ---------------------------------------------------

@pytest.mark.compile
def test_tuning_a_call_with_an_epilogue(fresh_cache):
    x, w, b, r = _tensors(torch.float32)
    kw = dict(SHAPE["kw"], activation="leaky_relu", negative_slope=0.3, residual=r)
    res = kernelgen.tune(x, w, b, **kw)
    assert res.spec.activation == "leaky_relu" and res.spec.residual
    assert len(res.timings) == 2 and all(us is not None for _, us, _ in res.timings), res.timings
    before = kernelgen.stats()["compiles"]
    y = kernelgen.conv2d(x, w, b, **kw)  # the tuned kernel, from the plan record
    assert kernelgen.stats()["compiles"] == before
    assert rel_err(y, expected(x, w, b, **kw)) <= 1e-5


def test_warm_records_carry_the_epilogue():
    from kernelgen import warm

    rec = {"input": [2, 8, 12, 12], "weight": [12, 8, 3, 3], "bias": True, "padding": 1, "device": "cpu",
           "activation": "silu", "residual": True}
    spec = warm.parse_record(rec)
    assert (spec.activation, spec.residual) == ("silu", True)
    args = warm.record_tensors(rec, "cpu")
    assert args["activation"] == "silu" and args["residual"].shape == (2, 12, 12, 12)
    with pytest.raises(warm.RecordError, match="'residual': expected true or false"):
        warm.parse_record(dict(rec, residual="yes"))
    with pytest.raises(warm.RecordError, match="activation must be None or one of"):
        warm.parse_record(dict(rec, activation="tanh"))


def test_a_model_run_on_meta_tensors_finds_its_epilogues():
    from kernelgen import warm

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = kernelgen.Conv2d(8, 12, 3, padding=1)
            self.b = torch.nn.Conv2d(12, 12, 3, padding=1)

        def forward(self, x):
            y = self.a(x)
            return kernelgen.conv2d(y, self.b.weight, self.b.bias, padding=1, activation="relu", residual=y)

    found = warm.find_model_calls(Block(), [(2, 8, 12, 12)], "cpu")
    assert [(f.spec.activation, f.spec.residual) for f in found] == [("none", False), ("relu", True)]
    assert found[1].record["activation"] == "relu" and found[1].record["residual"] is True
    assert warm.parse_record(found[1].record) == found[1].spec


@pytest.mark.compile
@pytest.mark.skipif(importlib.util.find_spec("onnx") is None or importlib.util.find_spec("onnxruntime") is None,
                    reason="needs onnx and onnxruntime")
def test_a_model_with_epilogues_exports_to_standard_onnx(tmp_path):
    # (torch.onnx.export's TorchScript exporter; the graph: Conv, then Add and the activation)
    import io

    import onnx
    import onnxruntime

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = kernelgen.Conv2d(4, 6, 3, padding=1)
            self.w = torch.nn.Parameter(torch.randn(6, 6, 3, 3))

        def forward(self, x):
            y = self.a(x)
            return kernelgen.conv2d(y, self.w, None, padding=1, activation="hardswish", residual=y)

    m, x = Block().eval(), torch.randn(2, 4, 8, 8)
    f = io.BytesIO()
    torch.onnx.export(m, (x,), f, dynamo=False)
    ops = [n.op_type for n in onnx.load_from_string(f.getvalue()).graph.node]
    assert ops.count("Conv") == 2 and "Add" in ops and "HardSwish" in ops, ops
    session = onnxruntime.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        assert rel_err(torch.from_numpy(y), m(x).double()) <= 1e-5


@pytest.mark.compile
def test_the_operator_path_explains_and_ignores_the_slope_as_the_eager_one_does():
    # (the profiler routes an eager call through the operator)
    x, w = _call_args()
    with torch.profiler.profile():
        with pytest.raises(ConvArgumentError, match="finite float"):
            kernelgen.conv2d(x, w, padding=1, activation="leaky_relu", negative_slope="0.1")
        y = kernelgen.conv2d(x, w, padding=1, activation="relu", negative_slope="ignored")
    assert rel_err(y, expected(x, w, None, padding=1, activation="relu")) <= 1e-5
