// kernel: wkv7_fwd
// body: wkv7.h
// inputs: r:InT log_w:float k:InT v:InT a:InT b:InT state:float dims:int
// outputs: y:InT state_out:float ckpt:float sa:float
// Entry of the WKV7 forward: the body of the kernel function whose signature MLX (or the test
// harness) writes from the lines above. dims = [T, H] int32; grid (B * H * N, 1, 1), threadgroup
// (N, 1, 1); InT and N are template arguments.
SHARED_ARRAY(float, wkv7_smem, WKV7_FWD_SHARED(N));
wkv7_forward<InT, N>(
    r, log_w, k, v, a, b, state, dims[0], dims[1], y, state_out, ckpt, sa, TID_X, GID_X,
    wkv7_smem);
