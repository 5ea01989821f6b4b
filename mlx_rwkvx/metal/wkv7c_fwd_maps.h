// kernel: wkv7c_fwd_maps
// body: wkv7_chunk.h
// template: L
// inputs: r:InT log_w:float k:InT v:InT a:InT b:InT dims:int
// outputs: W:float U0:float Qm:float Y0:float KL:float BL:float cL:float
// Entry of the chunked WKV7 forward, its first part: every chunk's maps at once. dims = [T, H]
// int32; grid (B * H * n_chunks * N, 1, 1), threadgroup (N, 1, 1); InT, N and L (steps per
// chunk) are template arguments.
SHARED_ARRAY(float, wkv7c_smem, WKV7C_MAPS_SHARED(N, L));
wkv7c_maps<InT, N, L>(
    r, log_w, k, v, a, b, dims[0], dims[1], W, U0, Qm, Y0, KL, BL, cL, TID_X, GID_X, wkv7c_smem);
