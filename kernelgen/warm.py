"""Warm the cache ahead of time: records -> specs -> parallel builds.

A *record* describes one convolution call in F.conv2d's vocabulary:

    {"input": [8, 64, 56, 56], "weight": [128, 64, 3, 3], "bias": true, "stride": 1,
     "padding": 1, "dilation": 1, "groups": 1, "dtype": "float16", "device": "cuda"}

input: (N, C_in, H, W) or (C_in, H, W); weight: (C_out, C_in / groups, kH, kW); bias: whether
there is one; stride, dilation: int or [h, w]; padding: int, [h, w], "same" or "valid";
groups: int; dtype: float32, float16, bfloat16, float64; device: "cuda" or "cpu".
Optional: precision ("ieee" or "tf32", float32 only; default: torch's setting, as
conv2d follows it), memory_format ("contiguous" or "channels_last"), family and tiles
(force a kernel family and some of its tile sizes, as conv2d's keywords do), activation (one
of kernelgen.ACTIVATIONS), residual (true: a residual of the output's shape) and scale (true: a
float32 scale per output channel, a folded BatchNorm's), conv2d's fused epilogue.

A record becomes a spec through `functional.spec_for` on meta tensors, so the spec is
exactly what `kernelgen.conv2d` would compile for that call, the selector's choice of
family and tiles included. No tensor is allocated and no device is needed.

`find_model_calls` finds the records of a whole model by running its forward on meta
tensors; `warm_specs` builds specs in parallel worker processes (spawned, so each has
its own compiler state), each going through `Cache.get` and so the cache's per-key
lock: two warm runs over the same specs compile each key once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import json
import multiprocessing
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from . import config
from .errors import CompileError, KernelgenError
from .spec import DTYPES, ConvSpec, canonical_dtype
from .toolchain import Toolchain

RECORD_FIELDS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups", "dtype", "device",
                 "precision", "memory_format", "family", "tiles", "activation", "residual", "scale")
MEMORY_FORMATS = ("contiguous", "channels_last")
STATUSES = ("built", "cached", "failed")


class RecordError(KernelgenError, ValueError):
    """A record that cannot become a spec; the message names the file, the line and the field."""

    def __init__(self, origin: str, message: str, field: str | None = None):
        self.origin = origin
        self.field = field
        where = f"{origin}: field {field!r}: " if field else f"{origin}: "
        super().__init__(where + message)


@dataclass(frozen=True)
class Item:
    """One thing to warm: a spec, the toolchain to build it with, and where it came from."""

    spec: ConvSpec
    toolchain: Toolchain
    origin: str = ""


@dataclass
class Result:
    """What warming one (spec, toolchain) did. status: 'built', 'cached' or 'failed'."""

    spec: ConvSpec
    toolchain: Toolchain
    status: str
    seconds: float
    key: str = ""
    message: str = ""
    origin: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "seconds": round(self.seconds, 3), "key": self.key,
                "summary": self.spec.summary(), "arch": self.toolchain.arch, "origin": self.origin,
                "message": self.message, "spec": self.spec.to_dict()}


# ---------------------------------------------------------------------------- records


def _shape(origin: str, name: str, value: Any, dims: tuple[int, ...]) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) not in dims
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        want = " or ".join(str(d) for d in dims)
        raise RecordError(origin, f"expected a list of {want} ints (a tensor shape), got {json.dumps(value)}", name)
    if any(v < 0 for v in value):
        raise RecordError(origin, f"sizes must not be negative, got {value}", name)
    return tuple(value)


def _int_or_pair(origin: str, name: str, value: Any, strings: tuple[str, ...] = ()) -> Any:
    if isinstance(value, str) and value in strings:
        return value
    ok_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if ok_int(value):
        return value
    if isinstance(value, list) and len(value) in (1, 2) and all(ok_int(v) for v in value):
        return tuple(value)
    extra = "".join(f" or {json.dumps(s)}" for s in strings)
    raise RecordError(origin, f"expected an int or a list of 2 ints{extra}, got {json.dumps(value)}", name)


def _choice(origin: str, name: str, value: Any, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise RecordError(origin, f"expected one of {list(allowed)}, got {json.dumps(value)}", name)
    return value


def parse_record(record: Any, origin: str = "<record>", default_device: str = "cuda") -> ConvSpec | None:
    """The spec `kernelgen.conv2d` would compile for the call a record describes.

    None when the call computes nothing (an empty batch). Raises RecordError naming
    `origin` and the offending field.
    """
    import torch

    from .functional import spec_for

    if not isinstance(record, Mapping):
        raise RecordError(origin, f"a record is a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(RECORD_FIELDS))
    if unknown:
        raise RecordError(origin, f"unknown field; known fields are {list(RECORD_FIELDS)}", unknown[0])
    for name in ("input", "weight"):
        if name not in record:
            raise RecordError(origin, "missing (a tensor shape such as [8, 64, 56, 56])", name)
    in_shape = _shape(origin, "input", record["input"], (3, 4))
    w_shape = _shape(origin, "weight", record["weight"], (4,))
    bias = record.get("bias", False)
    if not isinstance(bias, bool):
        raise RecordError(origin, f"expected true or false, got {json.dumps(bias)}", "bias")
    stride = _int_or_pair(origin, "stride", record.get("stride", 1))
    padding = _int_or_pair(origin, "padding", record.get("padding", 0), ("same", "valid"))
    dilation = _int_or_pair(origin, "dilation", record.get("dilation", 1))
    groups = record.get("groups", 1)
    if not isinstance(groups, int) or isinstance(groups, bool):
        raise RecordError(origin, f"expected an int, got {json.dumps(groups)}", "groups")
    try:
        dtype = canonical_dtype(record.get("dtype", "float32"))
    except TypeError:
        raise RecordError(origin, f"expected one of {list(DTYPES)}, got {json.dumps(record.get('dtype'))}",
                          "dtype") from None
    device = _choice(origin, "device", record.get("device", default_device), ("cuda", "cpu"))
    precision = record.get("precision")
    if precision is not None:
        _choice(origin, "precision", precision, ("ieee", "tf32"))
    memory_format = _choice(origin, "memory_format", record.get("memory_format", "contiguous"), MEMORY_FORMATS)
    if memory_format == "channels_last" and len(in_shape) != 4:
        raise RecordError(origin, "channels_last needs a 4-D input", "memory_format")
    family = record.get("family")
    if family is not None and not isinstance(family, str):
        raise RecordError(origin, f"expected a family name, got {json.dumps(family)}", "family")
    tiles = record.get("tiles")
    if tiles is not None and (not isinstance(tiles, Mapping) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in tiles.values())):
        raise RecordError(origin, f"expected an object of tile name -> int, got {json.dumps(tiles)}", "tiles")
    activation = record.get("activation")
    if activation is not None and not isinstance(activation, str):
        raise RecordError(origin, f"expected an activation's name, got {json.dumps(activation)}", "activation")
    residual = record.get("residual", False)
    if not isinstance(residual, bool):
        raise RecordError(origin, f"expected true or false, got {json.dumps(residual)}", "residual")
    scale = record.get("scale", False)
    if not isinstance(scale, bool):
        raise RecordError(origin, f"expected true or false, got {json.dumps(scale)}", "scale")
    if w_shape[0] == 0 or w_shape[1] == 0:
        raise RecordError(origin, f"a convolution needs at least one input and one output channel, "
                                  f"got weight {list(w_shape)}", "weight")
    _check_shapes(origin, in_shape, w_shape, groups)
    tdtype = getattr(torch, dtype)
    fmt = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
    x = torch.empty(in_shape, dtype=tdtype, device="meta", memory_format=fmt) if len(in_shape) == 4 else \
        torch.empty(in_shape, dtype=tdtype, device="meta")
    w = torch.empty(w_shape, dtype=tdtype, device="meta")
    b = torch.empty((w_shape[0],), dtype=tdtype, device="meta") if bias else None
    try:
        r = _residual(x, w, b, stride, padding, dilation, groups) if residual else None
        s = torch.empty((w_shape[0],), dtype=torch.float32, device="meta") if scale else None
        spec, _call = spec_for(x, w, b, stride, padding, dilation, groups, device=device, precision=precision,
                               family=family, tiles=dict(tiles) if tiles else None, activation=activation,
                               residual=r, scale=s)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise RecordError(origin, f"impossible convolution: {exc}", _field_named(str(exc))) from None
    return spec


def _residual(x, w, b, stride, padding, dilation, groups, device: str = "meta", generator=None):
    """A residual for the call (an epilogue's): the output's shape, dtype and format, on `device`
    (random, from `generator`, where that is not meta)."""
    import torch

    from .functional import spec_for

    # (the output's sizes as conv2d's checks compute them: planned for meta, nothing is chosen or built)
    meta = lambda t: None if t is None else t.to("meta")  # noqa: E731
    _, call = spec_for(meta(x), meta(w), meta(b), stride, padding, dilation, groups, device="meta")
    shape = (call.K, call.P, call.Q) if call.unbatched else (call.N, call.K, call.P, call.Q)
    if device == "meta":
        return torch.empty(shape, dtype=x.dtype, device="meta")
    return torch.randn(*shape, generator=generator).to(device=device, dtype=x.dtype)


def _check_shapes(origin: str, in_shape: tuple[int, ...], w_shape: tuple[int, ...], groups: int) -> None:
    """The shape mismatches whose field is plain; spec_for explains the rest."""
    if groups <= 0:
        raise RecordError(origin, f"must be positive, got {groups}", "groups")
    if w_shape[0] % groups:
        raise RecordError(origin, f"out channels weight[0]={w_shape[0]} is not divisible by groups={groups}",
                          "weight")
    channels = in_shape[-3]
    if channels != w_shape[1] * groups:
        raise RecordError(origin, f"has {channels} channels (dimension {len(in_shape) - 3}); weight {list(w_shape)} "
                                  f"with groups={groups} expects {w_shape[1] * groups}", "input")


def _field_named(message: str) -> str | None:
    """The record field a library message is about, when it names one."""
    m = re.search(r"\b(stride|padding|dilation|groups|tiles|family|precision|dtype)\b", message)
    if m:
        return m.group(1)
    if "Kernel size can't be greater" in message:
        return "input"
    return None


def read_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(origin, record) for each record of a JSON file (one object or an array) or a JSON Lines file.

    origin is 'FILE:LINE'. A file that cannot be read, or a JSON file that does not
    parse, raises RecordError. In JSON Lines a line that does not parse is yielded as
    (origin, RecordError) in place of its record, so that the other lines proceed.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(str(path), f"cannot read the spec file: {exc}") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        yield from _json_array(path, text)
        return
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, Mapping):
        yield f"{path}:{text[:len(text) - len(stripped)].count(chr(10)) + 1}", whole
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        origin = f"{path}:{lineno}"
        try:
            yield origin, json.loads(line)
        except ValueError as exc:
            yield origin, RecordError(origin, f"not valid JSON ({exc})")


def _json_array(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    # json.loads gives no positions; decode element by element to name each record's line.
    decoder = json.JSONDecoder()
    try:
        json.loads(text)
    except ValueError as exc:
        line = getattr(exc, "lineno", "?")
        raise RecordError(f"{path}:{line}", f"not valid JSON ({exc})") from None
    pos = text.index("[") + 1
    while True:
        while text[pos] in " \t\r\n,":
            pos += 1
        if text[pos] == "]":
            return
        record, end = decoder.raw_decode(text, pos)
        yield f"{path}:{text.count(chr(10), 0, pos) + 1}", record
        pos = end


# ---------------------------------------------------------------------------- models


def load_callable(target: str) -> Callable[..., Any]:
    """'package.module:attr' (or 'path/to/file.py:attr') -> the attribute."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:CALLABLE (e.g. mypkg.models:build), got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        module = _import_path(Path(module_name))
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` would: the current directory's modules
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{target} is not callable")
    return obj


def _import_path(path: Path):
    import importlib.util

    name = f"kernelgen_warm_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Found:
    """A convolution found in a model's forward, the spec kernelgen would compile for it, and the
    call as a record (what `kernelgen warm --tune` times it with)."""

    spec: ConvSpec
    where: str
    record: dict = field(default_factory=dict)


def call_record(x, w, b, stride, padding, dilation, groups, precision, device: str, activation=None,
                residual=None, scale=None) -> dict:
    """A record (this module's docstring) of the call these (meta) tensors and arguments make."""
    from .checks import is_channels_last

    plain = lambda v: list(v) if isinstance(v, (tuple, list)) else v  # noqa: E731
    rec = {"input": list(x.shape), "weight": list(w.shape), "bias": b is not None, "stride": plain(stride),
           "padding": plain(padding), "dilation": plain(dilation), "groups": int(groups),
           "dtype": canonical_dtype(x.dtype), "device": device,
           "memory_format": "channels_last" if is_channels_last(x) else "contiguous"}
    if precision is not None:
        rec["precision"] = precision
    if activation is not None:
        rec["activation"] = activation
    if residual is not None:
        rec["residual"] = True
    if scale is not None:
        rec["scale"] = True
    return rec


def record_tensors(record: Mapping[str, Any], device: str, seed: int = 0) -> dict:
    """kernelgen.conv2d's arguments for a (valid) record, with random tensors on `device`: what the
    tuner times a call with (kernelgen.tune_calls)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, canonical_dtype(record.get("dtype", "float32")))
    x = torch.randn(*record["input"], generator=g).to(device=device, dtype=dtype)
    if record.get("memory_format") == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(*record["weight"], generator=g).to(device=device, dtype=dtype)
    b = torch.randn(record["weight"][0], generator=g).to(device=device, dtype=dtype) if record.get("bias") else None
    pair = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731
    args = {"input": x, "weight": w, "bias": b, "stride": pair(record.get("stride", 1)),
            "padding": pair(record.get("padding", 0)), "dilation": pair(record.get("dilation", 1)),
            "groups": record.get("groups", 1), "precision": record.get("precision")}
    if record.get("activation") is not None:
        args["activation"] = record["activation"]
    if record.get("residual"):
        args["residual"] = _residual(x, w, b, args["stride"], args["padding"], args["dilation"], args["groups"],
                                     device=device, generator=g)
    if record.get("scale"):  # (a folded BatchNorm's: positive, near 1)
        args["scale"] = (0.5 + torch.rand(record["weight"][0], generator=g)).to(device)
    return args


def find_model_calls(model, input_shapes: Sequence[Sequence[int]], device: str, dtype: Any = "float32",
                     precision: str | None = None, origin: str = "model") -> list[Found]:
    """The specs of every convolution in `model`'s forward on inputs of `input_shapes`.

    The model and inputs live on the meta device: no memory, no data, no GPU. Found are
    every kernelgen.conv2d call (kernelgen.Conv2d modules and direct calls alike, through
    functional.observe_meta_calls, each with its own precision) and every torch.conv2d /
    F.conv2d call, torch.nn.Conv2d's included (through a TorchFunctionMode), planned as
    kernelgen.conv2d would plan them on `device`.
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from .functional import observe_meta_calls, spec_for

    tdtype = getattr(torch, canonical_dtype(dtype))
    model = model.to(device="meta", dtype=tdtype)
    found: list[Found] = []
    names = {m: n or type(model).__name__ for n, m in model.named_modules()}
    current: list[str] = []  # the module whose forward is running, for the report

    def record(x, w, b, stride, padding, dilation, groups, prec, where, activation=None, residual=None, scale=None):
        spec, _ = spec_for(x, w, b, stride, padding, dilation, groups, device=device, precision=prec,
                           activation=activation, residual=residual, scale=scale)
        if spec is not None:
            found.append(Found(spec=spec, where=f"{origin}: {where}",
                               record=call_record(x, w, b, stride, padding, dilation, groups, prec, device,
                                                  activation, residual, scale)))

    def on_kernelgen_call(x, w, b, stride, padding, dilation, groups, prec, family, tiles, activation=None,
                          residual=None, scale=None):
        record(x, w, b, stride, padding, dilation, groups, prec if prec is not None else precision,
               current[-1] if current else "kernelgen.conv2d", activation, residual, scale)

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.conv2d or func is F.conv2d:
                names_ = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
                bound = dict(zip(names_, args))
                bound.update(kwargs)
                # torch disables this mode while its handler runs, so spec_for's own tensor calls are not seen.
                record(bound["input"], bound["weight"], bound.get("bias"), bound.get("stride", 1),
                       bound.get("padding", 0), bound.get("dilation", 1), bound.get("groups", 1), precision,
                       "torch.conv2d")
            return func(*args, **kwargs)

    def enter(module, args) -> None:  # hooks must return None, or they replace inputs/outputs
        current.append(names.get(module, "?"))

    def leave(module, args, out) -> None:
        current.pop()

    hooks = []
    for m in model.modules():
        hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        inputs = [torch.empty(tuple(s), device="meta", dtype=tdtype) for s in input_shapes]
        with torch.no_grad(), Mode(), observe_meta_calls(on_kernelgen_call):
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return found


# ---------------------------------------------------------------------------- building


def local_toolchains(device: str, archs: Sequence[str] | None = None) -> list[Toolchain]:
    """The toolchains to build `device`'s kernels with: for CUDA, one per arch in `archs`
    (default: the local GPU's). Raises RuntimeError saying why none can be had."""
    import torch

    from .toolchain import current

    if device == "cpu":
        return [current("cpu")]
    if not torch.version.cuda:
        raise RuntimeError(f"torch {torch.__version__} is a CPU-only build: it cannot build CUDA kernels. "
                           f"Warm CUDA kernels with a CUDA build of torch, or use device 'cpu'")
    if archs:
        return [current("cuda", a) for a in archs]
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible, so the target is unknown; name it with --arch "
                           "(e.g. --arch sm_80,sm_90a)")
    return [current("cuda")]


def _build_one(spec: ConvSpec, toolchain: Toolchain, root: str, lock_timeout: float) -> tuple[str, float, str, str]:
    """Worker side: (status, seconds, key, message) for one spec. Never raises."""
    from .cache import Cache

    start = time.perf_counter()
    try:
        _module, key, compiled = Cache(root, lock_timeout=lock_timeout).get(spec, toolchain)
    except CompileError as exc:
        return "failed", time.perf_counter() - start, "", str(exc)
    except Exception as exc:  # a worker reports every failure; the run goes on with the others
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return "failed", time.perf_counter() - start, "", text
    return ("built" if compiled else "cached"), time.perf_counter() - start, key, ""


def _cached_key(cache, item: Item) -> str | None:
    """The key of a complete, verified entry for `item`, or None: checked here, so that a
    warm run over a warm cache starts no worker (each would import torch for nothing)."""
    from .cache import InvalidEntry, cache_key, lookup_key
    from .render import render

    try:
        key = cache.index_get(lookup_key(item.spec, item.toolchain))
        if key is None:
            key = cache_key(item.spec, render(item.spec), item.toolchain)
        entry = cache.read_entry(key, item.toolchain, verify_so=True)
    except (InvalidEntry, OSError, ValueError):
        return None
    with contextlib.suppress(OSError):  # warming is a use: keep it from `cache prune --older-than`
        (entry.path / "last_used").touch()
    return key


def build_items(items: Sequence[Item], jobs: int | None = None, cache=None,
                on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Build every item, `jobs` at a time; results in the items' order.

    jobs: worker processes (default: KERNELGEN_JOBS, else the number of cores). Items
    already in the cache (a verified entry) are reported 'cached' without a worker;
    with one job (or one item left to build) the build runs in this process.
    on_result: called in this process with each Result as it completes.
    """
    from .cache import Cache

    cache = cache if cache is not None else Cache()
    jobs = config.jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    root, timeout = str(cache.root), cache.lock_timeout
    results: list[Result | None] = [None] * len(items)

    def finish(i: int, outcome: tuple[str, float, str, str]) -> None:
        status, seconds, key, message = outcome
        item = items[i]
        results[i] = Result(spec=item.spec, toolchain=item.toolchain, status=status, seconds=seconds, key=key,
                            message=message, origin=item.origin)
        if on_result is not None:
            on_result(results[i])

    todo = []
    for i, item in enumerate(items):
        start = time.perf_counter()
        key = _cached_key(cache, item)
        if key is not None:
            finish(i, ("cached", time.perf_counter() - start, key, ""))
        else:
            todo.append(i)
    workers = min(jobs, len(todo))
    if workers <= 1:
        for i in todo:
            finish(i, _build_one(items[i].spec, items[i].toolchain, root, timeout))
        return results  # type: ignore[return-value]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = {pool.submit(_build_one, items[i].spec, items[i].toolchain, root, timeout): i for i in todo}
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            try:
                outcome = future.result()
            except Exception as exc:  # a worker died (killed, out of memory): report, keep the rest
                outcome = ("failed", 0.0, "", f"the build worker died: {type(exc).__name__}: {exc}")
            finish(i, outcome)
    return results  # type: ignore[return-value]


def warm_specs(specs: Iterable[ConvSpec], toolchains: Toolchain | Sequence[Toolchain] | None = None,
               jobs: int | None = None, cache=None, on_result: Callable[[Result], None] | None = None,
               ) -> list[Result]:
    """Compile (or find in the cache) every spec, in parallel; one Result per (spec, toolchain).

    toolchains: each spec is built with every toolchain of its device (several CUDA
        toolchains: one build per arch). Default: the local toolchain of each spec's
        device (for CUDA, the local GPU's arch).
    jobs: worker processes (default: KERNELGEN_JOBS or the number of cores).
    cache: a kernelgen.cache.Cache (default: the one at KERNELGEN_CACHE_DIR).
    on_result: called with each Result as it completes (in this process).
    Duplicate (spec, toolchain) pairs are built once. A failed build is a Result with
    status 'failed' and the compiler's message; it does not stop the others.
    """
    if isinstance(toolchains, Toolchain):
        toolchains = [toolchains]
    by_device: dict[str, list[Toolchain]] = {}
    if toolchains is not None:
        for tc in toolchains:
            by_device.setdefault(tc.device, []).append(tc)
    items: list[Item] = []
    seen: set[tuple[ConvSpec, Toolchain]] = set()
    for spec in specs:
        if spec.device not in by_device:
            if toolchains is not None:
                raise ValueError(f"no {spec.device} toolchain was given for {spec.summary()}")
            by_device[spec.device] = local_toolchains(spec.device)
        for tc in by_device[spec.device]:
            if (spec, tc) not in seen:
                seen.add((spec, tc))
                items.append(Item(spec=spec, toolchain=tc))
    return build_items(items, jobs=jobs, cache=cache, on_result=on_result)


__all__ = ["Found", "Item", "RecordError", "Result", "build_items", "call_record", "find_model_calls",
           "load_callable", "local_toolchains", "parse_record", "read_records", "record_tensors", "warm_specs"]
