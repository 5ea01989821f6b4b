// kernel: wkv7_bwd
// body: wkv7.h
// inputs: r:InT log_w:float k:InT v:InT a:InT b:InT dy:InT dstate:float ckpt:float sa:float
// inputs: dims:int
// outputs: dr:InT dlog_w:float dk:InT dv:InT da:InT db:InT dstate0:float scratch:float
// Entry of the WKV7 backward (see wkv7_fwd.h): ckpt and sa come from the forward, scratch is
// working memory [B * H, WKV7_SEG, N, N] float32. dims = [T, H] int32; grid (B * H * N, 1, 1),
// threadgroup (N, 1, 1).
SHARED_ARRAY(float, wkv7_smem, WKV7_BWD_SHARED(N));
wkv7_backward<InT, N>(
    r, log_w, k, v, a, b, dy, dstate, ckpt, sa, dims[0], dims[1], dr, dlog_w, dk, dv, da, db,
    dstate0, scratch, TID_X, GID_X, wkv7_smem);
