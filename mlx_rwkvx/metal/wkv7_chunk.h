// WKV7 by chunks, forward and backward: wkv7.h's recurrence cut into chunks of L steps.
// Written once over the vocabulary of prelude_{metal,cuda,cpu}.h; the entries wkv7c_fwd_maps.h,
// wkv7c_fwd_scan.h, wkv7c_bwd_scan.h and wkv7c_bwd_maps.h call these functions. The derivation
// is in ops/wkv7/README.md (the chunked MLX path's, and this kernel's): a chunk entering with
// state S_c gives
//     Z = W S_c^T + U0,  Y = Qm S_c^T + Y0,  S_{c+1} = S_c diag(e^{c_L}) + V^T K_L + Z^T B_L
// where c_t is the chunk's cumulative log-decay and W, U0, Qm, Y0, K_L, B_L (L x N) depend on the
// chunk's inputs alone. The first entry computes them for every chunk at once; the second runs
// the state through the chunks, one threadgroup per (batch, head).
//
// Exactness: every factor is one exponential of a sum of log-decays over its own range of
// steps, <= 0 where it is used: none overflows, one that underflows is a term below float32
// resolution, and a large drop earlier in the chunk leaves later ranges untouched (a difference
// of prefix sums would carry its rounding). log_w is clamped at WKV7C_LOG_W_MIN as the MLX path
// does (decays below 1.1e-7 a step change nothing float32 can see; their log_w gets no
// gradient; NaN passes). The state keeps itself as S hi + S lo, e^{c_L} split as wkv7.h splits
// a step's decay: a chunk decay near 1 is carried to the precision of log_w, a small one to
// full relative precision.
//
// Layouts: inputs and y [B, T, H, N] (log_w float32), states [B, H, N, N] float32 row-major
// S[i, j] (i = value index, j = key index); the chunk maps W, U0, Qm, Y0, K_L, B_L
// [B, H, n_chunks, L, N] float32 and cL [B, H, n_chunks, N] (each chunk's c_L); checkpoints
// [B, H, n_chunks, N, N], the state entering each chunk. dims = [T, H].
#ifndef MLX_RWKVX_WKV7_CHUNK_H
#define MLX_RWKVX_WKV7_CHUNK_H

// Steps per chunk, L: a template argument beside N, chosen by measurement among those whose
// threadgroup memory fits (ops/wkv7/kernel.py, chunk_lengths). The maps hold 5 L N + 4 L^2
// floats (their backward 4 L^2 more), the scans (4 L + 2) N: at N = 64, L = 16 24 KiB (28) and
// 17 KiB; at N = 128, L = 8 21 KiB (22) and 17 KiB. Metal gives 32 KiB, CUDA 48 KiB by default;
// every function below asserts the 32 KiB at compile time.
#define WKV7C_MAPS_SHARED(n, l) (5 * (l) * (n) + 4 * (l) * (l))
#define WKV7C_SCAN_SHARED(n, l) ((4 * (l) + 2) * (n))
#define WKV7C_BWD_MAPS_SHARED(n, l) (WKV7C_MAPS_SHARED(n, l) + 4 * (l) * (l))
#define WKV7C_SMEM_BYTES 32768
#define WKV7C_FITS(n, l)                                 \
    (WKV7C_BWD_MAPS_SHARED(n, l) * 4 <= WKV7C_SMEM_BYTES && \
     WKV7C_SCAN_SHARED(n, l) * 4 <= WKV7C_SMEM_BYTES)
#define WKV7C_LOG_W_MIN (-16.0f)

// e^x = hi + lo for x <= 0, split as wkv7.h splits a step's decay: hi is 1 above 1/2, with
// lo = e^x - 1 (by Taylor near 0: remainder < 3e-10 relative), else 0, with lo = e^x. A state
// kept as S hi + S lo + ... keeps a decay near 1 to the precision of x, and a small one to full
// relative precision.
#define WKV7C_LN_HALF (-0.69314718f)
KFN float wkv7c_decay_hi(float x) { return x > WKV7C_LN_HALF ? 1.0f : 0.0f; }

KFN float wkv7c_decay_lo(float x) {
    if (x > -0.1f) {
        const float p = 1.0f / 6 + x * (1.0f / 24 + x * (1.0f / 120 + x * (1.0f / 720 + x / 5040)));
        return x + x * x * (0.5f + x * p);
    }
    return x > WKV7C_LN_HALF ? FEXP(x) - 1.0f : FEXP(x);  // e^x - 1 is exact in [1/2, 1)
}

// The four L x L matrices of a chunk from its r, a, k, b and clamped log-decays (threadgroup
// memory), one thread per entry:
//     A_xy[t, s] = sum_m x[t, m] e^{X_t[m] - c_s[m]} y[s, m],
// X = c_t for r (s <= t), c_{t-1} for a (s < t): exponents <= 0, each taken as the sum over its
// own range of steps (a difference of prefix sums would carry the rounding of a large earlier
// drop). Zero above the diagonal.
template <int N, int L>
KFN void wkv7c_products(
    SMEM const float* sr,
    SMEM const float* sa,
    SMEM const float* sk,
    SMEM const float* sb,
    SMEM const float* sl,
    SMEM float* sA,
    int n) {
    static_assert(WKV7C_FITS(N, L), "chunk too long for 32 KiB of threadgroup memory");
    for (int p = n; p < L * L; p += N) {
        const int t = p / L;
        const int s = p % L;
        float rk = 0.0f, rb = 0.0f, ak = 0.0f, ab = 0.0f;
        if (s <= t) {
            for (int m = 0; m < N; ++m) {
                float gap = 0.0f;  // log-decays of the steps s < u < t, summed over that range
                for (int u = s + 1; u < t; ++u) gap += sl[u * N + m];
                const float rf = sr[t * N + m] * FEXP(s < t ? gap + sl[t * N + m] : 0.0f);
                rk = FMA(rf, sk[s * N + m], rk);
                rb = FMA(rf, sb[s * N + m], rb);
                if (s < t) {
                    const float af = sa[t * N + m] * FEXP(gap);
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
}

// The maps of one chunk (group g = (b * H + h) * n_chunks + chunk), thread n = channel n. Shared:
// r, a, k, b of the chunk, its cumulative log-decays c[u] (the sum of its first u steps, u = 0..L)
// and the four L x L matrices A_rk, A_rb, A_ak, A_ab (ops/wkv7/README.md).
template <typename InT, int N, int L>
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
    GMEM float* cLs,
    int n,
    int g,
    SMEM float* smem) {
    static_assert(WKV7C_FITS(N, L), "chunk too long for 32 KiB of threadgroup memory");
    const int n_chunks = (T + L - 1) / L;
    const int chunk = g % n_chunks;
    const size_t batch = static_cast<size_t>(g / n_chunks / H);
    const size_t head = static_cast<size_t>(g / n_chunks % H);
    SMEM float* sr = smem;
    SMEM float* sa = sr + L * N;
    SMEM float* sk = sa + L * N;
    SMEM float* sb = sk + L * N;
    SMEM float* sl = sb + L * N;  // the clamped log-decays
    SMEM float* sA = sl + L * N;  // A_rk, A_rb, A_ak, A_ab, each L x L
    float vn[L];  // v[., n]: only this thread's column is used
    float c[L + 1];  // this channel's prefix sums from the chunk start: c[u], the first u steps
    c[0] = 0.0f;
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
            x[5] = log_w[at] < WKV7C_LOG_W_MIN ? WKV7C_LOG_W_MIN : log_w[at];  // NaN stays
        }
        sr[t * N + n] = x[0];
        sa[t * N + n] = x[1];
        sk[t * N + n] = x[2];
        sb[t * N + n] = x[3];
        vn[t] = x[4];
        sl[t * N + n] = x[5];
        c[t + 1] = c[t] + x[5];
    }
    BARRIER();
    wkv7c_products<N, L>(sr, sa, sk, sb, sl, sA, n);
    BARRIER();
    SMEM const float* A_rk = sA;
    SMEM const float* A_rb = sA + L * L;
    SMEM const float* A_ak = sA + 2 * L * L;
    SMEM const float* A_ab = sA + 3 * L * L;
    // Column n of each map: z_t = S_{t-1} a_t solves (I - A_ab) Z = A0 S^T + A_ak V, split by
    // linearity in S (Z = W S^T + U0) and solved by forward substitution, row by row.
    const size_t out = static_cast<size_t>(g) * L * N + n;  // chunk g of all (b, h, chunk)
    float zs[L], z0[L], to_end[L];  // to_end[t] = e^{c_L - c_t}, summed over steps t + 1 ..
    float after = 0.0f;
    for (int t = L - 1; t >= 0; --t) {
        to_end[t] = FEXP(after);
        after += sl[t * N + n];
    }
    for (int t = 0; t < L; ++t) {
        float w_t = sa[t * N + n] * FEXP(c[t]);  // A0 = a_t e^{c_{t-1}}
        float u_t = 0.0f;
        for (int s = 0; s < t; ++s) u_t = FMA(A_ak[t * L + s], vn[s], u_t);
        for (int s = 0; s < t; ++s) {
            w_t = FMA(A_ab[t * L + s], zs[s], w_t);
            u_t = FMA(A_ab[t * L + s], z0[s], u_t);
        }
        zs[t] = w_t;
        z0[t] = u_t;
        float q_t = sr[t * N + n] * FEXP(c[t + 1]);  // R0 = r_t e^{c_t}
        float y_t = 0.0f;
        for (int s = 0; s <= t; ++s) {
            q_t = FMA(A_rb[t * L + s], zs[s], q_t);
            y_t = FMA(A_rk[t * L + s], vn[s], FMA(A_rb[t * L + s], z0[s], y_t));
        }
        const size_t at = out + static_cast<size_t>(t) * N;
        W[at] = w_t;
        U0[at] = u_t;
        Qm[at] = q_t;
        Y0[at] = y_t;
        KL[at] = sk[t * N + n] * to_end[t];
        BL[at] = sb[t * N + n] * to_end[t];
    }
    cLs[static_cast<size_t>(g) * N + n] = c[L];
}

// The state through the chunks (group g = b * H + h), thread i = row i of S in registers: per
// chunk z_t[i] and y_t[i] from the maps, then the row's update. No barrier inside a chunk: the
// chunk's W, Qm, K_L, B_L and the decay's hi, lo (indexed by the key j) come through
// threadgroup memory.
template <typename InT, int N, int L>
KFN void wkv7c_scan(
    GMEM const InT* v,
    GMEM const float* state,
    GMEM const float* W,
    GMEM const float* U0,
    GMEM const float* Qm,
    GMEM const float* Y0,
    GMEM const float* KL,
    GMEM const float* BL,
    GMEM const float* cLs,
    int T,
    int H,
    GMEM InT* y,
    GMEM float* state_out,
    GMEM float* ckpt,
    GMEM float* Z,
    int i,
    int g,
    SMEM float* smem) {
    static_assert(WKV7C_FITS(N, L), "chunk too long for 32 KiB of threadgroup memory");
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
        const float chunk_decay = cLs[(static_cast<size_t>(g) * n_chunks + chunk) * N + i];
        sd[i] = wkv7c_decay_hi(chunk_decay);
        sd[N + i] = wkv7c_decay_lo(chunk_decay);
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
            Z[at] = zt;
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
            S[j] = FMA(S[j], sd[j], FMA(S[j], sd[N + j], update));  // S e^{c_L} as S hi + S lo
        }
        BARRIER();  // the next chunk's maps overwrite threadgroup memory
    }
    for (int j = 0; j < N; ++j) state_out[row + j] = S[j];
}

// Backward, first part: the reverse scan through the chunks (group g = b * H + h). Thread k
// holds row k and column k of dS (the cotangent of the state leaving the chunk at hand) and
// reads row k and column k of the chunk's entering state from its checkpoint: every sum over
// the value index (column sums) and over the key index (row sums) is then thread-local, with
// the chunk's vectors through threadgroup memory. From S' = S diag(g) + V^T K_L + Z^T B_L,
// z_t = U0_t + S W_t, y_t = Y0_t + S Qm_t:
//     dz_t = dS' B_L,t   dv_t += dS' K_L,t   dB_L,t = dS'^T z_t   dK_L,t = dS'^T v_t
//     dg = colsum(dS' * S)   dQm_t = S^T dy_t   dW_t = S^T dz_t        (g = e^{c_L})
//     dS = dS' diag(g) + sum_t dy_t Qm_t^T + dz_t W_t^T
// Outputs [B, H, n_chunks, L, N]: dW, dQm, dZ (= dU0), dKL, dBL, dv0 (the direct share of dv);
// ddecay (dg) [B, H, n_chunks, N]; dstate0, the initial state's cotangent.
template <typename InT, int N, int L>
KFN void wkv7c_bwd_scan(
    GMEM const InT* dy,
    GMEM const InT* v,
    GMEM const float* dstate,
    GMEM const float* ckpt,
    GMEM const float* Z,
    GMEM const float* W,
    GMEM const float* Qm,
    GMEM const float* KL,
    GMEM const float* BL,
    GMEM const float* cLs,
    int T,
    int H,
    GMEM float* dW,
    GMEM float* dQm,
    GMEM float* dZ,
    GMEM float* dKL,
    GMEM float* dBL,
    GMEM float* ddecay,
    GMEM float* dv0,
    GMEM float* dstate0,
    int k,
    int g,
    SMEM float* smem) {
    static_assert(WKV7C_FITS(N, L), "chunk too long for 32 KiB of threadgroup memory");
    const int n_chunks = (T + L - 1) / L;
    const size_t batch = static_cast<size_t>(g / H);
    const size_t head = static_cast<size_t>(g % H);
    const size_t mat = static_cast<size_t>(g) * N * N;
    SMEM float* s1 = smem;
    SMEM float* s2 = s1 + L * N;
    SMEM float* s3 = s2 + L * N;
    SMEM float* s4 = s3 + L * N;
    SMEM float* sd = s4 + L * N;
    float dSr[N], dSc[N];  // dS[k, j] and dS[i, k]
    for (int j = 0; j < N; ++j) {
        dSr[j] = dstate[mat + static_cast<size_t>(k) * N + j];
        dSc[j] = dstate[mat + static_cast<size_t>(j) * N + k];
    }
    for (int chunk = n_chunks - 1; chunk >= 0; --chunk) {
        const size_t maps = (static_cast<size_t>(g) * n_chunks + chunk) * L * N;
        GMEM const float* ck = ckpt + (static_cast<size_t>(g) * n_chunks + chunk) * N * N;
        float Sc[N];  // S[i, k] of the entering state
        for (int i = 0; i < N; ++i) Sc[i] = ck[static_cast<size_t>(i) * N + k];
        float vk[L], dyk[L], dz[L];
        for (int t = 0; t < L; ++t) {
            const int step = chunk * L + t;
            const size_t at = maps + static_cast<size_t>(t) * N + k;
            vk[t] = 0.0f;
            dyk[t] = 0.0f;
            if (step < T) {
                const size_t seq = ((batch * T + step) * H + head) * N + k;
                vk[t] = TO_F32(v[seq]);
                dyk[t] = TO_F32(dy[seq]);
            }
            s1[t * N + k] = BL[at];
            s2[t * N + k] = KL[at];
            s3[t * N + k] = Z[at];
            s4[t * N + k] = vk[t];
        }
        const float chunk_decay = cLs[(static_cast<size_t>(g) * n_chunks + chunk) * N + k];
        sd[k] = wkv7c_decay_hi(chunk_decay);
        sd[N + k] = wkv7c_decay_lo(chunk_decay);
        BARRIER();
        float dd = 0.0f;
        for (int i = 0; i < N; ++i) dd = FMA(dSc[i], Sc[i], dd);
        ddecay[(static_cast<size_t>(g) * n_chunks + chunk) * N + k] = dd;
        for (int t = 0; t < L; ++t) {
            const size_t at = maps + static_cast<size_t>(t) * N + k;
            float dzt = 0.0f, dvt = 0.0f, dbt = 0.0f, dkt = 0.0f;
            for (int j = 0; j < N; ++j) {
                dzt = FMA(dSr[j], s1[t * N + j], dzt);
                dvt = FMA(dSr[j], s2[t * N + j], dvt);
                dbt = FMA(dSc[j], s3[t * N + j], dbt);
                dkt = FMA(dSc[j], s4[t * N + j], dkt);
            }
            dz[t] = dzt;
            dZ[at] = dzt;
            dv0[at] = dvt;
            dBL[at] = dbt;
            dKL[at] = dkt;
        }
        BARRIER();
        for (int t = 0; t < L; ++t) {
            const size_t at = maps + static_cast<size_t>(t) * N + k;
            s1[t * N + k] = Qm[at];
            s2[t * N + k] = W[at];
            s3[t * N + k] = dyk[t];
            s4[t * N + k] = dz[t];
        }
        BARRIER();
        for (int t = 0; t < L; ++t) {
            const size_t at = maps + static_cast<size_t>(t) * N + k;
            float dq = 0.0f, dw = 0.0f;
            for (int i = 0; i < N; ++i) {
                dq = FMA(s3[t * N + i], Sc[i], dq);
                dw = FMA(s4[t * N + i], Sc[i], dw);
            }
            dQm[at] = dq;
            dW[at] = dw;
        }
        for (int j = 0; j < N; ++j) {  // row k
            float acc = 0.0f;
            for (int t = 0; t < L; ++t) {
                acc = FMA(dyk[t], s1[t * N + j], FMA(dz[t], s2[t * N + j], acc));
            }
            dSr[j] = FMA(dSr[j], sd[j], FMA(dSr[j], sd[N + j], acc));
        }
        for (int i = 0; i < N; ++i) {  // column k
            float acc = 0.0f;
            for (int t = 0; t < L; ++t) {
                acc = FMA(s3[t * N + i], s1[t * N + k], FMA(s4[t * N + i], s2[t * N + k], acc));
            }
            dSc[i] = FMA(dSc[i], sd[k], FMA(dSc[i], sd[N + k], acc));
        }
        BARRIER();  // the next chunk overwrites threadgroup memory
    }
    for (int j = 0; j < N; ++j) dstate0[mat + static_cast<size_t>(k) * N + j] = dSr[j];
}

// Backward, second part: each chunk's maps back to its inputs (group g = (b * H + h) *
// n_chunks + chunk, thread n = channel n), from the cotangents of the first part. In order:
// Y0 and Qm give dA_rk, dA_rb and add A_rb^T dy, A_rb^T dQm to the cotangents of U0 and W;
// U0 = M A_ak V and W = M A0 (M = (I - A_ab)^-1) give lambda = M^T dU0, mu = M^T dW by back
// substitution, then dA_ak, dA_ab and dv; the four A's give dr, dk, da, db and, through their
// exponentials, d log_w: each factor e^{c_e - c_s} gives its share to the steps of its range
// (zero where log_w was clamped).
template <typename InT, int N, int L>
KFN void wkv7c_bwd_maps(
    GMEM const InT* r,
    GMEM const float* log_w,
    GMEM const InT* k,
    GMEM const InT* v,
    GMEM const InT* a,
    GMEM const InT* b,
    GMEM const InT* dy,
    GMEM const float* W,
    GMEM const float* U0,
    GMEM const float* dW,
    GMEM const float* dQm,
    GMEM const float* dZ,
    GMEM const float* dKL,
    GMEM const float* dBL,
    GMEM const float* ddecay,
    GMEM const float* dv0,
    int T,
    int H,
    GMEM InT* dr,
    GMEM float* dlog_w,
    GMEM InT* dk,
    GMEM InT* dv,
    GMEM InT* da,
    GMEM InT* db,
    int n,
    int g,
    SMEM float* smem) {
    static_assert(WKV7C_FITS(N, L), "chunk too long for 32 KiB of threadgroup memory");
    const int n_chunks = (T + L - 1) / L;
    const int chunk = g % n_chunks;
    const size_t batch = static_cast<size_t>(g / n_chunks / H);
    const size_t head = static_cast<size_t>(g / n_chunks % H);
    const size_t col = static_cast<size_t>(g) * L * N + n;  // column n of this chunk's maps
    SMEM float* sr = smem;
    SMEM float* sa = sr + L * N;
    SMEM float* sk = sa + L * N;
    SMEM float* sb = sk + L * N;
    SMEM float* sl = sb + L * N;  // the clamped log-decays
    SMEM float* sA = sl + L * N;  // A_rk, A_rb, A_ak, A_ab
    SMEM float* sG = sA + 4 * L * L;  // their cotangents
    // This thread's column of everything (channel n).
    float rc[L], ac[L], kc[L], bc[L], vc[L], lw[L], cc[L + 1], lw_raw[L];
    float gY[L], gQ[L], gW[L], gU[L], gK[L], gB[L], Wc[L], Uc[L], dvc[L];
    cc[0] = 0.0f;
    for (int t = 0; t < L; ++t) {
        const int step = chunk * L + t;
        const size_t at = col + static_cast<size_t>(t) * N;
        float x[7] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (step < T) {
            const size_t seq = ((batch * T + step) * H + head) * N + n;
            x[0] = TO_F32(r[seq]);
            x[1] = TO_F32(a[seq]);
            x[2] = TO_F32(k[seq]);
            x[3] = TO_F32(b[seq]);
            x[4] = TO_F32(v[seq]);
            x[5] = log_w[seq];
            x[6] = TO_F32(dy[seq]);
        }
        rc[t] = x[0];
        ac[t] = x[1];
        kc[t] = x[2];
        bc[t] = x[3];
        vc[t] = x[4];
        lw_raw[t] = x[5];
        gY[t] = x[6];
        lw[t] = x[5] < WKV7C_LOG_W_MIN ? WKV7C_LOG_W_MIN : x[5];
        cc[t + 1] = cc[t] + lw[t];
        sr[t * N + n] = rc[t];
        sa[t * N + n] = ac[t];
        sk[t * N + n] = kc[t];
        sb[t * N + n] = bc[t];
        sl[t * N + n] = lw[t];
        gQ[t] = dQm[at];
        gW[t] = dW[at];
        gU[t] = dZ[at];
        gK[t] = dKL[at];
        gB[t] = dBL[at];
        Wc[t] = W[at];
        Uc[t] = U0[at];
        dvc[t] = dv0[at];
    }
    BARRIER();
    wkv7c_products<N, L>(sr, sa, sk, sb, sl, sA, n);  // the A's again, as the forward made them
    BARRIER();
    SMEM const float* A_rk = sA;
    SMEM const float* A_rb = sA + L * L;
    SMEM const float* A_ak = sA + 2 * L * L;
    SMEM const float* A_ab = sA + 3 * L * L;
    float lam[L], mu[L];
    for (int s = L - 1; s >= 0; --s) {
        float u = gU[s], w = gW[s], dvs = dvc[s];
        for (int t = s; t < L; ++t) {
            u = FMA(A_rb[t * L + s], gY[t], u);
            w = FMA(A_rb[t * L + s], gQ[t], w);
            dvs = FMA(A_rk[t * L + s], gY[t], dvs);
        }
        for (int t = s + 1; t < L; ++t) {
            u = FMA(A_ab[t * L + s], lam[t], u);
            w = FMA(A_ab[t * L + s], mu[t], w);
            dvs = FMA(A_ak[t * L + s], lam[t], dvs);
        }
        lam[s] = u;
        mu[s] = w;
        dvc[s] = dvs;
    }
    BARRIER();  // the inputs' threadgroup copies are done with: the cotangents take their place
    SMEM float* q1 = smem;  // query side: dy then lambda
    SMEM float* q2 = q1 + L * N;  // dQm then mu
    SMEM float* kv = q2 + L * N;  // key side: v, U0, W
    SMEM float* kU = kv + L * N;
    SMEM float* kW = kU + L * N;
    for (int t = 0; t < L; ++t) {
        q1[t * N + n] = gY[t];
        q2[t * N + n] = gQ[t];
        kv[t * N + n] = vc[t];
        kU[t * N + n] = Uc[t];
        kW[t * N + n] = Wc[t];
    }
    BARRIER();
    for (int p = n; p < L * L; p += N) {
        const int t = p / L;
        const int s = p % L;
        float grk = 0.0f, grb = 0.0f;
        if (s <= t) {
            for (int m = 0; m < N; ++m) {
                grk = FMA(q1[t * N + m], kv[s * N + m], grk);
                grb = FMA(q1[t * N + m], kU[s * N + m], FMA(q2[t * N + m], kW[s * N + m], grb));
            }
        }
        sG[p] = grk;
        sG[L * L + p] = grb;
    }
    BARRIER();
    for (int t = 0; t < L; ++t) {
        q1[t * N + n] = lam[t];
        q2[t * N + n] = mu[t];
    }
    BARRIER();
    for (int p = n; p < L * L; p += N) {
        const int t = p / L;
        const int s = p % L;
        float gak = 0.0f, gab = 0.0f;
        if (s < t) {
            for (int m = 0; m < N; ++m) {
                gak = FMA(q1[t * N + m], kv[s * N + m], gak);
                gab = FMA(q1[t * N + m], kU[s * N + m], FMA(q2[t * N + m], kW[s * N + m], gab));
            }
        }
        sG[2 * L * L + p] = gak;
        sG[3 * L * L + p] = gab;
    }
    BARRIER();
    SMEM const float* G_rk = sG;
    SMEM const float* G_rb = sG + L * L;
    SMEM const float* G_ak = sG + 2 * L * L;
    SMEM const float* G_ab = sG + 3 * L * L;
    // Channel n, through the A's: A_xy[t, s] = sum_m x_t e^{X_t - c_s} y_s.
    float drc[L], dac[L], dkc[L], dbc[L];
    for (int t = 0; t < L; ++t) {
        drc[t] = 0.0f;
        dac[t] = 0.0f;
        dkc[t] = 0.0f;
        dbc[t] = 0.0f;
    }
    for (int s = 0; s < L; ++s) {
        float gap = 0.0f;  // log-decays of the steps s < u < t, summed over that range
        for (int t = s; t < L; ++t) {
            const float fr = FEXP(t > s ? gap + lw[t] : 0.0f);
            const float gr = G_rk[t * L + s] * kc[s] + G_rb[t * L + s] * bc[s];
            drc[t] = FMA(gr, fr, drc[t]);
            dkc[s] = FMA(G_rk[t * L + s] * rc[t], fr, dkc[s]);
            dbc[s] = FMA(G_rb[t * L + s] * rc[t], fr, dbc[s]);
            if (s < t) {
                const float fa = FEXP(gap);
                const float ga = G_ak[t * L + s] * kc[s] + G_ab[t * L + s] * bc[s];
                dac[t] = FMA(ga, fa, dac[t]);
                dkc[s] = FMA(G_ak[t * L + s] * ac[t], fa, dkc[s]);
                dbc[s] = FMA(G_ab[t * L + s] * ac[t], fa, dbc[s]);
                gap += lw[t];
            }
        }
    }
    float to_end[L];  // e^{c_L - c_t}, summed over steps t + 1 .. L - 1
    float after = 0.0f;
    for (int t = L - 1; t >= 0; --t) {
        to_end[t] = FEXP(after);
        after += lw[t];
    }
    // The direct ones: R0 = r e^{c_t}, A0 = a e^{c_{t-1}}, K_L, B_L = (k, b) e^{c_L - c_t}.
    for (int t = 0; t < L; ++t) {
        drc[t] = FMA(gQ[t], FEXP(cc[t + 1]), drc[t]);
        dac[t] = FMA(mu[t], FEXP(cc[t]), dac[t]);
        dkc[t] = FMA(gK[t], to_end[t], dkc[t]);
        dbc[t] = FMA(gB[t], to_end[t], dbc[t]);
    }
    // d log_w_u: every factor e^{c_e - c_s} (the sum of log_w over the steps s < u <= e) gives
    // d(factor) * factor to each step of its range. Summed over the factors whose range holds u,
    // each of which has w_u in its product: no term cancels another, so a tiny decay's gradient
    // keeps its relative precision (a sum of +-x over the ends of every range would not).
    float suffix_r0 = 0.0f, suffix_a0 = 0.0f;  // R0 and A0 terms of the steps after u
    float prefix_ends[L + 1];  // K_L, B_L terms of the steps before u
    prefix_ends[0] = 0.0f;
    for (int t = 0; t < L; ++t) {
        const float ends = (gK[t] * kc[t] + gB[t] * bc[t]) * to_end[t];
        prefix_ends[t + 1] = prefix_ends[t] + ends;
    }
    const float decay_term = ddecay[static_cast<size_t>(g) * N + n] * FEXP(cc[L]);
    for (int u = L - 1; u >= 0; --u) {
        suffix_r0 = FMA(gQ[u] * rc[u], FEXP(cc[u + 1]), suffix_r0);  // R0_t, t >= u
        if (u + 1 < L) suffix_a0 = FMA(mu[u + 1] * ac[u + 1], FEXP(cc[u + 1]), suffix_a0);
        float pairs = 0.0f;  // r-kind: ranges (s, t]; a-kind: (s, t - 1]
        for (int s = 0; s < u; ++s) {
            const float ks = kc[s], bs = bc[s];
            float range = 0.0f;  // log-decays of the steps s < v <= t, t from u on
            for (int v = s + 1; v < u; ++v) range += lw[v];
            for (int t = u; t < L; ++t) {
                range += lw[t];
                const float f = FEXP(range);
                const float gr = G_rk[t * L + s] * ks + G_rb[t * L + s] * bs;
                pairs = FMA(gr * rc[t], f, pairs);
                if (t + 1 < L) {
                    const float ga = G_ak[(t + 1) * L + s] * ks + G_ab[(t + 1) * L + s] * bs;
                    pairs = FMA(ga * ac[t + 1], f, pairs);
                }
            }
        }
        // K_L, B_L of step t cover steps t + 1 .. L - 1: those before u
        const float dlw = pairs + suffix_r0 + suffix_a0 + prefix_ends[u] + decay_term;
        const int step = chunk * L + u;
        if (step < T) {
            const size_t seq = ((batch * T + step) * H + head) * N + n;
            dr[seq] = FROM_F32(InT, drc[u]);
            dlog_w[seq] = lw_raw[u] < WKV7C_LOG_W_MIN ? 0.0f : dlw;
            dk[seq] = FROM_F32(InT, dkc[u]);
            dv[seq] = FROM_F32(InT, dvc[u]);
            da[seq] = FROM_F32(InT, dac[u]);
            db[seq] = FROM_F32(InT, dbc[u]);
        }
    }
}

#endif
