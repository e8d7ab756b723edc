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

enum { WIDEST = 2048, STEP = 16, COLUMNS = 8 };

static void rows_by_columns(const float *x, long ldx, const float *w, long sk, float *y, int m, int k, int n,
                            int j0, int width, int block) {
    /* columns [j0, j0 + width) of every row: each k streams `width` contiguous floats of w's row k */
    for (int i = 0; i < m; i++) {
        const float *xi = x + (long)i * ldx;
        float sum[WIDEST], acc[WIDEST];
        for (int k0 = 0; k0 < k; k0 += block) {
            const int k1 = k0 + block < k ? k0 + block : k;
            for (int j = 0; j < width; j++) acc[j] = 0.f;
            for (int kk = k0; kk < k1; kk++) {
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
