#!/usr/bin/env bash
# The device jobs' compile cache between the restore and the save (.github/workflows/inf2.yml).
#   mark              after the restore: note the entries restored and when this job started
#   changed OUTCOME   before the save: prune, after a successful job only, the entries this job did
#                     not use (a load touches its entry: harness/backends/neuron.py), then print
#                     changed=true when the directory differs from what was restored (new entries to
#                     keep, or stale ones dropped). A failed job prunes nothing: what it did not reach
#                     is still valid for the next run.
set -euo pipefail
dir="${GEMMA_PARITY_CACHE:?}/neuron"
state="${RUNNER_TEMP:?}/compile-cache"
case "${1:-}" in
  mark)
    mkdir -p "$dir" "$state"
    touch "$state/started"
    find "$dir" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort > "$state/restored"
    echo "restored $(wc -l < "$state/restored") compile-cache entries"
    ;;
  changed)
    outcome="${2:?usage: changed OUTCOME}"
    mkdir -p "$dir"
    if [ "$outcome" = "success" ]; then
      find "$dir" -mindepth 1 -maxdepth 1 ! -newer "$state/started" -print -exec rm -rf {} +
    fi
    find "$dir" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort > "$state/now"
    if cmp -s "$state/restored" "$state/now"; then echo "changed=false"; else echo "changed=true"; fi
    ;;
  *)
    echo "usage: $0 mark | changed OUTCOME" >&2
    exit 2
    ;;
esac
