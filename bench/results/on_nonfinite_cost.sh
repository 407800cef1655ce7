#!/bin/bash
# What on_nonfinite's check costs a step: throw_error and ignore interleaved in
# one process (ddp_step, fsdp_step; Threads at N = 2, 4 and Mpi at np 2, 4),
# then the agreement's own call, a 16-byte int64 Min all-reduce, alone.
# usage: on_nonfinite_cost.sh BUILD_DIR > on_nonfinite_cost.txt
b=${1:?build dir (meson setup --buildtype=release -Dbench=true -Dtests=disabled -Dexamples=false)}/bench
ab=throw_error,ignore,throw_error,ignore,throw_error,ignore,throw_error,ignore
mpirun="mpirun --oversubscribe"
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
uptime
nice -n 10 $b/ddp_step --ranks 2,4 --small-only --steps 30 --overlap on --on-nonfinite $ab
nice -n 10 $b/fsdp_step --ranks 2,4 --small-only --steps 10 --on-nonfinite $ab
for np in 2 4; do
  nice -n 10 $mpirun -np $np $b/ddp_step --backend mpi --small-only --steps 30 --overlap on --on-nonfinite $ab
done
nice -n 10 $mpirun -np 2 $b/fsdp_step --backend mpi --small-only --steps 10 --on-nonfinite $ab
uptime
for t in 2 4; do
  nice -n 10 $b/all_reduce_perf -t $t -b 16 -e 16 -d int64 -o min --algo all -n 20000 -r 5
done
for np in 2 4; do
  nice -n 10 $mpirun -np $np $b/all_reduce_perf_mpi -b 16 -e 16 -d int64 -o min --algo all -n 20000 -r 5
done
uptime
