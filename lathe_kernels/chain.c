/* Lathe's fixed-order product for the few rows of a decode step (lathe.kernels.chain builds and loads it).

   y[i, j] = sum over k of x[i, k] * w[k, j], in one fixed order: k is cut into blocks of `block`; each block is
   one chain of fused multiply-adds, k ascending, from zero; the blocks' sums are added in order, the first one
   taking the place of zero. That is how the BLAS this was measured on (MKL's AVX2 sgemm, block 192) computes every
   element of a product of four or more rows, so where a pool's trial finds the same bits (tiles.choose_chain) a
   lone row gets its tile's bits at the cost of streaming w once, without padding it to a tile of four rows for
   which the library packs the whole weight again.

   Every element depends on x's row and w's column alone, and threads split the columns only: the bits do not
   depend on the row count, the thread count or the vector width the compiler picks (fmaf is exact either way).

   x [m, k] (row stride ldx, elements contiguous), w [k, n] (strides sk, sn; sn == 1 streams rows of w, any other
   layout runs the chains of a few columns side by side), y [m, n] contiguous. fp32 only. */

#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

enum { WIDEST = 2048, STEP = 16, COLUMNS = 8, PANEL = 16, GROUP = 6, UNROLL = 8 };

#if defined(__AVX2__) && defined(__FMA__)
/* rows [0, mr) (mr <= GROUP) x the PANEL columns at w, y (row strides ldx, sk, ldy): the same chains, each row's
   and column's accumulator in a register, so a panel of w read once from cache serves up to GROUP rows */
static inline __attribute__((always_inline)) void panel(const float *x, long ldx, const float *w, long sk, float *y,
                                                        long ldy, int k, int block, const int mr) {
    __m256 s0[GROUP], s1[GROUP], a0[GROUP], a1[GROUP];
    for (int k0 = 0; k0 < k; k0 += block) {
        const int k1 = k0 + block < k ? k0 + block : k;
        for (int r = 0; r < mr; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        for (int kk = k0; kk < k1; kk++) {
            const __m256 w0 = _mm256_loadu_ps(w + (long)kk * sk), w1 = _mm256_loadu_ps(w + (long)kk * sk + 8);
            for (int r = 0; r < mr; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + (long)r * ldx + kk);
                a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);
                a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);
            }
        }
        for (int r = 0; r < mr; r++) {
            s0[r] = k0 == 0 ? a0[r] : _mm256_add_ps(s0[r], a0[r]);
            s1[r] = k0 == 0 ? a1[r] : _mm256_add_ps(s1[r], a1[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(y + (long)r * ldy, k > 0 ? s0[r] : _mm256_setzero_ps());
        _mm256_storeu_ps(y + (long)r * ldy + 8, k > 0 ? s1[r] : _mm256_setzero_ps());
    }
}

static int panels(const float *x, long ldx, const float *w, long sk, float *y, int m, int k, int n, int j0,
                  int width, int block) {
    /* the whole PANELs of columns [j0, j0 + width) of every row; returns the columns done */
    const int done = width / PANEL * PANEL;
    for (int j = j0; j < j0 + done; j += PANEL) {
        int i = 0;
        for (; i + GROUP <= m; i += GROUP)
            panel(x + (long)i * ldx, ldx, w + j, sk, y + (long)i * n + j, n, k, block, GROUP);
        const float *xi = x + (long)i * ldx;
        float *yi = y + (long)i * n + j;
        switch (m - i) {
            case 5: panel(xi, ldx, w + j, sk, yi, n, k, block, 5); break;
            case 4: panel(xi, ldx, w + j, sk, yi, n, k, block, 4); break;
            case 3: panel(xi, ldx, w + j, sk, yi, n, k, block, 3); break;
            case 2: panel(xi, ldx, w + j, sk, yi, n, k, block, 2); break;
            case 1: panel(xi, ldx, w + j, sk, yi, n, k, block, 1); break;
            default: break;
        }
    }
    return done;
}
#endif

static void rows_by_columns(const float *x, long ldx, const float *w, long sk, float *y, int m, int k, int n,
                            int j0, int width, int block) {
    /* columns [j0, j0 + width) of every row: each k streams `width` contiguous floats of w's row k. Several rows
       go through register panels where the CPU has AVX2 and FMA. A lone row streams w from memory either way, UNROLL
       rows of it at a time, so that its accumulators are loaded and stored once per UNROLL multiply-adds (25% less
       time than once per row, which was bound by those loads and stores, not by the memory) */
#if defined(__AVX2__) && defined(__FMA__)
    if (m > 1) {
        const int done = panels(x, ldx, w, sk, y, m, k, n, j0, width, block);
        j0 += done;
        width -= done;
    }
#endif
    for (int i = 0; i < m; i++) {
        const float *xi = x + (long)i * ldx;
        float sum[WIDEST], acc[WIDEST];
        for (int k0 = 0; k0 < k; k0 += block) {
            const int k1 = k0 + block < k ? k0 + block : k;
            for (int j = 0; j < width; j++) acc[j] = 0.f;
            int kk = k0;
            for (; kk + UNROLL <= k1; kk += UNROLL) {  /* UNROLL rows of w per pass over acc: the same chains */
                const float *wr = w + (long)kk * sk + j0;
                for (int j = 0; j < width; j++) {
                    float a = acc[j];
                    for (int u = 0; u < UNROLL; u++) a = fmaf(xi[kk + u], wr[(long)u * sk + j], a);
                    acc[j] = a;
                }
            }
            for (; kk < k1; kk++) {
                const float xv = xi[kk];
                const float *wr = w + (long)kk * sk + j0;
                for (int j = 0; j < width; j++) acc[j] = fmaf(xv, wr[j], acc[j]);
            }
            for (int j = 0; j < width; j++) sum[j] = k0 == 0 ? acc[j] : sum[j] + acc[j];
        }
        for (int j = 0; j < width; j++) y[(long)i * n + j0 + j] = k > 0 ? sum[j] : 0.f;
    }
}

static void some_columns(const float *x, long ldx, const float *w, long sk, long sn, float *y, int m, int k, int n,
                         int j0, int block) {
    /* up to COLUMNS columns' chains side by side: independent multiply-adds keep the FMA units busy */
    const int width = j0 + COLUMNS < n ? COLUMNS : n - j0;
    for (int i = 0; i < m; i++) {
        const float *xi = x + (long)i * ldx;
        float sum[COLUMNS] = {0.f}, acc[COLUMNS];
        for (int k0 = 0; k0 < k; k0 += block) {
            const int k1 = k0 + block < k ? k0 + block : k;
            for (int j = 0; j < width; j++) acc[j] = 0.f;
            for (int kk = k0; kk < k1; kk++) {
                const float xv = xi[kk];
                const float *wk = w + (long)kk * sk + (long)j0 * sn;
                for (int j = 0; j < width; j++) acc[j] = fmaf(xv, wk[(long)j * sn], acc[j]);
            }
            for (int j = 0; j < width; j++) sum[j] = k0 == 0 ? acc[j] : sum[j] + acc[j];
        }
        for (int j = 0; j < width; j++) y[(long)i * n + j0 + j] = sum[j];
    }
}

static void matmul(const float *x, long ldx, const float *w, long sk, long sn, float *y, int m, int k, int n,
                   int block, int threads) {
    if (sn == 1) {
        /* one run of columns per thread (a multiple of STEP, at most WIDEST wide) */
        int width = (n + threads - 1) / threads;
        width = (width + STEP - 1) / STEP * STEP;
        width = width < STEP ? STEP : width > WIDEST ? WIDEST : width;
        const int chunks = (n + width - 1) / width;
        #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && chunks > 1)
        for (int c = 0; c < chunks; c++) {
            const int j0 = c * width;
            rows_by_columns(x, ldx, w, sk, y, m, k, n, j0, j0 + width < n ? width : n - j0, block);
        }
    } else {
        const int groups = (n + COLUMNS - 1) / COLUMNS;
        #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && groups > 1)
        for (int g = 0; g < groups; g++) some_columns(x, ldx, w, sk, sn, y, m, k, n, g * COLUMNS, block);
    }
}

/* The same product with w stored in panels (lathe.kernels.chain.pack_panels): p [ceil(n / PANEL)][k][PANEL], panel q
   holding columns q * PANEL onwards, zeros past n. A walk down k then reads one panel's memory in order, where a walk
   down a row-major w reads one cache line a row, PANEL columns of every row of a group in registers
   (panel). The same chains as matmul; threads split the panels. Returns 0 where built without AVX2 and FMA. */
int lathe_chain_has_panels(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

static void panel_matmul(const float *x, long ldx, const float *p, float *y, int m, int k, int n, int block,
                         int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    const int count = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count > 1)
    for (int q = 0; q < count; q++) {
        const float *wq = p + (long)q * k * PANEL;
        const int j = q * PANEL, cols = n - j < PANEL ? n - j : PANEL;
        float spare[GROUP * PANEL];
        for (int i = 0; i < m; i += GROUP) {
            const float *xi = x + (long)i * ldx;
            float *out = cols == PANEL ? y + (long)i * n + j : spare;
            const long ldo = cols == PANEL ? n : PANEL;
            const int mr = m - i < GROUP ? m - i : GROUP;
            switch (mr) {
                case 6: panel(xi, ldx, wq, PANEL, out, ldo, k, block, 6); break;
                case 5: panel(xi, ldx, wq, PANEL, out, ldo, k, block, 5); break;
                case 4: panel(xi, ldx, wq, PANEL, out, ldo, k, block, 4); break;
                case 3: panel(xi, ldx, wq, PANEL, out, ldo, k, block, 3); break;
                case 2: panel(xi, ldx, wq, PANEL, out, ldo, k, block, 2); break;
                default: panel(xi, ldx, wq, PANEL, out, ldo, k, block, 1); break;
            }
            if (cols < PANEL)
                for (int r = 0; r < mr; r++)
                    for (int c = 0; c < cols; c++) y[(long)(i + r) * n + j + c] = spare[r * PANEL + c];
        }
    }
#else
    (void)x; (void)ldx; (void)p; (void)y; (void)m; (void)k; (void)n; (void)block; (void)threads;
#endif
}

void lathe_chain_matmul(const float *x, long ldx, const float *w, long sk, long sn, float *y, int m, int k, int n,
                        int block, int threads) {
    matmul(x, ldx, w, sk, sn, y, m, k, n, block, threads);
}

/* A LoRA correction in one call: v = x @ a (a: [k, r], strides ask, asn), v *= scale (one fp32 rounding, as torch
   multiplies an fp32 tensor by a number), y = v @ b (b: [r, n], strides bsk, bsn); v [m, r] is the caller's
   scratch. Each product in the order above. */
void lathe_chain_lora(const float *x, long ldx, const float *a, long ask, long asn, const float *b, long bsk,
                      long bsn, float scale, float *v, float *y, int m, int k, int r, int n, int block, int threads) {
    matmul(x, ldx, a, ask, asn, v, m, k, r, block, 1);
    for (long i = 0; i < (long)m * r; i++) v[i] = v[i] * scale;
    matmul(v, r, b, bsk, bsn, y, m, r, n, block, threads);
}

/* Several segments' corrections in one call (a decode step's adapters): segment s is row r0 of x and the `rows`
   after it, its A (a: [k, rank], strides ask, asn), B (b: [rank, n], strides bsk, bsn), scale and block, packed as
   seg[s] = {r0, rows, rank, block, a, ask, asn, b, bsk, bsn} (pointers as integers); its rows of y (y [T, n],
   contiguous) get lathe_chain_lora's result, with v (scratch, [T, widest rank]) as its scratch. Rows in no segment
   are not written. Several segments run one a thread; a lone segment's expand gets the threads (a product's bits
   never depend on how its columns are shared out). */
void lathe_chain_lora_segments(const float *x, long ldx, const long *seg, const float *scale, float *v, float *y,
                               int segments, int k, int n, int widest, int threads) {
    if (segments == 1) {  /* no region around the call: its own would nest in it, and a nested team is made anew
                             each time (3 ms for the LM head's correction of one row, against 0.1 ms) */
        lathe_chain_lora(x + seg[0] * ldx, ldx, (const float *)seg[4], seg[5], seg[6], (const float *)seg[7], seg[8],
                         seg[9], scale[0], v + seg[0] * widest, y + seg[0] * n, (int)seg[1], k, (int)seg[2], n,
                         (int)seg[3], threads);
        return;
    }
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && segments > 1)
    for (int s = 0; s < segments; s++) {
        const long *g = seg + 10L * s;
        const long r0 = g[0];
        lathe_chain_lora(x + r0 * ldx, ldx, (const float *)g[4], g[5], g[6], (const float *)g[7], g[8], g[9],
                         scale[s], v + r0 * widest, y + r0 * n, (int)g[1], k, (int)g[2], n, (int)g[3], 1);
    }
}

/* A base product and its LoRA corrections in one call (a decode step's linear): y = x @ w (as lathe_chain_matmul,
   or panel_matmul over w's panels where given), then y = y + d, where d [m, n] is lathe_chain_lora_segments' result
   (d: the caller's scratch) and rows of no segment add +0 (as adding a tensor of zeros does, which turns -0 into
   +0). No segments: y = x @ w alone. The segments go in row order, disjoint. */
void lathe_chain_linear(const float *x, long ldx, const float *w, long sk, long sn, const float *panels, float *y,
                        int m, int k, int n, int block, int threads, const long *seg, const float *scale, float *v,
                        float *d, int segments, int widest, int lora_threads) {
    if (panels)
        panel_matmul(x, ldx, panels, y, m, k, n, block, threads);
    else
        matmul(x, ldx, w, sk, sn, y, m, k, n, block, threads);
    if (segments == 0) return;
    lathe_chain_lora_segments(x, ldx, seg, scale, v, d, segments, k, n, widest, lora_threads);
    int s = 0;
    for (long i = 0; i < m; i++) {
        while (s < segments && seg[10L * s] + seg[10L * s + 1] <= i) s++;
        const int covered = s < segments && seg[10L * s] <= i;
        float *yi = y + i * n;
        const float *di = d + i * n;
        if (covered)
            for (int j = 0; j < n; j++) yi[j] = yi[j] + di[j];
        else
            for (int j = 0; j < n; j++) yi[j] = yi[j] + 0.f;
    }
}

/* Invariant decode attention's products (lathe.kernels.attention.decode_attention states the attention; these are
   its two halves around the exponentials, which stay torch's). For each sequence s and kv head h, query rows
   r < g are query heads h * g + r, keys sit in chunks of KEY on the absolute key grid, and sequence s sees keys
   0 .. pos[s]. Every [rows, D] @ [D, KEY] and [rows, KEY] @ [KEY, D] product is a row-by-columns product in the
   order above; chunks wholly past pos[s] are not computed (their scores are -inf, their products exactly zero).
   One thread computes a whole (s, h), so the bits do not depend on the thread count or on the other sequences.

   Keys and values are read in place: chunk c of sequence s starts at table[s * C + c] * ks (a paged cache's
   block ids, ks its block stride) or, without a table, at s * ks + c * KEY * kn (one buffer per sequence); row j
   of the chunk is kn further per row, kv head h kh further, and its D values are contiguous.

   scores: q [S, Hq, D] (strides qs, qh, 1) -> x [S, Hkv, C, g, KEY] = scale * q . k - (the row's max over its
           visible keys), -inf past pos[s]
   values: p [S, Hkv, C, g, KEY] (exp of x), den [S, Hkv, C, g] (p summed over its KEY keys) -> o [S, Hq, D]
           (strides os, oh, 1) = (sum over chunks, in order, of p @ v) / (den summed likewise) */

enum { KEY = 64, MAX_HEAD = 512 };

static const float *chunk_of(const float *base, const long *table, long ks, long kn, int s, int c, int chunks) {
    return base + (table ? table[(long)s * chunks + c] * ks : (long)s * ks + (long)c * KEY * kn);
}

static void transposed(const float *kc, long kn, float *kt, int d) {
    /* the chunk's keys kc [KEY, d] (row stride kn) as kt [d, KEY]: each score chain then streams a row of it */
    int i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i0 + 8 <= d; i0 += 8)
        for (int j0 = 0; j0 < KEY; j0 += 8) {  /* an 8 x 8 square in registers */
            __m256 r[8], t[8];
            for (int u = 0; u < 8; u++) r[u] = _mm256_loadu_ps(kc + (long)(j0 + u) * kn + i0);
            for (int u = 0; u < 8; u += 2) {
                t[u] = _mm256_unpacklo_ps(r[u], r[u + 1]);
                t[u + 1] = _mm256_unpackhi_ps(r[u], r[u + 1]);
            }
            for (int u = 0; u < 8; u += 4) {
                r[u] = _mm256_shuffle_ps(t[u], t[u + 2], 0x44);
                r[u + 1] = _mm256_shuffle_ps(t[u], t[u + 2], 0xEE);
                r[u + 2] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0x44);
                r[u + 3] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0xEE);
            }
            for (int u = 0; u < 4; u++) {
                t[u] = _mm256_permute2f128_ps(r[u], r[u + 4], 0x20);
                t[u + 4] = _mm256_permute2f128_ps(r[u], r[u + 4], 0x31);
            }
            for (int u = 0; u < 8; u++) _mm256_storeu_ps(kt + (long)(i0 + u) * KEY + j0, t[u]);
        }
#endif
    for (int i = i0; i < d; i++)
        for (int j = 0; j < KEY; j++) kt[i * KEY + j] = kc[(long)j * kn + i];
}

static void scores_of(const float *q, long qh, const float *k, const long *table, long ks, long kn, int b,
                      long last, float scale, float *x, int g, int d, int chunks, int block) {
    float rows[8 * MAX_HEAD], kt[MAX_HEAD * KEY];
    for (int r0 = 0; r0 < g; r0 += 8) {
        const int m = g - r0 < 8 ? g - r0 : 8;
        for (int r = 0; r < m; r++)
            for (int i = 0; i < d; i++) rows[r * d + i] = q[(long)(r0 + r) * qh + i] * scale;
        for (int c = 0; c < chunks; c++) {
            float *xc = x + ((long)c * g + r0) * KEY;
            if ((long)c * KEY > last) {
                for (int i = 0; i < m * KEY; i++) xc[i] = -INFINITY;
                continue;
            }
            transposed(chunk_of(k, table, ks, kn, b, c, chunks), kn, kt, d);
            rows_by_columns(rows, d, kt, KEY, xc, m, d, KEY, 0, KEY, block);
            for (int r = 0; r < m; r++)
                for (int j = 0; j < KEY; j++)
                    if ((long)c * KEY + j > last) xc[r * KEY + j] = -INFINITY;
        }
    }
    for (int r = 0; r < g; r++) {
        float top = -INFINITY;
        for (int c = 0; c < chunks; c++)
            for (int j = 0; j < KEY; j++) top = fmaxf(top, x[((long)c * g + r) * KEY + j]);
        for (int c = 0; c < chunks; c++)
            for (int j = 0; j < KEY; j++) x[((long)c * g + r) * KEY + j] -= top;
    }
}

void lathe_chain_attention_scores(const float *q, long qs, long qh, const float *k, const long *table, long ks,
                                  long kn, long kh, const long *pos, float scale, float *x, int s, int hkv, int g,
                                  int d, int chunks, int block, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && s * hkv > 1)
    for (int u = 0; u < s * hkv; u++) {
        const int b = u / hkv, h = u % hkv;
        scores_of(q + b * qs + (long)h * g * qh, qh, k + h * kh, table, ks, kn, b, pos[b], scale,
                  x + (long)u * chunks * g * KEY, g, d, chunks, block);
    }
}

void lathe_chain_attention_values(const float *p, const float *den, const float *v, const long *table, long vs,
                                  long vn, long vh, const long *pos, float *o, long os, long oh, int s, int hkv,
                                  int g, int d, int chunks, int block, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && s * hkv > 1)
    for (int u = 0; u < s * hkv; u++) {
        const int b = u / hkv, h = u % hkv;
        const float *pu = p + (long)u * chunks * g * KEY, *du = den + (long)u * chunks * g;
        float num[8 * MAX_HEAD], acc[8 * MAX_HEAD], total[8];
        for (int r0 = 0; r0 < g; r0 += 8) {
            const int m = g - r0 < 8 ? g - r0 : 8;
            for (int c = 0; c < chunks; c++) {
                const int seen = (long)c * KEY <= pos[b];
                if (seen)
                    rows_by_columns(pu + ((long)c * g + r0) * KEY, KEY,
                                    chunk_of(v + h * vh, table, vs, vn, b, c, chunks), vn, num, m, KEY, d, 0, d, block);
                for (int r = 0; r < m; r++) {
                    const float part = seen ? du[(long)c * g + r0 + r] : 0.f;
                    total[r] = c == 0 ? part : total[r] + part;
                    for (int i = 0; i < d; i++) {
                        const float n = seen ? num[r * d + i] : 0.f;
                        acc[r * d + i] = c == 0 ? n : acc[r * d + i] + n;
                    }
                }
            }
            for (int r = 0; r < m; r++)
                for (int i = 0; i < d; i++)
                    o[b * os + (long)(h * g + r0 + r) * oh + i] = acc[r * d + i] / total[r];
        }
    }
}

/* Several linears of the same rows in one call (a decode layer's q, k and v, or its gate and up): job j is
   lathe_chain_linear(x, ldx, ..., m, k, ...) with the 15 operands a[15 j .. 15 j + 14] (pointers as longs) in this
   order: w, sk, sn, panels, y, n, block, threads, seg, scale, v, d, segments, widest, lora_threads. */
void lathe_chain_linears(const float *x, long ldx, int m, int k, int jobs, const long *a) {
    for (int j = 0; j < jobs; j++, a += 15)
        lathe_chain_linear(x, ldx, (const float *)a[0], a[1], a[2], (const float *)a[3], (float *)a[4], m, k, (int)a[5],
                           (int)a[6], (int)a[7], (const long *)a[8], (const float *)a[9], (float *)a[10],
                           (float *)a[11], (int)a[12], (int)a[13], (int)a[14]);
}

/* RoPE in the rotate-half convention, on the calling thread: y[t, h, e] = x[t, h, e] * c[t, e] + r[t, h, e] * s[t, e]
   with r = (-x[..., half:], x[..., :half]); the two products and their sum each rounded on its own, as torch's
   elementwise ops compute x * cos + rotate_half(x) * sin (-ffp-contract=off keeps them from fusing), so the bits
   are theirs. x [t, h, d] (strides xt, xh; elements contiguous), c, s [t, d] and y [t, h, d] contiguous. */
void lathe_rope(const float *x, long xt, long xh, const float *c, const float *s, float *y, int t, int h, int d) {
    const int half = d / 2;
    for (long i = 0; i < t; i++) {
        const float *ci = c + i * d, *si = s + i * d;
        for (long j = 0; j < h; j++) {
            const float *xj = x + i * xt + j * xh;
            float *yj = y + (i * h + j) * d;
            for (int e = 0; e < half; e++) yj[e] = xj[e] * ci[e] + (-xj[e + half]) * si[e];
            for (int e = half; e < d; e++) yj[e] = xj[e] * ci[e] + xj[e - half] * si[e];
        }
    }
}
