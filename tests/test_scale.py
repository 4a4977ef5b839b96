"""conv2d's epilogue scale (a folded BatchNorm's float32 per-channel scale), CPU tier: numerics against
float64 torch, the spec and its key, argument errors, the operator under torch.compile, gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelgen
from kernelgen import compiled
from kernelgen.errors import ConvArgumentError
from kernelgen.functional import spec_for


def _reference(x, w, b, scale, residual=None, activation=None, groups=1, padding=1):
    y = F.conv2d(x.double(), w.double(), None, padding=padding, groups=groups) * scale.double()[:, None, None]
    if b is not None:
        y = y + b.double()[:, None, None]
    if residual is not None:
        y = y + residual.double()
    return y if activation is None else compiled.TORCH_ACTIVATIONS[activation](y, 0.01)


def _tensors(dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 9, 10, generator=g).to(dtype)
    w = (torch.randn(12, 4, 3, 3, generator=g) / 6).to(dtype)
    b = torch.randn(12, generator=g).to(dtype) if bias else None
    s = torch.rand(12, generator=g) * 2 - 0.5  # negative scales too
    r = torch.randn(2, 12, 9, 10, generator=g).to(dtype)
    return x, w, b, s, r


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bias, residual, activation", [(True, False, None), (False, True, "silu"),
                                                       (True, True, "relu")])
def test_the_scale_multiplies_the_accumulator_before_the_bias(dtype, bias, residual, activation):
    x, w, b, s, r = _tensors(dtype, bias=bias)
    r = r if residual else None
    y = kernelgen.conv2d(x, w, b, padding=1, groups=2, scale=s, residual=r, activation=activation)
    ref = _reference(x, w, b, s, r, activation, groups=2)
    assert y.dtype == dtype and y.shape == ref.shape
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err <= TOL[dtype], err


@pytest.mark.compile
def test_a_strided_scale_is_made_contiguous():
    x, w, b, s, _ = _tensors(torch.float32)
    wide = torch.stack([s, -s], 1)[:, 0]  # stride 2
    y = kernelgen.conv2d(x, w, b, padding=1, groups=2, scale=wide)
    torch.testing.assert_close(y.double(), _reference(x, w, b, s, groups=2), rtol=1e-5, atol=1e-5)


def test_the_scale_is_in_the_spec_and_key_only_when_given():
    x, w, b, s, _ = _tensors(torch.float32)
    plain, _ = spec_for(x, w, b, 1, 1, 1, 2)
    scaled, _ = spec_for(x, w, b, 1, 1, 1, 2, scale=s)
    assert not plain.scale and scaled.scale
    assert "scale" not in plain.to_json() and '"scale":true' in scaled.to_json()
    assert plain.replace(scale=True) == scaled


@pytest.mark.parametrize("scale, error, match", [
    ("x", TypeError, "argument 'scale' must be Tensor or None"),
    (torch.ones(12, dtype=torch.float64), TypeError, "scale must be a float32 tensor"),
    (torch.ones(12, dtype=torch.bfloat16), TypeError, "scale must be a float32 tensor"),
    (torch.ones(11), ConvArgumentError, "out_channels=12"),
    (torch.ones(12, 1), ConvArgumentError, "1-dimensional"),
    (torch.ones(12, device="meta"), ConvArgumentError, "input's device"),
])
def test_bad_scales_are_explained_before_compiling(scale, error, match):
    x, w, b, _, _ = _tensors(torch.float32)
    before = kernelgen.stats()["compiles"]
    with pytest.raises(error, match=match):
        kernelgen.conv2d(x, w, b, padding=1, groups=2, scale=scale)
    assert kernelgen.stats()["compiles"] == before


@pytest.mark.compile
def test_the_scale_through_torch_compile():
    x, w, b, s, r = _tensors(torch.float32)

    def f(x, w, b, s, r):
        return kernelgen.conv2d(x, w, b, padding=1, groups=2, scale=s, residual=r, activation="relu")

    y = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, b, s, r)
    torch.testing.assert_close(y.double(), _reference(x, w, b, s, r, "relu", groups=2), rtol=1e-5, atol=1e-5)


@pytest.mark.compile
@pytest.mark.parametrize("activation", [None, "silu"])
def test_gradients_through_the_scale(activation):
    x, w, b, s, r = _tensors(torch.float64)
    args = [t.clone().requires_grad_() for t in (x, w, b, r)]
    y = kernelgen.conv2d(args[0], args[1], args[2], padding=1, groups=2, scale=s, residual=args[3],
                         activation=activation)
    ref_args = [t.clone().requires_grad_() for t in (x, w, b, r)]
    ref = _reference(*ref_args[:3], s, ref_args[3], activation, groups=2)
    g = torch.randn_like(ref)
    y.backward(g)
    ref.backward(g)
    for a, e in zip(args, ref_args):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.compile
def test_the_scale_gets_no_gradient():
    x, w, b, s, _ = _tensors(torch.float64)
    with pytest.raises(NotImplementedError, match="scale gets no gradient"):
        kernelgen.conv2d(x.requires_grad_(), w, b, padding=1, groups=2, scale=s.double().float().requires_grad_())
