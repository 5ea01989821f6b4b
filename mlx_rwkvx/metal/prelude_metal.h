// Kernel vocabulary, Metal flavour (mx.fast.metal_kernel). Prepended to the `source`, not the
// `header`: MLX adds the thread-position attributes to the signature only when the source names
// them, and it only scans `source`.
#define KFN inline
#define GMEM device
#define SMEM threadgroup
#define SHARED_ARRAY(type, name, n) threadgroup type name[n]
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define TID_X (thread_position_in_threadgroup.x)
#define GID_X (threadgroup_position_in_grid.x)
#define GID_Y (threadgroup_position_in_grid.y)
#define FEXP(x) metal::precise::exp(x)
#define TO_F32(x) static_cast<float>(x)
