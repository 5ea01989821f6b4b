// MoBA's selected-chunk attention, forward and backward: written once over the vocabulary of
// prelude_{metal,cuda,cpu}.h; the entries moba_fwd.h, moba_bwd_dq.h and moba_bwd_dkv.h call these
// functions. The equations are those of tests/oracle/attention.py restricted to the slots below.
//
// Layouts: q, out, dout [B, T, Hq, N]; k, v, dk, dv [B, Tk, Hkv, N] with Tk >= T (the queries
// are the last T positions; query head h reads kv head h / (Hq / Hkv)). A query row is
// r = (b * T + t) * Hq + h. chunk, limit [R, S] int32: slot s of row r reads the keys
// chunk * cs + j for 0 <= j <= limit (a negative limit: an empty slot); causality is in the slots.
// lse, delta [R] float32. Scores are scale <q, k>; the softmax spans all slots of a row; every
// sum is float32. lse = log sum exp(score) over the row's keys, so p = exp(score - lse).
//
// Forward and dq: one threadgroup of N threads per query row; thread j scores key j of each tile
// of N keys (a dot product over its own key row), thread i accumulates output dimension i.
// dk, dv: a key is read by every (row, slot) that selected its chunk, so those rows are gathered
// per chunk (an inverse index built outside: `pairs`, the slots r * S + s sorted by chunk, and
// `offsets`, each chunk's range of them) and one threadgroup per (b, kv head, chunk, tile of N
// keys) sums over them, thread j owning key j: every gradient row has one writer. No atomics:
// Metal would need atomic types for every output, and sums would change order from run to run.
#ifndef MLX_RWKVX_MOBA_H
#define MLX_RWKVX_MOBA_H

// Below any real score: the running max before the first key (exp of it minus a score is 0).
#define MOBA_NO_SCORE (-3.0e38f)
// Query rows the dk/dv kernel stages per barrier.
#define MOBA_PAIRS 8
// Threadgroup memory, in floats (and ints for the dk/dv kernel's limits).
#define MOBA_FWD_SHARED(n) (3 * (n))
#define MOBA_DQ_SHARED(n) (5 * (n))
#define MOBA_DKV_BUF(n) (2 * MOBA_PAIRS * (n) + 2 * MOBA_PAIRS)
#define MOBA_DKV_SHARED(n) (2 * MOBA_DKV_BUF(n))
#define MOBA_DKV_INT_SHARED (2 * MOBA_PAIRS)

template <typename InT, int N>
KFN float moba_dot(GMEM const InT* x, SMEM const float* y) {
    float acc = 0.0f;
    for (int d = 0; d < N; ++d) acc = FMA(TO_F32(x[d]), y[d], acc);
    return acc;
}

// Number of keys slot (chunk, lim) reads: lim + 1, clipped at the sequence end.
KFN int moba_slot_keys(int chunk, int lim, int Tk, int cs) {
    const int n = lim + 1;
    const int left = Tk - chunk * cs;
    return n < left ? n : left;
}

// Forward, one query row per threadgroup: online softmax over tiles of N keys. Thread j scores
// key j of the tile; after the tile max, thread j's probability goes through shared memory and
// thread i accumulates out_i. The shared score and probability vectors alternate, so two
// barriers per tile need no double buffer.
template <typename InT, int N>
KFN void moba_forward(
    GMEM const InT* q,
    GMEM const InT* k,
    GMEM const InT* v,
    GMEM const int* chunk,
    GMEM const int* limit,
    float scale,
    int T,
    int Tk,
    int Hq,
    int Hkv,
    int S,
    int cs,
    GMEM InT* out,
    GMEM float* lse,
    int i,
    int r,
    SMEM float* smem) {
    const size_t b = static_cast<size_t>(r / (T * Hq));
    const size_t kv_head = static_cast<size_t>((r % Hq) / (Hq / Hkv));
    GMEM const InT* k0 = k + (b * Tk * Hkv + kv_head) * N;  // key tk: k0 + tk * Hkv * N
    GMEM const InT* v0 = v + (b * Tk * Hkv + kv_head) * N;
    const size_t kv_step = static_cast<size_t>(Hkv) * N;
    SMEM float* sq = smem;
    SMEM float* ssc = smem + N;
    SMEM float* sp = smem + 2 * N;
    sq[i] = TO_F32(q[static_cast<size_t>(r) * N + i]) * scale;
    BARRIER();
    float m = MOBA_NO_SCORE, l = 0.0f, acc = 0.0f;
    for (int s = 0; s < S; ++s) {
        const int lim = limit[static_cast<size_t>(r) * S + s];
        if (lim < 0) continue;  // the same for every thread of the group
        const int c = chunk[static_cast<size_t>(r) * S + s];
        const int t0 = c * cs;
        const int n_keys = moba_slot_keys(c, lim, Tk, cs);
        for (int j0 = 0; j0 < n_keys; j0 += N) {
            const int cnt = n_keys - j0 < N ? n_keys - j0 : N;
            const size_t tk = static_cast<size_t>(t0 + j0);
            if (i < cnt) ssc[i] = moba_dot<InT, N>(k0 + (tk + i) * kv_step, sq);
            BARRIER();
            float m_new = m;
            for (int j = 0; j < cnt; ++j) m_new = ssc[j] > m_new ? ssc[j] : m_new;
            if (i < cnt) sp[i] = FEXP(ssc[i] - m_new);
            BARRIER();
            const float alpha = FEXP(m - m_new);
            l *= alpha;
            acc *= alpha;
            for (int j = 0; j < cnt; ++j) {
                l += sp[j];
                acc = FMA(sp[j], TO_F32(v0[(tk + j) * kv_step + i]), acc);
            }
            m = m_new;
        }
    }
    out[static_cast<size_t>(r) * N + i] = FROM_F32(InT, acc / l);
    if (i == 0) lse[r] = m + FLOG(l);
}

// dq, one query row per threadgroup: p = exp(score - lse) again, ds = p (dp - delta) with
// dp = <dout, v>, and dq_i = scale sum ds k_i. delta = <dout, out> - dlse (the softmax's own term,
// and lse's cotangent), saved for the dk/dv kernel. Double-buffered ds: one barrier per tile.
template <typename InT, int N>
KFN void moba_backward_dq(
    GMEM const InT* q,
    GMEM const InT* k,
    GMEM const InT* v,
    GMEM const InT* out,
    GMEM const InT* dout,
    GMEM const float* lse,
    GMEM const float* dlse,
    GMEM const int* chunk,
    GMEM const int* limit,
    float scale,
    int T,
    int Tk,
    int Hq,
    int Hkv,
    int S,
    int cs,
    GMEM InT* dq,
    GMEM float* delta,
    int i,
    int r,
    SMEM float* smem) {
    const size_t b = static_cast<size_t>(r / (T * Hq));
    const size_t kv_head = static_cast<size_t>((r % Hq) / (Hq / Hkv));
    GMEM const InT* k0 = k + (b * Tk * Hkv + kv_head) * N;
    GMEM const InT* v0 = v + (b * Tk * Hkv + kv_head) * N;
    const size_t kv_step = static_cast<size_t>(Hkv) * N;
    SMEM float* sq = smem;
    SMEM float* sdo = smem + N;
    SMEM float* sred = smem + 2 * N;
    const size_t at = static_cast<size_t>(r) * N + i;
    sq[i] = TO_F32(q[at]) * scale;
    sdo[i] = TO_F32(dout[at]);
    sred[i] = sdo[i] * TO_F32(out[at]);
    BARRIER();
    float dot = 0.0f;
    for (int j = 0; j < N; ++j) dot += sred[j];
    const float dlt = dot - dlse[r];
    const float lse_r = lse[r];
    if (i == 0) delta[r] = dlt;
    float dqi = 0.0f;
    int stage = 0;
    for (int s = 0; s < S; ++s) {
        const int lim = limit[static_cast<size_t>(r) * S + s];
        if (lim < 0) continue;
        const int c = chunk[static_cast<size_t>(r) * S + s];
        const int t0 = c * cs;
        const int n_keys = moba_slot_keys(c, lim, Tk, cs);
        for (int j0 = 0; j0 < n_keys; j0 += N, ++stage) {
            const int cnt = n_keys - j0 < N ? n_keys - j0 : N;
            const size_t tk = static_cast<size_t>(t0 + j0);
            SMEM float* sds = smem + (3 + (stage & 1)) * N;
            if (i < cnt) {
                const float score = moba_dot<InT, N>(k0 + (tk + i) * kv_step, sq);
                const float dp = moba_dot<InT, N>(v0 + (tk + i) * kv_step, sdo);
                sds[i] = FEXP(score - lse_r) * (dp - dlt);
            }
            BARRIER();
            for (int j = 0; j < cnt; ++j) dqi = FMA(sds[j], TO_F32(k0[(tk + j) * kv_step + i]), dqi);
        }
    }
    dq[at] = FROM_F32(InT, dqi * scale);
}

// dk, dv, one threadgroup per (b, kv head, chunk, tile of N keys), group g = m * tiles + tile
// with m = (b * Hkv + kv head) * n_chunks + chunk. The rows reading the chunk (pairs[offsets[m]]
// to pairs[offsets[m + 1]]) come MOBA_PAIRS at a time into shared memory (double-buffered: one
// barrier per batch); thread j scores its key against each and adds to its own rows of dk and dv,
// kept in the float32 outputs (a register copy would not fit at N = 128).
template <typename InT, int N>
KFN void moba_backward_dkv(
    GMEM const InT* q,
    GMEM const InT* k,
    GMEM const InT* v,
    GMEM const InT* dout,
    GMEM const float* lse,
    GMEM const float* delta,
    GMEM const int* limit,
    GMEM const int* pairs,
    GMEM const int* offsets,
    float scale,
    int Tk,
    int Hkv,
    int S,
    int cs,
    GMEM float* dk,
    GMEM float* dv,
    int j,
    int g,
    SMEM float* smem,
    SMEM int* ismem) {
    const int n_chunks = (Tk + cs - 1) / cs;
    const int tiles = (cs + N - 1) / N;
    const int m = g / tiles;
    const int c = m % n_chunks;
    const size_t kv_head = static_cast<size_t>((m / n_chunks) % Hkv);
    const size_t b = static_cast<size_t>(m / (n_chunks * Hkv));
    const int jc = (g % tiles) * N + j;  // this thread's key, as an offset in its chunk
    const int tk = c * cs + jc;
    const bool mine = jc < cs && tk < Tk;
    const size_t kv_at = ((b * Tk + (mine ? tk : 0)) * Hkv + kv_head) * N;
    if (mine) {
        for (int d = 0; d < N; ++d) {
            dk[kv_at + d] = 0.0f;
            dv[kv_at + d] = 0.0f;
        }
    }
    const int first = offsets[m];
    const int last = offsets[m + 1];
    int stage = 0;
    for (int p0 = first; p0 < last; p0 += MOBA_PAIRS, ++stage) {
        SMEM float* sq = smem + (stage & 1) * MOBA_DKV_BUF(N);  // [MOBA_PAIRS, N], scaled
        SMEM float* sdo = sq + MOBA_PAIRS * N;                  // [MOBA_PAIRS, N]
        SMEM float* slse = sdo + MOBA_PAIRS * N;
        SMEM float* sdelta = slse + MOBA_PAIRS;
        SMEM int* slim = ismem + (stage & 1) * MOBA_PAIRS;
        // staged rows past the range are zeros with limit -1: fixed trip counts below
        for (int p = 0; p < MOBA_PAIRS; ++p) {
            const bool real = p0 + p < last;
            const size_t row = real ? static_cast<size_t>(pairs[p0 + p] / S) : 0;
            sq[p * N + j] = real ? TO_F32(q[row * N + j]) * scale : 0.0f;
            sdo[p * N + j] = real ? TO_F32(dout[row * N + j]) : 0.0f;
        }
        if (j < MOBA_PAIRS) {
            const bool real = p0 + j < last;
            const int slot = real ? pairs[p0 + j] : 0;
            slse[j] = real ? lse[slot / S] : 0.0f;
            sdelta[j] = real ? delta[slot / S] : 0.0f;
            slim[j] = real ? limit[slot] : -1;
        }
        BARRIER();
        if (mine) {
            float sc[MOBA_PAIRS], dp[MOBA_PAIRS];
            for (int p = 0; p < MOBA_PAIRS; ++p) sc[p] = dp[p] = 0.0f;
            for (int d = 0; d < N; ++d) {
                const float kd = TO_F32(k[kv_at + d]);
                const float vd = TO_F32(v[kv_at + d]);
                for (int p = 0; p < MOBA_PAIRS; ++p) {
                    sc[p] = FMA(sq[p * N + d], kd, sc[p]);
                    dp[p] = FMA(sdo[p * N + d], vd, dp[p]);
                }
            }
            for (int p = 0; p < MOBA_PAIRS; ++p) {
                const float pr = jc <= slim[p] ? FEXP(sc[p] - slse[p]) : 0.0f;
                sc[p] = pr;                        // now the probability
                dp[p] = pr * (dp[p] - sdelta[p]);  // now ds
            }
            for (int d = 0; d < N; ++d) {
                float dkd = dk[kv_at + d], dvd = dv[kv_at + d];
                for (int p = 0; p < MOBA_PAIRS; ++p) {
                    dkd = FMA(dp[p], sq[p * N + d], dkd);  // sq holds scale q: dk = scale ds q
                    dvd = FMA(sc[p], sdo[p * N + d], dvd);
                }
                dk[kv_at + d] = dkd;
                dv[kv_at + d] = dvd;
            }
        }
    }
}

#endif
