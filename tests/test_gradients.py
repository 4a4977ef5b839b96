"""Compile tier: kernelgen.gradients against torch.autograd's gradients of F.conv2d in float64.

Every gradient here is computed by kernelgen's forward kernels (the CPU family on a machine
without a GPU); F.conv2d and autograd only make the references.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelgen
from kernelgen import functional, gradients
from kernelgen.errors import ConvArgumentError

pytestmark = pytest.mark.compile

PARAMS = ("stride", "padding", "dilation", "groups")

CASES = [
    # input shape, (O, kh, kw), F.conv2d's keyword arguments
    ((2, 4, 9, 9), (6, 3, 3), dict(padding=1)),
    ((2, 4, 10, 9), (6, 3, 3), dict(padding=1, stride=2)),                       # row 9 of 10 read by no output
    ((2, 4, 10, 9), (6, 3, 3), dict(padding=1, stride=(2, 3))),
    ((2, 4, 11, 10), (6, 5, 3), dict(padding=(2, 0), stride=(3, 2), dilation=(2, 1))),
    ((2, 4, 12, 12), (6, 3, 3), dict(padding=1, stride=(3, 1), dilation=(1, 2))),
    ((2, 4, 10, 11), (6, 1, 5), dict(padding=(0, 2), stride=(1, 2))),            # 1 x 5
    ((2, 4, 9, 9), (6, 1, 1), dict()),                                            # 1 x 1
    ((2, 4, 9, 9), (6, 1, 1), dict(stride=2)),                                    # phases with no tap
    ((2, 4, 9, 9), (6, 3, 3), dict(padding=4)),                                   # padding > d*(k-1): crop
    ((2, 4, 9, 9), (6, 3, 3), dict(padding=(0, 2), stride=3, dilation=(2, 1))),
    ((2, 4, 10, 11), (8, 3, 3), dict(padding=1, groups=2)),
    ((2, 6, 9, 9), (6, 5, 3), dict(padding=(2, 1), stride=2, groups=3)),
    ((2, 4, 10, 11), (4, 3, 3), dict(padding=1, groups=4)),                       # depthwise
    ((2, 4, 10, 11), (8, 3, 3), dict(padding=(1, 3), stride=2, dilation=2, groups=4)),  # x2; s, d share 2
    ((2, 4, 10, 11), (8, 5, 3), dict(padding=(2, 1), stride=(2, 1), groups=4)),   # 5 x 3 depthwise x2
    ((2, 4, 10, 11), (8, 4, 4), dict(padding="same", dilation=(1, 2))),           # 'same' pads unequally
    ((2, 4, 10, 11), (8, 2, 3), dict(padding="same", groups=2)),
    ((2, 4, 9, 8), (6, 5, 3), dict(padding="valid", stride=(1, 2))),
    ((1, 2, 1, 5), (3, 1, 1), dict(padding=2, stride=3)),                         # every tap reads padding
    ((4, 10, 11), (8, 2, 3), dict(padding=5, stride=(3, 1))),                     # unbatched
    ((3, 9, 9), (6, 3, 3), dict(padding=1, stride=2)),                            # unbatched
]


def full(kw: dict) -> dict:
    return dict(dict(stride=1, padding=0, dilation=1, groups=1), **kw)


def make(xshape, wshape, kw, dtype=torch.float64, seed=0):
    """Random (never zero) input, weight and grad_out for the case, and torch's float64 gradients."""
    g = torch.Generator().manual_seed(seed)
    groups = kw.get("groups", 1)
    x = torch.randn(*xshape, generator=g, dtype=torch.float64)
    w = torch.randn(wshape[0], xshape[-3] // groups, wshape[1], wshape[2], generator=g, dtype=torch.float64)
    b = torch.randn(wshape[0], generator=g, dtype=torch.float64)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = F.conv2d(xr, wr, br, **kw)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    y.backward(dy)
    ref = (xr.grad, wr.grad, br.grad)
    return x.to(dtype), w.to(dtype), dy.to(dtype), ref


def ours(x, w, dy, kw, **extra):
    kw = full(kw)
    args = [kw[k] for k in PARAMS]
    return (gradients.input_grad(dy, w, x.shape, *args, **extra),
            gradients.weight_grad(dy, x, w.shape, *args, **extra),
            gradients.bias_grad(dy))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape
    if ref.norm() == 0:  # a gradient that is exactly zero (every tap reads padding)
        return got.double().norm().item()
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("xshape,wshape,kw", CASES)
def test_float64_matches_autograd(xshape, wshape, kw):
    x, w, dy, ref = make(xshape, wshape, kw)
    got = ours(x, w, dy, kw)
    for name, g, r in zip(("input", "weight", "bias"), got, ref):
        assert g.dtype == torch.float64
        assert rel_err(g, r) <= 1e-10, name


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("case", [2, 11, 15])
def test_channels_last_and_views(case):
    xshape, wshape, kw = CASES[case]
    x, w, dy, ref = make(xshape, wshape, kw)
    for xv, dyv in ((_cl(x), _cl(dy)), (_cl(x), dy), (x, _cl(dy))):
        got = ours(xv, w, dyv, kw)
        for g, r in zip(got, ref):
            assert rel_err(g, r) <= 1e-10
    # sliced views: every other channel of a wider tensor, a column offset, a transposed weight
    xw = torch.zeros(xshape[0], 2 * xshape[1], xshape[2], xshape[3] + 3, dtype=x.dtype)
    xw[:, ::2, :, 3:] = x
    dyw = torch.zeros(dy.shape[0], dy.shape[1], dy.shape[2] + 1, dy.shape[3], dtype=dy.dtype)
    dyw[:, :, 1:] = dy
    wt = w.transpose(2, 3).contiguous().transpose(2, 3)
    got = ours(xw[:, ::2, :, 3:], wt, dyw[:, :, 1:], kw)
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= 1e-10


def test_channels_last_grad_input_format():
    xshape, wshape, kw = CASES[0]
    x, w, dy, _ = make(xshape, wshape, kw)
    dx = gradients.input_grad(_cl(dy), w, x.shape, **kw)
    assert dx.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("precision", [None, "ieee"])
@pytest.mark.parametrize("case", [0, 3, 13])
def test_float32(case, precision):
    # strict float32 (docs/performance.md): relative error <= 1e-5 against float64; the CPU has no TF32
    xshape, wshape, kw = CASES[case]
    x, w, dy, ref = make(xshape, wshape, kw, dtype=torch.float32)
    for name, g, r in zip(("input", "weight", "bias"), ours(x, w, dy, kw, precision=precision), ref):
        assert g.dtype == torch.float32
        assert rel_err(g, r) <= 1e-5, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_no_worse_than_torch(dtype):
    # docs/performance.md: float32 accumulation, error no worse than 1.5x F.conv2d's own in that dtype
    xshape, wshape, kw = CASES[2]
    x, w, dy, ref = make(xshape, wshape, kw, dtype=dtype)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, torch.zeros(w.shape[0], dtype=dtype)))
    F.conv2d(xr, wr, br, **kw).backward(dy)
    theirs = (xr.grad, wr.grad, br.grad)
    unit = torch.finfo(dtype).eps / 2
    for name, g, t, r in zip(("input", "weight", "bias"), ours(x, w, dy, kw), theirs, ref):
        assert g.dtype == dtype
        assert rel_err(g, r) <= 1.5 * max(rel_err(t, r), unit), name


def test_no_torch_convolution_runs(monkeypatch):
    xshape, wshape, kw = CASES[13]
    x, w, dy, ref = make(xshape, wshape, kw)

    def refuse(*args, **kwargs):
        raise AssertionError("a torch convolution ran")

    monkeypatch.setattr(torch.nn.functional, "conv2d", refuse)
    monkeypatch.setattr(torch, "conv2d", refuse)
    monkeypatch.setattr(torch.nn.functional, "conv_transpose2d", refuse)
    monkeypatch.setattr(torch, "conv_transpose2d", refuse)
    monkeypatch.setattr(torch.nn.grad, "conv2d_input", refuse)
    monkeypatch.setattr(torch.nn.grad, "conv2d_weight", refuse)
    monkeypatch.setattr(torch.ops.aten, "convolution", refuse)
    monkeypatch.setattr(torch.ops.aten, "convolution_backward", refuse)
    with pytest.raises(AssertionError, match="torch convolution"):  # the patches are live
        torch.ops.aten.convolution(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    for g, r in zip(ours(x, w, dy, kw), ref):
        assert rel_err(g, r) <= 1e-10


def test_each_spec_compiles_once(fresh_cache, monkeypatch):
    # the gradients are forward convolutions: each distinct forward spec they need compiles once,
    # and repeating the gradients (or another batch of the same images) compiles nothing more
    specs = set()
    real = gradients.conv2d

    def spy(x, w, b, stride, padding, dilation, groups, *, precision=None):
        specs.add(functional.spec_for(x, w, b, stride, padding, dilation, groups, precision=precision)[0])
        return real(x, w, b, stride, padding, dilation, groups, precision=precision)

    monkeypatch.setattr(gradients, "conv2d", spy)
    xshape, wshape, kw = CASES[3]  # strided, dilated: six input-gradient phases and the weight gradient
    x, w, dy, ref = make(xshape, wshape, kw)
    before = kernelgen.stats()["compiles"]
    for _ in range(3):
        got = ours(x, w, dy, kw)
    assert kernelgen.stats()["compiles"] - before == len(specs) >= 3
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= 1e-10
    # a channels_last grad_out is the same specs (the CPU family reads any strides)
    ours(_cl(x), w, _cl(dy), kw)
    assert kernelgen.stats()["compiles"] - before == len(specs)


def test_errors():
    x = torch.randn(2, 4, 9, 9)
    w = torch.randn(6, 4, 3, 3)
    dy = torch.randn(2, 6, 7, 7)
    with pytest.raises(ConvArgumentError, match="forward output's size"):
        gradients.input_grad(dy, w, x.shape, padding=1)
    with pytest.raises(ConvArgumentError, match="forward output's size"):
        gradients.weight_grad(dy[0], x, w.shape)
    with pytest.raises(ConvArgumentError, match="groups=3"):
        gradients.weight_grad(dy, x, w.shape, groups=3)
    with pytest.raises(ConvArgumentError, match="strided"):
        gradients.input_grad(dy, w, x.shape, stride=2, padding="same")
    with pytest.raises(ConvArgumentError, match="dtype"):
        gradients.weight_grad(dy, x.double(), w.shape)


def test_memoised_geometry_explains_each_bad_call_and_takes_any_argument_form():
    """The geometry memo (gradients._geometry) keeps valid plain calls only: a bad call raises every
    time, and lists and tuples give the same gradients as ints."""
    x = torch.randn(2, 4, 9, 9, dtype=torch.float64)
    w = torch.randn(6, 4, 3, 3, dtype=torch.float64)
    dy = torch.randn(2, 6, 9, 9, dtype=torch.float64)
    for _ in range(2):
        with pytest.raises(ConvArgumentError, match="groups=3"):
            gradients.weight_grad(dy, x, w.shape, padding=1, groups=3)
        with pytest.raises(TypeError, match="groups"):
            gradients.input_grad(dy, w, x.shape, padding=1, groups=True)
    want = gradients.input_grad(dy, w, x.shape, 1, 1, 1, 1)
    for form in (dict(stride=[1, 1], padding=[1, 1]), dict(stride=(1, 1), padding="same"),
                 dict(stride=1, padding=(1, 1), dilation=[1, 1])):
        torch.testing.assert_close(gradients.input_grad(dy, w, list(x.shape), **form), want, rtol=0, atol=0)
    assert all(gradients._plain(v) for key in gradients._geometries for v in key)


def test_a_1x1_input_gradient_flips_nothing(monkeypatch):
    """A 1x1 kernel is its own flip: the input gradient reads the weight's transposed view, with no
    flip (a copy and a launch per backward); a 1x3 kernel flips its columns only."""
    flips = []
    real = torch.Tensor.flip

    def spy(self, *dims):
        flips.append(tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims)
        return real(self, *dims)

    monkeypatch.setattr(torch.Tensor, "flip", spy)
    x = torch.randn(2, 4, 7, 7, dtype=torch.float64)
    for kernel, want in (((1, 1), []), ((1, 3), [(3,)])):
        w = torch.randn(6, 4, *kernel, dtype=torch.float64)
        dy = torch.randn(2, 6, 7, 7 - kernel[1] + 1, dtype=torch.float64)
        flips.clear()
        got = gradients.input_grad(dy, w, x.shape)
        assert flips == want
        xr = x.clone().requires_grad_()
        (ref,) = torch.autograd.grad(F.conv2d(xr, w), xr, dy)
        torch.testing.assert_close(got, ref)
