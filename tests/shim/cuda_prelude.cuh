// What mx.fast.cuda_kernel puts before a kernel body, for compiling the bodies with nvcc:
// shapes and strides travel by value as fixed-size arrays (mlx/backend/cuda/device/config.h).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cuda/std/array>
#include <cuda/std/limits>

using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
#define inf cuda::std::numeric_limits<float>::infinity()
