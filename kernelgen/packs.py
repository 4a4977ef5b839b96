"""Weights packed once per weight version: the device memory a kernel's packed weights live in.

Families that reorder or round their weights (KG_PACKED bytes, a spec's PACKED_BYTES) pack them
into memory the caller hands them as `wp`, and report when they did. That memory is kept here with
the weight tensor, one buffer per kernel, so that the next call with the same tensor, at the same
version counter and storage, passes it as ready and the kernel skips the packing: inference
weights are packed once, not on every call. An in-place change of the weight bumps its version,
and the next call packs it again into the same buffer. The buffers go when the tensor does.

Streams: a buffer is packed on one stream. A call on another stream waits for that packing (an
event) unless it is known to be done; calls outside capture ask until it is.

CUDA graphs: a replay cannot look at a version counter, and a weight changed in place between
replays (an optimizer step, load_state_dict) must be seen as cuDNN sees it. So a capture packs
into memory of its own and its replays pack on every run, as without this module, unless the
capture runs under `frozen_weights()`: then it reads the kept packing (once that is known done;
an event can be neither queried nor waited on from outside during capture), and its replays treat
the weights as constants, as torch.compile's freezing does.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from .kernels import count


class _Pack:
    __slots__ = ("buf", "version", "ptr", "strides", "streams", "event", "done")

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.version = -1  # the weight's version counter when packed; -1: not packed yet
        self.ptr = 0
        self.strides = ()
        self.streams: set[int] = set()  # streams ordered after the packing
        self.event = None  # recorded after the packing (CUDA)
        self.done = False  # the packing is known to have finished


# id(weight) -> (a weak reference to it, {kernel key: its pack})
_packs: dict[int, tuple[weakref.ref, dict[str, _Pack]]] = {}
_frozen = 0  # open frozen_weights() contexts
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)  # (torch.cuda's, unwrapped)


@contextlib.contextmanager
def frozen_weights() -> Iterator[None]:
    """CUDA graphs captured inside read the weights' kept packings instead of packing on every
    replay: a weight changed in place after the capture is not seen by its replays (capture again).
    Outside capture it changes nothing."""
    global _frozen
    _frozen += 1
    try:
        yield
    finally:
        _frozen -= 1


def _forget(wid: int, ref: weakref.ref) -> None:
    entry = _packs.get(wid)
    if entry is not None and entry[0] is ref:  # (not a later tensor that took the same id)
        del _packs[wid]


def lookup(weight: torch.Tensor, key: str, nbytes: int, stream: int) -> tuple[_Pack | None, bool]:
    """(pack, ready): the buffer kept for `weight` under kernel `key`, and whether it holds the
    weight's current version for a launch on `stream` (a raw stream handle; 0 on the CPU).

    Not ready: the caller launches with ready=0 into pack.buf, then calls `packed` if the kernel
    packed. pack None (under capture, unless frozen_weights() and the packing is known done): the
    caller launches into memory of its own with ready=0 and keeps nothing.
    """
    capturing = weight.is_cuda and _capturing()
    if capturing and not _frozen:
        return None, False  # (the capture packs into its own memory: replays see in-place changes)
    if weight.is_inference():
        return None, False  # (made under inference_mode: no version counter to see a change by)
    wid = id(weight)
    entry = _packs.get(wid)
    if entry is None or entry[0]() is not weight:
        entry = _packs[wid] = (weakref.ref(weight, lambda ref, wid=wid: _forget(wid, ref)), {})
    pack = entry[1].get(key)
    if pack is None or pack.version != weight._version or pack.ptr != weight.data_ptr() or \
            pack.strides != weight.stride():
        if capturing:
            return None, False  # (nothing kept changes during a capture)
        if pack is None:
            pack = entry[1][key] = _Pack(torch.empty(nbytes, dtype=torch.uint8, device=weight.device))
        return pack, False
    if pack.done and stream in pack.streams:
        return pack, True
    if capturing:
        # An event can be neither queried nor waited on from outside during capture, and a replay
        # is ordered after nothing launched before it: read the buffer only once it is known done.
        return (pack, True) if pack.done else (None, False)
    if not pack.done and pack.event.query():  # (asked until it is, so that a later capture may read it)
        pack.done = True
    if stream not in pack.streams:
        current = torch.cuda.current_stream(weight.device)
        if not pack.done:
            current.wait_event(pack.event)
        pack.buf.record_stream(current)  # (freed only after this stream's reads)
        pack.streams.add(stream)
    return pack, True


def packed(pack: _Pack, weight: torch.Tensor, stream: int) -> None:
    """Record that a launch on `stream` packed `weight`'s current version into `pack`."""
    pack.version, pack.ptr, pack.strides = weight._version, weight.data_ptr(), weight.stride()
    pack.streams = {stream}
    pack.done = not weight.is_cuda
    if weight.is_cuda:
        if pack.event is None:
            pack.event = torch.cuda.Event()
        pack.event.record(torch.cuda.current_stream(weight.device))
    count("weight_packs")


def drop(weight: torch.Tensor, keys) -> None:
    """Forget the buffers kept for `weight` under the kernels `keys` (the tuner's losing candidates)."""
    entry = _packs.get(id(weight))
    if entry is not None and entry[0]() is weight:
        for key in keys:
            entry[1].pop(key, None)


def clear() -> None:
    """Forget every kept buffer (their memory goes back to torch's allocator)."""
    _packs.clear()
