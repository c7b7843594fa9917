// The probes' error check: a failed CUDA call prints where and why, and main returns 1.
#pragma once
#include <cstdio>
#include <cuda_runtime.h>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      return 1;                                                                      \
    }                                                                                \
  } while (0)
