#!/usr/bin/env bash
# The pending GPU work in priority order, cut into device calls of under ten minutes each:
#   perf/gpu_runbook.sh 1     (then 2, 3) — carry [".whl"]; results land in $OUT, copy them to perf/results/.
# Each stage has its own timeout, so a slow stage cannot take the rest of the call with it. (Triton's
# compile cache of one stage is ~26 MB compressed, over the 16 MiB a device call returns, so every
# call compiles afresh.)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-perf/results/tmp} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
suite() { bash perf/gpu_suite.sh "$@" >> "$OUT/runbook.log" 2>&1; tail -25 "$OUT/runbook.log"; }
case ${1:-1} in
  1)  # issues 4, 5, 8: graph-timed tuner picks at decode, the dequant + cuBLAS prefill path, where a 27B
      # int4 step's time goes now, and the 27B int4 engine (mixed prefill/decode steps) and speculation
      NINFER_AUTOTUNE=off TESTS_TIMEOUT=120 suite tests:quant_gemm
      export PYTHONPATH=/tmp/site:$PWD:$PWD/perf
      ncu_one() {  # path, M, kernel: why the 4-bit decode GEMMs stay under half the bandwidth (stall reasons)
        local args="--shape gate_up --format int4-g64 --m $2 --path $1" i
        i=$(timeout 60 python3 perf/ncu_gemm.py $args --best 2>> "$OUT/runbook.log")
        timeout 120 ncu -k "regex:$3" --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
          --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
          python3 perf/ncu_gemm.py $args --pick "${i:-0}" > "$OUT/ncu_$1_m$2.txt" 2>&1
      }
      if command -v ncu > /dev/null; then ncu_one gemv 1 _quant_gemv_kernel; ncu_one dot 4 _quant_gemm_kernel
      else echo "ncu not found" >> "$OUT/runbook.log"; fi
      timeout 120 python3 perf/bench_quant_gemm.py --path dot,dequant,tuned --m 1,4,512,4096 \
        --shapes gate_up,down,q_proj --formats int4-g64,nvfp4 --no-gemlite >> "$OUT/runbook.log" 2>&1
      timeout 140 python3 perf/profile_step.py --shape 27b --recipe int4 >> "$OUT/runbook.log" 2>&1
      SPEC_ARGS="--shape 27b --recipe int4 --lanes 1 8 --steps 12 --prefill 8192" timeout 200 \
        bash perf/gpu_suite.sh spec >> "$OUT/runbook.log" 2>&1; tail -25 "$OUT/runbook.log"
      ;;
  2)  # issues 6, 8, 7, 10: MoE expert paths (tl.dot vs the new GEMV), 35B-A3B int4 engine and speculation,
      # server overhead (1..16), prefix cache at the issue's scale
      part() { local t=$1; shift; timeout "$t" "$@" >> "$OUT/runbook.log" 2>&1; echo "--- rc=$? $*" >> "$OUT/runbook.log"; }
      export PYTHONPATH=$PWD:$PWD/perf
      part 90 python3 perf/bench_moe.py --no-bf16 --formats int4-g64,nvfp4 --path auto,dot,gemv
      SPEC_ARGS="--shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12 --prefill 8192" part 200 bash perf/gpu_suite.sh spec
      export PYTHONPATH=/tmp/site:$PYTHONPATH
      part 120 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 4 8 16 --max-tokens 64
      part 200 python3 perf/bench_prefix_cache.py --context 65536 --turns 20 --growth 5000
      tail -40 "$OUT/runbook.log" ;;
  3)  # issues 3, 5, 6, 8: the GPU test files that never finished (fp32 tiles now compile in ~1 s), the
      # transformers floor, compute-sanitizer over speculation
      NINFER_AUTOTUNE=off TESTS_TIMEOUT=150 suite tests:model_gpu tests:speculative_gpu tests:moe_quant tests:moe
      HF_SHAPES=27b suite hf
      NINFER_AUTOTUNE=off timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 perf/sanitize_spec.py --tokens 200 >> "$OUT/runbook.log" 2>&1; echo "sanitizer rc=$?" >> "$OUT/runbook.log" ;;
esac
