// Kernel vocabulary, CUDA flavour (mx.fast.cuda_kernel, and cupy.RawKernel in tests/gpu/).
#define KFN __device__ __forceinline__
#define GMEM
#define SMEM
#define SHARED_ARRAY(type, name, n) __shared__ type name[n]
#define BARRIER() __syncthreads()
#define TID_X (threadIdx.x)
#define GID_X (blockIdx.x)
#define GID_Y (blockIdx.y)
#define FEXP(x) expf(x)
#define TO_F32(x) static_cast<float>(x)
