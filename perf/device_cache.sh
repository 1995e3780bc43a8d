# Sourced by perf/gpu_runbook.sh: carry compiled kernels and tuning choices from one device call to the next.
#
# Every device call starts a fresh machine, so Triton recompiles every kernel and the runtime tuner times
# every candidate of every key again: at the 27B / 35B-A3B shapes that start-up took whole 200 s parts.
# `cache_restore` unpacks .devcache/cache.tar.* (carried: carry [".whl", ".devcache"]) into the Triton
# cache, Triton's autotuning cache and ninfer's tuning cache; `cache_save` packs them back into $OUT in
# parts under the 16 MiB a returned file may have. Copy them back with
#   mkdir -p .devcache && rm -f .devcache/* && cp <files_at>/cache.tar.* .devcache/
# The tar is xz-compressed where xz exists (half gzip's size on cubins: 24 against 48 MB for the 27B and
# 35B-A3B kernels, which gzip had pushed over the carry limit), gzip otherwise; restore reads either.
# Only what a later launch needs is packed (cubins, their metadata, launcher stubs, tuning JSON): the
# intermediate IRs are pruned first, and past CACHE_RAW_BYTES the kernels used least recently are dropped
# (perf/prune_triton_cache.py). A stale or partial cache only costs recompilation: Triton keys entries by source hash,
# compiler version and options, ninfer's tuning file by GPU, versions and a hash of the tuned kernels' sources (quant_*, moe*).

export TRITON_CACHE_DIR=/tmp/ninfer-triton-cache NINFER_TUNE_CACHE=/tmp/ninfer-tune TRITON_CACHE_AUTOTUNING=1
# Each cache hit marks its kernel as used, so that the save below can drop the kernels used least recently.
export TRITON_CACHE_MANAGER=prune_triton_cache:UsageMarkingCacheManager PYTHONPATH=$PWD/perf:${PYTHONPATH:-}
CACHE_PART_BYTES=${CACHE_PART_BYTES:-15000000}
# The carried tree (the checkout, perf/snapshot.sh's copy of it, wheels, this cache) must stay under 64 MiB: keep
# the kernels' uncompressed bytes under CACHE_RAW_BYTES (xz packs cubins ~6x), the packed cache under CACHE_MAX_BYTES.
CACHE_RAW_BYTES=${CACHE_RAW_BYTES:-250000000}
CACHE_MAX_BYTES=${CACHE_MAX_BYTES:-48000000}

_compress() { if command -v xz > /dev/null; then xz -T0 -3 -c; else gzip -c; fi; }
_decompressor() {  # from the first part's magic bytes: xz (fd 37 7a 58 5a 00) or gzip
  if [ "$(head -c 6 "$1" | od -An -tx1 | tr -d ' \n')" = "fd377a585a00" ]; then echo "xz -dc"; else echo "gzip -dc"; fi
}

cache_restore() {
  mkdir -p "$TRITON_CACHE_DIR" "$NINFER_TUNE_CACHE"
  if compgen -G ".devcache/cache.t*.*" > /dev/null; then
    local parts=(.devcache/cache.t*.*)
    cat "${parts[@]}" | $(_decompressor "${parts[0]}") | tar -xf - -C / 2>/dev/null \
      && echo "cache restored: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) cubins, $(ls "$NINFER_TUNE_CACHE" | wc -l) tuning files"
  else
    echo "no carried cache (.devcache/cache.tar.*): compiling from scratch"
  fi
}

cache_save() {  # quick (a few seconds): called after every part, so a call cut by its limit keeps the last one
  python3 perf/prune_triton_cache.py "$TRITON_CACHE_DIR" --budget "$CACHE_RAW_BYTES" > /dev/null
  rm -f "$OUT"/cache.t*.*
  tar -cf - "$TRITON_CACHE_DIR" "$NINFER_TUNE_CACHE" 2>/dev/null | _compress | split -b "$CACHE_PART_BYTES" -a 1 - "$OUT/cache.tar."
  local total
  total=$(cat "$OUT"/cache.tar.* 2>/dev/null | wc -c)
  if [ "${total:-0}" -gt "$CACHE_MAX_BYTES" ]; then  # too big to carry back in: keep the tuning choices only
    rm -f "$OUT"/cache.tar.*
    find "$NINFER_TUNE_CACHE" -type f | tar -cf - -T - 2>/dev/null | _compress | split -b "$CACHE_PART_BYTES" -a 1 - "$OUT/cache.tar."
    echo "cache of $total bytes is over $CACHE_MAX_BYTES: saved the tuning choices only"
  fi
}
