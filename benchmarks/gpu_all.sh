#!/usr/bin/env bash
# The GPU host's one job: the GPU test tier, the examples and the benchmarks, with every
# log and result under $OUT (or ./gpu-out when OUT is unset): env.txt, gpu_tests.log,
# examples.log, benches.log and the benchmarks' JSON, eight files at most (the device hands
# back eight).
#
#   bash benchmarks/gpu_all.sh [STAGE...]    stages: tests (or its parts, below) examples bench layers
#                                            census table ceiling machinery move87 networks backward
#                                            (default: tests examples bench layers ceiling machinery)
#
# `census` times the seeded layer census (benchmarks/census.py, two cells, untuned and tuned);
# `table` measures every family on the census's training layers and writes this GPU model's
# selection table (benchmarks/make_table.py) under $OUT, to be checked in as kernelgen/tables/.
# `networks` times whole torchvision networks, eager beside kernelgen and torch.compile
# (benchmarks/bench_networks.py, needs torchvision); all of it takes more than one call, so
# NETWORKS_ARGS narrows a call, e.g. NETWORKS_ARGS="--cells bf16-cl --batches 32 --no-compile".
# NETWORKS_ARGS="--train ..." times training steps instead (batch 64, eager beside kernelgen).
# `backward` times the gradients of single layers beside cuDNN's (benchmarks/bench_backward.py; the
# five cases and bench_layers' 28 by default, one call); BACKWARD_ARGS narrows or widens it, e.g.
# BACKWARD_ARGS="--layers census --skip 120".
#
# The tier takes more than one device call (about 17 minutes on the H100, each call at most 10):
# `tests-sweep` (the sweep against float64, 6 minutes), `tests-memcheck1` and `tests-memcheck2`
# (compute-sanitizer's memcheck over two halves of the families, 4-5 each; `tests-memcheck` runs
# both), `tests-memcheck-epilogue1` and `-epilogue2` (the same calls with fused epilogues, each a
# new kernel to build) and `tests-rest` (everything else, 2) are its parts for separate calls.
# `tests-sweep` includes the fused-epilogue cases (`-k "sweep and epilogue"` selects them alone).
# `tests-2gpu` runs the data-parallel training tests (DDP and FSDP2 over NCCL, tests/test_distributed.py)
# alone, on a kind with two GPUs (nvidia-h100-x2); elsewhere they skip.
#
# The kernel cache lives in .kgcache/ (git-ignored), so a second stage or call on the same
# machine reuses what the first compiled, the GPU tier's kernels included.
set -u -o pipefail
cd "$(dirname "$0")/.."
stages=" ${*:-tests examples bench layers ceiling machinery} "
want() { [[ $stages == *" $1 "* ]]; }
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The GPU host has torch but no kernelgen install: use this checkout (what `pip install -e .` gives).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export KERNELGEN_CACHE_DIR=${KERNELGEN_CACHE_DIR:-$PWD/.kgcache}
# The GPU tier keeps its kernels there too (tests/conftest.py), so a later call on a warm machine
# compiles only what an edit changed.
export KERNELGEN_TEST_CACHE=${KERNELGEN_TEST_CACHE:-$KERNELGEN_CACHE_DIR}
export KERNELGEN_JOBS=${KERNELGEN_JOBS:-$(nproc)}
mkdir -p "$KERNELGEN_CACHE_DIR" && chmod 700 "$KERNELGEN_CACHE_DIR"
status=0
# The logs the stages below append to start empty.
if want examples; then : > "$out/examples.log"; fi
if want bench || want layers || want census || want table || want ceiling || want machinery || want move87 ||
   want networks || want backward; then
  : > "$out/benches.log"
fi

python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$out/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >> "$out/env.txt" 2>&1

# The GPU tier only: the CPU tier runs in CI. -p no:cacheprovider keeps the tree clean.
tier() { python3 -m pytest tests -m gpu -q -p no:cacheprovider -rfE "$@" 2>&1 | tee -a "$out/gpu_tests.log" | tail -40
         status=$(( status | ${PIPESTATUS[0]} )); }
if want tests || want tests-sweep || want tests-memcheck || want tests-memcheck1 || want tests-memcheck2 ||
   want tests-memcheck-epilogue1 || want tests-memcheck-epilogue2 || want tests-rest || want tests-2gpu; then
  : > "$out/gpu_tests.log"
fi
if want tests; then tier; fi
if want tests-sweep; then tier -k test_sweep_against_float64; fi
if want tests-memcheck; then tier -k test_compute_sanitizer_memcheck_is_clean; fi
if want tests-memcheck1; then tier -k "test_compute_sanitizer_memcheck_is_clean and part1"; fi
if want tests-memcheck2; then tier -k "test_compute_sanitizer_memcheck_is_clean and part2"; fi
if want tests-memcheck-epilogue1; then tier -k "test_compute_sanitizer_memcheck_with_epilogues_is_clean and part1"; fi
if want tests-memcheck-epilogue2; then tier -k "test_compute_sanitizer_memcheck_with_epilogues_is_clean and part2"; fi
if want tests-2gpu; then tier -k test_data_parallel_training_on_two_gpus; fi
if want tests-rest; then
  tier -k "not test_sweep_against_float64 and not test_compute_sanitizer_memcheck_is_clean and not test_compute_sanitizer_memcheck_with_epilogues_is_clean"
fi
if want examples; then
  # Warm every example's kernels ahead of time, then the main job must compile nothing.
  python3 -m kernelgen warm --examples --jobs "$KERNELGEN_JOBS" 2>&1 | tee -a "$out/examples.log" | tail -8
  status=$(( status | ${PIPESTATUS[0]} ))
  for p in tf32 ieee bf16; do
    python3 examples/run_all.py --precision $p 2>&1 | tee -a "$out/examples.log"
    status=$(( status | ${PIPESTATUS[0]} ))
  done
fi
if want bench; then
  python3 benchmarks/bench_cases.py --json "$out/bench_cases.json" 2>&1 | tee -a "$out/benches.log"
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if want layers; then
  python3 benchmarks/bench_layers.py --json "$out/bench_layers.json" 2>&1 | tee -a "$out/benches.log"
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if want census; then
  python3 benchmarks/census.py --cells tf32-nchw,bf16-cl --budget-s 540 --tune --top 3 --json "$out/census.json" 2>&1 \
    | tee -a "$out/benches.log" | tail -30
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if want table; then
  key=$(python3 -c "import kernelgen.device as d; print(d.of(0).key)")
  merge=""; [[ -f kernelgen/tables/$key.json ]] && merge="--merge kernelgen/tables/$key.json"
  python3 benchmarks/make_table.py --budget-s 540 --top 4 $merge --out "$out/table_$key.json" 2>&1 \
    | tee -a "$out/benches.log" | tail -12
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if want ceiling; then
  python3 benchmarks/bench_ceiling.py --json "$out/bench_ceiling.json" 2>&1 | tee -a "$out/benches.log"
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if want machinery; then
  python3 benchmarks/bench_machinery.py --json "$out/bench_machinery.json" 2>&1 | tee -a "$out/benches.log"
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if want networks; then
  # Word splitting of NETWORKS_ARGS is wanted: it holds several arguments.
  # shellcheck disable=SC2086
  python3 benchmarks/bench_networks.py --budget-s 540 --json "$out/bench_networks.json" ${NETWORKS_ARGS:-} 2>&1 \
    | tee -a "$out/benches.log" | tail -80
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if want backward; then
  # shellcheck disable=SC2086
  python3 benchmarks/bench_backward.py --budget-s 540 --json "$out/bench_backward.json" ${BACKWARD_ARGS:-} 2>&1 \
    | tee -a "$out/benches.log" | tail -60
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if want move87; then
  # Case 87's structure: its movement in block shapes (move87.cu) and the one-block-a-tile TF32
  # prototype (pw87_tile.cu), stand-alone CUDA programs, each built and run here.
  for prog in move87 pw87_tile; do
    nvcc -O3 -arch=sm_90 -o "/tmp/kg_$prog" "benchmarks/$prog.cu" && "/tmp/kg_$prog" 2>&1 | tee -a "$out/benches.log"
    status=$(( status | ${PIPESTATUS[0]} ))
  done
fi
echo "gpu_all.sh${stages% }: exit status $status"
exit $status
