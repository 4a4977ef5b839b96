"""Records of which cached kernel serves a call signature, so a warm process skips the work.

The first call with a signature (shapes, strides, dtypes, device, parameters,
precision) is validated (checks.py), its kernel chosen (select.py) and loaded or built
(cache.py). The outcome, the entry's key and the call's sizes, is recorded under
`<cache>/plans/`. A later process making the same call reads the record and imports
the entry directly: the signature was valid when recorded, so there is nothing to
re-validate, and no spec, selection or rendering is needed. A record of a tuned call
(kernelgen.tune) also keeps the measured spec and the candidates' times under "tuned", so
the same choice is rebuilt where its entry has gone.

A record's name hashes the signature together with everything that could change the
answer: kernelgen's own sources and templates (by size and mtime), the Python, torch
and CUDA versions, the GPU's target and model, and the identity of the compilers on PATH. Any
change there is a different name, hence a miss and the full path. The entry a record
names is still verified (manifest and .so checksum) before it is imported.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import os
import stat
import sys
import uuid
from pathlib import Path

from . import config
from ._version import __version__

FORMAT = 1


def _walk(root: str, suffix: str) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of every file ending in `suffix` under `root`, sorted.

    One listing per directory and one stat per file found (DirEntry.is_dir answers from
    the listing): this runs in every process's first call.
    """
    found = []
    pending = [(root, "")]
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        pending.append((e.path, prefix + e.name + "/"))
                elif e.name.endswith(suffix):
                    st = e.stat()
                    found.append((prefix + e.name, st.st_size, st.st_mtime_ns))
    found.sort()
    return found


def _tool(name: str) -> list | None:
    """[path, device, inode, size, mtime_ns] of the executable PATH finds for `name` (None: none).

    shutil.which's answer (`name` itself if it has a directory part, else the first PATH
    entry holding an executable non-directory of that name), found with one access() per
    entry, which answers False rather than raising for the many entries that hold no such
    file, instead of which's exists/access/isdir. The stat follows symlinks, so the
    numbers are those of the real binary: switching what /usr/bin/c++ points to changes
    them, as an upgrade in place does.
    """
    if os.path.dirname(name):
        directories = [""]
    else:
        path = os.environ.get("PATH")
        if path is None:
            path = os.confstr("CS_PATH") if hasattr(os, "confstr") else os.defpath
        directories = path.split(os.pathsep) if path else []
    for directory in directories:
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK):
            try:
                st = os.stat(candidate)
            except OSError:  # removed since the access() call
                continue
            if not stat.S_ISDIR(st.st_mode):
                return [candidate, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    return None


@functools.lru_cache(maxsize=None)
def identity() -> str:
    """sha256 of what a record depends on besides the call: code, templates, the selector's measured
    tables, versions, compilers.

    The compilers are the host compiler and nvcc that PATH finds, the CUDA toolkit torch's
    builder would use, and the nvcc inside it (the one kernelgen builds with, which is not
    PATH's when CUDA_HOME names another toolkit).
    """
    import torch

    package = os.path.dirname(os.path.abspath(__file__))
    cxx, nvcc = _tool(config.host_compiler()), _tool("nvcc")
    home = config.cuda_home(nvcc[0] if nvcc else None)
    home_nvcc = _tool(os.path.join(home, "bin", "nvcc")) if home else None
    ident = [FORMAT, __version__, sys.implementation.cache_tag, torch.__version__, torch.version.cuda,
             _walk(package, ".py"), _walk(str(config.template_dir()), ".j2"), _walk(package, ".json"),
             [cxx, nvcc, home_nvcc],
             str(home) if home else None]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()


def record_name(signature: list, arch: str, gpu: str) -> str:
    """The record's name for a call signature (JSON-able) on a target `arch` and GPU model `gpu`
    (kernelgen.device.Device.key): the selector's choice, and a measured one, differ between GPUs."""
    text = json.dumps([identity(), arch, gpu, signature], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def read(root: Path, name: str) -> dict | None:
    try:
        record = json.loads((root / "plans" / f"{name}.json").read_bytes())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT else None


def write(root: Path, name: str, record: dict) -> None:
    """Atomically; best effort (a read-only cache only costs the full path next time)."""
    directory = root / "plans"
    tmp = directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        tmp.write_text(json.dumps(dict(record, format=FORMAT), sort_keys=True))
        os.replace(tmp, directory / f"{name}.json")
    except OSError:
        try:  # (a full disk: leave no temporary behind)
            os.unlink(tmp)
        except OSError:
            pass


_PREPS = {"any": ("any",), "nchw": ("nchw", "nchw_aligned"), "nhwc": ("nhwc",)}


def _pair(v) -> tuple[int, int]:
    """An int or a one/two-element sequence of ints as (h, w); TypeError/ValueError otherwise."""
    if isinstance(v, (tuple, list)):
        if len(v) == 1:
            v = (v[0], v[0])
        if len(v) != 2:
            raise ValueError(v)
        return operator.index(v[0]), operator.index(v[1])
    return operator.index(v), operator.index(v)


def _pads(padding, kernel, dilation) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) as spec.resolve_padding gives them ('same' needs stride 1 there)."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        th, tw = dilation[0] * (kernel[0] - 1), dilation[1] * (kernel[1] - 1)
        return (th // 2, th - th // 2, tw // 2, tw - tw // 2)
    ph, pw = _pair(padding)
    return (ph, ph, pw, pw)


def fits(record: dict, spec: dict | None, input, weight, bias, stride, padding, dilation, groups, activation=None,
         residual=None, scale=None) -> bool:
    """Whether a plan record read from disk, and the spec of the entry it names (its manifest's, as
    JSON values), describe this very call: its sizes, parameters, dtype, device and output format.

    A record's name covers the call's signature, but the file itself is only data: an edited or
    swapped record would hand a kernel sizes it was not built for (reads and writes out of
    bounds). Checked once per signature and process, from sizes and parameters alone, without the
    validation modules (a warm start does not import them); anything unusual is False, and the
    full path then decides."""
    from .layout import is_channels_last

    def ints(*values) -> bool:
        return all(v.__class__ is int for v in values)

    try:
        unbatched, N, K, P, Q, H, W, channels_last, sample = record["call"]
        if not isinstance(spec, dict) or unbatched not in (True, False) or channels_last not in (True, False):
            return False
        if not ints(N, K, P, Q, H, W) or record.get("prep") not in _PREPS.get(spec.get("layout"), ()):
            return False
        if unbatched != (input.dim() == 3) or weight.dim() != 4:
            return False
        n, c, h, w = (1, *input.shape) if unbatched else tuple(input.shape)
        k, cg, kh, kw = weight.shape
        kernel, s, d = (kh, kw), _pair(stride), _pair(dilation)
        pads = _pads(padding, kernel, d)
        if sample is not None:  # the kernel computes the stride-1 1x1 layer of input[..., ::sh, ::sw]
            if not (isinstance(sample, list) and len(sample) == 2 and ints(*sample) and tuple(sample) == s
                    and kernel == (1, 1) and not any(pads)):
                return False
            h, w, s = -(-h // s[0]), -(-w // s[1]), (1, 1)
        want = {"in_channels": c, "out_channels": k, "kernel_size": [kh, kw], "stride": list(s),
                "padding": list(pads), "dilation": list(d), "groups": operator.index(groups),
                "dtype": str(input.dtype).replace("torch.", ""), "bias": bias is not None,
                "device": input.device.type}
        if any(spec.get(f) != v for f, v in want.items()) or c != cg * want["groups"]:
            return False
        # the epilogue (fields a spec without one leaves out) and the residual it reads
        if spec.get("activation", "none") != (activation or "none") or spec.get("residual", False) != (
                residual is not None) or spec.get("scale", False) != (scale is not None):
            return False
        if scale is not None and (tuple(scale.shape) != (k,) or str(scale.dtype) != "torch.float32"
                                  or scale.device != input.device):
            return False
        if bias is not None and tuple(bias.shape) != (k,) or weight.dtype != input.dtype:
            return False
        p = (h + pads[0] + pads[1] - d[0] * (kh - 1) - 1) // s[0] + 1
        q = (w + pads[2] + pads[3] - d[1] * (kw - 1) - 1) // s[1] + 1
        cl = ((is_channels_last(input.unsqueeze(0) if unbatched else input) or is_channels_last(weight))
              and not (input.is_cuda and want["dtype"] == "float64"))
        if residual is not None and (tuple(residual.shape) != ((k, p, q) if unbatched else (n, k, p, q))
                                     or residual.dtype != input.dtype or residual.device != input.device):
            return False
        return (N, K, P, Q, H, W, channels_last) == (n, k, p, q, h, w, cl) and min(n, p, q) > 0
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
