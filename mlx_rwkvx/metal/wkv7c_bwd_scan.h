// kernel: wkv7c_bwd_scan
// body: wkv7_chunk.h
// template: L
// inputs: dy:InT v:InT dstate:float ckpt:float Z:float W:float Qm:float KL:float BL:float
// inputs: cL:float dims:int
// outputs: dW:float dQm:float dZ:float dKL:float dBL:float ddecay:float dv0:float dstate0:float
// Entry of the chunked WKV7 backward, its first part: the reverse scan through the chunks, from
// the forward's checkpoints, Z and maps. dims = [T, H] int32; grid (B * H * N, 1, 1),
// threadgroup (N, 1, 1).
SHARED_ARRAY(float, wkv7c_smem, WKV7C_SCAN_SHARED(N, L));
wkv7c_bwd_scan<InT, N, L>(
    dy, v, dstate, ckpt, Z, W, Qm, KL, BL, cL, dims[0], dims[1], dW, dQm, dZ, dKL, dBL, ddecay,
    dv0, dstate0, TID_X, GID_X, wkv7c_smem);
