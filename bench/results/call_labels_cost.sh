#!/bin/bash
# Alternates the before and after builds: ddp_step (overlap on) and fsdp_step, N = 2, small model.
# usage: call_labels_cost.sh BEFORE_BUILD AFTER_BUILD > runs.txt
before=${1:?before build dir}; after=${2:?after build dir}
out=/dev/stdout
for round in 1 2 3 4 5 6 7 8; do
  for which in before after; do
    [ $which = before ] && d=$before/bench || d=$after/bench
    $d/ddp_step --ranks 2 --small-only --steps 30 --overlap on 2>&1 | awk -v w=$which -v r=$round '/^ +2 +on/ {print r, w, "ddp", $3}' >> "$out"
    $d/fsdp_step --ranks 2 --small-only --steps 20 2>&1 | awk -v w=$which -v r=$round '/^ +2 +[A-Za-z]/ {print r, w, $2, $3}' >> "$out"
  done
done

