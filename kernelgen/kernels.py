"""Compose the layers: spec -> (memo | disk cache | render + build) -> a launch callable.

This is the only module that holds process-wide state: the memo of loaded kernels and
the counters `stats()` reports.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING, Callable

from . import config

if TYPE_CHECKING:
    from .build import Built
    from .cache import Cache
    from .spec import ConvSpec
    from .toolchain import Toolchain

Launch = Callable[..., None]

log = logging.getLogger("kernelgen")

_lock = threading.RLock()
_memo: dict[tuple["ConvSpec", "Toolchain"], tuple[Launch, str]] = {}
_by_key: dict[str, Launch] = {}
# key -> (KG_WORKSPACE, KG_WORKSPACE_PER_INPUT, KG_WORKSPACE_PER_OUTPUT, KG_PACKED): device scratch
# its launch takes, in bytes, and bytes more for each input and each output element; the bytes of
# its packed weights (kept with the weight, packs.py)
_workspace: dict[str, tuple[int, int, int, int]] = {}
# key -> the spec (as the manifest's JSON dict) its entry was built for, checked against a call
# that found the key in a plan record (plans.fits)
_specs: dict[str, dict] = {}
_caches: dict[str, "Cache"] = {}
_stats: Counter = Counter()


def default_cache() -> "Cache":
    """The cache at KERNELGEN_CACHE_DIR (read now, so a changed variable takes effect)."""
    from .cache import Cache

    root = str(config.cache_dir())
    with _lock:
        if root not in _caches:
            _caches[root] = Cache(root)
        return _caches[root]


def _count_compile(spec: "ConvSpec", key: str, built: "Built") -> None:
    _stats["compiles"] += 1
    _stats["compile_seconds"] += built.seconds


def load_kernel(spec: "ConvSpec", toolchain: "Toolchain", cache: "Cache | None" = None) -> tuple[Launch, str]:
    """(launch, key) of the kernel for `spec`, compiling it at most once."""
    memo_key = (spec, toolchain)
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    with _lock:
        hit = _memo.get(memo_key)
        if hit is None:
            module, key, compiled = (cache or default_cache()).get(spec, toolchain, on_compile=_count_compile)
            if not compiled:
                _stats["cache_hits"] += 1
            hit = _memo[memo_key] = (module.launch, key)
            _by_key.setdefault(key, module.launch)
            _specs.setdefault(key, json.loads(spec.to_json()))
            _workspace[key] = _workspace_of(module)
    return hit


def load_entry(key: str, cache: "Cache | None" = None, expect: dict | None = None) -> Launch | None:
    """The launch function of the verified entry `key`, or None if it is missing or unusable.

    For callers that already know the key from a plan record (plans.py), whose name
    covers the toolchain; `expect` names the toolchain fields the entry's manifest must
    still show (kernelgen, Python, torch, CUDA, device, arch).
    """
    fn = _by_key.get(key)
    if fn is not None:
        return fn
    if not (isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)):
        return None  # (a damaged record: the key names a directory)
    from .cache import InvalidEntry

    cache = cache or default_cache()
    with _lock:
        fn = _by_key.get(key)
        if fn is None:
            try:
                cache.ensure()
                module = cache.load(key, toolchain=None, expect=expect)
                fn = module.launch
            except (FileNotFoundError, InvalidEntry) as exc:
                log.debug("kernelgen: plan record names entry %s, which is not usable (%s)", key[:16], exc)
                return None
            spec = getattr(module, "KG_SPEC", None)
            if not isinstance(spec, dict):
                return None
            _stats["cache_hits"] += 1
            _by_key[key] = fn
            _specs[key] = spec
            _workspace[key] = _workspace_of(module)
    return fn


def entry_spec(key: str) -> dict | None:
    """The spec (a dict of JSON values) the loaded kernel `key` was built for; None if not loaded."""
    return _specs.get(key)


def _workspace_of(module) -> tuple[int, int, int, int]:
    return tuple(int(getattr(module, name, 0))
                 for name in ("KG_WORKSPACE", "KG_WORKSPACE_PER_INPUT", "KG_WORKSPACE_PER_OUTPUT", "KG_PACKED"))


def workspace_bytes(key: str, input_numel: int, output_numel: int) -> int:
    """Bytes of device scratch memory the loaded kernel `key` takes to launch on an input of
    `input_numel` elements and an output of `output_numel` (0: none)."""
    fixed, per_input, per_output, _ = _workspace.get(key, (0, 0, 0, 0))
    return fixed + per_input * input_numel + per_output * output_numel


def packed_bytes(key: str) -> int:
    """Bytes of device memory the loaded kernel `key` packs a weight into (0: it packs none)."""
    return _workspace.get(key, (0, 0, 0, 0))[3]


def count(name: str, n: int = 1) -> None:
    _stats[name] += n


def stats() -> dict[str, float]:
    """Counters for this process: compiles, compile_seconds, cache_hits (loads from disk), fallbacks,
    weight_packs (kernels that packed a weight version, packs.py)."""
    out = {"compiles": 0, "compile_seconds": 0.0, "cache_hits": 0, "fallbacks": 0, "weight_packs": 0}
    out.update(_stats)
    return out


def clear_memo() -> None:
    """Forget loaded kernels (the disk cache is untouched); for tests and cache tools."""
    with _lock:
        _memo.clear()
        _by_key.clear()
        _workspace.clear()
        _specs.clear()
        _caches.clear()
