#!/usr/bin/env bash
# Two runbook stages at once on a two-GPU machine (device kind nvidia-h200-x2), one stage per GPU:
#   OUT=$OUT BUDGET=540 bash perf/gpu_pair.sh engine-27b-int4 mtp-27b-int4   — carry [".whl", ".devcache"]
# (stage names: bash perf/gpu_runbook.sh --list)
# Device time is counted per machine held, so two GPUs working side by side do two stages for the price of
# one. The stages share one Triton cache and one tuning cache (concurrent writers never leave a torn
# entry: Triton and ninfer's tuner both write through a rename; at worst one stage re-tunes a key the other
# saved at the same moment) and the cache is saved once, at the end. What comes back: perf.jsonl (both stages' records), logs.tgz (each stage's logs under s<STAGE>/)
# and cache.tar.* — under the eight files a call may return.
set -uo pipefail
cd "$(dirname "$0")/.."
stages=$(bash perf/gpu_runbook.sh --list | awk 'NR > 1 && NF { print $1 }')
for stage in "$@"; do  # a misspelt stage would otherwise fail silently (its output goes to its own log)
  grep -qxF -- "$stage" <<< "$stages" || { echo "perf/gpu_pair.sh: unknown stage '$stage' (bash perf/gpu_runbook.sh --list)" >&2; exit 2; }
done
export OUT=${OUT:-perf/results/tmp} PYTHONUNBUFFERED=1 RUNBOOK_SHARED=1
mkdir -p "$OUT"
source perf/device_cache.sh
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/prepare.log" 2>&1 && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
cache_restore >> "$OUT/prepare.log" 2>&1
gpus=$(nvidia-smi -L | wc -l)
echo "$gpus GPUs" >> "$OUT/prepare.log"
i=0
for stage in "$@"; do
  # with one GPU the stages run one after the other, each with its share of the budget
  if [ "$gpus" -ge 2 ]; then
    CUDA_VISIBLE_DEVICES=$((i % gpus)) OUT=$OUT/s$stage bash perf/gpu_runbook.sh "$stage" > /dev/null 2>&1 &
  else
    BUDGET=$(( ${BUDGET:-540} / $# )) OUT=$OUT/s$stage bash perf/gpu_runbook.sh "$stage" > /dev/null 2>&1
  fi
  i=$((i + 1))
done
wait
cache_save >> "$OUT/prepare.log" 2>&1
cat "$OUT"/s*/perf.jsonl > "$OUT/perf.jsonl" 2>/dev/null
(cd "$OUT" && tar -czf logs.tgz prepare.log s* && rm -rf s* prepare.log)
tar -xzOf "$OUT/logs.tgz" --wildcards '*runbook.log' | grep -E '^(===|---)|Error|error' | tail -80
