#!/usr/bin/env bash
# Build .snap/, the tree a device call carries: the tracked files of this checkout, .commit (the commit they are,
# which perf/common.py records, since the copy has no git history of its own), .devcache/ (compiled kernels and
# tuning choices) and .whl/ (wheels to install there). Run the call as
#   cd .snap && OUT=$OUT BUDGET=540 bash perf/gpu_runbook.sh STAGE ...      with carry [".snap"]
# usage: bash perf/snapshot.sh [FILES_AT]
#   FILES_AT: a finished call's files: its cache.tar.* become .devcache/, its tuned-h200.json and
#   tuned-unshipped.json (the choices measured on a GPU model with no shipped table) are merged into the shipped
#   tables (perf/ship_tuning.py).
set -euo pipefail
cd "$(dirname "$0")/.."
from=${1:-}
for exported in tuned-h200.json tuned-unshipped.json; do  # not tuned-h200-tile.json: an off mode's own keys
  if [ -n "$from" ] && [ -f "$from/$exported" ]; then python3 perf/ship_tuning.py "$from/$exported"; fi
done
mkdir -p .devcache
if [ -n "$from" ] && compgen -G "$from/cache.tar.*" > /dev/null; then
  rm -f .devcache/cache.tar.*
  cp "$from"/cache.tar.* .devcache/
fi
rm -rf .snap && mkdir .snap
git ls-files -z | xargs -0 cp --parents -t .snap
git rev-parse --short HEAD > .snap/.commit
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "perf/snapshot.sh: uncommitted changes went into .snap; its records will name $(cat .snap/.commit)" >&2
fi
cp -r .devcache .snap/
if [ -d .whl ]; then cp -r .whl .snap/; fi
du -sh .snap
