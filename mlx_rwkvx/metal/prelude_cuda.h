// Kernel vocabulary, CUDA flavour (mx.fast.cuda_kernel, and cupy.RawKernel in tests/gpu/).
// Input dtypes are MLX's CUDA names: float, __nv_bfloat16, __half.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define KFN __device__ __forceinline__
#define GMEM
#define SMEM
#define SHARED_ARRAY(type, name, n) __shared__ type name[n]
#define BARRIER() __syncthreads()
#define TID_X (threadIdx.x)
#define GID_X (blockIdx.x)
#define GID_Y (blockIdx.y)
#define FEXP(x) expf(x)
#define FLOG(x) logf(x)
#define FMA(a, b, c) fmaf(a, b, c)
#define TO_F32(x) static_cast<float>(x)
#define FROM_F32(type, x) static_cast<type>(x)
