// WKV7 by chunks, forward: the recurrence of wkv7.h cut into chunks of L steps. Written once over
// the vocabulary of prelude_{metal,cuda,cpu}.h; the entries wkv7c_fwd_maps.h and
// wkv7c_fwd_scan.h call these functions. The derivation is ops/wkv7/README.md's (the chunked MLX
// path's): a chunk entering with state S_c gives
//     Z = W S_c^T + U0,  Y = Qm S_c^T + Y0,  S_{c+1} = S_c diag(e^{c_L}) + V^T K_L + Z^T B_L
// where c_t is the chunk's cumulative log-decay and W, U0, Qm, Y0, K_L, B_L (L x N) depend on the
// chunk's inputs alone. The first entry computes them for every chunk at once; the second runs
// the state through the chunks, one threadgroup per (batch, head).
//
// Exactness: every factor is one exponential of a difference of cumulative log-decays, <= 0
// where it is used, so none overflows and one that underflows is a term below float32
// resolution. The cumulative sums start at each chunk (|c| <= 16 L with log_w clamped at
// WKV7C_LOG_W_MIN, as the MLX path does: decays below 1.1e-7 a step change nothing float32 can
// see). The state keeps itself as S + S * (e^{c_L} - 1), e^x - 1 taken without cancellation near
// 0: decays near 1, where long memory lives, are carried to the precision of log_w itself once
// per chunk, not rounded to float32 once per step (the sequential kernel's hi + lo split).
//
// Layouts: inputs and y [B, T, H, N] (log_w float32), states [B, H, N, N] float32 row-major
// S[i, j] (i = value index, j = key index); the chunk maps W, U0, Qm, Y0, K_L, B_L
// [B, H, n_chunks, L, N] float32 and dlo [B, H, n_chunks, N] (e^{c_L} - 1); checkpoints
// [B, H, n_chunks, N, N], the state entering each chunk. dims = [T, H].
#ifndef MLX_RWKVX_WKV7_CHUNK_H
#define MLX_RWKVX_WKV7_CHUNK_H

// Steps per chunk: threadgroup memory of the maps holds (5 L + 1) N + 4 L^2 floats, 24.3 KiB at
// N = 64, L = 16 and 21.5 KiB at N = 128, L = 8 (Metal gives 32 KiB, CUDA 48 KiB by default).
#define WKV7C_L(n) ((n) > 64 ? 8 : 16)
#define WKV7C_MAPS_SHARED(n) ((5 * WKV7C_L(n) + 1) * (n) + 4 * WKV7C_L(n) * WKV7C_L(n))
#define WKV7C_SCAN_SHARED(n) ((4 * WKV7C_L(n) + 1) * (n))
#define WKV7C_LOG_W_MIN (-16.0f)

// e^x - 1 for x <= 0 with no cancellation near 0 (Taylor there: remainder < 3e-10 relative).
KFN float wkv7c_expm1(float x) {
    if (x > -0.1f) {
        const float p = 1.0f / 6 + x * (1.0f / 24 + x * (1.0f / 120 + x * (1.0f / 720 + x / 5040)));
        return x + x * x * (0.5f + x * p);
    }
    return FEXP(x) - 1.0f;
}

// The maps of one chunk (group g = (b * H + h) * n_chunks + chunk), thread n = channel n. Shared:
// r, a, k, b of the chunk, its cumulative log-decays c[u] (the sum of its first u steps, u = 0..L)
// and the four L x L matrices A_rk, A_rb, A_ak, A_ab (ops/wkv7/README.md).
template <typename InT, int N>
KFN void wkv7c_maps(
    GMEM const InT* r,
    GMEM const float* log_w,
    GMEM const InT* k,
    GMEM const InT* v,
    GMEM const InT* a,
    GMEM const InT* b,
    int T,
    int H,
    GMEM float* W,
    GMEM float* U0,
    GMEM float* Qm,
    GMEM float* Y0,
    GMEM float* KL,
    GMEM float* BL,
    GMEM float* dlo,
    int n,
    int g,
    SMEM float* smem) {
    constexpr int L = WKV7C_L(N);
    const int n_chunks = (T + L - 1) / L;
    const int chunk = g % n_chunks;
    const size_t batch = static_cast<size_t>(g / n_chunks / H);
    const size_t head = static_cast<size_t>(g / n_chunks % H);
    SMEM float* sr = smem;
    SMEM float* sa = sr + L * N;
    SMEM float* sk = sa + L * N;
    SMEM float* sb = sk + L * N;
    SMEM float* sc = sb + L * N;  // (L + 1) x N
    SMEM float* sA = sc + (L + 1) * N;  // A_rk, A_rb, A_ak, A_ab, each L x L
    float vn[L];  // v[., n]: only this thread's column is used
    float c = 0.0f;
    sc[n] = 0.0f;
    for (int t = 0; t < L; ++t) {
        const int step = chunk * L + t;
        float x[6] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // past T: zeros, decay 1
        if (step < T) {
            const size_t at = ((batch * T + step) * H + head) * N + n;
            x[0] = TO_F32(r[at]);
            x[1] = TO_F32(a[at]);
            x[2] = TO_F32(k[at]);
            x[3] = TO_F32(b[at]);
            x[4] = TO_F32(v[at]);
            x[5] = log_w[at] > WKV7C_LOG_W_MIN ? log_w[at] : WKV7C_LOG_W_MIN;
        }
        sr[t * N + n] = x[0];
        sa[t * N + n] = x[1];
        sk[t * N + n] = x[2];
        sb[t * N + n] = x[3];
        vn[t] = x[4];
        c += x[5];
        sc[(t + 1) * N + n] = c;
    }
    BARRIER();
    // A_xy[t, s] = sum_m x[t, m] e^{X_t[m] - c_s[m]} y[s, m]; X = c_t for r (s <= t), c_{t-1}
    // for a (s < t): exponents <= 0. Zero above the diagonal.
    for (int p = n; p < L * L; p += N) {
        const int t = p / L;
        const int s = p % L;
        float rk = 0.0f, rb = 0.0f, ak = 0.0f, ab = 0.0f;
        if (s <= t) {
            for (int m = 0; m < N; ++m) {
                const float cs = sc[(s + 1) * N + m];
                const float rf = sr[t * N + m] * FEXP(sc[(t + 1) * N + m] - cs);
                rk = FMA(rf, sk[s * N + m], rk);
                rb = FMA(rf, sb[s * N + m], rb);
                if (s < t) {
                    const float af = sa[t * N + m] * FEXP(sc[t * N + m] - cs);
                    ak = FMA(af, sk[s * N + m], ak);
                    ab = FMA(af, sb[s * N + m], ab);
                }
            }
        }
        sA[p] = rk;
        sA[L * L + p] = rb;
        sA[2 * L * L + p] = ak;
        sA[3 * L * L + p] = ab;
    }
    BARRIER();
    SMEM const float* A_rk = sA;
    SMEM const float* A_rb = sA + L * L;
    SMEM const float* A_ak = sA + 2 * L * L;
    SMEM const float* A_ab = sA + 3 * L * L;
    // Column n of each map: z_t = S_{t-1} a_t solves (I - A_ab) Z = A0 S^T + A_ak V, split by
    // linearity in S (Z = W S^T + U0) and solved by forward substitution, row by row.
    const float cL = sc[L * N + n];
    const size_t out = static_cast<size_t>(g) * L * N + n;  // chunk g of all (b, h, chunk)
    float zs[L], z0[L];
    for (int t = 0; t < L; ++t) {
        float w_t = sa[t * N + n] * FEXP(sc[t * N + n]);  // A0 = a_t e^{c_{t-1}}
        float u_t = 0.0f;
        for (int s = 0; s < t; ++s) u_t = FMA(A_ak[t * L + s], vn[s], u_t);
        for (int s = 0; s < t; ++s) {
            w_t = FMA(A_ab[t * L + s], zs[s], w_t);
            u_t = FMA(A_ab[t * L + s], z0[s], u_t);
        }
        zs[t] = w_t;
        z0[t] = u_t;
        float q_t = sr[t * N + n] * FEXP(sc[(t + 1) * N + n]);  // R0 = r_t e^{c_t}
        float y_t = 0.0f;
        for (int s = 0; s <= t; ++s) {
            q_t = FMA(A_rb[t * L + s], zs[s], q_t);
            y_t = FMA(A_rk[t * L + s], vn[s], FMA(A_rb[t * L + s], z0[s], y_t));
        }
        const float to_end = FEXP(cL - sc[(t + 1) * N + n]);  // e^{c_L - c_t} <= 1
        const size_t at = out + static_cast<size_t>(t) * N;
        W[at] = w_t;
        U0[at] = u_t;
        Qm[at] = q_t;
        Y0[at] = y_t;
        KL[at] = sk[t * N + n] * to_end;
        BL[at] = sb[t * N + n] * to_end;
    }
    dlo[static_cast<size_t>(g) * N + n] = wkv7c_expm1(cL);
}

// The state through the chunks (group g = b * H + h), thread i = row i of S in registers: per
// chunk z_t[i] and y_t[i] from the maps, then the row's update. No barrier inside a chunk: the
// chunk's W, Qm, K_L, B_L and dlo (indexed by the key j) come through threadgroup memory.
template <typename InT, int N>
KFN void wkv7c_scan(
    GMEM const InT* v,
    GMEM const float* state,
    GMEM const float* W,
    GMEM const float* U0,
    GMEM const float* Qm,
    GMEM const float* Y0,
    GMEM const float* KL,
    GMEM const float* BL,
    GMEM const float* dlo,
    int T,
    int H,
    GMEM InT* y,
    GMEM float* state_out,
    GMEM float* ckpt,
    int i,
    int g,
    SMEM float* smem) {
    constexpr int L = WKV7C_L(N);
    const int n_chunks = (T + L - 1) / L;
    const size_t batch = static_cast<size_t>(g / H);
    const size_t head = static_cast<size_t>(g % H);
    const size_t row = static_cast<size_t>(g) * N * N + static_cast<size_t>(i) * N;
    SMEM float* sW = smem;
    SMEM float* sQ = sW + L * N;
    SMEM float* sK = sQ + L * N;
    SMEM float* sB = sK + L * N;
    SMEM float* sd = sB + L * N;
    float S[N];
    for (int j = 0; j < N; ++j) S[j] = state[row + j];
    for (int chunk = 0; chunk < n_chunks; ++chunk) {
        const size_t maps = (static_cast<size_t>(g) * n_chunks + chunk) * L * N;
        for (int t = 0; t < L; ++t) {
            const size_t at = maps + static_cast<size_t>(t) * N + i;
            sW[t * N + i] = W[at];
            sQ[t * N + i] = Qm[at];
            sK[t * N + i] = KL[at];
            sB[t * N + i] = BL[at];
        }
        sd[i] = dlo[(static_cast<size_t>(g) * n_chunks + chunk) * N + i];
        GMEM float* c = ckpt + (static_cast<size_t>(g) * n_chunks + chunk) * N * N;
        for (int j = 0; j < N; ++j) c[static_cast<size_t>(i) * N + j] = S[j];
        BARRIER();
        float z[L], vi[L];
        for (int t = 0; t < L; ++t) {
            const int step = chunk * L + t;
            const size_t at = maps + static_cast<size_t>(t) * N + i;
            float zt = U0[at];
            float yt = Y0[at];
            for (int j = 0; j < N; ++j) {
                zt = FMA(sW[t * N + j], S[j], zt);
                yt = FMA(sQ[t * N + j], S[j], yt);
            }
            z[t] = zt;
            vi[t] = 0.0f;
            if (step < T) {
                const size_t seq = ((batch * T + step) * H + head) * N + i;
                y[seq] = FROM_F32(InT, yt);
                vi[t] = TO_F32(v[seq]);
            }
        }
        for (int j = 0; j < N; ++j) {
            float update = 0.0f;
            for (int t = 0; t < L; ++t) {
                update = FMA(z[t], sB[t * N + j], FMA(vi[t], sK[t * N + j], update));
            }
            S[j] = S[j] + FMA(S[j], sd[j], update);  // S e^{c_L} + ..., near 1 kept exact
        }
        BARRIER();  // the next chunk's maps overwrite threadgroup memory
    }
    for (int j = 0; j < N; ++j) state_out[row + j] = S[j];
}

#endif
