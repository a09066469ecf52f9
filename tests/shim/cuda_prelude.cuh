// The parts of the signature mx.fast.cuda_kernel generates, for compiling the body with nvcc.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
