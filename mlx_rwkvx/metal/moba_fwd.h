// kernel: moba_fwd
// body: moba.h
// inputs: q:InT k:InT v:InT chunk:int limit:int scale:float dims:int
// outputs: out:InT lse:float
// Entry of the MoBA forward over per-row chunk slots (see moba.h). dims = [T, Tk, Hq, Hkv, S,
// chunk_size] int32 and scale [1] float32 come in MLX's constant address space (under 8
// elements); every other input must have at least 8 elements so that it stays in `device`.
// Grid (B * T * Hq * N, 1, 1), threadgroup (N, 1, 1); InT and N (the head dim) are templates.
SHARED_ARRAY(float, moba_smem, MOBA_FWD_SHARED(N));
moba_forward<InT, N>(
    q, k, v, chunk, limit, scale[0], dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], out,
    lse, TID_X, GID_X, moba_smem);
