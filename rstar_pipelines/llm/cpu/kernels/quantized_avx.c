/* A weight-only int4 or int8 linear layer on AVX-512 or AVX2 with FMA, for CPUs without AMX:
 * out[M, N] = x[M, K] . w[N, K]^T in float32, where w is, by default, int4 in groups of 32
 * inputs, (q - 8) * scale + zero with q in 0..15 and one float32 scale and zero per output and
 * group (the weights of int4_cpu.c), or, built with INT8_WEIGHTS, q * scale with q in -127..127
 * and one float32 scale per output (quantized_cpu.py says why this kernel).
 *
 * Each group of 32 inputs' weights for 16 outputs is unpacked once per call into integers (exact
 * in float32 and in bfloat16), which multiply every row of x; the group's scale and zero are
 * applied to those float32 sums afterwards, as in the AMX kernel:
 *   out[r, n] = sum_g scale[n, g] * sum_{k in g} x[r, k] (q[n, k] - 8) + zero[n, g] * sum_{k in g} x[r, k]
 * (int8: out[r, n] = scale[n] * sum_g sum_{k in g} x[r, k] q[n, k]).
 * Built with AVX512-BF16 (__AVX512BF16__), x is bfloat16 and each instruction multiplies an input
 * pair (vdpbf16ps: two products added to each float32 sum); else x holds bfloat16 values in
 * float32 and each FMA multiplies one input. Either way each product is exact, and each row's
 * sums are taken in the same order (the inputs of a group in order, then the groups in order)
 * whatever the other rows of its batch.
 *
 * Layouts: x [M, K] row-major; out [M, N] float32. int4: q [N/16][K/32][16][16] bytes, byte o of
 * input pair t holding q[16 block + o, 32 g + 2 t] in its low nibble and q[16 block + o,
 * 32 g + 2 t + 1] in its high one; scale and zero [N/16][K/32][16] (int4_cpu.c's). int8: q
 * [N/16][K/32][16][2][16] bytes, q[16 block + o, 32 g + 2 t + p] at [block][g][t][p][o]; scale [N];
 * zero unused. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#define BLOCK 16 /* outputs a group's unpacked weights cover */
#define GROUP 32 /* inputs per scale and zero */

#if defined(__AVX512F__)
/* One vector: a block's 16 outputs. Eight rows at once: eight independent sums in registers
 * hide the FMAs' latency, and each weight vector loaded serves eight FMAs. */
typedef __m512 vec;
typedef __m512i ivec;
#define LANES 16
#define ROWS_AT_ONCE 8
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_load_ps
#define vstore _mm512_store_ps
#define vstoreu _mm512_storeu_ps
#define vloadu _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
#define vsub _mm512_sub_ps
/* The 16 (or 8) bytes at p, each widened to a 32-bit lane. */
#define widen(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define widen_signed(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define to_floats _mm512_cvtepi32_ps
#define vadd _mm512_add_ps
#define vmul _mm512_mul_ps
#define low_nibble(v) to_floats(_mm512_and_si512(v, _mm512_set1_epi32(15)))
#define high_nibble(v) to_floats(_mm512_srli_epi32(v, 4))
#else
/* Two vectors a block; four rows at once: their 8 sums, 2 weights and a broadcast fit AVX2's 16
 * registers. */
typedef __m256 vec;
typedef __m256i ivec;
#define LANES 8
#define ROWS_AT_ONCE 4
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_load_ps
#define vstore _mm256_store_ps
#define vstoreu _mm256_storeu_ps
#define vloadu _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
#define vsub _mm256_sub_ps
#define widen(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define widen_signed(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define to_floats _mm256_cvtepi32_ps
#define vadd _mm256_add_ps
#define vmul _mm256_mul_ps
#define low_nibble(v) to_floats(_mm256_and_si256(v, _mm256_set1_epi32(15)))
#define high_nibble(v) to_floats(_mm256_srli_epi32(v, 4))
#endif
#define VECS (BLOCK / LANES) /* vectors a block */

#if defined(__AVX512BF16__)
/* A lane holds one output's weights for an input pair, as two bfloat16s: each dot instruction
 * adds both products. */
typedef uint16_t activation; /* bfloat16's bits */
#define STEP 2 /* inputs an instruction multiplies */
static inline float to_float(activation a) {
  const uint32_t bits = (uint32_t)a << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
/* The float32 integers lo and hi as bfloat16 pairs (their low 16 bits are zero: exact). */
static inline vec bfloat16_pairs(vec lo, vec hi) {
  const __m512i top = _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32((int)0xFFFF0000));
  return _mm512_castsi512_ps(_mm512_or_si512(top, _mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
}
/* sums + the products of an input pair's weights (each lane's bfloat16 pair) and x[0], x[1]. */
static inline vec multiply_add(vec sums, vec weights, const activation *x) {
  int32_t pair;
  memcpy(&pair, x, sizeof pair);
  return _mm512_dpbf16_ps(sums, (__m512bh)weights, (__m512bh)_mm512_set1_epi32(pair));
}
#else
typedef float activation;
#define STEP 1
static inline float to_float(activation a) { return a; }
static inline vec multiply_add(vec sums, vec weights, const activation *x) {
  return vfma(vset1(*x), weights, sums);
}
#endif

#if defined(INT8_WEIGHTS)
#define GROUP_BYTES (BLOCK * GROUP) /* one byte a weight */
/* Input pair `pair`'s weights for outputs LANES v .. LANES v + LANES - 1 as float32 integers. */
static inline void pair_weights(const uint8_t *group, int pair, int v, vec *lo, vec *hi) {
  *lo = to_floats(widen_signed(group + 2 * BLOCK * pair + LANES * v));
  *hi = to_floats(widen_signed(group + 2 * BLOCK * pair + BLOCK + LANES * v));
}
#else
#define GROUP_BYTES (BLOCK * GROUP / 2) /* two weights a byte */
static inline void pair_weights(const uint8_t *group, int pair, int v, vec *lo, vec *hi) {
  const ivec bytes = widen(group + BLOCK * pair + LANES * v);
  *lo = vsub(low_nibble(bytes), vset1(8.0f));
  *hi = vsub(high_nibble(bytes), vset1(8.0f));
}
#endif

/* One group's weights for a block as float32 or bfloat16 integers: w[VECS * s + v] holds step
 * s's inputs (an input, or an input pair in bfloat16) for outputs LANES v .. LANES v + LANES - 1. */
static inline void unpack(const uint8_t *group, vec *w) {
  for (int pair = 0; pair < GROUP / 2; pair++)
    for (int v = 0; v < VECS; v++) {
      vec lo, hi;
      pair_weights(group, pair, v, &lo, &hi);
#if STEP == 2
      w[VECS * pair + v] = bfloat16_pairs(lo, hi);
#else
      w[VECS * (2 * pair) + v] = lo;
      w[VECS * (2 * pair + 1) + v] = hi;
#endif
    }
}

/* `rows` rows' (a compile-time constant where inlined) products with one group's weights, scaled
 * and added to their running outputs acc (BLOCK floats a row). */
static inline __attribute__((always_inline)) void rows_times_group(
    const activation *x, int64_t k, const vec *w, const float *scale, const float *zero,
    const float *x_sums, int64_t groups, float *acc, const int rows) {
  vec sums[ROWS_AT_ONCE][VECS];
  for (int r = 0; r < rows; r++)
    for (int v = 0; v < VECS; v++) sums[r][v] = vzero();
#pragma GCC unroll 4
  for (int step = 0; step < GROUP / STEP; step++)
    for (int v = 0; v < VECS; v++) {
      const vec weight = w[VECS * step + v];
      for (int r = 0; r < rows; r++)
        sums[r][v] = multiply_add(sums[r][v], weight, x + r * k + STEP * step);
    }
  for (int v = 0; v < VECS; v++) {
#if defined(INT8_WEIGHTS)
    /* One scale an output, applied to the whole sum at the end. */
    for (int r = 0; r < rows; r++) {
      float *out = acc + BLOCK * r + LANES * v;
      vstore(out, vadd(vload(out), sums[r][v]));
    }
#else
    const vec s = vloadu(scale + LANES * v), z = vloadu(zero + LANES * v);
    for (int r = 0; r < rows; r++) {
      float *out = acc + BLOCK * r + LANES * v;
      vstore(out, vfma(vset1(x_sums[r * groups]), z, vfma(sums[r][v], s, vload(out))));
    }
#endif
  }
}

#if !defined(INT8_WEIGHTS)
/* Each row's sum over each group of its inputs, for the zeros, in a fixed order. */
static float group_sum(const activation *xs) {
  float total = 0.0f;
  for (int i = 0; i < GROUP; i++) total += to_float(xs[i]);
  return total;
}
#endif

/* 0, or -1 when there was no memory for the scratch. */
int quantized_avx_mm(const activation *x, int64_t m, int64_t k, int64_t n, const uint8_t *q,
                const float *scale, const float *zero, float *out) {
  const int64_t groups = k / GROUP, blocks = n / BLOCK;
#if defined(INT8_WEIGHTS)
  float *x_sums = NULL; /* no zeros */
#else
  float *x_sums = malloc(sizeof(float) * m * groups);
  if (x_sums == NULL) return -1;
#endif
  float *accs = aligned_alloc(64, sizeof(float) * BLOCK * m * omp_get_max_threads());
  if (accs == NULL) {
    free(x_sums), free(accs);
    return -1;
  }
#pragma omp parallel
  {
    vec w[GROUP / STEP * VECS];
    float *acc = accs + BLOCK * m * omp_get_thread_num();
#if !defined(INT8_WEIGHTS)
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m * groups; i++) x_sums[i] = group_sum(x + (i / groups) * k + (i % groups) * GROUP);
#endif
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
      memset(acc, 0, sizeof(float) * BLOCK * m);
      for (int64_t g = 0; g < groups; g++) {
        const int64_t at = block * groups + g;
        unpack(q + at * GROUP_BYTES, w);
        for (int64_t first = 0; first < m; first += ROWS_AT_ONCE) {
          const activation *xs = x + first * k + g * GROUP;
          float *rows_acc = acc + BLOCK * first;
#if defined(INT8_WEIGHTS)
          const float *s = NULL, *z = NULL, *sums = NULL;
#else
          const float *s = scale + at * BLOCK, *z = zero + at * BLOCK;
          const float *sums = x_sums + first * groups + g;
#endif
          switch (m - first < ROWS_AT_ONCE ? m - first : ROWS_AT_ONCE) {
#define ROWS_CASE(r) \
  case r: rows_times_group(xs, k, w, s, z, sums, groups, rows_acc, r); break;
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
#if ROWS_AT_ONCE > 4
            ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#endif
#undef ROWS_CASE
          }
        }
      }
      for (int64_t r = 0; r < m; r++)
        for (int v = 0; v < VECS; v++) {
          vec sum = vload(acc + BLOCK * r + LANES * v);
#if defined(INT8_WEIGHTS)
          sum = vmul(sum, vloadu(scale + block * BLOCK + LANES * v));
#endif
          vstoreu(out + r * n + block * BLOCK + LANES * v, sum);
        }
    }
  }
  free(x_sums), free(accs);
  return 0;
}
