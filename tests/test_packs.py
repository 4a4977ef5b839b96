"""Weights packed once per weight version (kernelgen/packs.py), on the CPU path.

No CPU kernel packs its weights, so the launches here are stand-ins that do what the ABI says a
packing kernel does (report that they packed when handed memory that is not ready); the real
kernels' side of the contract is tested in test_candidates.py (rendered source) and on the GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kernelgen import functional, packs
from kernelgen.kernels import stats


@pytest.fixture(autouse=True)
def _fresh():
    packs.clear()
    yield
    packs.clear()


class FakeLaunch:
    """A launch that 'packs' (returns True) whenever the weights are not ready, recording each call's
    packed-memory pointer and readiness."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        wp, ready = args[24], args[25]
        assert len(args) == 29 and wp != 0
        self.calls.append((wp, ready))
        return not ready


def _plan(launch, w, nbytes=256, pack_once=True):
    x = torch.randn(1, 4, 5, 5)
    plan = functional.Plan(launch, (1, 8, 5, 5), torch.contiguous_format, False, 1, True, True,
                           (1, 5, 5, 5, 5, *x.stride(), 200, 25, 5, 1, *w.stride(), -1), "k" * 64,
                           packed=nbytes, pack_once=pack_once)
    return plan, x


def test_weights_pack_once_per_version_into_the_same_memory():
    w = torch.randn(8, 4, 1, 1)
    launch = FakeLaunch()
    plan, x = _plan(launch, w)
    before = stats().get("weight_packs", 0)
    for _ in range(3):
        functional._run(plan, x, w, None)
    assert [ready for _, ready in launch.calls] == [False, True, True]
    assert stats()["weight_packs"] - before == 1
    w.mul_(2)  # an in-place change bumps the version: packed again, into the same memory
    functional._run(plan, x, w, None)
    functional._run(plan, x, w, None)
    assert [ready for _, ready in launch.calls[3:]] == [False, True]
    assert len({wp for wp, _ in launch.calls}) == 1
    assert stats()["weight_packs"] - before == 2


def test_another_tensor_or_new_storage_is_packed_again():
    w = torch.randn(8, 4, 1, 1)
    launch = FakeLaunch()
    plan, x = _plan(launch, w)
    functional._run(plan, x, w, None)
    functional._run(plan, x, w.clone(), None)  # same values, another tensor
    with torch.no_grad():
        w.data = torch.randn(8, 4, 1, 1)  # new storage, version unchanged
    functional._run(plan, x, w, None)
    assert [ready for _, ready in launch.calls] == [False, False, False]


def test_a_kernel_that_did_not_pack_leaves_the_memory_not_ready():
    w = torch.randn(8, 4, 1, 1)
    calls = []

    def reads_weights_as_they_lie(*args):
        calls.append(args[25])
        return False

    plan, x = _plan(reads_weights_as_they_lie, w)
    functional._run(plan, x, w, None)
    functional._run(plan, x, w, None)
    assert calls == [False, False]


def test_pack_once_off_packs_every_call_into_memory_of_its_own():
    w = torch.randn(8, 4, 1, 1)
    launch = FakeLaunch()
    plan, x = _plan(launch, w, pack_once=False)
    for _ in range(3):
        functional._run(plan, x, w, None)
    assert [ready for _, ready in launch.calls] == [False, False, False]
    assert not packs._packs


def test_transient_weights_pack_every_call_and_keep_nothing_on_this_thread_only():
    """The gradients' operands (functional.transient_weights): packed each call, nothing kept; a
    call on another thread meanwhile (autograd's device threads) still keeps its packing."""
    import threading

    w = torch.randn(8, 4, 1, 1)
    launch = FakeLaunch()
    plan, x = _plan(launch, w)
    before = stats().get("weight_packs", 0)
    with functional.transient_weights():
        for _ in range(2):
            functional._run(plan, x, w, None)
        other = threading.Thread(target=lambda: functional._run(plan, x, w, None))
        other.start()
        other.join()
    assert [ready for _, ready in launch.calls] == [False, False, False]
    assert stats()["weight_packs"] - before == 1  # (the other thread's: kept, as outside the context)
    functional._run(plan, x, w, None)  # the context is over: the other thread's packing is read
    assert launch.calls[-1][1] is True


def test_gradients_mark_their_operands_transient(monkeypatch):
    """gradients.py runs its convolutions (flipped weights, grad_out as a kernel) as transient."""
    from kernelgen import gradients

    seen = []
    real = functional.conv2d

    def spy(*args, **kwargs):
        seen.append(getattr(functional._local, "transient", 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(gradients, "conv2d", spy)
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    gy = torch.randn(2, 4, 4, 4)
    gradients.input_grad(gy, w, x.shape)
    gradients.weight_grad(gy, x, w.shape)
    assert seen and all(t == 1 for t in seen)
    assert getattr(functional._local, "transient", 0) == 0


def test_pack_once_is_read_from_the_environment(monkeypatch):
    from kernelgen import config

    monkeypatch.setenv("KERNELGEN_PACK_ONCE", "0")
    assert config.pack_once() is False
    monkeypatch.setenv("KERNELGEN_PACK_ONCE", "maybe")
    with pytest.raises(ValueError, match="KERNELGEN_PACK_ONCE"):
        config.pack_once()
    monkeypatch.delenv("KERNELGEN_PACK_ONCE")
    assert config.pack_once() is True


def test_kept_memory_goes_with_the_weight_and_the_tuners_drop():
    w = torch.randn(8, 4, 1, 1)
    launch = FakeLaunch()
    plan, x = _plan(launch, w)
    functional._run(plan, x, w, None)
    assert len(packs._packs) == 1
    packs.drop(w, [plan.key])
    functional._run(plan, x, w, None)
    assert launch.calls[-1][1] is False  # dropped: packed again
    del w
    gc.collect()
    assert not packs._packs


def test_each_kernel_keeps_its_own_packing_of_a_weight():
    w = torch.randn(8, 4, 1, 1)
    a, b = FakeLaunch(), FakeLaunch()
    plan_a, x = _plan(a, w)
    plan_b, _ = _plan(b, w, nbytes=512)
    plan_b.key = "b" * 64
    for _ in range(2):
        functional._run(plan_a, x, w, None)
        functional._run(plan_b, x, w, None)
    assert [r for _, r in a.calls] == [False, True] and [r for _, r in b.calls] == [False, True]
    assert a.calls[0][0] != b.calls[0][0]


def test_frozen_weights_changes_nothing_outside_capture():
    import kernelgen

    w = torch.randn(8, 4, 1, 1)
    launch = FakeLaunch()
    plan, x = _plan(launch, w)
    with kernelgen.frozen_weights():
        for _ in range(2):
            functional._run(plan, x, w, None)
        w.add_(1)
        functional._run(plan, x, w, None)
    assert [ready for _, ready in launch.calls] == [False, True, False]
    assert packs._frozen == 0


def test_an_inference_tensor_is_packed_every_call():
    # made under torch.inference_mode, a weight has no version counter: nothing to see a change by
    with torch.inference_mode():
        w = torch.randn(8, 4, 1, 1)
    launch = FakeLaunch()
    plan, x = _plan(launch, w)
    for _ in range(2):
        functional._run(plan, x, w, None)
    assert [ready for _, ready in launch.calls] == [False, False]
    assert not packs._packs
