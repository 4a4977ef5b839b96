#!/usr/bin/env bash
# Nsight Compute on the GEMM cases: one profiled launch of each kernel, raw metrics as CSV
# under $OUT/ncu (or ./gpu-out/ncu), a short summary on stdout.
#
#   bash benchmarks/ncu_cases.sh "63 tf32 kernelgen" "63 tf32 torch" ...
#
# Leaves the clocks alone (--clock-control none). Run benchmarks/gpu_all.sh's stages or a
# warm first so that nothing compiles under the profiler. NCU_SOURCE=1 also profiles each
# kernelgen launch's SASS source page (one more launch) and summarises it with
# benchmarks/ncu_sass.py into $OUT/ncu/<case>_<precision>_<who>.sass.txt. Words after <who> go to
# benchmarks/profile_case.py (--tiles, --family, --padding) and into the file names.
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-out}/ncu
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export KERNELGEN_CACHE_DIR=${KERNELGEN_CACHE_DIR:-$PWD/.kgcache}
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
          --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats)
for run in "$@"; do
  read -r case prec who rest <<<"$run"
  name="${case}_${prec}_${who}"
  if [[ -n $rest ]]; then name+="_${rest//[^A-Za-z0-9]/_}"; fi  # e.g. --padding 1: 63_tf32_kernelgen___padding_1
  if [[ $who == torch ]]; then filter=(--launch-skip 1 --launch-count 4); else
    filter=(-k "regex:kg_(gemm|wgmma|depthwise|direct|pointwise_tile)" --launch-skip 1 --launch-count 1); fi
  ncu --clock-control none "${filter[@]}" "${sections[@]}" --page raw --csv \
      python3 benchmarks/profile_case.py $case $prec $who $rest > "$out/$name.csv" 2> "$out/$name.err"
  echo "== $name (exit $?)"
  python3 - "$out/$name.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if len(rows) < 3: print("  no rows"); sys.exit()
head = rows[0]
want = ["Kernel Name", "gpu__time_duration.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
        "lts__xbar2lts_cycles_active.avg.pct_of_peak_sustained_elapsed", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
        "dram__bytes.sum.per_second"]
unit = dict(zip(head, rows[1]))
# Bytes DRAM moved: its rate times the kernel's time (the sections report no plain sum).
scale = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3,
         **{p + "byte/" + s: m for p, m in (("", 1.0), ("K", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12))
            for s in ("s", "second")}}
rate, dur = "dram__bytes.sum.per_second", "gpu__time_duration.sum"
for r in rows[2:]:
    d = dict(zip(head, r))
    print("  " + " | ".join(f"{k.split('.')[0].split('__')[-1]}={d.get(k, '?')[:40]}{unit.get(k, '')}" for k in want))
    try:
        gb = float(d[rate].replace(",", "")) * scale[unit[rate]] * float(d[dur].replace(",", "")) * scale[unit[dur]] / 1e9
        print(f"  DRAM moved {gb:.2f} GB")
    except (KeyError, ValueError):
        pass
    stalls = sorted(((float(v.replace(',', '')), k) for k, v in d.items()
                     if "issue_stalled" in k and k.endswith(".ratio") and k.startswith("smsp__average")
                     and v.replace(',', '').replace('.', '', 1).isdigit()), reverse=True)[:6]
    print("  stalls: " + ", ".join(f"{k.split('stalled_')[1].split('_per')[0].split('.')[0]} {v:.2f}" for v, k in stalls))
PY
  if [[ ${NCU_SOURCE:-0} == 1 && $who != torch ]]; then
    ncu --clock-control none "${filter[@]}" --section SourceCounters --section WarpStateStats --page source \
        --print-source sass --csv python3 benchmarks/profile_case.py $case $prec $who $rest \
        > "$out/$name.source.csv" 2>> "$out/$name.err"
    python3 benchmarks/ncu_sass.py "$out/$name.source.csv" --top 40 > "$out/$name.sass.txt" 2>&1
    sed -n '1,14p' "$out/$name.sass.txt"
  fi
done
