"""Compose the layers: spec -> (memo | disk cache | render + build) -> a launch callable.

This is the only module that holds process-wide state: the memo of loaded kernels and
the counters `stats()` reports.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from . import config
from .build import Built
from .cache import Cache
from .spec import ConvSpec
from .toolchain import Toolchain

Launch = Callable[..., None]

_lock = threading.RLock()
_memo: dict[tuple[ConvSpec, Toolchain], Launch] = {}
_caches: dict[str, Cache] = {}
_stats: Counter = Counter()


def default_cache() -> Cache:
    """The cache at KERNELGEN_CACHE_DIR (read now, so a changed variable takes effect)."""
    root = str(config.cache_dir())
    with _lock:
        if root not in _caches:
            _caches[root] = Cache(root)
        return _caches[root]


def _count_compile(spec: ConvSpec, key: str, built: Built) -> None:
    _stats["compiles"] += 1
    _stats["compile_seconds"] += built.seconds


def load_kernel(spec: ConvSpec, toolchain: Toolchain, cache: Cache | None = None) -> Launch:
    """The `launch` function of the kernel for `spec`, compiling it at most once."""
    memo_key = (spec, toolchain)
    fn = _memo.get(memo_key)
    if fn is not None:
        return fn
    with _lock:
        fn = _memo.get(memo_key)
        if fn is None:
            module, _key, compiled = (cache or default_cache()).get(spec, toolchain, on_compile=_count_compile)
            if not compiled:
                _stats["cache_hits"] += 1
            fn = module.launch
            _memo[memo_key] = fn
    return fn


def count(name: str, n: int = 1) -> None:
    _stats[name] += n


def stats() -> dict[str, float]:
    """Counters for this process: compiles, compile_seconds, cache_hits (loads from disk), fallbacks."""
    out = {"compiles": 0, "compile_seconds": 0.0, "cache_hits": 0, "fallbacks": 0}
    out.update(_stats)
    return out


def clear_memo() -> None:
    """Forget loaded kernels (the disk cache is untouched); for tests and cache tools."""
    with _lock:
        _memo.clear()
        _caches.clear()
