// WKV7, the RWKV-7 recurrence, forward and backward: written once over the vocabulary of
// prelude_{metal,cuda,cpu}.h; the entries wkv7_fwd.h and wkv7_bwd.h call these functions.
// Per (batch, head), with S[i, j] (i = value index, j = key index) and w = exp(log_w):
//     sa = S a;  S = S diag(w) + v k^T + sa b^T;  y = S r
// The backward equations are those of tests/oracle/wkv7.py (wkv7_bwd_np).
//
// Layouts: inputs and y [B, T, H, N] (log_w float32); states [B, H, N, N] float32, row-major
// S[i, j]; checkpoints [B, H, ceil(T / WKV7_SEG), N, N], the state entering each segment of
// WKV7_SEG steps (so checkpoint 0 is the initial state); sa [B, T, H, N] float32, S_{t-1} a_t.
// One threadgroup of N threads per (b, h), group index g = b * H + h.
#ifndef MLX_RWKVX_WKV7_H
#define MLX_RWKVX_WKV7_H

#define WKV7_SEG 16
// Threadgroup floats: two buffers (even and odd steps) so that one barrier per step suffices.
#define WKV7_FWD_SHARED(n) (2 * 6 * (n))
#define WKV7_BWD_SHARED(n) (2 * 10 * (n))

// The decay w = exp(log_w) as hi + lo with hi in {0, 1}, and updates as S hi + S lo (exact when
// hi is 0 or 1). Near 1, where long memory lives, lo = w - 1 carries w to |w - 1| * 6e-8 instead
// of float32's 6e-8, which T steps would compound (w = 0.9999, T = 1000: ~1.7e-5 of the initial
// state); below 1/2, lo = w keeps small decays to full relative precision.
#define WKV7_LN_HALF (-0.69314718f)
KFN float wkv7_decay_hi(float log_w) { return log_w > WKV7_LN_HALF ? 1.0f : 0.0f; }

KFN float wkv7_decay_lo(float log_w) {
    const float x = log_w;
    if (x > -0.1f) {  // exp(x) - 1 by Taylor: remainder < 3e-10 relative
        const float p = 1.0f / 6 + x * (1.0f / 24 + x * (1.0f / 120 + x * (1.0f / 720 + x / 5040)));
        return x + x * x * (0.5f + x * p);
    }
    return x > WKV7_LN_HALF ? FEXP(x) - 1.0f : FEXP(x);  // exp(x) - 1 is exact in [1/2, 1)
}

// Forward. Thread i holds row i of S in registers: sa_i, the update of row i and y_i are all
// thread-local; only the step's r, w, k, a, b (indexed by key j) are shared.
template <typename InT, int N>
KFN void wkv7_forward(
    GMEM const InT* r,
    GMEM const float* log_w,
    GMEM const InT* k,
    GMEM const InT* v,
    GMEM const InT* a,
    GMEM const InT* b,
    GMEM const float* state,
    int T,
    int H,
    GMEM InT* y,
    GMEM float* state_out,
    GMEM float* ckpt,
    GMEM float* sa_out,
    int i,
    int g,
    SMEM float* smem) {
    const size_t batch = static_cast<size_t>(g / H);
    const size_t head = static_cast<size_t>(g % H);
    const size_t n_seg = static_cast<size_t>((T + WKV7_SEG - 1) / WKV7_SEG);
    const size_t row = static_cast<size_t>(g) * N * N + static_cast<size_t>(i) * N;
    float S[N];
    for (int j = 0; j < N; ++j) S[j] = state[row + j];
    for (int t = 0; t < T; ++t) {
        if (t % WKV7_SEG == 0) {
            // Each thread writes its own row, contiguous per thread though strided across the
            // group; the backward, which reads these most, reads them coalesced.
            GMEM float* c = ckpt + (static_cast<size_t>(g) * n_seg + t / WKV7_SEG) * N * N;
            for (int j = 0; j < N; ++j) c[static_cast<size_t>(i) * N + j] = S[j];
        }
        const size_t at = ((batch * T + t) * H + head) * N + i;
        SMEM float* sh = smem + (t & 1) * 6 * N;
        SMEM float* sr = sh;
        SMEM float* s_hi = sh + N;
        SMEM float* s_lo = sh + 2 * N;
        SMEM float* sk = sh + 3 * N;
        SMEM float* s_a = sh + 4 * N;
        SMEM float* sb = sh + 5 * N;
        sr[i] = TO_F32(r[at]);
        s_hi[i] = wkv7_decay_hi(log_w[at]);
        s_lo[i] = wkv7_decay_lo(log_w[at]);
        sk[i] = TO_F32(k[at]);
        s_a[i] = TO_F32(a[at]);
        sb[i] = TO_F32(b[at]);
        const float vi = TO_F32(v[at]);
        BARRIER();
        float sa = 0.0f;
        for (int j = 0; j < N; ++j) sa = FMA(S[j], s_a[j], sa);
        float yi = 0.0f;
        for (int j = 0; j < N; ++j) {
            S[j] = FMA(S[j], s_hi[j], FMA(S[j], s_lo[j], FMA(vi, sk[j], sa * sb[j])));
            yi = FMA(S[j], sr[j], yi);
        }
        y[at] = FROM_F32(InT, yi);
        sa_out[at] = sa;
    }
    for (int j = 0; j < N; ++j) state_out[row + j] = S[j];
}

// Backward. Thread j holds column j of S and of dS, and row j of dS: the column sums over the
// value index i (dr, dk, db, dlog_w, da) and the row sums (dv_j, (dS b)_j) are then all
// thread-local, and only dS b crosses threads (one vector through shared memory per step). Per
// segment, the states are recomputed from the checkpoint (column-wise, from the saved sa: no
// reduction) into `scratch` [B * H, WKV7_SEG, N, N], then the reverse steps read them back.
// Nothing is divided by w (as BlinkDL's kernel does to step back), so tiny decays lose nothing.
template <typename InT, int N>
KFN void wkv7_backward(
    GMEM const InT* r,
    GMEM const float* log_w,
    GMEM const InT* k,
    GMEM const InT* v,
    GMEM const InT* a,
    GMEM const InT* b,
    GMEM const InT* dy,
    GMEM const float* dstate,
    GMEM const float* ckpt,
    GMEM const float* sa_in,
    int T,
    int H,
    GMEM InT* dr,
    GMEM float* dlog_w,
    GMEM InT* dk,
    GMEM InT* dv,
    GMEM InT* da,
    GMEM InT* db,
    GMEM float* dstate0,
    GMEM float* scratch,
    int j,
    int g,
    SMEM float* smem) {
    const size_t batch = static_cast<size_t>(g / H);
    const size_t head = static_cast<size_t>(g % H);
    const int n_seg = (T + WKV7_SEG - 1) / WKV7_SEG;
    const size_t mat = static_cast<size_t>(g) * N * N;
    GMEM float* scr = scratch + static_cast<size_t>(g) * WKV7_SEG * N * N + j;
    float S[N];    // S[i] = S_t[i, j]
    float dSc[N];  // dSc[i] = dS[i, j]
    float dSr[N];  // dSr[l] = dS[j, l]
    for (int i = 0; i < N; ++i) dSc[i] = dstate[mat + static_cast<size_t>(i) * N + j];
    for (int l = 0; l < N; ++l) dSr[l] = dstate[mat + static_cast<size_t>(j) * N + l];
    int stage = 0;  // counts shared-buffer uses: buffer stage & 1
    for (int seg = n_seg - 1; seg >= 0; --seg) {
        const int t0 = seg * WKV7_SEG;
        const int t1 = t0 + WKV7_SEG < T ? t0 + WKV7_SEG : T;
        GMEM const float* c = ckpt + (static_cast<size_t>(g) * n_seg + seg) * N * N + j;
        for (int i = 0; i < N; ++i) S[i] = c[static_cast<size_t>(i) * N];
        // Recompute: slot t - t0 of scratch holds S_t, the state after step t. The last one stays
        // in registers.
        for (int t = t0; t < t1; ++t) {
            const size_t at = ((batch * T + t) * H + head) * N + j;
            SMEM float* sv = smem + (stage & 1) * 10 * N + 3 * N;
            SMEM float* ssa = smem + (stage & 1) * 10 * N + 8 * N;
            sv[j] = TO_F32(v[at]);
            ssa[j] = sa_in[at];
            const float hij = wkv7_decay_hi(log_w[at]);
            const float loj = wkv7_decay_lo(log_w[at]);
            const float kj = TO_F32(k[at]);
            const float bj = TO_F32(b[at]);
            BARRIER();
            ++stage;
            for (int i = 0; i < N; ++i) {
                S[i] = FMA(S[i], hij, FMA(S[i], loj, FMA(sv[i], kj, ssa[i] * bj)));
            }
            if (t + 1 < t1) {
                GMEM float* slot = scr + static_cast<size_t>(t - t0) * N * N;
                for (int i = 0; i < N; ++i) slot[static_cast<size_t>(i) * N] = S[i];
            }
        }
        for (int t = t1 - 1; t >= t0; --t) {
            const size_t at = ((batch * T + t) * H + head) * N + j;
            SMEM float* sh = smem + (stage & 1) * 10 * N;
            SMEM float* s_dy = sh;
            SMEM float* sr = sh + N;
            SMEM float* sk = sh + 2 * N;
            SMEM float* sv = sh + 3 * N;
            SMEM float* s_a = sh + 4 * N;
            SMEM float* sb = sh + 5 * N;
            SMEM float* s_hi = sh + 6 * N;
            SMEM float* s_lo = sh + 7 * N;
            SMEM float* ssa = sh + 8 * N;
            SMEM float* s_dsb = sh + 9 * N;
            const float dyj = TO_F32(dy[at]);
            const float rj = TO_F32(r[at]);
            const float aj = TO_F32(a[at]);
            const float hij = wkv7_decay_hi(log_w[at]);
            const float loj = wkv7_decay_lo(log_w[at]);
            s_dy[j] = dyj;
            sr[j] = rj;
            sk[j] = TO_F32(k[at]);
            sv[j] = TO_F32(v[at]);
            s_a[j] = aj;
            sb[j] = TO_F32(b[at]);
            s_hi[j] = hij;
            s_lo[j] = loj;
            ssa[j] = sa_in[at];
            BARRIER();
            ++stage;
            float drj = 0.0f;  // y_t = S_t r_t
            for (int i = 0; i < N; ++i) drj += S[i] * s_dy[i];
            // S becomes S_{t-1}, the state before step t
            GMEM const float* prev = t > t0 ? scr + static_cast<size_t>(t - 1 - t0) * N * N : c;
            for (int i = 0; i < N; ++i) S[i] = prev[static_cast<size_t>(i) * N];
            float dkj = 0.0f, dbj = 0.0f, dwj = 0.0f;
            for (int i = 0; i < N; ++i) {
                dSc[i] += s_dy[i] * rj;
                dkj += dSc[i] * sv[i];
                dbj += dSc[i] * ssa[i];
                dwj += S[i] * dSc[i];
            }
            float dvj = 0.0f, dsbj = 0.0f;
            for (int l = 0; l < N; ++l) {
                dSr[l] += dyj * sr[l];
                dvj += dSr[l] * sk[l];
                dsbj += dSr[l] * sb[l];
            }
            s_dsb[j] = dsbj;
            BARRIER();
            float daj = 0.0f;  // (S_{t-1}^T dS_t b)_j
            for (int i = 0; i < N; ++i) {
                daj += S[i] * s_dsb[i];
                // dS_{t-1} = dS_t D_t^T = dS_t diag(w) + (dS_t b) a^T
                dSc[i] = FMA(dSc[i], hij, FMA(dSc[i], loj, s_dsb[i] * aj));
            }
            for (int l = 0; l < N; ++l) {
                dSr[l] = FMA(dSr[l], s_hi[l], FMA(dSr[l], s_lo[l], dsbj * s_a[l]));
            }
            dr[at] = FROM_F32(InT, drj);
            dlog_w[at] = dwj * (hij + loj);
            dk[at] = FROM_F32(InT, dkj);
            dv[at] = FROM_F32(InT, dvj);
            da[at] = FROM_F32(InT, daj);
            db[at] = FROM_F32(InT, dbj);
        }
    }
    for (int i = 0; i < N; ++i) dstate0[mat + static_cast<size_t>(i) * N + j] = dSc[i];
}

#endif
