#!/bin/bash
# Instructions per call of call_instructions.cpp under callgrind (the VM has no hardware counters;
# read in docs/PERFORMANCE.md, "Instructions per call").
#   call_instructions.sh build TREE OUT          builds OUT (Threads) and OUT_mpi against TREE/include
#   call_instructions.sh threads BIN ALGO FLOATS CALLS RANKS
#   call_instructions.sh mpi BIN_mpi ALGO FLOATS CALLS NP
# prints: total, wait loops and outside them, per call (rank 0's process under MPI; every rank thread on Threads).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case $1 in
build)
  flags=(-std=c++20 -O2 -g -pthread -D_FILE_OFFSET_BITS=64 -I "$2/include")
  g++ "${flags[@]}" "$here/call_instructions.cpp" -o "$3"
  mpicxx "${flags[@]}" -DOMPI_SKIP_MPICXX=1 -DCALL_COST_MPI "$here/call_instructions.cpp" -o "$3_mpi"
  exit 0 ;;
threads) run=(valgrind --tool=callgrind) ;;
mpi) run=(mpirun --allow-run-as-root --oversubscribe -np "$6" valgrind --tool=callgrind) ;;
*) echo "usage: see the head of $0" >&2; exit 2 ;;
esac
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
if [ "$1" = threads ]; then
  "${run[@]}" --callgrind-out-file="$d/cg.%p" "$2" "$3" "$4" "$5" "$6" 1 >/dev/null 2>&1
else
  "${run[@]}" --callgrind-out-file="$d/cg.%p" "$2" "$3" "$4" "$5" >/dev/null 2>&1
fi
# The *.1 dump is the timed loop (CALLGRIND_DUMP_STATS_AT): only rank 0 dumps, so there is one.
f=$(ls "$d"/cg.*.1)
callgrind_annotate --threshold=100 --inclusive=yes --auto=no "$f" | python3 -c "
import re, sys
total = waits = 0
for line in sys.stdin:
    m = re.match(r'\s*([\d,]+) \(.*?\)\s+(.*)', line)
    if not m:
        continue
    v, f = int(m.group(1).replace(',', '')), m.group(2)
    if 'PROGRAM TOTALS' in f:
        total = v
    # one line per wait loop instantiation, in the file that holds the loop's body
    if re.search(r'endpoint\.hpp:void (gradsync::detail::)?mpi::Endpoint::await<', f) or \
       re.search(r'doorbell\.hpp:void (gradsync::detail::)?threads::wait_on<', f):
        waits += v
n = int(sys.argv[1])
print(f'total {total / n:.1f} waits {waits / n:.1f} outside {(total - waits) / n:.1f}')
" "$5"
