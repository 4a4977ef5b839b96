"""Pure tier: every bad call fails like F.conv2d does, before any compile or launch."""

import pytest
import torch
import torch.nn.functional as F

import kernelgen

x = torch.randn(2, 4, 8, 8)
w = torch.randn(6, 4, 3, 3)

CASES = [
    # (args, kwargs, exception type, message fragment)
    ((torch.randn(4, 8), w), {}, RuntimeError, "Expected 3D (unbatched) or 4D (batched) input"),
    ((torch.randn(1, 2, 4, 8, 8), w), {}, RuntimeError, "Expected 3D (unbatched) or 4D (batched) input"),
    ((x, torch.randn(6, 4, 3)), {}, RuntimeError, "4-dimensional weight"),
    ((torch.randn(2, 5, 8, 8), w), {}, RuntimeError, "to have 4 channels, but got 5 channels instead"),
    ((torch.randn(2, 6, 8, 8), torch.randn(4, 2, 3, 3)), dict(groups=3), RuntimeError,
     "Given groups=3, expected weight to be divisible"),
    ((torch.randn(2, 6, 8, 8), torch.randn(6, 2, 3, 3)), dict(groups=3), None, None),  # valid: control
    ((x, torch.randn(6, 4, 3, 3), torch.randn(5)), {}, RuntimeError, "expected bias to be 1-dimensional with 6"),
    ((torch.randn(2, 4, 2, 2), w), {}, RuntimeError, "Kernel size can't be greater than actual input size"),
    ((x, w), dict(stride=0), RuntimeError, "non-positive stride"),
    ((x, w), dict(stride=-1), RuntimeError, "non-positive stride"),
    ((x, w), dict(dilation=0), RuntimeError, "dilation should be greater than zero"),
    ((x, w), dict(padding=-1), RuntimeError, "negative padding"),
    ((x, w), dict(padding="full"), RuntimeError, "Invalid padding string"),
    ((x, w), dict(padding="same", stride=2), RuntimeError, "not supported for strided convolutions"),
    ((x, w), dict(groups=0), RuntimeError, "non-positive groups"),
    ((x, w.double()), {}, RuntimeError, "should be the same"),
    ((x, w, torch.randn(6).half()), {}, RuntimeError, "should be the same"),
    ((x.long(), w.long()), {}, TypeError, None),
    ((x, w), dict(stride="2"), TypeError, None),
    ((x, w), dict(stride=1.5), TypeError, None),
    ((x, w), dict(padding=(1, "1")), TypeError, None),
    ((x, w), dict(groups=1.0), TypeError, None),
    ((x, w), dict(stride=(1, 1, 1)), RuntimeError, "list of 2 values"),
    # four pads are the spec's own canonical form, not an argument F.conv2d takes
    ((x, w), dict(padding=(1, 1, 1, 1)), RuntimeError, "list of 2 values"),
    ((x, w), dict(padding=[1, 2, 3]), RuntimeError, "list of 2 values"),
    ((x, w), dict(stride=torch.tensor(2.0)), TypeError, None),
    ((x, w), dict(stride=(True, 1)), TypeError, None),
    ((3, w), {}, TypeError, "must be Tensor"),
]


@pytest.mark.parametrize("args,kwargs,exc,fragment", CASES)
def test_errors_match_f_conv2d(args, kwargs, exc, fragment):
    before = kernelgen.stats()["compiles"]
    if exc is None:
        kernelgen.functional.spec_for(*args, **kwargs)  # valid: plans without error
        return
    with pytest.raises(exc) as info:
        kernelgen.conv2d(*args, **kwargs)
    if fragment:
        assert fragment in str(info.value)
    # torch refuses the same call (it may word type errors differently). Integer
    # convolution is the exception: torch's CPU path computes it, kernelgen refuses it.
    if not (isinstance(args[0], torch.Tensor) and not args[0].is_floating_point()):
        with pytest.raises((RuntimeError, TypeError, ValueError)):
            F.conv2d(*args, **kwargs)
    assert kernelgen.stats()["compiles"] == before


def test_mixed_devices_message():
    meta = torch.empty(6, 4, 3, 3, device="meta")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        kernelgen.conv2d(x, meta)


def test_bad_precision_and_family():
    with pytest.raises(ValueError, match="precision must be"):
        kernelgen.conv2d(x, w, precision="fast")
    with pytest.raises(ValueError, match="unknown kernel family"):
        kernelgen.conv2d(x, w, family="winograd")
    with pytest.raises(ValueError, match="cannot serve"):
        kernelgen.conv2d(x, w, family="direct")  # a CUDA family for CPU tensors


def test_sparse_is_refused():
    with pytest.raises(RuntimeError, match="dense"):
        kernelgen.conv2d(x.to_sparse(), w)


def test_meta_tensors_give_shapes_without_compiling():
    before = kernelgen.stats()["compiles"]
    y = kernelgen.conv2d(x.to("meta"), w.to("meta"), stride=2, padding=1)
    ref = F.conv2d(x.to("meta"), w.to("meta"), stride=2, padding=1)
    assert y.shape == ref.shape and y.device.type == "meta"
    assert kernelgen.stats()["compiles"] == before
