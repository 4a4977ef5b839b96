"""kernelgen.conv2d through autograd (issue 56's second item), on the CPU path: the gradients come
from kernelgen's own forward kernels (kernelgen/gradients.py), eagerly and from a compiled graph's
backward, compared with torch's in float64 on random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelgen

pytestmark = pytest.mark.compile  # (the gradients' convolutions build CPU kernels)

CASES = [dict(stride=2, padding=1, groups=2), dict(padding="same", dilation=2), dict(stride=(1, 2), padding=(0, 1))]


def _tensors(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(6, 2, 3, 3, dtype=torch.float64, generator=g).requires_grad_()
    b = torch.randn(6, dtype=torch.float64, generator=g).requires_grad_() if bias else None
    return x, w, b


def _torch_grads(x, w, b, kw, groups):
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    bs = None if b is None else b.detach().requires_grad_()
    y = F.conv2d(xs, ws, bs, groups=groups, **kw)
    y.backward(torch.ones_like(y) * torch.linspace(-1, 2, y.numel(), dtype=y.dtype).reshape(y.shape))
    return xs.grad, ws.grad, None if bs is None else bs.grad


def _weights(y):
    return torch.linspace(-1, 2, y.numel(), dtype=y.dtype).reshape(y.shape)


@pytest.mark.parametrize("kw", CASES, ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradients_match_torchs_in_float64(kw, compiled):
    groups = kw.get("groups", 1)
    kw = {k: v for k, v in kw.items() if k != "groups"}
    x, w, b = _tensors()
    if groups == 1:
        w = torch.randn(6, 4, 3, 3, dtype=torch.float64).requires_grad_()
    fn = lambda x, w, b: kernelgen.conv2d(x, w, b, groups=groups, **kw)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    y = fn(x, w, b)
    y.backward(_weights(y))
    ref = _torch_grads(x, w, b, kw, groups)
    for got, want in zip((x.grad, w.grad, b.grad), ref):
        assert float((got - want).norm() / want.norm()) < 1e-12


def test_gradcheck():
    x, w, b = _tensors()
    assert torch.autograd.gradcheck(lambda x, w, b: kernelgen.conv2d(x, w, b, padding=1, groups=2), (x, w, b))


def test_only_the_gradients_autograd_needs_are_computed():
    x, w, b = _tensors()
    x.requires_grad_(False)  # a first layer: no input gradient
    before = kernelgen.stats()
    y = kernelgen.conv2d(x, w, b, padding=1, groups=2)
    y.sum().backward()
    assert x.grad is None and w.grad is not None and b.grad is not None
    from kernelgen import gradients

    calls = []
    real = gradients.input_grad
    try:
        gradients.input_grad = lambda *a, **k: calls.append(a) or real(*a, **k)
        kernelgen.conv2d(x, w, b, padding=1, groups=2).sum().backward()
    finally:
        gradients.input_grad = real
    assert calls == [] and kernelgen.stats()["fallbacks"] == before["fallbacks"]


def test_a_residual_gets_the_output_gradient():
    # (through an activation: tests/test_epilogue_grad.py)
    x, w, b = _tensors()
    w = torch.randn(4, 2, 3, 3, dtype=torch.float64).requires_grad_()
    r = torch.randn(2, 4, 9, 8, dtype=torch.float64).requires_grad_()
    y = kernelgen.conv2d(x, w, None, padding=1, groups=2, residual=r)
    g = _weights(y)
    y.backward(g)
    assert torch.equal(r.grad, g)


def test_double_backward_is_a_clear_error():
    x, w, b = _tensors()
    y = kernelgen.conv2d(x, w, b, padding=1, groups=2)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=False)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(kernelgen.conv2d(x, w, b, padding=1, groups=2).sum(), x, create_graph=True)


def test_a_module_trains_as_torchs_does():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, stride=2))
    ref = ref.double()
    ours = kernelgen.convert(__import__("copy").deepcopy(ref))
    x = torch.randn(4, 3, 10, 10, dtype=torch.float64)
    losses = []
    for model in (ref, ours):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        run = []
        for _ in range(3):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == pytest.approx(losses[1], rel=1e-10)
