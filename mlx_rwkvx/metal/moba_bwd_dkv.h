// kernel: moba_bwd_dkv
// body: moba.h
// inputs: q:InT k:InT v:InT dout:InT lse:float delta:float limit:int pairs:int offsets:int
// inputs: scale:float dims:int
// outputs: dk:float dv:float
// Entry of the MoBA backward, part two: dk and dv (float32) per key, summed over the rows that
// read it. pairs [R * S] int32: the non-empty slots r * S + s sorted by chunk matrix
// m = (b * Hkv + kv head) * n_chunks + chunk, n_chunks = ceil(Tk / chunk_size); offsets [M + 1]
// int32: matrix m's slots are pairs[offsets[m]] .. pairs[offsets[m + 1] - 1]. dims and scale as
// in moba_fwd.h. Grid (M * ceil(chunk_size / N) * N, 1, 1), threadgroup (N, 1, 1).
SHARED_ARRAY(float, moba_smem, MOBA_DKV_SHARED(N));
SHARED_ARRAY(int, moba_ismem, MOBA_DKV_INT_SHARED);
moba_backward_dkv<InT, N>(
    q, k, v, dout, lse, delta, limit, pairs, offsets, scale[0], dims[1], dims[3], dims[4],
    dims[5], dk, dv, TID_X, GID_X, moba_smem, moba_ismem);
