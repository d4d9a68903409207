/* A weight-only int4 linear layer on Intel AMX: out[M, N] = x[M, K] . w[N, K]^T in float32, where
 * x is bfloat16 and w, in groups of 32 inputs, is (q - 8) * scale + zero with q in 0..15 and one
 * float32 scale and zero per output and group (quantized_cpu.py packs them and says why this kernel).
 *
 * Each group's 4-bit values are unpacked once per call into a 16 x 16 pair tile of bfloat16
 * integers (-8..7, exact), which one AMX dot product multiplies with up to 16 rows of x at a time;
 * the group's scale and zero are applied to those float32 sums afterwards:
 *   out[r, n] = sum_g scale[n, g] * sum_{k in g} x[r, k] (q[n, k] - 8) + zero[n, g] * sum_{k in g} x[r, k].
 * Every product and sum is float32 (bfloat16 products are exact in it), in an order that does not
 * depend on the other rows of the batch.
 *
 * Layouts: x [M, K] row-major; q [N/16][K/32][8][32] bytes, byte i of pair p holding, in its low
 * nibble, B-tile row 2p lane i and, in its high one, row 2p + 1 lane i, where lane i of row j is
 * q[16 nb + i / 2, 32 g + 2 j + i % 2] (AMX's pair-interleaved B layout); scale and zero
 * [N/16][K/32][16]; out [M, N]. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands a process AMX's tile state only when asked: 0 when granted. */
int int4_cpu_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} tile_config;

/* Tile registers (numbers: the intrinsics paste them into the instruction): x and the sums of a
 * tile of 16 rows, of the last tile's `rest` rows (a tile's rows past them read as zeros), and the
 * weights. */
#define TILE_X 0
#define TILE_SUMS 1
#define TILE_X_REST 2
#define TILE_SUMS_REST 3
#define TILE_Q 4

static void configure(int rest) {
  tile_config config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int tile = 0; tile <= TILE_Q; tile++) config.bytes_per_row[tile] = 64;
  config.rows[TILE_X] = config.rows[TILE_SUMS] = config.rows[TILE_Q] = 16;
  config.rows[TILE_X_REST] = config.rows[TILE_SUMS_REST] = (uint8_t)(rest ? rest : 16);
  _tile_loadconfig(&config);
}

/* One group's weights (16 outputs x 32 inputs) as bfloat16 integers q - 8 in AMX's B layout. */
static inline void unpack(const uint8_t *packed, uint16_t *q_tile) {
  /* bfloat16 bits of q - 8 for q = 0..15, twice: the permute indexes 32 entries. */
  const __m512i as_bf16 = _mm512_set_epi16(
      0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, (short)0xBF80, (short)0xC000,
      (short)0xC040, (short)0xC080, (short)0xC0A0, (short)0xC0C0, (short)0xC0E0, (short)0xC100,
      0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, (short)0xBF80, (short)0xC000,
      (short)0xC040, (short)0xC080, (short)0xC0A0, (short)0xC0C0, (short)0xC0E0, (short)0xC100);
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  for (int pair = 0; pair < 8; pair++) {
    __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(packed + 32 * pair)));
    __m512i low = _mm512_and_si512(bytes, nibble), high = _mm512_srli_epi16(bytes, 4);
    _mm512_store_si512((__m512i *)(q_tile + 64 * pair), _mm512_permutexvar_epi16(low, as_bf16));
    _mm512_store_si512((__m512i *)(q_tile + 64 * pair + 32), _mm512_permutexvar_epi16(high, as_bf16));
  }
}

/* Each row's sum over each group of its inputs, for the zeros. */
static float group_sum(const uint16_t *xs) {
  __m512 total = _mm512_setzero_ps();
  for (int half = 0; half < 2; half++) {
    __m256i bits = _mm256_loadu_si256((const __m256i *)(xs + 16 * half));
    total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
  return _mm512_reduce_add_ps(total);
}

/* 0, or -1 when there was no memory for the scratch. */
int int4_cpu_mm(const uint16_t *x, int64_t m, int64_t k, int64_t n, const uint8_t *q,
                const float *scale, const float *zero, float *out) {
  const int64_t groups = k / 32, blocks = n / 16;
  const int rest = (int)(m % 16);
  /* Each thread's running outputs of its block, every row: a group's weights are unpacked once
   * for all the rows. */
  const size_t stride = (size_t)16 * ((m + 15) / 16 * 16);
  float *group_sums = malloc(sizeof(float) * m * groups);
  float *accs = aligned_alloc(64, sizeof(float) * stride * omp_get_max_threads());
  if (group_sums == NULL || accs == NULL) {
    free(group_sums), free(accs);
    return -1;
  }
#pragma omp parallel
  {
    uint16_t q_tile[16 * 32] __attribute__((aligned(64)));
    float sums[16 * 16] __attribute__((aligned(64)));
    float *acc = accs + stride * omp_get_thread_num();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m * groups; i++) group_sums[i] = group_sum(x + (i / groups) * k + (i % groups) * 32);
    configure(rest);
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
      memset(acc, 0, sizeof(float) * 16 * m);
      for (int64_t g = 0; g < groups; g++) {
        unpack(q + (block * groups + g) * 256, q_tile);
        _tile_loadd(TILE_Q, q_tile, 64);
        const __m512 s = _mm512_loadu_ps(scale + (block * groups + g) * 16);
        const __m512 z = _mm512_loadu_ps(zero + (block * groups + g) * 16);
        for (int64_t first = 0; first < m; first += 16) {
          const int64_t rows = m - first < 16 ? m - first : 16;
          if (rows == 16) {
            _tile_loadd(TILE_X, x + first * k + g * 32, k * 2);
            _tile_zero(TILE_SUMS);
            _tile_dpbf16ps(TILE_SUMS, TILE_X, TILE_Q);
            _tile_stored(TILE_SUMS, sums, 64);
          } else {
            _tile_loadd(TILE_X_REST, x + first * k + g * 32, k * 2);
            _tile_zero(TILE_SUMS_REST);
            _tile_dpbf16ps(TILE_SUMS_REST, TILE_X_REST, TILE_Q);
            _tile_stored(TILE_SUMS_REST, sums, 64);
          }
          for (int64_t r = 0; r < rows; r++) {
            float *row = acc + 16 * (first + r);
            __m512 a = _mm512_fmadd_ps(_mm512_load_ps(sums + 16 * r), s, _mm512_load_ps(row));
            a = _mm512_fmadd_ps(_mm512_set1_ps(group_sums[(first + r) * groups + g]), z, a);
            _mm512_store_ps(row, a);
          }
        }
      }
      for (int64_t r = 0; r < m; r++)
        _mm512_storeu_ps(out + r * n + block * 16, _mm512_load_ps(acc + 16 * r));
    }
    _tile_release();
  }
  free(group_sums), free(accs);
  return 0;
}
