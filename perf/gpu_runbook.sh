#!/usr/bin/env bash
# Named GPU stages, each sized for one device call of under ten minutes:
#   OUT=$OUT bash perf/gpu_runbook.sh engine-27b-int4 [STAGE ...]     — carry [".whl", ".devcache"]
#   bash perf/gpu_runbook.sh --list                                    (the stages and what each measures)
# Several stages in one call share its deadline. Results land in $OUT: runbook.log (every part's output),
# perf.jsonl (records: file them with `python perf/report.py --add <files_at>/perf.jsonl`), gpu_tests.log,
# model_gpu.log, and cache.tar.* — the compiled kernels and tuning choices of this call; copy those into
# .devcache/ before the next call so it does not compile and tune from scratch (perf/device_cache.sh).
# Each part has its own timeout and the whole call a deadline ($BUDGET seconds, default 560), so a slow
# part cannot take the rest of the call, and the cache is saved after every part.
set -uo pipefail
cd "$(dirname "$0")/.."
# name | what it measures (one line each; `--list` prints them)
STAGES='
gpu-tests-model       whole-model GPU tests: fp32 parity with transformers, graphs = eager, batched = single, KV dtypes
gpu-tests-runtime     whole-model tests beside the runtime ones: MTP, host copies, structured output, min_tokens, /v1/completions scoring
gpu-tests-attention   attention (split-KV prefill, decode tiles), pinned host pool and DeltaNet GPU tests, model tests beside
gpu-tests-quant       quantized GEMM GPU tests: GEMV split-K, graph-timed tuning, epilogues, tensor-core decode; stacked MoE gate
verify-fused          the fused projection modules: whole-model, DeltaNet and stacked-MoE GPU tests
kernels-attention     attention kernels vs torch SDPA (prefill, split-KV chunks, paged decode, KV write); prefill tile sweep
sweep-attention-decode  paged decode attention: every tile config x split count at B = 1 / 8, ctx 8k-128k
kernels-deltanet      DeltaNet decode and chunked prefill vs fla; the fused sampler vs torch sort + multinomial
quant-gemm-decode     int4 decode GEMMs at 1..32 tokens: GEMV, tensor-core decode and the tuner pick, % of copy bandwidth
quant-gemm-regs       int4 tensor-core decode with and without a register cap (maxnreg 128 / 96) at 1 / 8 / 16 tokens
quant-gemm-frag       register decode of fragment-laid int4: its GPU tests, then L2-cold vs the tl.dot decode, cuBLAS bf16, int4pack
frag-first-look       the register decode L2-cold at 1 / 8 tokens against the tl.dot decode and cuBLAS, its GPU tests, an int4 model
frag-int8             register decode of fragment-laid int8-g64 (the LM head, the int8 projections of the model recipes): its GPU tests, L2-cold vs the row-major tuner and cuBLAS
deltanet-split-27b    the DeltaNet decode over value-column blocks: its GPU tests, the 27B int4 engine with autotuning off (as frag-engine-27b) and on (ctx 1k / 32k, C = 1 / 8, 8k prefill; tuning choices exported)
export-tuning-h200    tuning choices for the shipped H200 table (NINFER_SHIPPED_TUNING=0, everything measured): the 27B int4 engine, its main thread sampled every 25 s (perf/stack_sampler.py); merge with perf/ship_tuning.py <files_at>/tuned-h200.json
export-tuning-h200-35b  the same for the 35B-A3B qwen3_5_35b_a3b_int4 engine
export-tuning-h200-nvfp4  the same for the 27B nvfp4 engine (its register-decode keys: the shipped table has none)
structured-27b        the cost of structured output, 27B int4: constrained vs free decode at C = 1 / 8, JSON Schema compile first / cached (carry an xgrammar wheel in .whl: ../shared/tools/device-wheels.sh xgrammar)
profile-structured-27b  where the extra host time of structured output goes, 27B int4 (first configs): C = 1 / 8, free vs constrained, cProfile of each round
frag-engine-27b       27B int4 engine with fragment-laid weights, cold caches, triton autotune off: decode C = 1 / 8 at ctx 1k, 1k prefill, step profile
quant-gemm-gemlite    the tuner pick vs cuBLAS bf16 and gemlite at M = 1 / 8 / 4096, int4 / nvfp4 / fp8
moe-kernels           35B-A3B expert GEMMs (tl.dot, GEMV, per-key pick) at 1..64 tokens and an 8k prefill
engine-27b-int4       27B int4 engine: decode at ctx 1k / 32k and C = 1 / 2 / 4 / 8, 8k prefill in one chunk
prefill-27b-long      27B int4 prefill of 64k / 128k / 256k tokens (chunk 4096)
engine-35b-a3b        35B-A3B qwen3_5_35b_a3b_int4 engine: decode C = 1 / 8, 8k prefill in one chunk
mtp-27b-int4          27B int4 MTP speculation (K = 3, forced acceptance) at C = 1 / 8 and its plain engine
mtp-35b-a3b           35B-A3B 4-bit MTP speculation at C = 1 / 8 and its plain engine (8k prefill)
transformers-floor    transformers bf16 floor: batch-1 decode and warm 8k prefill, 27B and 35B-A3B
server-27b-int4       HTTP vs library API, 27B int4: TTFT and decode at C = 1 / 2 (24 requests per level)
server-27b-int4-load  the same at C = 1 / 2 / 4 / 8 / 16
prefix-cache-27b      pinned host copies; prefix cache at 64k / 20 agent turns (27B bf16)
vision-27b            27B ViT encode vs transformers, preprocessing, TTFT with an image / a video
profile-27b           where a 27B int4 step goes (torch.profiler by op family): decode C = 1 / 8, 8k prefill in one chunk
profile-35b-a3b       where a 35B-A3B 4-bit step goes: decode C = 1, 8k prefill in one chunk
moe-expert-mma        the expert register decode of int4 stacks: its GPU tests, the 35B-A3B expert block at decode (the tuner time of every candidate: GEMV, tl.dot, register decode), the 35B-A3B engine (decode C = 1 / 8, 8k prefill)
moe-35b-tuned         the 35B-A3B engine (decode C = 1 / 8, 8k prefill) exporting its tuning choices (the expert keys timed among the register decode; merge with perf/ship_tuning.py <files_at>/tuned-h200.json), then its MTP speculation at C = 1 / 8
stall-budget-graph-27b  27B int4 warm start: ITL of 4 decodes beside a 32k prefill at a 16-token chunk graph and at max_decode_stall 3x over it (graph and eager chunks costed apart)
moe-combine-tests     the GPU tests of the gated shared expert in the MoE combine and the whole-model GPU tests of the MoE checkpoint (parity with transformers, graphs = eager, batched = single)
profile-35b-decode    the 35B-A3B 4-bit decode step kernel by kernel (top 45 at C = 1, top 30 at C = 8): what its launches are
bench-27b-step        27B int4 engine (decode ctx 1k / 32k, C = 1 / 8, 8k prefill) and its C = 8 profile
ncu-gemm-mma          Nsight Compute of the tensor-core int4 decode (gate/up, int4-g64 / -g128, 1 and 8 tokens)
ncu-gemm-frag         Nsight Compute of the register decode of fragment-laid int4-g64 (gate_up and down, 1 and 8 tokens or NCU_TOKENS, the fastest config of each): DRAM throughput, stall reasons, occupancy
gpu-tests-fragments-model  the whole int4 and nvfp4 models over fragment-laid weights on the GPU (tests/gpu/test_fragments_model_gpu.py)
gpu-tests-no-stalls   nothing compiles or tunes after ready over a serving mix (int4, int4 + MTP, nvfp4, bf16, MoE int4 + MTP); the 8k-chunk workspace bound at 27B widths
startup-27b-int4      27B int4 cold and warm start-up by phase (main thread sampled every 3 s until ready), TTFT of first / second batch at C = 8 / 1, 8k / 32k prefill, ITL beside a 32k prefill, compiles after ready
startup-27b-warm-serial  27B int4 warm start (on the caches the runbook restored) with the dry passes off (NINFER_PARALLEL_COMPILE=0), then on: is a warm start faster without them (20 s of dry passes found nothing to compile in run 2026-12-03.10), main thread sampled every 2 s
profile-27b-chunks    why a small 27B int4 chunk costs as much as a large one: 8k prefill in 128- and 1024-token chunks, kernel time vs wall time, and a cProfile of the host
profile-27b-mixed     4 decodes beside a long 27B int4 prompt in 128-token chunks from 16k context on (replayed from the prompt-chunk graph; NINFER_CHUNK_GRAPHS=0: eager): wall time per step, kernels by family, cProfile of the host
itl-128-27b           27B int4 warm start: ITL of 4 decodes beside a 32k prefill at the default budget and at 128 tokens, and the rate of the 32k prompt at each
chunk-graphs-27b      the prompt-chunk graph (on by default up to 256 tokens): its GPU tests, then the 27B int4 ITL of 4 decodes beside a 32k prefill with 128- and 256-token chunks replayed from it
profile-mtp-27b       where a 27B int4 MTP round goes at C = 8 (K = 3, all drafts accepted: 2.25x a plain step in run 2026-12-03.13) beside the plain C = 8 step, kernels by family
prologue-and-head-tests  the GPU tests of the one-launch attention prologue, the round rows, RoPE tables and embedding rows in one launch, and all speculative GPU tests (quantized head, host-held mtp tensors; no timings)
prologue-27b          the one-launch attention prologue (on by default): its GPU test, the whole-model GPU tests with it on, the 27B int4 engine with it on and off twice
mtp-quantized-head    the MTP head quantized by the mtp rules of the recipes: its GPU tests, 27B int4 MTP at C = 1 / 8 with plain steps, 35B-A3B at C = 1
moe-norm-35b          the norm after each MoE block inside its combine launch (on by default, NINFER_MOE_NORM=0 turns it off; 40 launches fewer a 35B-A3B step): its GPU test, the MoE model and speculative GPU tests with it on, the 35B-A3B engine on and off twice
draft-vocab           the drafts LM head over the 32768 lowest token ids instead of all 248320 (draft_vocab): 27B int4 MTP at C = 1 without then with it, both over the models whole vocabulary (--full-vocab), 35B-A3B at C = 1 with it (forced acceptance: timings only)
deferred-norm-tests   the GPU tests of the deferred norm (every producer and reader candidate, the gate GEMV, a CUDA graph, routed experts) and the whole fragment-laid model on and off (cold caches compile for minutes: a call of its own)
deferred-norm-27b     the norm after each output projection left to the GEMMs that read its rows (NINFER_DEFERRED_NORM=1, 128 launches fewer a 27B step, nothing serial): whole-model and speculative GPU tests with it on, the 27B int4 engine on and off twice at batch 1 / C = 8
deferred-norm-35b     the deferred norm on the 35B-A3B (NINFER_DEFERRED_NORM_MOE=1: its post-attention norm, read by the router, the shared expert and the routed experts; off by default since run 2026-12-05.19): the GPU tests of its readers, the engine on and off twice
deferred-norm-quick   the 27B int4 engine at batch 1 with the deferred norm on, then off (one alternation: a device call of about four minutes)
deferred-norm-bench   the 27B int4 engine with the deferred norm on and off (timings only, before its GPU tests: a device call of little time)
profile-deferred-35b  the 35B-A3B step profiled with the MoE blocks reading deferred rows and not (it lost 6% at batch 1 in run 2026-12-05.19): which reader pays
profile-deferred-27b  where a 27B int4 C = 1 step goes with the deferred norm on, then off (kernels by family, top 30): what the readers and the producer add against the 128 norm launches they remove
deferred-norm-gemms   where the deferred norm loses, GEMM by GEMM (perf/bench_deferred_norm.py: producers GEMM alone / GEMM then norm / deferred, readers of normed / deferred rows, L2-cold, 1 and 8 tokens), then its GPU tests (the readers sum their shares after the loop now)
deferred-late         the deferred norm with the split that sums applying the rows factors (after the fused split-K sum): the GEMMs of perf/bench_deferred_norm.py at 1 / 8 tokens, then the 27B int4 engine at batch 1 on and off
across-default-tests  the split-K sum split after split (now the default): the whole-model GPU tests (parity, graphs = eager) and the fragment-laid model tests (run 2026-12-05.16 reached none in 270 s on a cold cache)
split-across-27b      the 27B int4 engine at batch 1 / C = 8 with the split-K sums split after split (NINFER_SPLIT_SUM=across, 0-9% faster L2-cold on three shapes in run 2026-12-05.13) and the shipped sum, alternating in one process
norm-in-gemm-27b      the norm after each output projection inside its register decode launch (NINFER_NORM_IN_GEMM=1, 128 launches fewer a 27B step): whole-model and speculative GPU tests with it on, the 27B int4 engine on and off twice
profile-draft-vocab-27b  a 27B int4 C = 1 round with the drafts over 32768 token ids, then over all (run 2026-12-05.9 never narrowed them: its tokenizer had 481 ids), kernels by family
profile-mtp-27b-c1    where a 27B int4 MTP round goes at C = 1 (K = 3, all drafts accepted), kernels by family, top 40
gates-in-decode-27b   the a/b gate projection inside the DeltaNet decode kernel (GPU tests) and the 27B int4 decode at C = 1 / 8 with it off (the default: its own cuBLAS GEMM, two launches a layer) then on (NINFER_GATES_IN_DECODE=1), and a step profile with it on
frag-tiled-27b        the tiled tl.dot GEMM over fragment-laid weights (GPU tests), then 4 decodes beside a 32k prefill with the 128-token chunk graph (its graph keys tuned among the decodes and the tiled GEMM) and the profile of that step
bench-frag-tiled      the GPU tests of the tiled GEMM (both variants) and of the dequantization path in a graph, the tiled GEMM over fragment-laid int4-g64 weights against the dequantization path and cuBLAS bf16 at 128 and 512 tokens (27B shapes, every candidate timed), then 4 decodes beside a 32k prefill with the 256-token chunk graph
dequant-in-graph-27b  the dequantization path inside the prompt-chunk graph (its GPU test), then 4 decodes beside a 32k prefill with the 128-token and the 256-token chunk graph
pdl-trigger           programmatic dependent launch with the register decode letting the next kernel launch early (griddepcontrol.launch_dependents): its graph test, the decode GEMMs back to back L2-cold with it on and off, then the 27B int4 decode at C = 1 / 8 on and off
pdl-norms             programmatic dependent launch with the RMSNorm kernels letting the next GEMM launch early too: the whole-model test (same tokens and logprobs on and off), then the 27B int4 decode at C = 1 / 8, on and off twice in turn
itl-small-chunks      27B int4 warm start: ITL of 4 decodes beside a 32k prefill with 64- and 32-token prompt chunks replayed from the chunk graph, and the rate of the 32k prompt at each
frag-narrow           the register decode at 16 and 32 tokens with programs of 8 or 16 tokens side by side (sharing codes through L2) among the candidates: GPU tests of every candidate, then L2-cold on the 27B shapes, every candidate timed (the engine takes them after export-tuning-h200)
frag-pair             the register decode with two tiles per warp sharing each activation load (frag-pair), SwiGLU loading its activations once for both streams: GPU tests of the fragment kernels, then L2-cold at 1 / 8 / 16 / 32 tokens on the 27B shapes, every candidate timed
overlap-streams       the shared expert and the DeltaNet a/b gate GEMM on a second stream of the captured decode step: its GPU test, the 35B-A3B and 27B int4 decode at C = 1 / 8 with it on (the default) and off (NINFER_OVERLAP=0) in turn, then the whole-model MoE GPU test (graphs = eager)
overlap-timeline      the graph-replayed decode step in time (perf/graph_timeline.py: busy, two kernels at once, idle between kernels) with the second stream on and off: 35B-A3B and 27B int4 at C = 1
host-split            the host time of a graph-replayed decode step (an engine step less a bare replay of its graph): cProfile of the 35B-A3B 4-bit steps at C = 1, then its timeline (idle in gaps over 20 us: the host)
decode-ahead          decode steps left in flight (the host works while the GPU computes the next step): its GPU test (graphs and eager, dense and MoE), the 35B-A3B and 27B int4 decode at C = 1 / 8 with it on (the default) and off in turn, the host share of each step, then the whole-model graphs = eager tests
ahead-checks          the paths beside the decode left in flight on the GPU: speculative (MTP greedy = plain greedy), structured output and min_tokens tests, then the 35B-A3B MTP speculation at C = 1 / 8 (never run ahead) against its plain engine
pdl-triggers          programmatic dependent launch with the DeltaNet / attention decode, the attention merge and the MoE combine letting the next GEMM launch early as well (the deferred norm left a GEMM behind them at every layer): the whole-model tests with it on, then the 27B int4 and 35B-A3B engines on and off twice in one process each
profile-pdl-35b       the 35B-A3B graph-replayed step timeline (--timeline) with programmatic dependent launch on and off: PDL moved nothing there in run 2026-12-05.21 (the 27B: 1.6-2.2%): do its kernels start before the one before them ends
launch-diet-tests     the GPU tests of the launch-diet switches not yet measured: the a/b gates from deferred rows in the DeltaNet decode, then the whole MoE model with PDL waits
launch-diet-35b       the 35B-A3B engine at C = 1 / 8 under each launch-diet switch alone and all together (bench_engine --settings, one process): base, NINFER_GATES_IN_DECODE=1, NINFER_PDL_WAITS=1, NINFER_NORM_IN_GEMM=1, all; then base and all again
launch-diet-27b       the 27B int4 engine at C = 1 / 8 the same way: base, NINFER_GATES_IN_DECODE=1, NINFER_PDL_WAITS=1, both; then base and each again
tune-l2               the decode tuners timing their candidates L2-cold (NINFER_TUNE_L2_COLD=all; experts, the default since run 2026-12-06.4: the MoE expert GEMMs only) against warm (20 launches on one weight, L2-resident up to 50 MB): the picks of each, timed over weight copies with every candidate (perf/bench_tune_l2.py), then the 35B-A3B expert GEMMs tuned each way (perf/bench_moe.py, one process each)
deltanet-early        the Gated DeltaNet decode launched early (NINFER_DELTANET_EARLY=1: its recurrent state loaded while the q/k/v/z projection runs, under programmatic dependent launch): its kernel GPU tests with it on, then the 27B int4 and 35B-A3B engines on and off twice at C = 1 / 8
early-model-tests     the early starts (on by default since run 2026-12-06.12) under the whole-model GPU tests (parity, graphs = eager, dense and MoE), the MTP tests (greedy = plain greedy), the DeltaNet decode kernel tests and the float GEMV early launches at 1..16 rows (the MTP and DeltaNet ones did not finish in the call after that run)
float-gemv-early      the routers through the one-launch float GEMV launched early (NINFER_FLOAT_GEMV_EARLY=1: its weights asked of the L2 while the kernel before runs, cuBLAS not a candidate): its GPU tests, then the 35B-A3B engine on and off twice at C = 1 / 8
frag-variants         two variants of the register decodes, codes copied into shared memory by the loops cp.async pipeline (NINFER_FRAG_ASYNC=1 adds 3- and 5-stage configs) and K split over a programs warps (NINFER_FRAG_KSPLIT=1, the expert register decode too): their GPU tests, then each L2-cold against the register decodes own configs at 1 / 4 / 8 tokens, int4-g64 and nvfp4, the 27B and 35B-A3B projections, then the 35B-A3B expert GEMMs tuned without and with the K-split configs
route-prefetch        the MoE routing asking the L2 for its chosen experts gate/up bytes (NINFER_ROUTE_PREFETCH=1, up to 4 tokens): its GPU test, one 35B-A3B MoE block with and without (perf/bench_moe_block.py), the 35B-A3B engine on and off twice at C = 1 / 8, then its MTP round at C = 1 on and off
ncu-small-gemm        Nsight Compute of the register decode on the 35B-A3B out_proj (2048 x 4096, 4.2 MB: 5.4 us a launch where its bytes take 1.3) and qkvz at 1 token, the fastest config of its own, of the cp.async ones and of the K-split ones: how much of a small GEMM is inside the kernel, and where it waits
frag-variants-35b     the 35B-A3B int4 engine with every key tuned at start (NINFER_SHIPPED_TUNING=0) with the register decode variants among the candidates (NINFER_FRAG_ASYNC=1, NINFER_FRAG_KSPLIT=1), its choices exported to tuned-variants.json, then the shipped table alone in a second process (C = 1 / 8): run after frag-variants shows a family winning
frag-variants-27b     the same for the 27B int4 engine
launch-floor          the fixed cost of one dependent kernel in a captured step whatever it computes (perf/bench_launch_floor.py: chains of tiny kernels reading a word, a 16 KB row, or a row plus a split-K style arrival counter, at 1 / SMs / 8 x SMs programs, plain and with PDL)
variants-model-tests  the whole-model GPU tests (parity, graphs = eager, dense and MoE) and the MTP tests with the register decode variants among every key candidates (NINFER_FRAG_ASYNC=1, NINFER_FRAG_KSPLIT=1, tuned from nothing) and the routing prefetch on: before any of them becomes a default
early-all             the three early starts (MoE down, DeltaNet decode, float GEMV) together against none, 35B-A3B then 27B int4 at C = 1 / 8 (bench_engine --settings, one process each: base, all, base, all)
moe-down-early        the MoE down projection launched early (NINFER_MOE_DOWN_EARLY=1: its expert ids read and its weights asked of the L2 while the gate/up runs, under programmatic dependent launch): its GPU tests, one 35B-A3B MoE block with and without (perf/bench_moe_block.py), the 35B-A3B engine on and off twice at C = 1 / 8
defaults-check        the defaults since run 2026-12-06.10 on the GPU that comes: the 27B int4 and 35B-A3B engines at C = 1 / 8 with the a/b gates in the DeltaNet decode on then off, then the early starts (MoE down, DeltaNet decode, float GEMV from 8 tokens; on by default since run 2026-12-06.12) against all three off, twice each
gates-export-35b      the gates kernel test against its fixed reference (deferred rows), then the 35B-A3B engine with every tuning key measured (NINFER_SHIPPED_TUNING=0: the expert keys L2-cold, the default since run 2026-12-06.4) and its choices exported for the shipped table (merge: perf/snapshot.sh FILES_AT); run 2026-12-06.6: the H100 table
gates-deferred        the DeltaNet a/b gates projected inside the decode kernel from rows whose norm was deferred (NINFER_GATES_IN_DECODE=1 declined those rows before: 48 launches fewer a 27B step, 30 a 35B-A3B step): its GPU tests (the kernel, then the whole-model parity and graph tests with it on), then both engines on and off twice (run 2026-12-06.7: all passed, 3.1% / 3.7% faster at 27B / 35B-A3B batch 1 on an H100; the default since)
pdl-waits             NINFER_PDL_WAITS=1: the norms, the MoE routing, the expert GEMV and the MoE combine launched with programmatic dependent launch too, waiting at their start (only their launch overlaps the kernel before): its GPU test (the MoE model bit-equal with and without), then the 35B-A3B and 27B int4 engines on and off twice
norm-in-gemm-35b      the norm after the 35B-A3B output projections (read by the MoE blocks, which decline deferred rows) in their GEMMs last program (NINFER_NORM_IN_GEMM, 2048-wide rows): its GPU tests, then the engine on and off twice (run 2026-12-06.8: 1.3% at batch 1; the default since)
pdl-35b               programmatic dependent launch on the 35B-A3B decode (NINFER_PDL=1: the register decodes and norms let the next kernel launch early), on and off in turn, C = 1 / 8, then the whole-model MoE test with it on
profile-mtp-35b       where a 35B-A3B 4-bit MTP round goes at C = 1 (K = 3, all drafts accepted) beside the plain step: kernels by family, the graph timeline
engine-27b-nvfp4      27B nvfp4 engine: decode at ctx 1k, C = 1 / 8 (the target: within 5% of int4)
nvfp4-checks          the whole nvfp4 model over fragment-laid weights (GPU tests), the 27B nvfp4 prefill of 8k in one chunk (the default) and decode at 32k, the 35B-A3B nvfp4 recipe decode C = 1 / 8
dequant-nvfp4         the dequantization of fragment-laid nvfp4 for prefill sizes (GPU test: bit for bit), the 27B nvfp4 prefill of 8k in 1024-token chunks (the dequantization once per chunk) and in one
profile-nvfp4-chunks  why the 27B nvfp4 prefill in 1024-token chunks took 4.4k tok/s against 7.3k for int4 (run 2026-12-04.44): kernels by family and a host profile, nvfp4 then int4, 8k prompt in 1024-token chunks
frag-nvfp4            the register decode of fragment-laid nvfp4: its GPU tests, then L2-cold at 1 / 8 tokens against the int4-g64 register decode and the nvfp4 row-major tuner pick on the 27B shapes
deltanet-tail         the DeltaNet decode with the loads of its last program batched: its GPU tests, the kernel vs fla, the 27B int4 engine at ctx 1k, C = 1 / 8 and an 8k prompt in 1024-token chunks (also the first measure of the tuner candidate lists built once)
split-sum             the fused split-K reduction of the register decodes split after split (NINFER_SPLIT_SUM=across) and over whole tiles in one load (=tile) against the default: their GPU tests, L2-cold int4-g64 GEMMs at 1 / 8 tokens on the four 27B shapes (the best of every candidate under each)
split-sum-tests       the GPU tests of split-sum alone (tile sum, its 8-chunk trips included)
split-sum-bench       the L2-cold GEMMs of split-sum without its GPU tests (a device call of little time)
split-sum-engine      the 27B int4 engine at batch 1 / C = 8 under each split-K sum: each and across on the shipped configs, tile tuning its own keys at start (its choices exported to tuned-h200-tile.json)
float-gemv            the one-launch float GEMV of the small bf16 projections (routers, a/b gates) against cuBLAS: its GPU tests, the bench at 1-16 tokens, the 35B-A3B engine C = 1 / 8 and its MTP rounds (the tuner picks per shape)
float-expert-35b      float-gemv and expert-aligned in one call: both GPU tests, the float GEMV against cuBLAS, then 35B-A3B plain steps and MTP rounds at C = 1 / 8
expert-aligned        the expert register decode over rows aligned in blocks of 16 (past 64 pairs: the 35B-A3B verification of several lanes): its GPU tests, then 35B-A3B MTP at C = 1 / 8 (the C = 8 round took the tl.dot grouped GEMM)
chunks-host-35b       the 35B-A3B 8k prompt in 1024-token chunks (host-bound before the tuner built its candidate lists once per call shape) and in one chunk, beside batch 1
itl-budgets-27b       27B int4 warm start: ITL of 4 decodes beside a 32k prefill at prefill_tokens_while_decoding 1024 (the default) / 512 / 256 / 128 and at max_decode_stall 3x / 2.5x, and the rate of the 32k prompt at each
'
names=$(echo "$STAGES" | awk 'NF { print $1 }')
if [ "$#" -eq 0 ] || [ "$1" = --list ]; then
  echo "usage: OUT=DIR [BUDGET=SECONDS] bash perf/gpu_runbook.sh STAGE [STAGE ...]; stages:$STAGES"
  [ "$#" -gt 0 ]; exit $?
fi
for name in "$@"; do
  grep -qxF -- "$name" <<< "$names" || { echo "perf/gpu_runbook.sh: unknown stage '$name' (--list names them)" >&2; exit 2; }
done
export OUT=${OUT:-perf/results/tmp} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG=$OUT/runbook.log
DEADLINE=$((SECONDS + ${BUDGET:-560}))
source perf/device_cache.sh
if [ -z "${RUNBOOK_SHARED:-}" ]; then  # perf/gpu_pair.sh prepares once for two stages and saves the cache itself
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >> "$LOG" 2>&1 && export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
  cache_restore >> "$LOG" 2>&1
fi
export PYTHONPATH=$PWD:$PWD/perf:${PYTHONPATH:-}
# A GPU model without a shipped table (an H100 lent for an H200) tunes every key at each engine start: every
# benchmark then exports what it measured to $OUT/tuned-unshipped.json, which perf/snapshot.sh merges into the
# shipped tables (stages that export on purpose set NINFER_EXPORT_TUNING themselves).
if [ -z "${NINFER_EXPORT_TUNING:-}" ] && python3 perf/unshipped_gpu.py >> "$LOG" 2>&1; then
  export NINFER_EXPORT_TUNING=$OUT/tuned-unshipped.json
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}"; } >> "$LOG" 2>&1
# The GPU's clocks, temperature, power and throttle reasons every second of the call: are slower runs late in a
# call the GPU's state or the code?
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
  --format=csv -l 1 > "$OUT/gpu_state.csv" 2>&1 &
STATE_PID=$!
trap 'kill $STATE_PID 2> /dev/null' EXIT

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
  local args=""; [ "$#" -gt 0 ] && args=$(printf '%q ' "$@")  # quoted again for bash -c: -k "a or b" stays one argument
  part "$limit" bash -c "python3 -m pytest -m gpu -v -p no:cacheprovider --durations=5 tests/gpu/test_$file.py $args 2>&1 | tee -a $OUT/gpu_tests.log | grep -E 'PASSED|FAILED|ERROR|passed|failed|^E '"
}


stage() {
  case $1 in
    gpu-tests-model)
      export NINFER_AUTOTUNE=off
      gpu_tests 330 model_gpu -n 3
      ;;
    gpu-tests-runtime)  # compile-bound, no timings: the model tests run beside the runtime tests
      export NINFER_AUTOTUNE=off
      ( timeout 300 python3 -m pytest -m gpu -v -p no:cacheprovider --durations=5 tests/gpu/test_model_gpu.py -n 3 \
          > "$OUT/model_gpu.log" 2>&1; echo "--- rc=$? test_model_gpu.py" >> "$OUT/model_gpu.log" ) &
      gpu_tests 150 speculative_gpu
      gpu_tests 90 host_memory_gpu
      gpu_tests 120 structured_gpu
      gpu_tests 90 min_tokens_gpu
      gpu_tests 90 completions_gpu
      wait
      ;;
    gpu-tests-attention)  # compile-bound, no timings: the model tests run beside the kernel tests
      export NINFER_AUTOTUNE=off
      ( timeout 300 python3 -m pytest -m gpu -v -p no:cacheprovider --durations=5 tests/gpu/test_model_gpu.py -n 3 \
          > "$OUT/model_gpu.log" 2>&1; echo "--- rc=$? test_model_gpu.py" >> "$OUT/model_gpu.log" ) &
      gpu_tests 200 attention -n 4
      gpu_tests 120 host_memory_gpu
      gpu_tests 90 deltanet
      wait
      ;;
    gpu-tests-quant)
      NINFER_AUTOTUNE=off gpu_tests 150 quant_gemm -n 4 -k "gemv or graph or epilogues"
      gpu_tests 190 quant_gemm -k tensor_core_decode -n 4
      NINFER_AUTOTUNE=off gpu_tests 60 moe -k stacked
      ;;
    verify-fused)
      export NINFER_AUTOTUNE=off
      gpu_tests 300 model_gpu -n 3
      gpu_tests 120 deltanet
      gpu_tests 90 moe -k stacked  # the router + shared gate through the same fusion (views, not a copy)
      ;;
    kernels-attention)
      part 150 python3 perf/bench_attention.py
      part 80 python3 perf/sweep_attention_prefill.py
      ;;
    sweep-attention-decode)
      part 170 python3 perf/sweep_attention_decode.py
      ;;
    kernels-deltanet)
      part 110 python3 perf/bench_deltanet.py
      part 120 python3 perf/bench_sampling.py
      ;;
    quant-gemm-decode)
      part 180 python3 perf/bench_quant_gemm.py --path gemv,mma,tuned --m 1,2,4,8,16 --formats int4-g64,int4-g128 \
        --shapes gate_up,down,q_proj,in_proj_qkv,o_proj --no-gemlite
      part 90 python3 perf/bench_quant_gemm.py --path mma,tuned --m 32 --formats int4-g64 \
        --shapes gate_up,down,q_proj,o_proj --no-gemlite
      ;;
    quant-gemm-frag)
      part 300 python3 perf/bench_quant_gemm.py --path mma,frag --m 1,8,16,32 --formats int4-g64 --l2 cold \
        --shapes gate_up,down,in_proj_qkvz,o_proj --no-gemlite
      gpu_tests 240 quant_fragments_gpu -n 6
      ;;
    frag-first-look)
      part 200 python3 perf/bench_quant_gemm.py --path frag,mma --m 1,8 --formats int4-g64 --l2 cold \
        --shapes gate_up,down,in_proj_qkvz,o_proj --no-gemlite
      NINFER_PDL=1 part 50 python3 perf/bench_quant_gemm.py --path frag --m 1 --formats int4-g64 --l2 cold \
        --shapes gate_up,down --no-gemlite
      gpu_tests 150 quant_fragments_gpu -n 12
      gpu_tests 200 fragments_model_gpu
      ;;
    frag-int8)
      gpu_tests 230 quant_fragments_gpu -n 16 -k "int8 or graph or projections or fp32"
      part 220 python3 perf/bench_quant_gemm.py --path frag,tuned --m 1,8 --formats int8-g64 --l2 cold \
        --shapes lm_head,in_proj_qkvz,o_proj --no-gemlite
      gpu_tests 100 quant_fragments_gpu -n 16 -k "every_candidate and int4-g128"
      ;;
    deltanet-split-27b)
      gpu_tests 170 deltanet_decode_gpu -n 16
      NINFER_AUTOTUNE=off part 100 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 \
        --steps 12 --chunk 1024 --prefill 1024
      NINFER_EXPORT_TUNING=$OUT/tuned-27b.json part 280 python3 perf/bench_engine.py --shape 27b --recipe int4 \
        --contexts 1024 32768 --lanes 1 8 --steps 12 --chunk 8192 --prefill 8192
      ;;
    export-tuning-h200)  # a part exports at its end, or what it chose so far when its limit stops it
      export NINFER_SHIPPED_TUNING=0 NINFER_EXPORT_TUNING=$OUT/tuned-h200.json
      part 330 python3 perf/stack_sampler.py perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --chunk 8192 --prefill 8192
      ;;
    export-tuning-h200-35b)
      export NINFER_SHIPPED_TUNING=0 NINFER_EXPORT_TUNING=$OUT/tuned-h200.json
      part 300 python3 perf/stack_sampler.py perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 \
        --contexts 1024 --lanes 1 8 --steps 12 --chunk 8192 --prefill 8192
      ;;
    export-tuning-h200-nvfp4)
      export NINFER_SHIPPED_TUNING=0 NINFER_EXPORT_TUNING=$OUT/tuned-h200.json
      part 330 python3 perf/stack_sampler.py perf/bench_engine.py --shape 27b --recipe nvfp4 --contexts 1024 \
        --lanes 1 8 --steps 12 --chunk 8192 --prefill 8192
      ;;
    structured-27b)
      part 300 python3 perf/bench_structured.py --shape 27b --recipe int4 --lanes 1 8 --tokens 128
      ;;
    profile-structured-27b)
      NINFER_AUTOTUNE=off part 260 python3 perf/bench_structured.py --shape 27b --recipe int4 --lanes 1 8 --tokens 64 \
        --profile
      ;;
    frag-engine-27b)  # Triton's own autotuning off (first configs of attention / DeltaNet): a cold start in one call
      export NINFER_AUTOTUNE=off
      part 400 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --chunk 1024 --prefill 1024
      part 150 python3 perf/profile_step.py --shape 27b --recipe int4
      ;;
    quant-gemm-regs)
      part 200 python3 perf/bench_quant_gemm.py --path mma,regs --m 1,8,16 --formats int4-g64 \
        --shapes gate_up,down,q_proj,in_proj_qkv,o_proj --no-gemlite
      ;;
    quant-gemm-gemlite)
      part 250 python3 perf/bench_quant_gemm.py --path tuned --m 1,8,4096 --shapes gate_up,down,q_proj,in_proj_qkv \
        --formats int4-g64,nvfp4,fp8 --gemlite-budget 200
      ;;
    moe-kernels)
      NINFER_TUNE_CACHE=off part 150 python3 perf/bench_moe.py --no-bf16 --formats int4-g64,nvfp4 --path auto,dot,gemv,mma
      ;;
    engine-27b-int4)
      part 330 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 32768 --lanes 1 2 4 8 \
        --steps 12 --chunk 8192 --prefill 8192
      ;;
    prefill-27b-long)
      part 330 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts --lanes 1 --steps 12 \
        --chunk 4096 --prefill 65536 131072 262144
      ;;
    engine-35b-a3b)
      part 170 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 \
        --steps 12 --chunk 8192 --prefill 8192
      ;;
    mtp-27b-int4)
      part 240 python3 perf/bench_spec.py --shape 27b --recipe int4 --lanes 1 8 --steps 12 --prefill 1024
      ;;
    mtp-35b-a3b)
      part 280 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12 --prefill 8192
      ;;
    transformers-floor)  # the prefill is timed warm: the first one compiles fla's kernels
      part 250 python3 perf/bench_engine.py --hf-only --shape 27b --prefill 8192 --hf-new 8 --hf-budget 220
      part 250 python3 perf/bench_engine.py --hf-only --shape 35b-a3b --prefill 8192 --hf-new 8 --hf-budget 220
      ;;
    server-27b-int4)
      part 225 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 --max-tokens 64 --requests 24
      ;;
    server-27b-int4-load)
      part 290 python3 perf/bench_server.py --random 27b --recipe int4 --levels 1 2 4 8 16 --max-tokens 64
      ;;
    prefix-cache-27b)
      part 80 python3 perf/bench_host_copies.py
      part 290 python3 perf/bench_prefix_cache.py --context 65536 --turns 20 --growth 5000
      ;;
    vision-27b)
      part 300 python3 perf/bench_vision.py --shape 27b --reps 3
      ;;
    profile-27b)
      part 110 python3 perf/profile_step.py --shape 27b --recipe int4
      part 120 python3 perf/profile_step.py --shape 27b --recipe int4 --lanes 8
      part 150 python3 perf/profile_step.py --shape 27b --recipe int4 --prefill 8192 --chunk 8192
      ;;
    profile-35b-a3b)
      part 110 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4
      part 240 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --prefill 8192 --chunk 8192
      ;;
    moe-expert-mma)
      gpu_tests 170 moe_quant_mma
      NINFER_TUNE_CACHE=off part 130 python3 perf/bench_moe.py --no-bf16 --formats int4-g64 --path auto,gemv
      part 200 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --chunk 8192 --prefill 8192
      ;;
    moe-35b-tuned)
      NINFER_EXPORT_TUNING=$OUT/tuned-h200.json part 200 python3 perf/bench_engine.py --shape 35b-a3b \
        --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 --steps 12 --chunk 8192 --prefill 8192
      part 280 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12 \
        --prefill 8192
      ;;
    stall-budget-graph-27b)
      NINFER_CHUNK_GRAPHS=1 part 330 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm \
        --prefill --ttft-lanes 1 --while-decoding 16 --stalls 3x --child-timeout 320 --budget 325
      ;;
    moe-combine-tests)
      gpu_tests 90 moe -k shared
      gpu_tests 300 model_gpu -k moe
      ;;
    overlap-timeline)
      for on in 1 0; do
        NINFER_OVERLAP=$on part 120 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 \
          --timeline --top 12
      done
      part 150 python3 perf/profile_step.py --shape 27b --recipe int4 --timeline --top 12
      ;;
    decode-ahead)
      gpu_tests 150 run_ahead_gpu
      for ahead in on off on; do
        flag=""; [ "$ahead" = off ] && flag=--no-decode-ahead
        part 80 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 \
          --lanes 1 8 --steps 30 $flag --label "ahead=$ahead"
      done
      for ahead in on off; do
        flag=""; [ "$ahead" = off ] && flag=--no-decode-ahead
        part 90 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 30 \
          $flag --label "ahead=$ahead"
      done
      gpu_tests 120 model_gpu -k graphs_equal_eager
      ;;
    ahead-checks)
      gpu_tests 150 speculative_gpu
      gpu_tests 100 structured_gpu
      gpu_tests 80 min_tokens_gpu
      part 200 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12
      ;;
    host-split)
      part 120 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --host --timeline --top 30 \
        --steps 20
      ;;
    pdl-triggers)  # PDL was in the noise with norm kernels between the GEMMs (runs 2026-12-04.13 / .14 / .34)
      gpu_tests 90 fragments_model_gpu -k programmatic
      part 150 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --toggle NINFER_PDL=1,0,1,0
      part 150 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --toggle NINFER_PDL=1,0,1,0
      NINFER_PDL=1 gpu_tests 90 model_gpu -n 2 -k graphs_equal  # the MoE combine's trigger
      ;;
    profile-pdl-35b)
      NINFER_PDL=1 part 140 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --timeline --top 20 --label pdl
      NINFER_PDL=0 part 120 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --timeline --top 20 --label no-pdl
      ;;
    launch-diet-tests)
      gpu_tests 200 model_gpu -k small_kernels_waiting
      gpu_tests 120 deltanet_decode_gpu -n 4 -k gates_projected
      ;;
    launch-diet-35b)  # one process: every switch against the same model and the base twice (drift shows)
      ALL_35B=NINFER_GATES_IN_DECODE=1+NINFER_PDL_WAITS=1+NINFER_NORM_IN_GEMM=1
      part 300 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --settings base NINFER_GATES_IN_DECODE=1 NINFER_PDL_WAITS=1 NINFER_NORM_IN_GEMM=1 \
        "$ALL_35B" base "$ALL_35B"
      ;;
    launch-diet-27b)
      part 300 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --settings base NINFER_GATES_IN_DECODE=1 NINFER_PDL_WAITS=1 NINFER_GATES_IN_DECODE=1+NINFER_PDL_WAITS=1 base \
        NINFER_GATES_IN_DECODE=1 NINFER_PDL_WAITS=1
      ;;
    tune-l2)  # the 35B-A3B projections and experts all fit the L2 the tuner times them in
      part 200 python3 perf/bench_tune_l2.py
      NINFER_SHIPPED_TUNING=0 NINFER_TUNE_CACHE=off NINFER_TUNE_L2_COLD=none part 120 python3 perf/bench_moe.py \
        --no-bf16 --formats int4-g64 --path auto
      NINFER_SHIPPED_TUNING=0 NINFER_TUNE_CACHE=off NINFER_TUNE_L2_COLD=experts part 120 python3 perf/bench_moe.py \
        --no-bf16 --formats int4-g64 --path auto
      ;;
    deltanet-early)  # the state (2 MB a 35B-A3B layer, 3 MB a 27B one) was read after the projection before it
      NINFER_DELTANET_EARLY=1 gpu_tests 150 deltanet_decode_gpu -n 4
      part 150 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 --prefill \
        --toggle NINFER_DELTANET_EARLY=1,0,1,0
      part 130 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 \
        --steps 12 --prefill --toggle NINFER_DELTANET_EARLY=1,0,1,0
      ;;
    early-model-tests)  # early reads are safe only for what no kernel of the chain before them writes: MTP rounds too
      gpu_tests 300 speculative_gpu -n 4
      gpu_tests 150 deltanet_decode_gpu -n 4
      gpu_tests 90 float_gemv_gpu -n 2 -k early
      gpu_tests 300 model_gpu -n 3
      ;;
    float-gemv-early)  # a 35B-A3B router took 3.2 us for 1 MB through cuBLAS at batch 1 (run 2026-12-06.8)
      gpu_tests 120 float_gemv_gpu -n 2 -k "early or every_candidate"
      part 170 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 \
        --steps 12 --prefill --toggle NINFER_FLOAT_GEMV_EARLY=1,0,1,0
      ;;
    frag-variants)  # a decode GEMM costs ~5 us beyond its bytes; its loads wait with registers capping its warps
      gpu_tests 300 fragment_variants_gpu -n 8  # compiling is most of it on a cold cache: 8 of the 16 cores
      NINFER_FRAG_KSPLIT=1 gpu_tests 200 moe_quant_mma -n 8
      part 300 python3 perf/bench_quant_gemm.py --path frag,frag-async,frag-ksplit --m 1,4,8 --formats int4-g64,nvfp4 \
        --l2 cold --shapes gate_up,down,in_proj_qkvz,o_proj,35b_in_proj_qkvz,35b_out_proj --no-gemlite
      for ks in 0 1; do  # the expert keys tuned from nothing (L2-cold, as the engine tunes them), their picks recorded
        NINFER_FRAG_KSPLIT=$ks NINFER_SHIPPED_TUNING=0 NINFER_TUNE_CACHE=off part 120 python3 perf/bench_moe.py \
          --no-bf16 --formats int4-g64 --path auto
      done
      ;;
    route-prefetch)  # the 35B-A3B expert gate/up took 9.7 us for 8.4 MB at batch 1, its codes read after its ids (run 2026-12-06.8)
      gpu_tests 120 route_prefetch_gpu -n 4
      for on in 1 0; do
        NINFER_ROUTE_PREFETCH=$on part 60 python3 perf/bench_moe_block.py --tokens 1 2 4 8 --label "route-prefetch=$on"
      done
      part 170 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 \
        --steps 12 --toggle NINFER_ROUTE_PREFETCH=1,0,1,0
      for on in 1 0; do
        NINFER_ROUTE_PREFETCH=$on part 150 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 \
          --lanes 1 --steps 12 --draft-vocab 32768 --label "route-prefetch=$on"
      done
      ;;
    ncu-small-gemm)  # the small GEMMs floor: launch, ramp, split-K epilogue (docs/performance.md, the 35B-A3B known limit)
      for shape in 35b_out_proj 35b_qkvz; do
        for path in frag frag-async frag-ksplit; do
          i=$(timeout 90 python3 perf/ncu_gemm.py --shape $shape --format int4-g64 --m 1 --path $path --best 2>> "$LOG")
          part 100 ncu --clock-control none -k regex:_fragment_mma_kernel --launch-skip 2 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
            --section LaunchStats python3 perf/ncu_gemm.py --shape $shape --format int4-g64 --m 1 --path $path \
            --pick "${i:-0}"
        done
      done
      ;;
    frag-variants-35b | frag-variants-27b)  # after frag-variants: do the winners win inside the step?
      if [ "$1" = frag-variants-35b ]; then model="35b-a3b --recipe qwen3_5_35b_a3b_int4"; else model="27b --recipe int4"; fi
      NINFER_FRAG_ASYNC=1 NINFER_FRAG_KSPLIT=1 NINFER_SHIPPED_TUNING=0 NINFER_EXPORT_TUNING=$OUT/tuned-variants.json \
        part 360 python3 perf/bench_engine.py --shape $model --contexts 1024 --lanes 1 8 --steps 12 --label variants
      part 120 python3 perf/bench_engine.py --shape $model --contexts 1024 --lanes 1 8 --steps 12 --label shipped
      ;;
    launch-floor)  # ~440 dependent kernels in a 2.45 ms 35B-A3B step: how much of it is their floor
      part 120 python3 perf/bench_launch_floor.py --chain 64
      ;;
    variants-model-tests)  # the tuner may pick a variant for any key here, so the models run through them
      export NINFER_FRAG_ASYNC=1 NINFER_FRAG_KSPLIT=1 NINFER_ROUTE_PREFETCH=1 NINFER_SHIPPED_TUNING=0
      gpu_tests 300 model_gpu -n 3
      gpu_tests 200 speculative_gpu -n 4
      ;;
    early-all)
      all=NINFER_MOE_DOWN_EARLY=1+NINFER_DELTANET_EARLY=1+NINFER_FLOAT_GEMV_EARLY=1
      part 200 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 \
        --steps 12 --prefill --settings base $all base $all
      part 200 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 --prefill \
        --settings base $all base $all
      ;;
    moe-down-early)  # the 35B-A3B down GEMV took 5.4 us for 4.2 MB at batch 1 (26% of copy bandwidth, run 2026-12-06.8)
      gpu_tests 200 moe_down_early_gpu -n 4
      for early in 1 0; do
        NINFER_MOE_DOWN_EARLY=$early part 60 python3 perf/bench_moe_block.py --tokens 1 2 8 --label "down-early=$early"
      done
      part 170 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 \
        --steps 12 --prefill --toggle NINFER_MOE_DOWN_EARLY=1,0,1,0
      ;;
    defaults-check)  # an H200 had not run the gates in the decode from deferred rows (2.4% slower there before them)
      part 140 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 --prefill \
        --toggle NINFER_GATES_IN_DECODE=1,0
      part 120 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 \
        --steps 12 --prefill --toggle NINFER_GATES_IN_DECODE=1,0
      none=NINFER_MOE_DOWN_EARLY=0+NINFER_DELTANET_EARLY=0+NINFER_FLOAT_GEMV_EARLY=0
      for shape in "35b-a3b --recipe qwen3_5_35b_a3b_int4" "27b --recipe int4"; do
        part 160 python3 perf/bench_engine.py --shape $shape --contexts 1024 --lanes 1 8 --steps 12 \
          --settings base $none base $none
      done
      ;;
    gates-export-35b)
      gpu_tests 150 deltanet_decode_gpu -n 4 -k gates_projected
      export NINFER_SHIPPED_TUNING=0 NINFER_EXPORT_TUNING=$OUT/tuned-h200.json
      part 330 python3 perf/stack_sampler.py perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 \
        --contexts 1024 --lanes 1 8 --steps 12
      ;;
    gates-deferred)  # the a/b gates GEMV: 48 launches of a 27B step on the second stream (run 2026-12-05.14)
      gpu_tests 150 deltanet_decode_gpu -n 4 -k gates_projected
      NINFER_GATES_IN_DECODE=1 gpu_tests 150 model_gpu -n 3 -k "fp32 or bf16_error or graphs_equal"
      part 150 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --toggle NINFER_GATES_IN_DECODE=1,0,1,0
      part 150 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --toggle NINFER_GATES_IN_DECODE=1,0,1,0
      ;;
    pdl-waits)  # off: the 27B in the noise (run 2026-12-06.2); the 35B-A3B step did not move with PDL on the GEMMs alone (run 2026-12-05.21)
      gpu_tests 120 model_gpu -k small_kernels_waiting
      part 170 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --toggle NINFER_PDL_WAITS=1,0,1,0
      part 150 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --toggle NINFER_PDL_WAITS=1,0,1,0
      ;;
    norm-in-gemm-35b)  # the 35B-A3B post-attention norm: a launch of its own since its MoE blocks decline deferred rows
      gpu_tests 90 norm_in_gemm_gpu -k "int8 or graph"
      part 170 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --toggle NINFER_NORM_IN_GEMM=1,0,1,0
      ;;
    pdl-35b)
      for pdl in 1 0 1 0; do
        NINFER_PDL=$pdl part 80 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 \
          --contexts 1024 --lanes 1 8 --steps 30 --prefill --label "pdl=$pdl"
      done
      NINFER_PDL=1 gpu_tests 200 model_gpu -k moe
      ;;
    overlap-streams)
      gpu_tests 120 overlap_gpu
      for on in 1 0 1 0; do
        NINFER_OVERLAP=$on part 80 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 \
          --contexts 1024 --lanes 1 8 --steps 12 --prefill --label "overlap=$on"
      done
      for on in 1 0; do
        NINFER_OVERLAP=$on part 100 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 \
          --steps 12 --prefill --label "overlap=$on"
      done
      gpu_tests 200 model_gpu -k moe
      ;;
    profile-35b-decode)
      part 150 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --top 45
      part 150 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 8 --top 30
      ;;
    bench-27b-step)
      part 150 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 32768 --lanes 1 8 --steps 12 \
        --chunk 8192 --prefill 8192
      part 120 python3 perf/profile_step.py --shape 27b --recipe int4 --lanes 8
      ;;
    gpu-tests-fragments-model)
      gpu_tests 330 fragments_model_gpu -n 3
      ;;
    gpu-tests-no-stalls)  # autotuning on: the mix must meet no kernel key that warm-up left out
      gpu_tests 500 no_stalls -s
      ;;
    startup-27b-int4)  # cold: fresh cache directories inside the bench (its own children), then warm on them
      part 540 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes cold warm --child-timeout 320 \
        --budget 515 --sample-stacks 3
      ;;
    startup-27b-warm-serial)
      part 150 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm --compile serial --measure ttft \
        --ttft-lanes 1 --sample-stacks 2 --child-timeout 140 --budget 145
      part 150 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm --compile parallel --measure ttft \
        --ttft-lanes 1 --sample-stacks 2 --child-timeout 140 --budget 145
      ;;
    profile-27b-chunks)  # the eager step: ITL beside a 32k prefill stayed near 130 ms at 128-token chunks (run 2026-12-03.15)
      part 130 python3 perf/profile_step.py --shape 27b --recipe int4 --prefill 8192 --chunk 128 --host --top 30
      part 80 python3 perf/profile_step.py --shape 27b --recipe int4 --prefill 8192 --chunk 1024
      ;;
    profile-27b-mixed)  # a 128-token mixed step cost ~125 ms beside a 32k prefill (run 2026-12-03.15), 8x TPOT
      part 200 python3 perf/profile_step.py --shape 27b --recipe int4 --mixed 16384 --chunk 128 --steps 8 --host --top 30
      ;;
    itl-128-27b)
      part 200 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm --prefill --ttft-lanes 1 \
        --budgets 128 --child-timeout 190 --budget 195
      ;;
    chunk-graphs-27b)  # steps beside decodes were host-bound at 100-150 ms eagerly (run 2026-12-03.18)
      gpu_tests 150 chunk_graphs_gpu
      for budget in 128 256; do
        NINFER_CHUNK_GRAPHS=1 part 170 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm \
          --prefill --ttft-lanes 1 --while-decoding $budget --child-timeout 160 --budget 165
      done
      ;;
    ncu-gemm-frag)  # the register decode reads 61-76% of copy bandwidth at one token (run 2026-12-03.1): why
      for shape in gate_up down; do
        for m in ${NCU_TOKENS:-1 8}; do  # NCU_TOKENS=32: the prompt-chunk graphs' and verification's size
          i=$(timeout 90 python3 perf/ncu_gemm.py --shape $shape --format int4-g64 --m $m --path frag --best 2>> "$LOG")
          part 100 ncu --clock-control none -k regex:_fragment_mma_kernel --launch-skip 2 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section InstructionStats \
            --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
            python3 perf/ncu_gemm.py --shape $shape --format int4-g64 --m $m --path frag --pick "${i:-0}"
        done
      done
      ;;
    profile-mtp-35b)
      part 200 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 --draft-tokens 3 \
        --top 40 --timeline
      ;;
    nvfp4-checks)
      gpu_tests 150 fragments_model_gpu -n 2 -k "nvfp4"
      part 200 python3 perf/bench_engine.py --shape 27b --recipe nvfp4 --contexts 32768 --lanes 1 --steps 12 \
        --prefill 8192 --chunk 8192
      part 200 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_nvfp4 --contexts 1024 \
        --lanes 1 8 --steps 12 --prefill 8192 --chunk 8192
      ;;
    dequant-nvfp4)
      gpu_tests 100 quant_fragments_gpu -k "64_token_decode and nvfp4"
      part 130 python3 perf/bench_engine.py --shape 27b --recipe nvfp4 --contexts 1024 --lanes 1 --steps 8 \
        --prefill 8192 --chunk 1024
      part 100 python3 perf/bench_engine.py --shape 27b --recipe nvfp4 --contexts 1024 --lanes 1 --steps 8 \
        --prefill 8192 --chunk 8192
      ;;
    deltanet-tail)
      gpu_tests 150 deltanet_decode_gpu -n 8
      part 110 python3 perf/bench_deltanet.py
      part 250 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --prefill 8192 --chunk 1024
      ;;
    float-expert-35b)
      gpu_tests 110 float_gemv_gpu -s
      gpu_tests 110 moe_quant_mma -k aligned
      part 60 python3 perf/bench_float_gemv.py
      part 280 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12 \
        --prefill 1024
      ;;
    expert-aligned)
      gpu_tests 150 moe_quant_mma -k aligned
      part 300 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 8 --steps 12 \
        --prefill 1024
      ;;
    float-gemv)
      gpu_tests 120 float_gemv_gpu -s
      part 90 python3 perf/bench_float_gemv.py
      part 150 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 8 \
        --steps 12
      part 170 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 --steps 12 --prefill 1024
      ;;
    split-sum)
      NINFER_SPLIT_SUM=across gpu_tests 100 quant_fragments_gpu -n 4 -k "int4-g64"
      NINFER_SPLIT_SUM=tile gpu_tests 100 quant_fragments_gpu -n 4 -k "int4-g64"
      for mode in each across tile; do
        NINFER_SPLIT_SUM=$mode part 90 python3 perf/bench_quant_gemm.py --path frag --m 1,8 --formats int4-g64 \
          --l2 cold --shapes gate_up,down,in_proj_qkvz,o_proj --no-gemlite
      done
      ;;
    split-sum-tests)
      NINFER_SPLIT_SUM=tile gpu_tests 150 quant_fragments_gpu -n 4 -k "int4-g64"
      ;;
    split-sum-bench)
      for mode in each across tile; do
        NINFER_SPLIT_SUM=$mode part 90 python3 perf/bench_quant_gemm.py --path frag --m 1,8 --formats int4-g64 \
          --l2 cold --shapes gate_up,down,in_proj_qkvz,o_proj --no-gemlite
      done
      ;;
    split-sum-engine)  # each / across: the shipped table; tile tunes its own keys at start (more candidates)
      for mode in each across; do
        NINFER_SPLIT_SUM=$mode part 110 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 \
          --lanes 1 8 --steps 12 --label split-$mode
      done
      NINFER_SPLIT_SUM=tile NINFER_EXPORT_TUNING=$OUT/tuned-h200-tile.json part 300 python3 perf/bench_engine.py \
        --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 --label split-tile
      ;;
    chunks-host-35b)
      part 200 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 \
        --steps 12 --prefill 8192 --chunk 1024
      part 150 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 --lanes 1 \
        --steps 12 --prefill 8192 --chunk 8192
      ;;
    profile-nvfp4-chunks)
      part 200 python3 perf/profile_step.py --shape 27b --recipe nvfp4 --prefill 8192 --chunk 1024 --host --top 30
      part 150 python3 perf/profile_step.py --shape 27b --recipe int4 --prefill 8192 --chunk 1024 --top 30
      ;;
    frag-nvfp4)
      gpu_tests 200 quant_fragments_gpu -n 4 -k "nvfp4 or re_laid"
      part 200 python3 perf/bench_quant_gemm.py --path frag,tuned --m 1,8 --formats nvfp4,int4-g64 --l2 cold \
        --shapes gate_up,down,in_proj_qkvz,o_proj --no-gemlite
      ;;
    engine-27b-nvfp4)
      part 280 python3 perf/bench_engine.py --shape 27b --recipe nvfp4 --contexts 1024 --lanes 1 8 --steps 12
      ;;
    prologue-and-head-tests)
      gpu_tests 70 attention_prologue_gpu -n 4
      gpu_tests 40 spec_rows_gpu
      gpu_tests 60 embedding_gpu
      gpu_tests 40 elementwise -k "mrope or cuda_graph"
      NINFER_AUTOTUNE=off gpu_tests 200 speculative_gpu -n 4  # tuning every candidate compiled for 160+ s
      ;;
    prologue-27b)  # the one-launch attention prologue, on by default since run 2026-12-05.5 (NINFER_FUSED_PROLOGUE)
      gpu_tests 70 attention_prologue_gpu -n 4
      NINFER_FUSED_PROLOGUE=1 gpu_tests 120 model_gpu -k "triton_path or bf16_error or graphs_equal"
      part 330 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --prefill --toggle NINFER_FUSED_PROLOGUE=1,0,1,0
      ;;
    mtp-quantized-head)
      NINFER_AUTOTUNE=off gpu_tests 100 speculative_gpu -k quantized_head -n 4
      part 190 python3 perf/bench_spec.py --shape 27b --recipe int4 --lanes 1 8 --steps 12 --prefill 1024
      part 150 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 --steps 12 --prefill 1024
      ;;
    moe-norm-35b)  # on by default since run 2026-12-05.6 (2.705 against 2.734 ms at batch 1)
      gpu_tests 60 moe -k "next_norm or shared_expert"
      NINFER_MOE_NORM=1 gpu_tests 120 model_gpu -k "graphs_equal"
      NINFER_MOE_NORM=1 gpu_tests 100 speculative_gpu -k "greedy_equals_plain"
      part 300 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --prefill --toggle NINFER_MOE_NORM=1,0,1,0
      ;;
    deferred-norm-tests)  # run 2026-12-05.16 reached 6 of its 12 tests in 150 s on a cold cache
      gpu_tests 380 deferred_norm_gpu -n 6
      NINFER_DEFERRED_NORM=1 gpu_tests 170 fragments_model_gpu  # readers wide enough for the fragment layout
      ;;
    deferred-norm-27b)  # on by default since its GPU tests passed (run 2026-12-05.18)
      NINFER_DEFERRED_NORM=1 gpu_tests 150 model_gpu -n 3 -k "triton_path or bf16_error or graphs_equal"
      NINFER_DEFERRED_NORM=1 NINFER_AUTOTUNE=off gpu_tests 100 speculative_gpu -k "greedy_equals_plain"
      part 290 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --toggle NINFER_DEFERRED_NORM=1,0,1,0
      ;;
    deferred-norm-35b)  # 3.02 against 2.85 ms at batch 1 on an H100 in run 2026-12-05.19: off by default
      gpu_tests 150 deferred_norm_gpu -k "routed or gate_projection"
      part 300 python3 perf/bench_engine.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --toggle NINFER_DEFERRED_NORM_MOE=1,0,1,0
      ;;
    deferred-norm-quick)
      part 230 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 --steps 12 \
        --toggle NINFER_DEFERRED_NORM=1,0
      ;;
    deferred-norm-bench)
      part 280 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --toggle NINFER_DEFERRED_NORM=1,0,1,0
      ;;
    profile-deferred-35b)
      NINFER_DEFERRED_NORM_MOE=1 part 150 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --top 30 --label deferred
      NINFER_DEFERRED_NORM_MOE=0 part 120 python3 perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --top 30 --label norms
      ;;
    profile-deferred-27b)
      NINFER_DEFERRED_NORM=1 part 130 python3 perf/profile_step.py --shape 27b --recipe int4 --top 30 --label deferred
      NINFER_DEFERRED_NORM=0 part 110 python3 perf/profile_step.py --shape 27b --recipe int4 --top 30 --label norms
      ;;
    deferred-norm-gemms)
      part 200 python3 perf/bench_deferred_norm.py --m 1,8
      gpu_tests 150 deferred_norm_gpu -n 4
      ;;
    deferred-late)
      part 100 python3 perf/bench_deferred_norm.py --m 1,8
      part 220 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 --steps 12 \
        --toggle NINFER_DEFERRED_NORM=1,0
      ;;
    across-default-tests)
      gpu_tests 300 model_gpu -n 3 -k "triton_path or bf16_error or graphs_equal"
      gpu_tests 240 fragments_model_gpu
      ;;
    split-across-27b)
      part 300 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --toggle NINFER_SPLIT_SUM=across,each,across,each
      ;;
    norm-in-gemm-27b)  # off by default until measured
      [ -f tests/gpu/test_norm_in_gemm_gpu.py ] && gpu_tests 90 norm_in_gemm_gpu
      NINFER_NORM_IN_GEMM=1 gpu_tests 120 model_gpu -k "triton_path or bf16_error or graphs_equal"
      NINFER_NORM_IN_GEMM=1 gpu_tests 100 speculative_gpu -k "greedy_equals_plain"
      part 300 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 --steps 12 \
        --toggle NINFER_NORM_IN_GEMM=1,0,1,0
      ;;
    draft-vocab)  # the drafts int8 LM heads took ~1.2 ms of a 9.76 ms 27B C = 1 round (run 2026-12-05.4)
      part 170 python3 perf/bench_spec.py --shape 27b --recipe int4 --lanes 1 --steps 12 --full-vocab
      part 170 python3 perf/bench_spec.py --shape 27b --recipe int4 --lanes 1 --steps 12 --draft-vocab 32768
      part 150 python3 perf/bench_spec.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --lanes 1 --steps 12 \
        --draft-vocab 32768
      ;;
    profile-draft-vocab-27b)
      part 150 python3 perf/profile_step.py --shape 27b --recipe int4 --lanes 1 --draft-tokens 3 --draft-vocab 32768 --top 30
      part 150 python3 perf/profile_step.py --shape 27b --recipe int4 --lanes 1 --draft-tokens 3 --full-vocab --top 30
      ;;
    profile-mtp-27b-c1)  # a C = 1 round cost 1.6x a plain step in run 2026-12-04.21: where the rest goes
      part 150 python3 perf/profile_step.py --shape 27b --recipe int4 --lanes 1 --draft-tokens 3 --top 40
      ;;
    profile-mtp-27b)
      part 150 python3 perf/profile_step.py --shape 27b --recipe int4 --lanes 8 --draft-tokens 3 --top 30
      part 100 python3 perf/profile_step.py --shape 27b --recipe int4 --lanes 8 --top 30
      ;;
    gates-in-decode-27b)  # in_proj_ab was a cuBLAS GEMM and its split-K reduce per DeltaNet layer: 0.29 ms of a 7.8 ms step (run 2026-12-03.6)
      gpu_tests 150 deltanet_decode_gpu -k "gates or graph"
      NINFER_GATES_IN_DECODE=0 part 120 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --chunk 1024 --prefill 1024 --label gates-separate
      NINFER_GATES_IN_DECODE=1 part 120 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 \
        --lanes 1 8 --steps 12 --chunk 1024 --prefill 1024 --label gates-in-decode
      NINFER_GATES_IN_DECODE=1 part 100 python3 perf/profile_step.py --shape 27b --recipe int4
      ;;
    frag-tiled-27b)  # the graph step spent 40 of 51.5 ms in register decodes that read each weight 4 times (run 2026-12-04.5)
      NINFER_AUTOTUNE=off gpu_tests 130 quant_fragments_gpu -k tiled -n 4
      NINFER_CHUNK_GRAPHS=1 part 170 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm \
        --prefill --ttft-lanes 1 --while-decoding 128 --child-timeout 160 --budget 165
      part 200 python3 perf/profile_step.py --shape 27b --recipe int4 --mixed 16384 --chunk 128 --steps 8 --top 30
      ;;
    bench-frag-tiled)
      NINFER_AUTOTUNE=off gpu_tests 120 quant_fragments_gpu -k "tiled or dequantization_path" -n 4
      part 150 python3 perf/bench_quant_gemm.py --formats int4-g64 --m 128,512 --shapes gate_up,down,in_proj_qkvz,o_proj \
        --path dequant,frag-tiled --no-gemlite
      NINFER_CHUNK_GRAPHS=1 part 170 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm \
        --prefill --ttft-lanes 1 --while-decoding 256 --child-timeout 160 --budget 165
      ;;
    dequant-in-graph-27b)  # the dequantization beat the tiled GEMM by 0-25% at 128 tokens and 2x at 512 (run 2026-12-04.8)
      NINFER_AUTOTUNE=off gpu_tests 60 quant_fragments_gpu -k "dequantization_path_in_cuda_graph or tiled_in_cuda_graph"
      for budget in 128 256; do
        NINFER_CHUNK_GRAPHS=1 part 100 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm \
          --prefill --ttft-lanes 1 --while-decoding $budget --child-timeout 95 --budget 98
      done
      ;;
    pdl-trigger)  # without an explicit trigger the next kernel could only launch as this one exited (run 2026-12-03.1)
      NINFER_PDL=1 gpu_tests 60 quant_fragments_gpu -k "graph_bit_equal and not tiled"
      for pdl in 1 0; do
        NINFER_PDL=$pdl part 100 python3 perf/bench_quant_gemm.py --path frag --m 1,8 --formats int4-g64 --l2 cold \
          --shapes gate_up,down,in_proj_qkvz,o_proj --no-gemlite
      done
      for pdl in 1 0; do
        NINFER_PDL=$pdl part 120 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 \
          --steps 12 --chunk 1024 --prefill 1024 --label "pdl=$pdl"
      done
      ;;
    pdl-norms)  # a GEMM follows a norm kernel at three of the four GEMMs of a DeltaNet layer
      NINFER_PDL=1 gpu_tests 100 fragments_model_gpu -k programmatic
      for pdl in 1 0 1 0; do
        NINFER_PDL=$pdl part 75 python3 perf/bench_engine.py --shape 27b --recipe int4 --contexts 1024 --lanes 1 8 \
          --steps 12 --prefill --label "pdl=$pdl"
      done
      ;;
    itl-small-chunks)  # the 128-token graph step stays at 6.2x TPOT (run 2026-12-04.11): what smaller chunks give
      for budget in ${ITL_BUDGETS:-64 32}; do  # ITL_BUDGETS=16: other chunk lengths
        NINFER_CHUNK_GRAPHS=1 part 170 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm \
          --prefill --ttft-lanes 1 --while-decoding $budget --child-timeout 160 --budget 165
      done
      ;;
    frag-narrow)  # 32-token programs need 100-255 registers (perf/ptx_check.py --kinds frag --m 32): 2-3 programs an SM
      NINFER_AUTOTUNE=off gpu_tests 200 quant_fragments_gpu -k "every_candidate" -n 8
      part 200 python3 perf/bench_quant_gemm.py --path frag --m 16,32 --formats int4-g64 --l2 cold \
        --shapes gate_up,down,in_proj_qkvz,o_proj --no-gemlite
      ;;
    frag-pair)  # at 32 tokens a warp reads as many activation bytes from L1 as code bytes from memory
      NINFER_AUTOTUNE=off gpu_tests 220 quant_fragments_gpu -n 8
      part 220 python3 perf/bench_quant_gemm.py --path frag --m 1,8,16,32 --formats int4-g64 --l2 cold \
        --shapes gate_up,down,in_proj_qkvz,o_proj --no-gemlite
      ;;
    itl-budgets-27b)  # a budget whose mixed step stays within 3x TPOT chooses the default (docs/performance.md)
      part 420 python3 perf/bench_startup.py --shape 27b --recipe int4 --modes warm --prefill --ttft-lanes 1 \
        --budgets 512 256 128 --stalls 3x 2.5x --child-timeout 400 --budget 410
      ;;
    ncu-gemm-mma)  # why the tensor-core decode reads 35-53% of copy bandwidth: its fastest config under ncu
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
}

for name in "$@"; do
  echo "=== stage $name" >> "$LOG"
  ( stage "$name" )  # a subshell each: one stage's exports (NINFER_AUTOTUNE=off) do not leak into the next
done
tail -60 "$LOG"
