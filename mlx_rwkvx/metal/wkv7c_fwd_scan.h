// kernel: wkv7c_fwd_scan
// body: wkv7_chunk.h
// template: L
// inputs: v:InT state:float W:float U0:float Qm:float Y0:float KL:float BL:float cL:float
// inputs: dims:int
// outputs: y:InT state_out:float ckpt:float Z:float
// Entry of the chunked WKV7 forward, its second part: the state through the chunks, from the
// maps of wkv7c_fwd_maps.h; Z (every z_t = S_{t-1} a_t, [B, H, n_chunks, L, N]) is kept for
// the backward. dims = [T, H] int32; grid (B * H * N, 1, 1), threadgroup (N, 1, 1).
SHARED_ARRAY(float, wkv7c_smem, WKV7C_SCAN_SHARED(N, L));
wkv7c_scan<InT, N, L>(
    v, state, W, U0, Qm, Y0, KL, BL, cL, dims[0], dims[1], y, state_out, ckpt, Z, TID_X, GID_X,
    wkv7c_smem);
