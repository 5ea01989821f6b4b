// kernel: moba_bwd_dq
// body: moba.h
// inputs: q:InT k:InT v:InT out:InT dout:InT lse:float dlse:float chunk:int limit:int
// inputs: scale:float dims:int
// outputs: dq:InT delta:float
// Entry of the MoBA backward, part one: dq, and per row delta = <dout, out> - dlse for part two
// (moba_bwd_dkv.h). dims and scale as in moba_fwd.h, the same grid and threadgroup.
SHARED_ARRAY(float, moba_smem, MOBA_DQ_SHARED(N));
moba_backward_dq<InT, N>(
    q, k, v, out, dout, lse, dlse, chunk, limit, scale[0], dims[0], dims[1], dims[2], dims[3],
    dims[4], dims[5], dq, delta, TID_X, GID_X, moba_smem);
