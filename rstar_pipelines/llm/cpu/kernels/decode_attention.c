/* Attention of a decode step on the CPU: a few queries of each (batch, key/value head) over its
   keys, the log-sum-exp of each query's scores returned with its output.

   Why: torch's CPU flash-attention kernel tiles for long query blocks; at a decode step's few
   queries (cascade attention stacks a group's rows: 3 samples x 3 query heads a key/value head)
   it reads the keys well below the machine's memory bandwidth (docs/benchmarks.md). Here each
   key and value row is read once for all the task's queries, from memory straight into the dot
   products.

   Per task (b, h): scores s[i][j] = scale * <q_i, k_j> + mask[b][j] into a scratch row of the
   thread's, their maximum, p = exp(s - max) and its sum, then out_i = sum_j p_ij v_j / sum and
   lse_i = max + log(sum). A query whose keys are all masked (-inf) gets out 0 and lse -inf.
   float32 throughout; the sums' order differs from torch's and exp is Cephes' polynomial, so
   results agree to float rounding (the tests: 1e-5 relative). AVX-512; heads of 64 or 128. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* The 16 sums across of `v`: lane i of the result holds v[i]'s lanes added. Each level adds
   pairs of vectors interleaved (16 vectors of lanes, 8 of pairs, 4 of quadruples, 2 of octets,
   1 of sums), and the interleaving leaves the sums in order (the kernel's tests check every
   lane). */
static inline __m512 sum_across(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int k = 0; k < 8; k++)
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; k++) {
    const __m512d lo = _mm512_castps_pd(a[2 * k]), hi = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  for (int k = 0; k < 2; k++)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

/* e^x for x <= 0 (scores minus their maximum), 16 at a time: Cephes' expf polynomial for e^r,
   |r| <= ln 2 / 2, scaled by 2^n (`scalef`); 0 below -87 (where e^x is no longer a normal
   float), so masked keys weigh exactly nothing. */
static inline __m512 exp_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

/* The lanes of keys j .. j + 15 that lie below `length`. */
static inline __mmask16 keys_left(int64_t j, int64_t length) {
  return length - j >= 16 ? 0xffff : (__mmask16)((1u << (length - j)) - 1);
}

/* Row `s` of `length` scores in place: e^(s - max) / its sum; returns the log-sum-exp, or -inf
   (the row all zeros) where every score is -inf. */
static inline float softmax_row(float *s, int64_t length) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < length; j += 16)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, keys_left(j, length), s + j));
  const float max = _mm512_reduce_max_ps(top);
  if (max == -INFINITY) {
    for (int64_t j = 0; j < length; j++) s[j] = 0.0f;
    return -INFINITY;
  }
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; j += 16) {
    const __mmask16 lanes = keys_left(j, length);
    const __m512 p = exp_nonpositive(
        _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j), _mm512_set1_ps(max)));
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(lanes, p));
    _mm512_mask_storeu_ps(s + j, lanes, p);
  }
  const float sum = _mm512_reduce_add_ps(total);
  const __m512 inverse = _mm512_set1_ps(1.0f / sum);
  for (int64_t j = 0; j < length; j += 16) {
    const __mmask16 lanes = keys_left(j, length);
    _mm512_mask_storeu_ps(s + j, lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + j), inverse));
  }
  return max + logf(sum);
}

/* The most queries whose sums over a 64-wide head stay in registers (6 x 4 vectors). */
#define PV_QUERIES 6

/* out_i = sum_j p_ij v_j for the `count` queries from `first` (count <= PV_QUERIES, a constant
   where inlined), over a head of `chunks` x 16 (a constant: 4 or 8): each value row is loaded
   once for them all, their sums stay in registers. */
static inline void weighted_values(const float *scores, int64_t length, const float *vt,
                                   int64_t v_r, float *ot, int64_t first, const int count,
                                   const int chunks) {
  __m512 sums[PV_QUERIES * 4];
  const int per_pass = PV_QUERIES * 4 / chunks; /* 8 chunks: 3 queries a pass */
  for (int start = 0; start < count; start += per_pass) {
    const int queries = count - start < per_pass ? count - start : per_pass;
#pragma GCC unroll 24
    for (int x = 0; x < queries * chunks; x++) sums[x] = _mm512_setzero_ps();
    for (int64_t j = 0; j < length; j++) {
      __m512 vj[8];
#pragma GCC unroll 8
      for (int c = 0; c < chunks; c++) vj[c] = _mm512_loadu_ps(vt + j * v_r + 16 * c);
#pragma GCC unroll 6
      for (int ii = 0; ii < queries; ii++) {
        const __m512 p = _mm512_set1_ps(scores[(first + start + ii) * length + j]);
#pragma GCC unroll 8
        for (int c = 0; c < chunks; c++)
          sums[ii * chunks + c] = _mm512_fmadd_ps(p, vj[c], sums[ii * chunks + c]);
      }
    }
    for (int ii = 0; ii < queries; ii++)
      for (int c = 0; c < chunks; c++)
        _mm512_storeu_ps(ot + (first + start + ii) * 16 * chunks + 16 * c, sums[ii * chunks + c]);
  }
}

/* weighted_values for every query, in blocks of as even a size as PV_QUERIES allows, each
   block's size a constant of its own copy. */
static void all_weighted_values(const float *scores, int64_t m, int64_t length, const float *vt,
                                int64_t v_r, float *ot, const int chunks) {
  const int64_t blocks = (m + PV_QUERIES - 1) / PV_QUERIES;
  const int size = (int)((m + blocks - 1) / blocks);
  for (int64_t first = 0; first < m; first += size) {
    const int count = m - first < size ? (int)(m - first) : size;
#define WEIGHTED(n)                                                             \
  case n:                                                                       \
    if (chunks == 4)                                                            \
      weighted_values(scores, length, vt, v_r, ot, first, n, 4);                \
    else                                                                        \
      weighted_values(scores, length, vt, v_r, ot, first, n, 8);                \
    break;
    switch (count) {
      WEIGHTED(1) WEIGHTED(2) WEIGHTED(3) WEIGHTED(4) WEIGHTED(5) WEIGHTED(6)
    }
#undef WEIGHTED
  }
}

int decode_attention(const float *q, const float *k, const float *v, const float *mask,
                     float *out, float *lse, int64_t batch, int64_t heads, int64_t m,
                     int64_t length, int64_t dim, const int64_t *strides, float scale) {
  /* strides, in floats: q's batch and head; k's batch, head and row; v's batch, head and row;
     mask's batch (0: one mask for all). q's rows and out's are contiguous [batch, heads, m, dim],
     lse [batch, heads, m], each row of k and v `dim` contiguous floats. */
  const int64_t q_b = strides[0], q_h = strides[1];
  const int64_t k_b = strides[2], k_h = strides[3], k_r = strides[4];
  const int64_t v_b = strides[5], v_h = strides[6], v_r = strides[7];
  const int64_t mask_b = strides[8];
  int failed = 0;
#pragma omp parallel
  {
    float *scores = malloc(sizeof(float) * (size_t)(m * length));
    if (scores == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < batch * heads; task++) {
      if (scores == NULL) continue;
      const int64_t b = task / heads, h = task % heads;
      const float *qt = q + b * q_b + h * q_h;
      const float *kt = k + b * k_b + h * k_h;
      const float *vt = v + b * v_b + h * v_h;
      const float *mt = mask == NULL ? NULL : mask + b * mask_b;
      float *ot = out + task * m * dim;
      float *lt = lse + task * m;
      /* 16 keys at a time: a query's 16 dot products as 16 vectors of partial sums, added
         across into one vector of 16 scores (`sum_across`), so no dot product ends in a
         horizontal sum of its own. */
      int64_t j = 0;
      for (; j + 16 <= length; j += 16) {
        const __m512 bias = mt == NULL ? _mm512_setzero_ps() : _mm512_loadu_ps(mt + j);
        for (int64_t i = 0; i < m; i++) {
          const float *qi = qt + i * dim;
          __m512 partial[16];
          for (int jj = 0; jj < 16; jj++) partial[jj] = _mm512_setzero_ps();
          for (int64_t d = 0; d < dim; d += 16) {
            const __m512 qd = _mm512_loadu_ps(qi + d);
#pragma GCC unroll 16
            for (int jj = 0; jj < 16; jj++)
              partial[jj] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kt + (j + jj) * k_r + d),
                                            partial[jj]);
          }
          _mm512_storeu_ps(scores + i * length + j,
                           _mm512_fmadd_ps(sum_across(partial), _mm512_set1_ps(scale), bias));
        }
      }
      for (; j < length; j++) {
        const float *kj = kt + j * k_r;
        const float bias = mt == NULL ? 0.0f : mt[j];
        for (int64_t i = 0; i < m; i++) {
          const float *qi = qt + i * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; d++) dot += qi[d] * kj[d];
          scores[i * length + j] = dot * scale + bias;
        }
      }
      for (int64_t i = 0; i < m; i++) lt[i] = softmax_row(scores + i * length, length);
      all_weighted_values(scores, m, length, vt, v_r, ot, (int)(dim / 16));
    }
    free(scores);
  }
  return failed;
}
