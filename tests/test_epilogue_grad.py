"""Backward through a fused epilogue (issue 56): kernelgen.conv2d(..., activation=, residual=).

Compile tier, on the CPU path: the gradients of input, weight, bias and residual against torch's
autograd of F.conv2d + residual + torch's activation, in float64, for every activation (leaky_relu
with a positive, a zero and a negative slope), eagerly and through torch.compile; pre-activations
built to land exactly on each activation's kinks (and NaN, +-inf), where torch's ties decide;
what each call saves for its backward. One convolution shape throughout, so the CPU kernels (one
per activation, bias and residual) are shared by all the tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelgen
from kernelgen import gradients
from kernelgen.compiled import TORCH_ACTIVATIONS

pytestmark = pytest.mark.compile  # (every call builds CPU kernels)

KW = dict(stride=(1, 2), padding=1, groups=2)  # weight (4, 2, 3, 3): input (N, 4, H, W), output (N, 4, H, Q)
# (activation, negative_slope): the slopes are float32 values, as the kernels take them
ACTIVATIONS = [("relu", 0.01), ("relu6", 0.01), ("leaky_relu", 0.125), ("leaky_relu", 0.0), ("leaky_relu", -0.5),
               ("silu", 0.01), ("gelu", 0.01), ("hardswish", 0.01), ("hardsigmoid", 0.01), ("sigmoid", 0.01)]
IDS = [a if a != "leaky_relu" else f"leaky_relu({s})" for a, s in ACTIVATIONS]


def _tensors(bias=True, residual=True, n=2, height=7, width=7, seed=0):
    """Random float64 (x, w, b, r) for KW's convolution, each requiring grad (b, r: None where not wanted)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, height, width, dtype=torch.float64, generator=g).mul(2).requires_grad_()
    q = (width - 1) // 2 + 1  # (the output's width)
    r = torch.randn(n, 4, height, q, dtype=torch.float64, generator=g).requires_grad_() if residual else None
    w = torch.randn(4, 2, 3, 3, dtype=torch.float64, generator=g).requires_grad_()
    b = torch.randn(4, dtype=torch.float64, generator=g).requires_grad_() if bias else None
    return x, w, b, r


def _grad_out():
    return torch.randn(2, 4, 7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _call(x, w, b, r, activation, slope):
    return kernelgen.conv2d(x, w, b, **KW, activation=activation, negative_slope=slope, residual=r)


def _torch(x, w, b, r, activation, slope):
    z = F.conv2d(x, w, b, **KW)
    return TORCH_ACTIVATIONS[activation](z if r is None else z + r, slope)


def _grads(fn, tensors, grad_out):
    """fn's gradients of the tensors that require grad, given fresh leaves of them."""
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in tensors]
    y = fn(*leaves)
    y.backward(grad_out)
    return [None if t is None else t.grad for t in leaves]


def _assert_same(got, want, **kw):
    for name, g, t in zip(("input", "weight", "bias", "residual"), got, want):
        assert (g is None) == (t is None), name
        if g is not None:
            torch.testing.assert_close(g, t, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}", **kw)


def _check_against_torch(activation, slope, bias, residual):
    tensors = _tensors(bias, residual)
    grad_out = _grad_out()
    got = _grads(lambda *t: _call(*t, activation, slope), tensors, grad_out)
    want = _grads(lambda *t: _torch(*t, activation, slope), tensors, grad_out)
    _assert_same(got, want)


@pytest.mark.parametrize("activation,slope", ACTIVATIONS, ids=IDS)
@pytest.mark.parametrize("bias,residual", [(True, True), (False, False)], ids=["bias+residual", "bare"])
def test_gradients_match_torchs_in_float64(activation, slope, bias, residual):
    _check_against_torch(activation, slope, bias, residual)


@pytest.mark.parametrize("activation,slope", [("relu", 0.01), ("silu", 0.01)], ids=["relu", "silu"])
@pytest.mark.parametrize("bias,residual", [(True, False), (False, True)], ids=["bias", "residual"])
def test_a_bias_or_a_residual_alone(activation, slope, bias, residual):
    # (relu reads the output; silu recomputes the pre-activation from whichever of the two there is)
    _check_against_torch(activation, slope, bias, residual)


# Every activation's kinks, and values one ulp inside them: hardsigmoid's z + 3 rounds to 6 at
# 3 - 2**-51, where torch's gradient is still 1/6 (so its backward reads z, not the output).
KINKS = [0.0, -3.0, 3.0, 6.0, 3 - 2**-51, -3 + 2**-51, 6 - 2**-50, 2**-50, -(2**-50), 1.0, -6.0]


def _at_kinks(nonfinite=False):
    """(x, w, b, r) and the pre-activation z = conv + b + r they give, exactly: each value of KINKS
    in turn, and where `nonfinite`, NaN, +inf and -inf from the residual at three places. Only the
    weight's centre tap is non-zero, 2 from each output channel to its own input channel, so
    z = 2 * x[..., ::2] + 0.5 + 0.25 with every sum exact."""
    w = torch.zeros(4, 2, 3, 3, dtype=torch.float64)
    for o in range(4):
        w[o, o % 2, 1, 1] = 2  # (groups=2: output channel o reads input channels 2*(o//2) + (0, 1))
    z = torch.tensor(KINKS * 5, dtype=torch.float64)[:48].reshape(1, 4, 3, 4)
    x = torch.randn(1, 4, 3, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x[..., ::2] = (z - 0.75) / 2
    b = torch.full((4,), 0.5, dtype=torch.float64)
    r = torch.full_like(z, 0.25)
    if nonfinite:
        r[0, 3, 2, 1:] = z[0, 3, 2, 1:] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return (x, w, b, r), z


@pytest.mark.parametrize("activation,slope", ACTIVATIONS, ids=IDS)
def test_at_the_kinks_ties_go_as_torchs(activation, slope):
    tensors, z = _at_kinks()
    assert torch.equal(F.conv2d(*tensors[:3], **KW) + tensors[3], z)  # (the kinks, exactly)
    grad_out = torch.linspace(-1, 2, 48, dtype=torch.float64).reshape(1, 4, 3, 4)
    tensors = [t.requires_grad_() for t in tensors]
    got = _grads(lambda *t: _call(*t, activation, slope), tensors, grad_out)
    want = _grads(lambda *t: _torch(*t, activation, slope), tensors, grad_out)
    _assert_same(got, want)
    # NaN and +-inf: the residual's gradient is the activation's (a NaN there reaches the other
    # gradients through the convolutions, which torch's and kernelgen's pad differently)
    tensors = [t.requires_grad_() for t in _at_kinks(nonfinite=True)[0]]
    got = _grads(lambda *t: _call(*t, activation, slope), tensors, grad_out)
    want = _grads(lambda *t: _torch(*t, activation, slope), tensors, grad_out)
    torch.testing.assert_close(got[3], want[3], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("activation,slope", [("silu", 0.01), ("sigmoid", 0.01), ("leaky_relu", -0.5)],
                         ids=["silu", "sigmoid", "leaky_relu(-0.5)"])
def test_gradcheck(activation, slope):
    x, w, b, r = _tensors(n=1, height=4, width=5)
    assert torch.autograd.gradcheck(lambda *t: _call(*t, activation, slope), (x, w, b, r))


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_compiled_gradients_match_torchs(activation):
    tensors = _tensors()
    grad_out = _grad_out()
    fn = torch.compile(lambda *t: _call(*t, activation, 0.01), backend="aot_eager", fullgraph=True)
    got = _grads(fn, tensors, grad_out)
    want = _grads(lambda *t: _torch(*t, activation, 0.01), tensors, grad_out)
    _assert_same(got, want)


def test_each_call_saves_what_its_backward_reads():
    x, w, b, r = _tensors()

    def saved(y):
        return {t.data_ptr() for t in y.grad_fn.saved_tensors if t is not None}

    plain = kernelgen.conv2d(x, w, b, **KW)
    assert saved(plain) == {x.data_ptr(), w.data_ptr()}  # as before activations had a backward
    y = _call(x, w, b, r, "relu", 0.01)  # the output decides relu's derivative
    assert saved(y) == {x.data_ptr(), w.data_ptr(), y.data_ptr()}
    y = _call(x, w, b, r, "silu", 0.01)  # silu's reads the pre-activation, recomputed from these
    assert saved(y) == {x.data_ptr(), w.data_ptr(), b.data_ptr(), r.data_ptr()}


@pytest.mark.parametrize("activation,slope", [("relu", 0.01), ("leaky_relu", -0.5)], ids=["relu", "leaky_relu"])
def test_only_the_gradients_autograd_needs_are_computed(activation, slope, monkeypatch):
    x, w, b, r = _tensors()
    x.requires_grad_(False)  # a first layer: no input gradient
    calls = []
    real = gradients.input_grad
    monkeypatch.setattr(gradients, "input_grad", lambda *a, **k: calls.append(a) or real(*a, **k))
    _call(x, w, b, r, activation, slope).sum().backward()
    assert x.grad is None and w.grad is not None and b.grad is not None and r.grad is not None
    assert calls == []


def test_double_backward_is_a_clear_error():
    x, w, b, r = _tensors()
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(_call(x, w, b, r, "silu", 0.01).sum(), x, create_graph=True)
