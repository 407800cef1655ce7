#pragma once
// The main of a test binary that needs a CUDA device. Without one it prints
// why and exits 77, which Meson reports as SKIP, so a machine without a GPU
// never counts the test as passed; with one it runs doctest. Included once per
// binary, by the file that defines DOCTEST_CONFIG_IMPLEMENT.

#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdio>

int main(int argc, char** argv) {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess || n == 0) {
    std::printf("SKIP: no CUDA device (%s)\n", rc != cudaSuccess ? cudaGetErrorString(rc) : "cudaGetDeviceCount returned 0");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
