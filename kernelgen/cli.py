"""The `kernelgen` command: warm the kernel cache ahead of time, and manage it.

    kernelgen warm SPECFILE... | --examples | --model MODULE:CALLABLE --input-shape N,C,H,W
    kernelgen cache ls | info KEY | clear | prune | export FILE | import FILE | keygen FILE
    kernelgen render --input N,C,H,W --weight K,C,R,S [...]
    kernelgen doctor

Exit status: 0 success, 1 some work failed (a build, a corrupt entry), 2 bad usage or
input (an unknown option, a bad spec record, a hostile archive).
"""

from __future__ import annotations

import argparse
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
DEFAULT_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
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


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid shape {text!r}; expected sizes like 8,3,224,224") from None
    if not dims or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(f"invalid shape {text!r}; expected sizes like 8,3,224,224")
    return dims


def _int_or_pair(text: str) -> Any:
    if text in ("same", "valid"):
        return text
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected an int or two like 1,2") from None
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected an int or two like 1,2")
    return parts[0] if len(parts) == 1 else parts


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


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
    """Progress on a terminal (a bar on stderr), one line per spec otherwise (on stdout)."""

    def __init__(self, total: int, as_json: bool, stream=None):
        self.total = total
        self.stream = stream or sys.stderr
        self.bar = self.stream.isatty()
        self.lines = not self.bar and not as_json
        self.counts = {"built": 0, "cached": 0, "failed": 0}
        self.start = time.perf_counter()

    def __call__(self, result) -> None:
        self.counts[result.status] += 1
        if result.status == "failed":
            self._clear()
            _err(f"FAILED {result.spec.summary()} ({result.toolchain.arch})"
                 + (f" from {result.origin}" if result.origin else "") + f":\n{result.message}")
        if self.lines:
            print(f"{result.status:<6} {result.seconds:6.1f} s  {result.spec.summary()}  ({result.toolchain.arch})",
                  flush=True)
        if self.bar:
            self._draw()

    def _draw(self) -> None:
        done = sum(self.counts.values())
        width = 30
        filled = int(width * done / max(self.total, 1))
        c = self.counts
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  built {c['built']}  "
                          f"cached {c['cached']}  failed {c['failed']}  {time.perf_counter() - self.start:.0f} s ")
        self.stream.flush()

    def _clear(self) -> None:
        if self.bar:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()

    def close(self) -> None:
        if self.bar:
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
    reporter = Reporter(len(items), args.json)
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

    record: dict[str, Any] = {"input": list(args.input), "weight": list(args.weight), "bias": args.bias,
                              "stride": args.stride, "padding": args.padding, "dilation": args.dilation,
                              "groups": args.groups, "dtype": args.dtype, "device": args.device,
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
    facts["cuda_home"] = str(home) if home else None
    facts["nvcc"] = {"path": str(nvcc) if nvcc and nvcc.exists() else shutil.which("nvcc"),
                     "version": nvcc_version() or None}
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
        facts["trial_builds"] = _trial_builds(gpu)
        for device, outcome in facts["trial_builds"].items():
            if outcome["status"] == "failed":
                problems.append(f"a trial {device} build failed: {outcome['message']}")
    return facts, problems, notes


def _trial_builds(gpu: bool) -> dict[str, dict]:
    """Build a tiny kernel per local device into a throw-away cache."""
    import tempfile

    from .cache import Cache
    from .warm import parse_record, warm_specs

    out = {}
    with tempfile.TemporaryDirectory(prefix="kernelgen-doctor-") as tmp:
        cache = Cache(Path(tmp) / "cache")
        for device in ("cpu", "cuda") if gpu else ("cpu",):
            spec = parse_record({"input": [1, 4, 8, 8], "weight": [4, 4, 3, 3], "device": device})
            r = warm_specs([spec], jobs=1, cache=cache)[0]
            out[device] = {"status": r.status, "seconds": round(r.seconds, 2), "message": r.message[-2000:]}
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
        print(f"CUDA home      {facts['cuda_home'] or '-'}")
        print(f"nvcc           {nv['path'] or 'not found'} {nv['version'] or ''}".rstrip())
        extra = f", {cache['entries']} entries, {cache['bytes']} bytes" if "entries" in cache else ""
        print(f"cache          {cache['path']} ({'writable' if cache.get('writable') else 'NOT writable'}{extra})")
        for device, t in facts.get("trial_builds", {}).items():
            print(f"trial build    {device}: {t['status']} in {t['seconds']} s")
        for n in notes:
            print(f"note: {n}")
        for p in problems:
            print(f"PROBLEM: {p}")
        print("ok: nothing stops a compile" if not problems else f"{len(problems)} problem(s) stop a compile")
    return EXIT_FAILED if problems else EXIT_OK


# ---------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", metavar="DIR",
                        help="the cache directory (default: $KERNELGEN_CACHE_DIR or ~/.cache/kernelgen)")
    common.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")

    p = argparse.ArgumentParser(prog="kernelgen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Exit status: 0 success, 1 some work failed, 2 bad usage or input.")
    p.add_argument("--version", action="version", version=f"kernelgen {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    w = sub.add_parser("warm", parents=[common], help="compile kernels ahead of time into the cache",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Compile the kernels kernelgen.conv2d would compile, ahead of time.\n\n"
                                   "Each SPECFILE is JSON (one object or an array) or JSON Lines, one call per "
                                   "record:\n  {\"input\": [8, 64, 56, 56], \"weight\": [128, 64, 3, 3], "
                                   "\"bias\": true, \"stride\": 1,\n   \"padding\": 1, \"dilation\": 1, "
                                   "\"groups\": 1, \"dtype\": \"float16\", \"device\": \"cuda\"}\n"
                                   "optional: precision (ieee|tf32), memory_format (contiguous|channels_last), "
                                   "family, tiles {name: int}.\nA bad record is reported with its file and line "
                                   "and skipped (exit status 2); a failed build is reported with the\ncompiler's "
                                   "message and does not stop the others (exit status 1).")
    w.add_argument("specfiles", nargs="*", metavar="SPECFILE", help="JSON or JSON Lines spec records")
    w.add_argument("--examples", nargs="?", const=str(DEFAULT_EXAMPLES), metavar="DIR",
                   help="warm every kernel examples/conv_*.py use (ModelNew at get_inputs() shapes; the harness's "
                        "reduced shapes on the CPU), in each mode of examples/run_all.py (ieee, tf32, bf16) "
                        f"unless --dtype/--precision narrow it (default DIR: {DEFAULT_EXAMPLES})")
    w.add_argument("--model", metavar="MODULE:CALLABLE",
                   help="a callable returning a torch.nn.Module; it is built and run on meta tensors (no memory, "
                        "no data, no GPU) to find every convolution (kernelgen.Conv2d and torch convolutions alike)")
    w.add_argument("--input-shape", type=_shape, action="append", metavar="N,C,H,W",
                   help="the shape of one forward argument of --model (repeat for several)")
    w.add_argument("--device", choices=("cuda", "cpu"),
                   help="device of records that name none, and of --model/--examples (default: cuda with a "
                        "visible GPU or --arch, else cpu)")
    w.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64"),
                   help="dtype for --model (default float32) and --examples")
    w.add_argument("--precision", choices=("ieee", "tf32"),
                   help="float32 math for --model and --examples (default: torch's setting, as conv2d follows it)")
    w.add_argument("--arch", metavar="LIST",
                   help="CUDA targets, e.g. sm_80,sm_90a, planned and built instead of the local GPU's (needs "
                        "torch with CUDA)")
    w.add_argument("--wide-dram", action="store_true",
                   help="with --arch: plan for the target's larger-memory part (for sm_90a the H200, whose DRAM "
                        "moves 4.8 TB/s to the H100's 3.35; kernelgen.device.nominal)")
    w.add_argument("--jobs", "-j", type=_positive, default=None,
                   help="parallel builds (default: $KERNELGEN_JOBS or the number of cores)")
    w.add_argument("--dry-run", action="store_true", help="list the specialisations found; build nothing")
    w.add_argument("--tune", action="store_true",
                   help="then time each call's top candidates on this machine's GPU (random data of the call's "
                        "sizes) and keep the fastest in its plan record, as kernelgen.tune does")
    w.set_defaults(func=cmd_warm)

    c = sub.add_parser("cache", help="list, inspect, prune, clear, export and import cache entries",
                       description="See and control what is in the kernel cache.")
    csub = c.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    x = csub.add_parser("ls", parents=[common], help="list entries: key, family, arch, size, age, last used, spec",
                        description="List complete entries: key, family, arch, size, age, last use, spec.")
    x.set_defaults(func=cmd_cache_ls)
    x = csub.add_parser("info", parents=[common], help="one entry: full spec, source paths, toolchain",
                        description="Show one entry (a unique key prefix will do) and verify its binary.")
    x.add_argument("key", metavar="KEY")
    x.set_defaults(func=cmd_cache_info)
    x = csub.add_parser("clear", parents=[common], help="remove every entry",
                        description="Remove every entry, index file and failed build.")
    x.set_defaults(func=cmd_cache_clear)
    x = csub.add_parser("prune", parents=[common], help="remove old entries and cap the size",
                        description="Remove entries unused for longer than AGE, then the least recently used "
                                    "until the cache is at most SIZE.")
    x.add_argument("--max-size", metavar="SIZE", help="e.g. 500M, 2G (powers of 1024), 2GB (powers of 1000)")
    x.add_argument("--older-than", metavar="AGE", help="unused for longer than, e.g. 30m, 12h, 7d, 2w")
    x.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    x.set_defaults(func=cmd_cache_prune)
    x = csub.add_parser("export", parents=[common], help="write entries to a tar.gz for machines without a compiler",
                        description="Write verified entries (manifest, .so, sources) and a manifest of "
                                    "sha256 checksums to a tar.gz.")
    x.add_argument("file", metavar="FILE")
    x.add_argument("--key", action="append", metavar="KEY", help="only this entry (repeatable; prefixes work)")
    x.add_argument("--secret", metavar="FILE", help="sign the archive with the secret in FILE (default: "
                   "$KERNELGEN_ARCHIVE_SECRET; `kernelgen cache keygen FILE` makes one)")
    x.set_defaults(func=cmd_cache_export)
    x = csub.add_parser("import", parents=[common], help="import an exported tar.gz, verifying it",
                        description="Import entries from `kernelgen cache export`. An archive carries compiled "
                                    "code that kernelgen did not build here, and its checksums are its own, so "
                                    "only a signature says who made it: archives must be signed with your secret "
                                    "(--secret) unless --trust-unsigned is given. Every member name and checksum "
                                    "is verified; entries built by another toolchain (torch, CUDA, compilers, "
                                    "arch) are skipped; nothing is written outside the cache directory.")
    x.add_argument("file", metavar="FILE")
    x.add_argument("--secret", metavar="FILE", help="the secret the archive must be signed with (default: "
                   "$KERNELGEN_ARCHIVE_SECRET)")
    x.add_argument("--trust-unsigned", action="store_true",
                   help="import an unsigned archive (or one not checked against a secret): its code will run here")
    x.add_argument("--arch", metavar="LIST",
                   help="CUDA targets to accept (default: the local GPU's; every arch where no GPU is visible)")
    x.set_defaults(func=cmd_cache_import)
    x = csub.add_parser("keygen", parents=[common], help="write a new secret for signing archives",
                        description="Write 256 random bits (hex) to FILE, readable by you only. Share it with the "
                                    "machines that import your archives, and nobody else.")
    x.add_argument("file", metavar="FILE")
    x.set_defaults(func=cmd_cache_keygen)

    r = sub.add_parser("render", help="print the source kernelgen would compile for a convolution",
                       description="Print the CUDA (or C++) source, with its banner, that kernelgen would compile "
                                   "for a call of conv2d with these arguments.")
    r.add_argument("--input", type=_shape, required=True, metavar="N,C,H,W", help="input shape")
    r.add_argument("--weight", type=_shape, required=True, metavar="K,C/g,R,S", help="weight shape")
    r.add_argument("--bias", action="store_true", help="with a bias")
    r.add_argument("--stride", type=_int_or_pair, default=1, metavar="S[,S]")
    r.add_argument("--padding", type=_int_or_pair, default=0, metavar="P[,P]|same|valid")
    r.add_argument("--dilation", type=_int_or_pair, default=1, metavar="D[,D]")
    r.add_argument("--groups", type=int, default=1)
    r.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16", "float64"))
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    r.add_argument("--precision", choices=("ieee", "tf32"), help="float32 math (default: torch's setting)")
    r.add_argument("--memory-format", default="contiguous", choices=("contiguous", "channels_last"))
    r.add_argument("--family", help="force a kernel family")
    r.add_argument("--tile", action="append", metavar="NAME=INT", help="force a tile size (repeatable)")
    r.add_argument("--arch", metavar="ARCH", help="plan for this CUDA target, e.g. sm_90a (default: the local "
                                                   "GPU's; where none is visible, families that need one are "
                                                   "not chosen)")
    r.add_argument("--wide-dram", action="store_true", help="with --arch: plan for the target's larger-memory part (the H200 for sm_90a)")
    r.add_argument("--unit", choices=("cuda", "cpp", "all"),
                   help="which translation unit (default: cuda for a cuda spec, cpp for cpu)")
    r.set_defaults(func=cmd_render)

    d = sub.add_parser("doctor", parents=[common], help="report what kernelgen needs and what would stop a compile",
                       description="Report torch, CUDA, nvcc, the GPU and its arch, the cache directory, and "
                                   "what would stop a compile. Exit status 1 if something would.")
    d.add_argument("--try-build", action="store_true", help="also build a tiny kernel into a throw-away cache")
    d.add_argument("--verify", action="store_true", help="re-hash every cached binary against its manifest")
    d.set_defaults(func=cmd_doctor)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kernelgen` command; returns the exit status (0 ok, 1 work failed, 2 bad usage or input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return args.func(args)
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


if __name__ == "__main__":
    sys.exit(main())
