#!/usr/bin/env bash
# The pending GPU work in priority order, cut into device calls of under ten minutes each:
#   perf/gpu_runbook.sh 1     (then 2, 3) — carry [".whl"]; results land in $OUT, copy them to perf/results/.
# Each stage has its own timeout, so a slow stage cannot take the rest of the call with it.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-perf/results/tmp} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
suite() { bash perf/gpu_suite.sh "$@" >> "$OUT/runbook.log" 2>&1; tail -25 "$OUT/runbook.log"; }
case ${1:-1} in
  1)  # issues 4, 5, 8: is the GEMV decode path fast, and what does it do to the 4-bit engine and speculation?
      QUANT_ARGS="--path dot,gemv,tuned --m 1,2,4,8 --shapes gate_up,down,q_proj,in_proj_qkv,o_proj --no-gemlite"
      PYTHONPATH=/tmp/site:$PWD:$PWD/perf timeout 200 python3 perf/bench_quant_gemm.py $QUANT_ARGS >> "$OUT/runbook.log" 2>&1
      NINFER_AUTOTUNE=off TESTS_TIMEOUT=150 suite tests:speculative_gpu
      SPEC_ARGS="--shape 27b --recipe int4 --lanes 1 8 --steps 12 --prefill 8192" suite spec ;;
  2)  # issues 6, 8: MoE kernels and 35B-A3B end to end, speculation there, compute-sanitizer
      suite moe
      SPEC_ARGS="--shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12 --prefill 8192" suite spec
      NINFER_AUTOTUNE=off timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 perf/sanitize_spec.py --tokens 200 >> "$OUT/runbook.log" 2>&1; echo "sanitizer rc=$?" >> "$OUT/runbook.log" ;;
  3)  # issues 7, 9, 10, 5: server overhead, prefix cache, vision, transformers floor, whole-model GPU tests
      PYTHONPATH=/tmp/site:$PWD:$PWD/perf timeout 240 python3 perf/bench_server.py --random 27b --recipe int4 >> "$OUT/runbook.log" 2>&1
      suite prefix_cache vision
      HF_SHAPES=27b suite hf
      NINFER_AUTOTUNE=off TESTS_TIMEOUT=120 suite tests:model_gpu tests:moe tests:moe_quant ;;
esac
