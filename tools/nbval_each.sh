#!/bin/sh
# One pytest --nbval per notebook, JOBS at a time, then the ALONE ones one at a
# time; a table of seconds per notebook at the end, and a non-zero exit naming
# the notebooks that failed (every notebook runs even when one fails).
#
#   sh tools/nbval_each.sh JOBS "PYTEST COMMAND" NOTEBOOK... [-- ALONE_NOTEBOOK...]
#
# `make nbval` runs it with JOBS=2 (NBVAL_JOBS): a chapter's cells mostly run
# on one core, so two chapters keep both cores of a two-core machine busy. The
# ALONE notebooks time things on the wall clock with threads of their own
# (the CPU-kernels appendix), so they run with the machine to themselves.
set -u
jobs=$1
cmd=$2
shift 2
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
n=0
for nb in "$@"; do [ "$nb" = -- ] || n=$((n + 1)); done

# one notebook: $1 its number, $2 its path; writes $logs/N.{log,time,failed}
one='
  i=$1; nb=$2; t0=$(date +%s)
  echo "nbval [$i/'$n'] $nb"
  if '"$cmd"' "$nb" > "'$logs'/$i.log" 2>&1; then
    result=$(tail -n 1 "'$logs'/$i.log")
  else
    result="FAILED (its output comes at the end)"; echo "$nb" > "'$logs'/$i.failed"
  fi
  s=$(( $(date +%s) - t0 ))
  echo "$s $nb" > "'$logs'/$i.time"
  echo "nbval [$i/'$n'] $nb: $s s, $result"
'
i=0
parallel=""
alone=""
seen_sep=0
for nb in "$@"; do
  if [ "$nb" = -- ]; then seen_sep=1; continue; fi
  i=$((i + 1))
  if [ $seen_sep -eq 0 ]; then parallel="$parallel $i $nb"; else alone="$alone $i $nb"; fi
done
# Side by side, each notebook gets one PyTorch thread (unless OMP_NUM_THREADS says
# otherwise): two notebooks with a thread per core each leave threads spinning at
# OpenMP's barriers while the other notebook holds the core (chapter 9 took 93 s
# beside another notebook with two threads, 37 s with one). No stored output a
# notebook checks may depend on its thread count (the engine picks it from the
# free cores, so it varies anyway). The ALONE notebooks get the setting the
# caller had.
saved_threads=${OMP_NUM_THREADS:-}
[ "$jobs" -le 1 ] || export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
[ -z "$parallel" ] || printf '%s\n' $parallel | xargs -n 2 -P "$jobs" sh -c "$one" sh
[ -n "$saved_threads" ] && export OMP_NUM_THREADS="$saved_threads" || unset OMP_NUM_THREADS
[ -z "$alone" ] || printf '%s\n' $alone | xargs -n 2 -P 1 sh -c "$one" sh

echo
how="$jobs at a time"
[ -z "$alone" ] || how="$how, then alone:$(printf '%s\n' $alone | sed -n 'n;p' | tr '\n' ' ' | sed 's/ $//; s/^/ /')"
echo "nbval: seconds per notebook, slowest first ($how)"
cat "$logs"/*.time 2>/dev/null | sort -rn | awk '{ printf "  %5d  %s\n", $1, $2; s += $1 } END { printf "  %5d  (sum)\n", s }'
failed=""
for j in $(ls "$logs" | sed -n 's/\.failed$//p' | sort -n); do
  nb=$(cat "$logs/$j.failed")
  failed="$failed $nb"
  echo
  echo "=== nbval output of $nb ==="
  cat "$logs/$j.log"
done
if [ -n "$failed" ]; then
  echo
  echo "nbval failed:$failed"
  exit 1
fi
