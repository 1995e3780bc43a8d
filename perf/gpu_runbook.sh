#!/usr/bin/env bash
# The pending GPU work in priority order, cut into device calls of under ten minutes each:
#   OUT=$OUT bash perf/gpu_runbook.sh 1     (then 2 ... 6) — carry [".whl", ".devcache"]
# Results land in $OUT: runbook.log (every part's output), perf.jsonl (records: copy to perf/results/),
# gpu_tests.log, model_gpu.log (stage 1), and cache.tar.* — the compiled kernels and tuning choices of this call; copy those
# into .devcache/ before the next call so it does not compile and tune from scratch (perf/device_cache.sh).
# Each part has its own timeout and the whole call a deadline ($BUDGET seconds, default 560), so a slow
# part cannot take the rest of the call, and the cache is saved after every part.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-perf/results/tmp} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG=$OUT/runbook.log
DEADLINE=$((SECONDS + ${BUDGET:-560}))
source perf/device_cache.sh
if [ -z "${RUNBOOK_SHARED:-}" ]; then  # perf/gpu_pair.sh prepares once for two stages and saves the cache itself
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >> "$LOG" 2>&1 && export PYTHONPATH=/tmp/site
  fi
  cache_restore >> "$LOG" 2>&1
fi
export PYTHONPATH=$PWD:$PWD/perf:${PYTHONPATH:-}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}"; } >> "$LOG" 2>&1

# part SECONDS CMD...: run CMD with at most SECONDS (less if the call's deadline is nearer), log it, save the cache.
part() {
  local limit=$1; shift
  local left=$((DEADLINE - SECONDS - 20))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 10 ]; then echo "--- skipped (deadline): $*" >> "$LOG"; return; fi
  echo "=== $(date +%T) [${limit}s] $*" >> "$LOG"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "--- rc=$? $*" >> "$LOG"
  [ -n "${RUNBOOK_SHARED:-}" ] || cache_save >> "$LOG" 2>&1
}
# gpu_tests SECONDS FILE [pytest args]: one GPU test file, its log also in gpu_tests.log. Pass -n N for files
# that compile many configs: pytest-xdist workers compile in parallel on the machine's 16 cores.
gpu_tests() {
  local limit=$1 file=$2; shift 2
  part "$limit" bash -c "python3 -m pytest -m gpu -v -p no:cacheprovider --durations=5 tests/gpu/test_$file.py $* 2>&1 | tee -a $OUT/gpu_tests.log | grep -E 'PASSED|FAILED|ERROR|passed|failed|^E '"
}

case ${1:-1} in
  1)  # correctness first (no timings, compile-bound, so side by side): the split-KV prefill attention and
      # the pinned host pool's GPU tests, and the whole-model parity (its fp32 prefill takes the split path)
      export NINFER_AUTOTUNE=off
      ( timeout 300 python3 -m pytest -m gpu -v -p no:cacheprovider --durations=5 tests/gpu/test_model_gpu.py -n 3 \
          > "$OUT/model_gpu.log" 2>&1; echo "--- rc=$? test_model_gpu.py" >> "$OUT/model_gpu.log" ) &
      gpu_tests 200 attention -n 4
      gpu_tests 120 host_memory_gpu
      gpu_tests 90 deltanet
      wait
      ;;
  2)  # issues 7, 10: the HTTP benchmark with the quantized-head fix and the replayed arrivals (27B int4), the
      # pinned host pool's copies, the prefix cache with split-KV short chunks and pre-pinned host blocks
      part 170 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 4 8 16 --max-tokens 64
      part 80 python3 perf/bench_host_copies.py
      part 290 python3 perf/bench_prefix_cache.py --context 65536 --turns 20 --growth 5000
      ;;
  3)  # issue 3: attention (split-KV prefill rows), DeltaNet (inverse precision A/B); 6, 8: 35B-A3B engine
      part 150 python3 perf/bench_attention.py
      part 110 python3 perf/bench_deltanet.py
      part 280 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12 --prefill 8192
      ;;
  4)  # issues 5, 6: the 4-bit engine at C = 1, 2, 4, 8, contexts 1k / 32k, long prefills; the transformers floors
      part 330 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 32768 --lanes 1 2 4 8 \
        --steps 12 --chunk 4096 --prefill 8192 65536 131072 262144
      part 140 python3 perf/bench_engine.py --hf-only --shape 27b
      part 200 python3 perf/bench_engine.py --hf-only --shape 35b-a3b
      ;;
  5)  # what is left: where the 27B and 35B-A3B steps go, the fused sampler, MoE expert paths, gemlite
      part 150 python3 perf/profile_step.py --shape 27b --recipe int4
      part 110 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4
      part 120 python3 perf/bench_sampling.py
      NINFER_TUNE_CACHE=off part 120 python3 perf/bench_moe.py --no-bf16 --formats int4-g64,nvfp4 --path auto,dot,gemv
      ;;
  6)  # the pinned-pool GPU test, decode attention's (config, splits) sweep (issue 3), gemlite across shapes (4)
      gpu_tests 70 host_memory_gpu
      part 170 python3 perf/sweep_attention_decode.py
      part 250 python3 perf/bench_quant_gemm.py --path tuned --m 1,8,4096 --shapes gate_up,down,q_proj,in_proj_qkv \
        --formats int4-g64,nvfp4,fp8 --gemlite-budget 200
      ;;
  7)  # correctness of the fifth session's changes: the GEMV's in-kernel split-K reduction, decode attention's
      # measured tiles, the MoE block's stacked router/shared-gate GEMM; whole-model parity over all of them;
      # then decode attention through the launcher and the prefill tile sweep
      ( export NINFER_AUTOTUNE=off
        timeout 300 python3 -m pytest -m gpu -v -p no:cacheprovider --durations=5 tests/gpu/test_model_gpu.py -n 3 \
          > "$OUT/model_gpu.log" 2>&1; echo "--- rc=$? test_model_gpu.py" >> "$OUT/model_gpu.log" ) &
      NINFER_AUTOTUNE=off gpu_tests 150 quant_gemm -n 4 -k "'gemv or graph or epilogues'"
      NINFER_AUTOTUNE=off gpu_tests 100 attention -n 4 -k decode
      NINFER_AUTOTUNE=off gpu_tests 60 moe -k stacked
      wait
      part 100 python3 perf/bench_attention.py
      part 80 python3 perf/sweep_attention_prefill.py
      ;;
  8)  # their timings: where the 27B / 35B-A3B steps go now; the HTTP benchmark with and without the
      # launch-timed hand-overs (A/B in one call)
      part 110 python3 perf/profile_step.py --shape 27b --recipe int4
      part 90 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 4 --max-tokens 64 --requests 16
      part 90 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 4 --max-tokens 64 --requests 16 --no-overlap
      part 90 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4
      ;;
  9)  # not measured yet (docs/performance.md, "GPU tests and what is not measured yet"): prefill attention after
      # the serialised-wgmma fix; the 4-bit engines after the in-kernel split-K sum, stacked MoE gate and decode
      # attention defaults
      part 100 python3 perf/bench_attention.py
      part 220 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 32768 --lanes 1 8 --steps 12 \
        --chunk 4096 --prefill 8192
      part 200 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12 --prefill 8192
      ;;
  10) # the HTTP A/B of the launch-timed hand-overs (16 requests per level; each level is recorded as it ends)
      part 240 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 --max-tokens 64 --requests 16
      part 240 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 --max-tokens 64 --requests 16 --no-overlap
      ;;
  11) # the tensor-core int4 decode (quant_gemv_mma): correctness at real shapes, then every int4 decode
      # path side by side (GEMV, tensor-core, the tuner's pick) at 1..16 tokens, then where a 27B step goes
      gpu_tests 190 quant_gemm -k tensor_core_decode -n 4  # (one -k word: gpu_tests re-splits its arguments)
      part 180 python3 perf/bench_quant_gemm.py --path gemv,mma,tuned --m 1,2,4,8,16 --formats int4-g64,int4-g128 \
        --shapes gate_up,down,q_proj,in_proj_qkv,o_proj --no-gemlite
      part 120 python3 perf/profile_step.py --shape 27b --recipe int4 --lanes 8
      ;;
  12) # the 27B int4 engine with the tensor-core decode among the tuner's candidates (C = 1, 2, 4, 8)
      part 300 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 2 4 8 --steps 12 \
        --chunk 4096 --prefill 8192
      part 200 python3 perf/bench_spec.py --shape 27b --recipe int4 --lanes 1 8 --steps 12 --prefill 1024
      ;;
  13) # the tensor-core int4 decode up to 32 tokens (C = 8 speculative verification): GPU tests, the M = 32
      # GEMMs next to the tuner's other paths, then 27B int4 MTP rounds at C = 1 and 8
      gpu_tests 160 quant_gemm -k tensor_core_decode -n 4
      part 90 python3 perf/bench_quant_gemm.py --path mma,tuned --m 32 --formats int4-g64 \
        --shapes gate_up,down,q_proj,o_proj --no-gemlite
      part 240 python3 perf/bench_spec.py --shape 27b --recipe int4 --lanes 1 8 --steps 12 --prefill 1024
      ;;
  14) # the transformers floors' 8k prefill (issues 5 and 6), warm (the first prefill compiles fla's kernels)
      part 250 python3 perf/bench_engine.py --hf-only --shape 27b --prefill 8192 --hf-new 8 --hf-budget 220
      part 250 python3 perf/bench_engine.py --hf-only --shape 35b-a3b --prefill 8192 --hf-new 8 --hf-budget 220
      ;;
  15) # where an 8k prefill's time goes: 35B-A3B (12.6k / 9.7k tok/s against 45k) and 27B int4 (11.2-11.7k vs 12k)
      part 290 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --prefill 8192 --chunk 1024
      ;;
  16) part 290 python3 perf/profile_step.py --shape 27b --recipe int4 --prefill 8192 --chunk 4096
      ;;
  17) # the 8k prefills in one chunk: how much of the 35B-A3B prefill is launch overhead (chunk 1024: 329 of 685 ms
      # outside kernels, 11,061 launches)
      part 240 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --prefill 8192 --chunk 8192
      ;;
  18) part 150 python3 perf/profile_step.py --shape 27b --recipe int4 --prefill 8192 --chunk 8192
      part 120 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --prefill 8192 --chunk 4096
      ;;
  19) # correctness of the fused MLP gate/up (one GEMM with the SwiGLU epilogue): the whole-model GPU tests
      export NINFER_AUTOTUNE=off
      gpu_tests 330 model_gpu -n 3
      ;;
  20) # the engines after the fused MLP gate/up: 27B int4 decode C = 1 / 8 and the 8k prefill in one chunk, then
      # 35B-A3B the same (its shared expert is fused too)
      part 150 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --chunk 8192 --prefill 8192
      part 170 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 \
        --steps 12 --chunk 8192 --prefill 8192
      ;;
  21) # issue 7's TTFT: the HTTP vs library A/B with more requests per level (default GIL switch interval) ...
      part 225 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 --max-tokens 64 --requests 24
      ;;
  22) # ... and with a 0.5 ms switch interval (the HTTP thread can hold the engine thread off the GIL for 5 ms)
      part 225 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 --max-tokens 64 --requests 24 \
        --switch-interval 0.5
      ;;
  23) # next: the fused attention q/k/v, DeltaNet a/b and MoE router + shared gate (ninfer/models/fused.py) on the
      # GPU: whole-model, DeltaNet and MoE tests (stage 24: the engines and where a 27B int4 step goes)
      export NINFER_AUTOTUNE=off
      gpu_tests 300 model_gpu -n 3
      gpu_tests 120 deltanet
      gpu_tests 90 moe -k stacked  # the router + shared gate through the same fusion (views, not a copy)
      ;;
  24) part 150 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 32768 --lanes 1 8 --steps 12 \
        --chunk 8192 --prefill 8192
      part 120 python3 perf/profile_step.py --shape 27b --recipe int4 --lanes 8
      part 200 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12 --prefill 8192
      ;;
  25) # why the tensor-core int4 decode reads 35-53% of copy bandwidth (int4-g64 below -g128): Nsight Compute of
      # its fastest config at 1 and 8 tokens, gate/up (SwiGLU) shape
      for fmt in int4-g64 int4-g128; do
        for m in 1 8; do
          i=$(timeout 90 python3 perf/ncu_gemm.py --shape gate_up --format $fmt --m $m --path mma --best 2>> "$LOG")
          part 100 ncu -k regex:_quant_gemv_mma_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
            --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis --section Occupancy \
            python3 perf/ncu_gemm.py --shape gate_up --format $fmt --m $m --path mma --pick "${i:-0}"
        done
      done
      ;;
esac
tail -60 "$LOG"
