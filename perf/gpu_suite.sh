#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks named on the command line (default: all kernels); the named
# stages that reproduce the tables of docs/performance.md are in perf/gpu_runbook.sh (--list).
#   perf/gpu_suite.sh tests elementwise deltanet attention sampling quant_gemm moe prefix_cache server engine
# End to end (each part bounded by its own timeout):
#   engine        perf/bench_engine.py $ENGINE_ARGS (default: 27B bf16)
#   engine_4bit   27B with each recipe in $RECIPES_27B (default "int4 qwen3_5_27b_int4"); $ENGINE_4BIT_ARGS
#   engine_moe    35B-A3B with each recipe in $RECIPES_35B (default "qwen3_5_35b_a3b_int4"; "bf16" = no recipe)
#   hf            transformers floor, batch-1 decode, for each shape in $HF_SHAPES (default "27b 35b-a3b")
#   vision        perf/bench_vision.py $VISION_ARGS (default: 27B ViT, 1024² image, 32x448² video, TTFT)
#   spec          perf/bench_spec.py $SPEC_ARGS (default: 27B bf16, K=3, C=1 and 8, forced acceptance n=0..K)
# Engine-level GPU tests compile faster with NINFER_AUTOTUNE=off (one config per kernel).
# Logs and JSON records land in $OUT (the device tool brings them back; file them with perf/report.py --add).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-perf/results/tmp}; mkdir -p "$OUT"; export OUT PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:$PWD/perf:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
recipe_arg() { [ "$1" = bf16 ] || echo "--recipe $1"; }
parts=${*:-tests elementwise deltanet attention sampling quant_gemm}
for part in $parts; do
  echo "=== $part ($(date +%T)) ==="
  case $part in
    # Test logs are written as they come (a killed run keeps its partial log); $TESTS_TIMEOUT bounds each.
    tests) timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -m gpu tests/gpu -v -x --durations=15 -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 ;;
    tests:*) timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -m gpu "tests/gpu/test_${part#tests:}.py" -v --durations=10 -p no:cacheprovider 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -40 ;;
    spec) timeout 420 python3 perf/bench_spec.py ${SPEC_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" ;;
    engine) timeout 480 python3 perf/bench_engine.py ${ENGINE_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" ;;
    engine_4bit)
      for recipe in ${RECIPES_27B:-int4 qwen3_5_27b_int4}; do
        echo "--- 27b $recipe ($(date +%T)) ---" | tee -a "$OUT/bench.log"
        timeout 420 python3 perf/bench_engine.py --shape 27b $(recipe_arg "$recipe") \
          ${ENGINE_4BIT_ARGS:---contexts 1024 32768 --lanes 1 4 8 --prefill 8192 --steps 20} 2>&1 | tee -a "$OUT/bench.log"
      done ;;
    engine_moe)
      for recipe in ${RECIPES_35B:-qwen3_5_35b_a3b_int4}; do
        echo "--- 35b-a3b $recipe ($(date +%T)) ---" | tee -a "$OUT/bench.log"
        timeout 420 python3 perf/bench_engine.py --shape 35b-a3b $(recipe_arg "$recipe") \
          ${ENGINE_MOE_ARGS:---contexts 1024 32768 --lanes 1 8 --prefill 8192 --steps 20} 2>&1 | tee -a "$OUT/bench.log"
      done ;;
    hf)
      for shape in ${HF_SHAPES:-27b 35b-a3b}; do
        echo "--- transformers $shape ($(date +%T)) ---" | tee -a "$OUT/bench.log"
        timeout 240 python3 perf/bench_engine.py --hf-only --shape "$shape" ${HF_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
      done ;;
    vision) timeout 420 python3 perf/bench_vision.py ${VISION_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" ;;
    *) timeout 240 python3 "perf/bench_$part.py" 2>&1 | tee -a "$OUT/bench.log" ;;
  esac
done
