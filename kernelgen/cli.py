"""The `kernelgen` command's work: warm, cache, render and doctor.

The command line itself (argparse, help, the console script) is kernelgen_cli, a module
beside this package that parses before anything imports torch; `run` here takes what it
parsed. See kernelgen_cli for the commands and exit statuses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from . import config
from ._version import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# (dtype, precision) of each mode examples/run_all.py offers: --precision ieee, tf32, bf16.
EXAMPLE_MODES = (("float32", "ieee"), ("float32", "tf32"), ("bfloat16", None))


class UsageError(Exception):
    """Bad usage or input: reported on stderr, exit status 2."""


def _err(message: str) -> None:
    print(f"kernelgen: {message}", file=sys.stderr)


def _clean(value: Any) -> str:
    """`value` as text safe to print: control and format characters (terminal escapes, carriage
    returns, bidirectional overrides) from a manifest or an archive shown as escapes."""
    import unicodedata

    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else
                   (repr(c)[1:-1] if unicodedata.category(c)[0] == "C" else "?") for c in text)


def _secret(args) -> bytes | None:
    from . import cache_admin as ca

    path = getattr(args, "secret", None) or config.archive_secret()
    if path is None:
        return None
    try:
        return ca.read_secret(path)
    except ca.ArchiveError as exc:
        raise UsageError(str(exc)) from None


def _dump(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def _cache(args):
    from .cache import Cache

    return Cache(args.cache_dir) if getattr(args, "cache_dir", None) else Cache()


def _archs(text: str | None) -> list[str] | None:
    """Validated arch names from 'sm_80,sm_90a' (UsageError naming the bad one)."""
    if text is None:
        return None
    from .toolchain import arch_flags

    archs = [a.strip() for a in text.split(",") if a.strip()]
    if not archs:
        raise UsageError("--arch needs at least one architecture, e.g. --arch sm_80,sm_90a")
    for a in archs:
        try:
            arch_flags(a)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return list(dict.fromkeys(archs))


# ---------------------------------------------------------------------------- warm


class Reporter:
    """Progress on a terminal (a bar on stderr), one line per spec otherwise (on stdout).

    The bar is drawn at 0/N before the first build starts and redrawn every second, so a long
    first build shows what it is building and for how long; the ETA is the mean time of the
    builds done so far times those left, divided among the jobs.
    """

    TICK = 1.0  # seconds between redraws while nothing completes

    def __init__(self, items: Sequence[Any], as_json: bool, jobs: int = 1, stream=None):
        import threading

        self.items = list(items)
        self.total = len(self.items)
        self.jobs = max(1, min(jobs, self.total))
        self.stream = stream or sys.stderr
        self.bar = self.stream.isatty()
        self.lines = not self.bar and not as_json
        self.counts = {"built": 0, "cached": 0, "failed": 0}
        self.index = {(item.spec, item.toolchain): i for i, item in enumerate(self.items)}  # (warm dedups)
        self.done: set[int] = set()  # indices into items; items finish in any order with several jobs
        self.build_seconds = 0.0
        self.start = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = None
        if self.bar:
            self._draw()
            self._ticker = threading.Thread(target=self._tick, name="kernelgen-progress", daemon=True)
            self._ticker.start()

    def __call__(self, result) -> None:
        with self._lock:
            self.counts[result.status] += 1
            self.done.add(self.index.get((result.spec, result.toolchain), -1))
            if result.status != "cached":
                self.build_seconds += result.seconds
            if result.status == "failed":
                self._clear()
                _err(f"FAILED {result.spec.summary()} ({result.toolchain.arch})"
                     + (f" from {result.origin}" if result.origin else "") + f":\n{result.message}")
            if self.lines:
                print(f"{result.status:<6} {result.seconds:6.1f} s  {result.spec.summary()}  "
                      f"({result.toolchain.arch})", flush=True)
            if self.bar:
                self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(self.TICK):
            with self._lock:
                self._draw()

    def line(self, width: int) -> str:
        """The bar's text: done/total, counts, elapsed, ETA and the item being built, in `width` columns."""
        c = self.counts
        done = sum(c.values())
        filled = int(20 * done / max(self.total, 1))
        elapsed = time.perf_counter() - self.start
        builds = c["built"] + c["failed"]
        left = self.total - done
        if left == 0:
            eta = ""
        elif builds:
            eta = f"  ETA {self.build_seconds / builds * left / self.jobs:.0f} s"
        else:
            eta = "  ETA ?"
        text = (f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{self.total}  built {c['built']}  cached "
                f"{c['cached']}  failed {c['failed']}  {elapsed:.0f} s{eta}")
        # The oldest item not done: the one being built with one job, the longest running with several.
        current = next((item for i, item in enumerate(self.items) if i not in self.done), None)
        if current is not None:
            text += f"  {current.spec.summary()}"
        return text if len(text) <= width else text[:max(width - 1, 0)] + "…"

    def _draw(self) -> None:
        width = shutil.get_terminal_size((100, 24)).columns - 1
        self.stream.write("\r" + self.line(width).ljust(width) + "\r")
        self.stream.flush()

    def _clear(self) -> None:
        if self.bar:
            width = shutil.get_terminal_size((100, 24)).columns - 1
            self.stream.write("\r" + " " * width + "\r")
            self.stream.flush()

    def close(self) -> None:
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
        if self.bar:
            with self._lock:
                self._draw()
                self.stream.write("\n")
                self.stream.flush()


def _model_specs(model_factory, shapes, device, dtype, precision, origin) -> list:
    import torch

    from .warm import find_model_calls

    with torch.device("meta"):
        model = model_factory()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{origin} returned {type(model).__name__}, not a torch.nn.Module")
    return find_model_calls(model.eval(), shapes, device=device, dtype=dtype, precision=precision, origin=origin)


def _example_specs(directory: Path, device: str, dtype: str | None, precision: str | None) -> list:
    """Every spec examples/conv_*.py's ModelNew compiles, in each mode of run_all.py."""
    import torch

    from .warm import _import_path

    files = sorted(directory.glob("conv_*.py"))
    if not files:
        raise UsageError(f"no examples (conv_*.py) in {directory}; name the directory: --examples DIR")
    modes = [(d, p) for d, p in EXAMPLE_MODES if (dtype is None or d == dtype) and (precision is None or p == precision)]
    if not modes:
        raise UsageError(f"the examples run in modes {EXAMPLE_MODES}; --dtype {dtype} --precision {precision} "
                         f"matches none")
    harness = None
    if device == "cpu":
        # The CPU path runs at reduced shapes that only the harness knows.
        path = directory / "_harness.py"
        if not path.is_file():
            raise UsageError(f"{path} is missing: it defines the reduced shapes the examples use on the CPU")
        sys.path.insert(0, str(directory))
        harness = _import_path(path)
        if not hasattr(harness, "input_shapes") or not hasattr(harness, "Options"):
            raise UsageError(f"{path} exposes no input_shapes()/Options; cannot tell the examples' CPU shapes")
    found = []
    for f in files:
        module = _import_path(f)
        for fn in ("ModelNew", "get_inputs", "get_init_inputs"):
            if not hasattr(module, fn):
                raise UsageError(f"{f} defines no {fn}; an example needs Model, ModelNew, get_inputs, "
                                 f"get_init_inputs")
        for d, p in modes:
            if harness is not None:
                label = {"ieee": "ieee", "tf32": "tf32", None: "bf16"}[p]
                shapes = harness.input_shapes(module, harness.Options(device="cpu", precision=label))
            else:
                with torch.device("meta"):
                    shapes = [tuple(t.shape) for t in module.get_inputs()]
            init = module.get_init_inputs()
            found += _model_specs(lambda: module.ModelNew(*init), shapes, device, d, p,
                                  f"{f.name} ({d}{'/' + p if p else ''})")
    return found


def _collect_specs(args, device: str) -> tuple[list[tuple[Any, str, dict]], list[str]]:
    """(spec, origin, record) of every call warm's sources name, planned for the current target, and
    the bad records' messages."""
    from . import warm

    errors: list[str] = []
    found: list[tuple[Any, str, dict]] = []
    for path in args.specfiles:
        try:
            for origin, record in warm.read_records(path):
                if isinstance(record, Exception):
                    errors.append(str(record))
                    continue
                try:
                    spec = warm.parse_record(record, origin, default_device=device)
                except warm.RecordError as exc:
                    errors.append(str(exc))
                    continue
                if spec is not None:
                    found.append((spec, origin, record))
        except warm.RecordError as exc:
            errors.append(str(exc))
    if args.model:
        try:
            factory = warm.load_callable(args.model)
        except (ValueError, ImportError) as exc:
            raise UsageError(f"--model {args.model}: {exc}") from None
        for f in _model_specs(factory, args.input_shape, device, args.dtype or "float32", args.precision,
                              args.model):
            found.append((f.spec, f.where, f.record))
    if args.examples:
        for f in _example_specs(Path(args.examples), device, args.dtype, args.precision):
            found.append((f.spec, f.where, f.record))
    return found, errors


def cmd_warm(args) -> int:
    import torch

    from . import functional, warm

    archs = _archs(args.arch)
    if args.tune and (archs or args.dry_run):
        raise UsageError("--tune times the calls on this machine's GPU: it goes with neither --arch nor --dry-run")
    if args.wide_dram and not archs:
        raise UsageError("--wide-dram goes with --arch: it plans for that target's larger-memory part (the H200 "
                         "for sm_90a; without --arch, warm plans for the local GPU, which kernelgen reads itself)")
    if archs and not torch.version.cuda:
        raise UsageError(f"--arch needs a torch with CUDA support; this torch ({torch.__version__}) is a CPU-only "
                         f"build, so it cannot compile CUDA kernels. Install a CUDA build of torch, or warm "
                         f"the CPU path without --arch")
    device = args.device or ("cuda" if archs or torch.cuda.is_available() else "cpu")
    if not (args.specfiles or args.examples or args.model):
        raise UsageError("nothing to warm: give SPECFILE(s), --examples or --model (see kernelgen warm --help)")
    if args.model and not args.input_shape:
        raise UsageError("--model needs --input-shape (one per forward argument), e.g. --input-shape 1,3,224,224")
    if args.input_shape and not args.model:
        raise UsageError("--input-shape goes with --model")

    # Each --arch target is planned for itself (the families and the selector's data differ by GPU),
    # and its specs are built with that arch's toolchain; without --arch, for the local GPU.
    errors: list[str] = []
    found: list[tuple[Any, str, str | None]] = []  # (spec, origin, arch)
    calls: list[tuple[str, dict]] = []  # (origin, record), for --tune
    for arch in archs or [None]:
        with functional.planning_for(arch, args.wide_dram) if arch else contextlib.nullcontext():
            specs, errs = _collect_specs(args, device)
        found += [(spec, origin, arch) for spec, origin, _ in specs]
        calls += [(origin, record) for _, origin, record in specs]
        errors += [e for e in errs if e not in errors]  # a bad record is bad for every target

    toolchains: dict[tuple[str, str | None], Any] = {}
    items: list[warm.Item] = []
    seen: set = set()
    for spec, origin, arch in found:
        arch = arch if spec.device == "cuda" else None
        if (spec.device, arch) not in toolchains:
            try:
                toolchains[spec.device, arch] = warm.local_toolchains(spec.device, [arch] if arch else None)
            except (RuntimeError, ValueError) as exc:
                toolchains[spec.device, arch] = exc
        tcs = toolchains[spec.device, arch]
        if isinstance(tcs, Exception):
            message = f"{origin}: cannot warm {spec.device} kernels here: {tcs}"
            if message not in errors:
                errors.append(message)
            continue
        for tc in tcs:
            if (spec, tc) not in seen:
                seen.add((spec, tc))
                items.append(warm.Item(spec=spec, toolchain=tc, origin=origin))
    for e in errors:
        _err(e)

    cache = _cache(args)
    if args.dry_run:
        if args.json:
            _dump({"cache_dir": str(cache.root), "errors": errors, "items": [
                {"summary": i.spec.summary(), "arch": i.toolchain.arch, "origin": i.origin, "spec": i.spec.to_dict()}
                for i in items]})
        else:
            for i in items:
                print(f"{i.spec.summary()}  ({i.toolchain.arch})  from {i.origin}")
            print(f"kernelgen warm --dry-run: {len(items)} specialisation(s) would be warmed")
        return EXIT_USAGE if errors else EXIT_OK
    reporter = Reporter(items, args.json, jobs=args.jobs or config.jobs())
    start = time.perf_counter()
    try:
        results = warm.build_items(items, jobs=args.jobs, cache=cache, on_result=reporter)
    finally:
        reporter.close()
    elapsed = time.perf_counter() - start
    counts = {s: sum(r.status == s for r in results) for s in ("built", "cached", "failed")}
    if args.json:
        _dump({"cache_dir": str(cache.root), "seconds": round(elapsed, 3), **counts, "errors": errors,
               "results": [r.to_dict() for r in results]})
    else:
        print(f"kernelgen warm: {len(results)} specialisation(s) in {elapsed:.1f} s: {counts['built']} built, "
              f"{counts['cached']} cached, {counts['failed']} failed"
              + (f"; {len(errors)} bad record(s) skipped" if errors else "") + f" (cache {cache.root})")
    if errors:
        return EXIT_USAGE
    if counts["failed"]:
        return EXIT_FAILED
    return _tune_calls(calls, device, args) if args.tune else EXIT_OK


def _tune_calls(calls: list[tuple[str, dict]], device: str, args) -> int:
    """`warm --tune`: each distinct call timed on this machine's GPU with random data of its sizes,
    its candidates built in parallel, the fastest kept in its plan record (kernelgen.tune_calls)."""
    import json as _json

    import torch

    from . import tuner, warm

    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--tune times kernels on this machine's GPU, and none is visible")
    unique = {}
    for origin, record in calls:
        unique.setdefault(_json.dumps(record, sort_keys=True), (origin, record))
    start, tuned = time.perf_counter(), 0
    batch = 16  # calls whose tensors are alive at once
    items = list(unique.values())
    for i in range(0, len(items), batch):
        part = items[i:i + batch]
        results = tuner.tune_calls([warm.record_tensors(r, device, seed=i + j) for j, (_, r) in enumerate(part)],
                                   jobs=args.jobs)
        for (origin, _), res in zip(part, results):
            tuned += 1
            if not args.json:
                print(f"tuned {origin}: {res.spec.summary()} ({res.speedup:.2f}x the untuned choice)")
    seconds = time.perf_counter() - start
    if args.json:
        _dump({"tuned": tuned, "seconds": round(seconds, 3)})
    else:
        print(f"kernelgen warm --tune: {tuned} call(s) in {seconds:.1f} s")
    return EXIT_OK


# ---------------------------------------------------------------------------- cache


def cmd_cache_ls(args) -> int:
    from . import cache_admin as ca

    cache = _cache(args)
    entries = ca.list_entries(cache)
    now = time.time()
    if args.json:
        _dump([e.to_dict(now) for e in entries])
        return EXIT_OK
    if not entries:
        print(f"no entries in {cache.root}")
        return EXIT_OK
    rows = [("KEY", "FAMILY", "ARCH", "SIZE", "AGE", "USED", "SPEC")]
    rows += [(e.key[:16], _clean(e.family), _clean(e.arch), ca.human_size(e.size), ca.human_age(now - e.created),
              ca.human_age(now - e.last_used) + " ago", _clean(e.summary)) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[6])
    total = sum(e.size for e in entries)
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {ca.human_size(total)} in {cache.root}")
    return EXIT_OK


def cmd_cache_info(args) -> int:
    from . import cache_admin as ca

    try:
        d = ca.entry_details(_cache(args), args.key)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    if args.json:
        _dump(d)
    else:
        print(f"key:       {d['key']}")
        print(f"status:    {_clean(d['status'])}")
        print(f"summary:   {_clean(d['summary'])}")
        print(f"path:      {_clean(d['path'])}")
        for s in d["sources"]:
            print(f"source:    {_clean(s)}")
        so = d.get("so") if isinstance(d.get("so"), dict) else {}
        print(f"binary:    {_clean(so.get('file'))} ({_clean(so.get('size'))} bytes, sha256 {_clean(so.get('sha256'))})")
        created = d.get("created")
        when = time.ctime(created) if isinstance(created, (int, float)) and 0 < created < 1e11 else "?"
        print(f"built:     {when} in {_clean(d.get('build_seconds'))} s")
        print("spec:      " + json.dumps(d["spec"], sort_keys=True))
        print("toolchain:")
        tc = d.get("toolchain") if isinstance(d.get("toolchain"), dict) else {}
        for k, v in tc.items():
            print(f"  {_clean(k)}: {_clean(' '.join(map(str, v)) if isinstance(v, list) else v)}")
    return EXIT_OK if d["status"] == "ok" else EXIT_FAILED


def cmd_cache_clear(args) -> int:
    from . import cache_admin as ca

    cache = _cache(args)
    n = ca.clear(cache)
    if args.json:
        _dump({"removed": n, "cache_dir": str(cache.root)})
    else:
        print(f"removed {n} entr{'y' if n == 1 else 'ies'} from {cache.root}")
    return EXIT_OK


def cmd_cache_prune(args) -> int:
    from . import cache_admin as ca

    try:
        max_size = ca.parse_size(args.max_size) if args.max_size is not None else None
        older = ca.parse_age(args.older_than) if args.older_than is not None else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if max_size is None and older is None:
        raise UsageError("cache prune needs --max-size SIZE, --older-than AGE or both")
    cache = _cache(args)
    removed = ca.prune(cache, max_size=max_size, older_than=older, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        _dump({"dry_run": args.dry_run, "removed": [e.to_dict() for e in removed],
               "bytes": sum(e.size for e in removed)})
    else:
        for e in removed:
            print(f"{verb} {e.key[:16]}  {ca.human_size(e.size)}  {_clean(e.summary)}")
        print(f"{verb} {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}, "
              f"{ca.human_size(sum(e.size for e in removed))} from {cache.root}")
    return EXIT_OK


def cmd_cache_export(args) -> int:
    from . import cache_admin as ca

    cache = _cache(args)
    try:
        keys = ca.export(cache, args.file, keys=args.key, secret=_secret(args))
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    except OSError as exc:
        _err(f"cannot write {args.file}: {exc}")
        return EXIT_FAILED
    size = os.path.getsize(args.file)
    if args.json:
        _dump({"file": str(args.file), "keys": keys, "bytes": size})
    else:
        signed = "signed" if _secret(args) is not None else "unsigned: importers need --trust-unsigned"
        print(f"exported {len(keys)} entr{'y' if len(keys) == 1 else 'ies'} to {args.file} ({ca.human_size(size)}, "
              f"{signed})")
    return EXIT_OK


def cmd_cache_import(args) -> int:
    from . import cache_admin as ca

    archs = _archs(args.arch)
    cache = _cache(args)
    try:
        outcomes = ca.import_archive(cache, args.file, archs=archs, secret=_secret(args),
                                     trust_unsigned=args.trust_unsigned)
    except ca.ArchiveError as exc:
        raise UsageError(f"refusing {args.file}: {exc}") from None
    counts = {s: sum(o.status == s for o in outcomes) for s in ("imported", "present", "skipped", "failed")}
    if args.json:
        _dump({"cache_dir": str(cache.root), **counts, "entries": [o.to_dict() for o in outcomes]})
    else:
        for o in outcomes:
            line = f"{o.status:<8} {_clean(o.key[:16])}  {_clean(o.summary)}"
            print(line + (f"\n         {_clean(o.reason)}" if o.reason and o.status != "present" else ""))
        print(f"kernelgen cache import: {counts['imported']} imported, {counts['present']} already present, "
              f"{counts['skipped']} skipped, {counts['failed']} failed (cache {cache.root})")
    return EXIT_FAILED if counts["failed"] else EXIT_OK


def cmd_cache_keygen(args) -> int:
    from . import cache_admin as ca

    try:
        ca.new_secret(args.file)
    except FileExistsError:
        raise UsageError(f"{args.file} exists; refusing to overwrite a secret") from None
    except OSError as exc:
        _err(f"cannot write {args.file}: {exc.strerror}")
        return EXIT_FAILED
    if args.json:
        _dump({"file": str(args.file)})
    else:
        print(f"wrote a new archive secret to {args.file} (mode 600): `kernelgen cache export --secret "
              f"{args.file}` signs, `kernelgen cache import --secret {args.file}` verifies")
    return EXIT_OK


# ---------------------------------------------------------------------------- render


def cmd_render(args) -> int:
    from . import functional
    from .render import render
    from .warm import RecordError, parse_record

    archs = _archs(args.arch)
    if archs and len(archs) > 1:
        raise UsageError(f"--arch: render plans for one target, got {','.join(archs)}")
    if args.wide_dram and not archs:
        raise UsageError("--wide-dram goes with --arch (without it, render plans for the local GPU)")

    device = args.device
    if device is None:
        import torch

        device = "cuda" if archs or torch.cuda.is_available() else "cpu"
        if device == "cpu":  # say so: CUDA source for a GPU this machine lacks would be of no use here
            _err("no GPU is visible, so this is the C++ source kernelgen.conv2d compiles for CPU tensors; for a "
                 "GPU's CUDA source name its target, e.g. --arch sm_90a (or --device cuda)")
    record: dict[str, Any] = {"input": list(args.input), "weight": list(args.weight), "bias": args.bias,
                              "stride": args.stride, "padding": args.padding, "dilation": args.dilation,
                              "groups": args.groups, "dtype": args.dtype, "device": device,
                              "memory_format": args.memory_format}
    if args.precision:
        record["precision"] = args.precision
    if args.family:
        record["family"] = args.family
    if args.tile:
        tiles = {}
        for t in args.tile:
            name, sep, value = t.partition("=")
            if not sep or not value.lstrip("-").isdigit():
                raise UsageError(f"--tile {t!r}: expected NAME=INT, e.g. --tile block_p=8")
            tiles[name] = int(value)
        record["tiles"] = tiles
    try:
        with functional.planning_for(archs[0], args.wide_dram) if archs else contextlib.nullcontext():
            spec = parse_record(record, "command line")
    except RecordError as exc:
        raise UsageError(str(exc)) from None
    if spec is None:
        raise UsageError("the batch is empty: there is nothing to compile")
    rendered = render(spec)
    unit = args.unit or ("cuda" if spec.device == "cuda" else "cpp")
    if unit == "cuda" and rendered.cuda is None:
        raise UsageError("a cpu spec has no CUDA unit; use --unit cpp")
    if unit in ("cpp", "all"):
        sys.stdout.write(rendered.cpp)
    if unit in ("cuda", "all") and rendered.cuda is not None:
        sys.stdout.write(rendered.cuda)
    return EXIT_OK


# ---------------------------------------------------------------------------- doctor

# The CUDA target `doctor --try-build` builds for where no GPU is visible (any: what fails here is the
# toolkit, the headers and the link, not the target).
TRIAL_ARCH = "sm_80"


def _doctor_report(cache_dir: str | None, try_build: bool,
                   verify: bool = False) -> tuple[dict[str, Any], list[str], list[str]]:
    """(facts, problems that stop a compile here, notes). `verify`: re-hash every entry's binary."""
    import torch

    from .cache import Cache
    from .device import of
    from .errors import CacheError
    from .toolchain import arch_for_capability, host_compiler_version, nvcc_version

    facts: dict[str, Any] = {"kernelgen": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
                             "torch_cuda": torch.version.cuda or None}
    problems: list[str] = []
    notes: list[str] = []
    gpu = bool(torch.version.cuda) and torch.cuda.is_available()
    facts["cuda_available"] = gpu
    if gpu:
        facts["gpus"] = []
        for i in range(torch.cuda.device_count()):
            props, dev = torch.cuda.get_device_properties(i), of(i)
            facts["gpus"].append({"index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                                  "arch": arch_for_capability(props.major, props.minor),
                                  "memory_gib": round(props.total_memory / 2**30, 1), "sms": dev.sms,
                                  "smem_block_kib": dev.smem_block // 1024, "l2_mib": dev.l2_bytes >> 20,
                                  "dram_tb_s": round(dev.dram_bytes_s / 1e12, 2)})
    elif not torch.version.cuda:
        notes.append(f"torch {torch.__version__} is a CPU-only build: only the CPU path can be compiled "
                     f"(no CUDA kernels, no --arch)")
    else:
        notes.append("no CUDA device is visible: CUDA kernels can still be built with --arch")

    cxx = config.host_compiler()
    facts["host_compiler"] = {"name": cxx, "path": shutil.which(cxx), "version": host_compiler_version() or None}
    if not facts["host_compiler"]["path"]:
        problems.append(f"the host C++ compiler {cxx!r} is not on PATH: no kernel can be built (set CXX)")
    try:
        from torch.utils.cpp_extension import is_ninja_available

        facts["ninja"] = is_ninja_available()
    except ImportError:
        facts["ninja"] = False
    if not facts["ninja"]:
        problems.append("ninja is not available: torch's extension builder needs it (pip install ninja)")
    try:
        import jinja2

        facts["jinja2"] = jinja2.__version__
    except ImportError:
        facts["jinja2"] = None
        problems.append("jinja2 is not installed: kernels cannot be rendered (pip install jinja2)")

    home = config.cuda_home()
    nvcc = home / "bin" / "nvcc" if home else None
    facts["nvcc"] = {"path": str(nvcc) if nvcc and nvcc.exists() else shutil.which("nvcc"),
                     "version": nvcc_version() or None}
    # What torch's builder (load_inline) will compile and link with: its own CUDA home, which can
    # differ from the toolkit nvcc runs (a wrapper script on PATH), and that home's libcudart.
    build = _cuda_build_facts(facts["nvcc"]["path"]) if facts["nvcc"]["path"] else None
    facts["cuda_build"] = build
    facts["cuda_home"] = build["home"] if build else (str(home) if home else None)
    if torch.version.cuda:
        if not facts["nvcc"]["path"]:
            (problems if gpu else notes).append("nvcc was not found (CUDA_HOME, PATH, /usr/local/cuda): CUDA "
                                                "kernels cannot be built")
        else:
            import re

            m = re.search(r"release (\d+)\.(\d+)", facts["nvcc"]["version"] or "")
            if m and m.group(1) != torch.version.cuda.split(".")[0]:
                (problems if gpu else notes).append(
                    f"nvcc is CUDA {m.group(1)}.{m.group(2)} but torch was built with CUDA {torch.version.cuda}: "
                    f"torch's builder refuses a different major version; point CUDA_HOME at a matching toolkit")
            if build and build["missing"]:
                fix = (f"set CUDA_HOME={build['toolkit']} (the toolkit {facts['nvcc']['path']} runs)"
                       if build["toolkit"] and build["toolkit"] != build["home"] else
                       "set CUDA_HOME to the CUDA toolkit's directory")
                (problems if gpu else notes).append(
                    f"torch's builder takes the CUDA home {build['home']} ({build['home_from']}), which has no "
                    f"{' and no '.join(build['missing'])}: a CUDA build will fail (e.g. `cannot find -lcudart`); "
                    f"{fix}")

    root = Path(cache_dir) if cache_dir else config.cache_dir()
    cache_facts: dict[str, Any] = {"path": str(root), "exists": root.is_dir()}
    try:
        cache = Cache(root)
        cache.ensure()
        cache_facts["writable"] = cache.writable
        if not cache.writable:
            problems.append(f"the cache directory {root} is not writable: kernels build in a temporary directory "
                            f"on every run and are never kept (set KERNELGEN_CACHE_DIR)")
        from .cache_admin import list_entries

        entries = list_entries(cache)
        cache_facts["entries"] = len(entries)
        cache_facts["bytes"] = sum(e.size for e in entries)
        if verify:
            from .cache import InvalidEntry

            bad = []
            for e in entries:
                try:
                    cache.read_entry(e.key, verify_so=True, rehash=True)
                except (InvalidEntry, OSError) as exc:
                    bad.append(e.key)
                    problems.append(f"cache entry {e.key[:16]} does not verify ({exc}); `kernelgen cache clear` "
                                    f"or a rebuild replaces it")
            cache_facts["verified"] = len(entries) - len(bad)
    except CacheError as exc:
        cache_facts["writable"] = False
        problems.append(str(exc))
    facts["cache"] = cache_facts

    if try_build and not problems:
        facts["trial_builds"] = _trial_builds(gpu, bool(torch.version.cuda and facts["nvcc"]["path"]))
        for device, outcome in facts["trial_builds"].items():
            if outcome["status"] == "failed":
                problems.append(f"a trial {device} build failed: {outcome['message']}")
    return facts, problems, notes


def _cuda_build_facts(nvcc: str) -> dict[str, Any]:
    """Where torch's builder will look for CUDA, and whether what a build needs is there.

    torch.utils.cpp_extension takes $CUDA_HOME, $CUDA_PATH, else the directory above the bin/
    holding the nvcc on PATH, without following a wrapper script (so /usr/local/bin/nvcc that
    execs /usr/local/cuda-13.0/bin/nvcc gives /usr/local), else /usr/local/cuda; it compiles with
    <home>/include and links -L<home>/lib64 (lib where only that exists) -lcudart. Replicated
    here rather than read from cpp_extension.CUDA_HOME, which is fixed when torch's module is
    first imported and logs a warning whenever no GPU is visible.
    """
    import subprocess
    import tempfile

    source = next((f"${name}" for name in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(name)), None)
    if source:
        home = os.environ[source[1:]]
    elif shutil.which("nvcc"):
        home, source = os.path.dirname(os.path.dirname(shutil.which("nvcc"))), "the nvcc on PATH"
    else:
        home, source = "/usr/local/cuda", "the default"
    lib = "lib" if not os.path.exists(os.path.join(home, "lib64")) and os.path.exists(os.path.join(home, "lib")) \
        else "lib64"
    libcudart = os.path.join(home, lib, "libcudart.so")
    header = os.path.join(home, "include", "cuda_runtime.h")
    missing = [p for p in (header, libcudart) if not os.path.exists(p)]
    # The toolkit nvcc really runs: its dry run names it (TOP=<toolkit>/bin/..), through any wrapper.
    toolkit = None
    try:
        with tempfile.TemporaryDirectory(prefix="kernelgen-doctor-") as tmp:
            probe = os.path.join(tmp, "probe.cu")
            open(probe, "w").close()
            out = subprocess.run([nvcc, "--dryrun", "-c", probe, "-o", os.path.join(tmp, "probe.o")],
                                 capture_output=True, text=True, timeout=30)
        for line in (out.stdout + out.stderr).splitlines():
            if line.startswith("#$ TOP="):
                toolkit = os.path.normpath(line[len("#$ TOP="):].strip())  # <toolkit>/bin/..
                break
    except (OSError, subprocess.SubprocessError):
        pass
    return {"home": home, "home_from": source, "libcudart": libcudart, "header": header, "missing": missing,
            "toolkit": toolkit}


def _trial_builds(gpu: bool, cuda_buildable: bool) -> dict[str, dict]:
    """Build a tiny kernel per device into a throw-away cache: CPU always; CUDA where a GPU is
    visible (for its arch) or torch has CUDA and nvcc is found (for TRIAL_ARCH: compiling and
    linking need no GPU, and that is where a broken toolkit shows)."""
    import tempfile

    from .cache import Cache
    from .warm import local_toolchains, parse_record, warm_specs

    out = {}
    with tempfile.TemporaryDirectory(prefix="kernelgen-doctor-") as tmp:
        cache = Cache(Path(tmp) / "cache")
        for device in ("cpu", "cuda") if gpu or cuda_buildable else ("cpu",):
            spec = parse_record({"input": [1, 4, 8, 8], "weight": [4, 4, 3, 3], "device": device})
            toolchains = local_toolchains(device, None if gpu or device == "cpu" else [TRIAL_ARCH])
            r = warm_specs([spec], toolchains=toolchains, jobs=1, cache=cache)[0]
            out[device] = {"status": r.status, "seconds": round(r.seconds, 2), "arch": r.toolchain.arch,
                           "message": r.message[-2000:]}
    return out


def cmd_doctor(args) -> int:
    facts, problems, notes = _doctor_report(args.cache_dir, args.try_build, args.verify)
    if args.json:
        _dump({**facts, "problems": problems, "notes": notes, "ok": not problems})
    else:
        host, nv, cache = facts["host_compiler"], facts["nvcc"], facts["cache"]
        print(f"kernelgen      {facts['kernelgen']} (Python {facts['python']})")
        print(f"torch          {facts['torch']} (CUDA {facts['torch_cuda'] or 'none: CPU-only build'})")
        for g in facts.get("gpus", []):
            print(f"GPU {g['index']}          {g['name']}, compute capability {g['capability']}, arch {g['arch']}, "
                  f"{g['memory_gib']} GiB, {g['sms']} SMs, {g['smem_block_kib']} KiB shared memory a block, "
                  f"{g['l2_mib']} MiB L2, {g['dram_tb_s']} TB/s")
        if not facts.get("gpus"):
            print("GPU            none visible")
        print(f"host compiler  {host['path'] or host['name'] + ' (not found)'} {host['version'] or ''}".rstrip())
        print(f"ninja          {'yes' if facts['ninja'] else 'no'}")
        print(f"jinja2         {facts['jinja2'] or 'missing'}")
        build = facts.get("cuda_build")
        if build:
            state = "no " + " and no ".join(build["missing"]) if build["missing"] else "headers and libcudart found"
            runs = f"; nvcc runs {build['toolkit']}" if build["toolkit"] and build["toolkit"] != build["home"] else ""
            print(f"CUDA home      {build['home']} (torch's builder, from {build['home_from']}): {state}{runs}")
        else:
            print(f"CUDA home      {facts['cuda_home'] or '-'}")
        print(f"nvcc           {nv['path'] or 'not found'} {nv['version'] or ''}".rstrip())
        extra = f", {cache['entries']} entries, {cache['bytes']} bytes" if "entries" in cache else ""
        print(f"cache          {cache['path']} ({'writable' if cache.get('writable') else 'NOT writable'}{extra})")
        for device, t in facts.get("trial_builds", {}).items():
            print(f"trial build    {device} ({t['arch']}): {t['status']} in {t['seconds']} s")
        for n in notes:
            print(f"note: {n}")
        for p in problems:
            print(f"PROBLEM: {p}")
        print("ok: nothing stops a compile" if not problems else f"{len(problems)} problem(s) stop a compile")
    return EXIT_FAILED if problems else EXIT_OK


# ---------------------------------------------------------------------------- dispatch

COMMANDS = {"warm": cmd_warm, "cache_ls": cmd_cache_ls, "cache_info": cmd_cache_info, "cache_clear": cmd_cache_clear,
            "cache_prune": cmd_cache_prune, "cache_export": cmd_cache_export, "cache_import": cmd_cache_import,
            "cache_keygen": cmd_cache_keygen, "render": cmd_render, "doctor": cmd_doctor}


def run(args) -> int:
    """Run the command kernelgen_cli parsed into `args`; returns the exit status."""
    try:
        return COMMANDS[args.command_name](args)
    except UsageError as exc:
        _err(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except Exception as exc:
        from .errors import CacheError

        if isinstance(exc, (CacheError, ValueError)):  # a configuration problem (cache directory, env var)
            _err(str(exc))
            return EXIT_USAGE
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kernelgen` command; returns the exit status (0 ok, 1 work failed, 2 bad usage or input).
    The same as kernelgen_cli.main, which parses the command line before importing this package."""
    from kernelgen_cli import main as parse_and_run

    return parse_and_run(argv)


if __name__ == "__main__":
    sys.exit(main())
