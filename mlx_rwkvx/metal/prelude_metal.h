// Kernel vocabulary, Metal flavour (mx.fast.metal_kernel). Macros only: the builder puts this text
// in the `header` (for the body's functions) and again at the top of the `source`, because MLX adds
// the thread-position attributes to the signature only for names it finds in `source`. Identical
// macro redefinitions are legal, so the second copy is harmless.
#define KFN inline
#define GMEM device
#define SMEM threadgroup
#define SHARED_ARRAY(type, name, n) threadgroup type name[n]
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define TID_X (thread_position_in_threadgroup.x)
#define GID_X (threadgroup_position_in_grid.x)
#define GID_Y (threadgroup_position_in_grid.y)
#define FEXP(x) metal::precise::exp(x)
#define FLOG(x) metal::precise::log(x)
#define FMA(a, b, c) metal::fma(a, b, c)
#define TO_F32(x) static_cast<float>(x)
#define FROM_F32(type, x) static_cast<type>(x)
