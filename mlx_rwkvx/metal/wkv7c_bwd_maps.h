// kernel: wkv7c_bwd_maps
// body: wkv7_chunk.h
// template: L
// inputs: r:InT log_w:float k:InT v:InT a:InT b:InT dy:InT W:float U0:float dW:float
// inputs: dQm:float dZ:float dKL:float dBL:float ddecay:float dv0:float dims:int
// outputs: dr:InT dlog_w:float dk:InT dv:InT da:InT db:InT
// Entry of the chunked WKV7 backward, its second part: every chunk's maps back to the inputs at
// once, from the cotangents of wkv7c_bwd_scan.h. dims = [T, H] int32; grid
// (B * H * n_chunks * N, 1, 1), threadgroup (N, 1, 1).
SHARED_ARRAY(float, wkv7c_smem, WKV7C_BWD_MAPS_SHARED(N, L));
wkv7c_bwd_maps<InT, N, L>(
    r, log_w, k, v, a, b, dy, W, U0, dW, dQm, dZ, dKL, dBL, ddecay, dv0, dims[0], dims[1], dr,
    dlog_w, dk, dv, da, db, TID_X, GID_X, wkv7c_smem);
