#!/usr/bin/env bash
# tools/gpu-check's build, as the GPU machine will do it, checked here
# without a GPU: no network, no doctest-dev, nvcc only through CUDA_HOME and
# NCCL only as the nvidia-nccl-cu13 wheel lays it out.
#
#   gpu_check_offline.sh SOURCE_ROOT WORK_DIR CUDA_ROOT
#
# A copy of the working tree (what travels to the GPU machine) gets
# doctest's source from `tools/gpu-check --prepare` (offline: from this
# machine's doctest-dev), twice, to check the second run changes nothing.
# A fake site-packages holds nvidia/nccl/include/nccl.h and
# lib/libnccl.so.2 (a link to this machine's library, with no unversioned
# libnccl.so beside it), found through Python as the real wheel is.
# `tools/gpu-check --build-only` then configures with
# --wrap-mode=nodownload and doctest forced from the subproject, and builds
# one NCCL test; its RUNPATH must name the fake lib directory, and it must
# run (ncclGetUniqueId needs no GPU) without LD_LIBRARY_PATH.
# Exit 77 (skip) where this machine lacks what the check imitates.
set -euo pipefail
src=$1 work=$2 cuda_root=$3

fail() { echo "FAIL: $*" >&2; exit 1; }
skip() { echo "SKIP: $*"; exit 77; }

header='' lib=''
for d in "$cuda_root/include" /usr/include /usr/local/include; do
  [[ -z $header && -f $d/nccl.h ]] && header=$d/nccl.h
done
for d in "$cuda_root/lib64" "$cuda_root/lib" /usr/lib/x86_64-linux-gnu /usr/lib64; do
  [[ -z $lib && -f $d/libnccl.so.2 ]] && lib=$d/libnccl.so.2
done
[[ -n $header && -n $lib ]] || skip "no nccl.h and libnccl.so.2 to build a fake wheel from"
[[ -f /usr/include/doctest/doctest.h ]] || skip "no doctest-dev for an offline --prepare to copy"
command -v git >/dev/null && git -C "$src" rev-parse --git-dir >/dev/null 2>&1 || skip "$src is not a git checkout"

rm -rf "$work"
mkdir -p "$work/src" "$work/site/nvidia/nccl/include" "$work/site/nvidia/nccl/lib"
# Tracked files and untracked ones git does not ignore, as they travel;
# the doctest source is left behind so that --prepare makes it afresh.
git -C "$src" ls-files -z -co --exclude-standard \
  | grep -zv '^subprojects/doctest-2\.4\.11/' \
  | tar -C "$src" --null -T - -cf - | tar -C "$work/src" -xf -
cp "$header" "$work/site/nvidia/nccl/include/"
ln -s "$lib" "$work/site/nvidia/nccl/lib/libnccl.so.2"

cd "$work/src"
export GRADSYNC_PREPARE_OFFLINE=1
tools/gpu-check --prepare
tools/gpu-check --prepare | tee "$work/prepare2.log"
grep -q 'already prepared' "$work/prepare2.log" || fail "a second --prepare did not find the first one's work"
[[ -z $(git -C "$src" check-ignore subprojects/doctest-2.4.11/meson.build || true) ]] \
  || fail "subprojects/doctest-2.4.11 is git-ignored, so it would not travel with the working tree"

# nvcc only through CUDA_HOME: PATH keeps meson, ninja and the compilers.
path=''
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
  [[ -x $d/nvcc ]] || path+=${path:+:}$d
done
env -u NCCL_ROOT -u LD_LIBRARY_PATH -u OUT PATH="$path" CUDA_HOME="$cuda_root" PYTHONPATH="$work/site" \
  GRADSYNC_DOCTEST=subproject GRADSYNC_GPU_CHECK_TARGETS=test/nccl/test_nccl_unique_id GRADSYNC_GPU_CHECK_JOBS=2 \
  tools/gpu-check --build-only "$work/build" || fail "tools/gpu-check --build-only failed"

logs=$work/build/gpu-check-logs
grep -qx "nvcc: $cuda_root/bin/nvcc" "$logs/locate.log" || fail "nvcc not found through CUDA_HOME: $(cat "$logs/locate.log")"
grep -qx "nccl: $work/site/nvidia/nccl" "$logs/locate.log" || fail "the wheel's NCCL not found through Python"
grep -q 'wrap_mode *: nodownload' "$logs/configure.log" || fail "not configured with --wrap-mode=nodownload"
grep -q 'subprojects/doctest-2\.4\.11' "$work/build/compile_commands.json" || fail "doctest did not come from the subproject"
exe=$work/build/test/nccl/test_nccl_unique_id
runpath=$(readelf -d "$exe" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
[[ :$runpath: == *":$work/site/nvidia/nccl/lib:"* ]] || fail "RUNPATH '$runpath' lacks $work/site/nvidia/nccl/lib"
env -u LD_LIBRARY_PATH "$exe" || fail "test_nccl_unique_id did not run from its RUNPATH"
echo "ok: offline configure and build with the wheel layout; RUNPATH $runpath"
rm -rf "$work"
