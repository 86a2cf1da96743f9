// Small-M matmul for XLA:CPU (fp32, bf16, int8 or int4 weights), called through the XLA FFI.
//
// Why: XLA:CPU streams a one-row matmul (decode) at memory bandwidth, but for 2..16 rows (a K+1-token
// verify, a few tree branches) it switches to a GEMM that costs 1.5-2.8x the one-row time although
// the weights are read once either way; and its bf16 dots are ~10x slower than fp32 ones. This
// kernel streams each weight once for all rows: 8 rows of w at a time over a long run of columns,
// the rows' x values broadcast in registers and out's rows kept hot in L1/L2. So M = 5 costs
// 1.1-1.4x M = 1, and bf16 weights (widened in registers) read half the bytes.
//
// Determinism across M: each output element is accumulated in the same order whatever M (ascending
// k from zero: per lane FMAs, pairs of k with vdpbf16ps, ordered partial sums over row ranges, or a
// fixed 16-lane reduction for the transposed layout; the choice depends on dtypes, K, N and the
// thread count, never on M; int8 weights sum exact integers), so a token's logits in a verify equal
// its logits in a one-token decode bit for bit.
//
// Portable C++ with GCC/Clang vector extensions: -march=native turns them into AVX-512 (or AVX2
// halves); the vdpbf16ps path is compiled only where the CPU has AVX512_BF16.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline v16 load(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// bf16 weights: 16 of them widened to fp32 in registers (bf16 is the top half of an fp32), so a
// bf16 model streams half the bytes and still accumulates in fp32.
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
inline v16 load(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
}
// int8 weights where the CPU lacks AVX512_VNNI (else see nn_panel_vnni): 16 widened to fp32 in
// registers and multiplied by x's int16 values (exact in fp32); the scales are applied at the end.
// (GCC scalarises __builtin_convertvector from int8, hence the intrinsics.)
inline v16 load(const int8_t* p) {
  v16 r;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&r, &f, sizeof(r));
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  std::memcpy(&r, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof(lo), &hi, sizeof(hi));
#else
  for (int i = 0; i < 16; ++i) r[i] = float(p[i]);
#endif
  return r;
}
inline float scalar(int8_t v) { return float(v); }
inline float scalar(float v) { return v; }
inline float scalar(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint16_t to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline v16 splat(float s) { return v16{} + s; }
// 16 lanes rounded to bf16 as to_bf16 does, kept as fp32 (the low halves zero). A NaN is quieted
// instead, so that its top half, what a bf16 store keeps, is a NaN too.
inline v16 bf16_round(v16 x) {
  u32x16 u;
  std::memcpy(&u, &x, sizeof(u));
  const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const u32x16 out = x != x ? (u | 0x00400000u) : rounded;
  v16 r;
  std::memcpy(&r, &out, sizeof(r));
  return r;
}

inline float hsum(v16 v) {
  // A fixed pairwise tree, so the order never depends on the caller.
  float t[16];
  std::memcpy(t, &v, sizeof(t));
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// out[0:MR, c0:c1] (+)= x[0:MR, k0:k0+KB] @ w[k0:k0+KB, c0:c1]: KB rows of w streamed side by side,
// the MR x KB broadcast x values held in registers, out rows kept hot in L1/L2.
template <int MR, int KB, typename W>
inline void nn_panel(const float* x, int64_t K, const W* w, int64_t N, float* out, int64_t k0,
                     int64_t c0, int64_t c1) {
  v16 xs[MR][KB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < KB; ++j) xs[m][j] = splat(x[m * K + k0 + j]);
  const W* wp = w + k0 * N;
  int64_t n = c0;
  for (; n + 16 <= c1; n += 16) {
    v16 wv[KB];
    for (int j = 0; j < KB; ++j) wv[j] = load(wp + j * N + n);
    for (int m = 0; m < MR; ++m) {
      v16 acc = load(out + m * N + n);
      for (int j = 0; j < KB; ++j) acc += xs[m][j] * wv[j];
      store(out + m * N + n, acc);
    }
  }
  for (; n < c1; ++n)  // ragged last columns: the same k order, one lane
    for (int m = 0; m < MR; ++m) {
      float a = out[m * N + n];
      for (int j = 0; j < KB; ++j) a = __builtin_fmaf(x[m * K + k0 + j], scalar(wp[j * N + n]), a);
      out[m * N + n] = a;
    }
}

template <int KB, typename W>
inline void nn_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* out,
                    int64_t k0, int64_t c0, int64_t c1) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) nn_panel<6, KB, W>(x + m * K, K, w, N, out + m * N, k0, c0, c1);
  switch (M - m) {
    case 5: nn_panel<5, KB, W>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 4: nn_panel<4, KB, W>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 3: nn_panel<3, KB, W>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 2: nn_panel<2, KB, W>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 1: nn_panel<1, KB, W>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    default: break;
  }
}

// Measured on a Zen 4 core (1536 x 17920 and 1536 x 151936 weights): 8 rows of w per pass and
// work items of 32768 columns (long contiguous runs the prefetchers follow) stream at 80-95% of the
// bandwidth XLA's one-row GEMV reaches, and M = 5 costs 1.15-1.3x M = 1.
constexpr int kRowsPerPass = 8;
constexpr int64_t kColumnsPerItem = 32768;
constexpr int64_t kMinRun = 4096;  // columns (16 KiB) of a row one thread streams before row ranges win
#if defined(__AVX512F__)
// Puts back in column order the 32-column blocks that nn_panel_dp / nn_panel_vnni leave permuted by
// their in-lane pairing (lo lanes: columns 0-3, 8-11, 16-19, 24-27; hi: the others), in rows
// [0, M) of stride ld, from c0 in steps of 32 while a whole block fits. It only moves 32-bit
// lanes, so fp32 sums and int32 sums alike.
template <typename T>
inline void unpermute32(T* base, int64_t M, int64_t ld, int64_t c0, int64_t c1) {
  static_assert(sizeof(T) == 4, "32-bit lanes");
  alignas(64) static const int32_t kFirst[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t kSecond[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = c0; n + 32 <= c1; n += 32) {
      T* o = base + m * ld + n;
      const __m512i lo = _mm512_loadu_si512(o), hi = _mm512_loadu_si512(o + 16);
      _mm512_storeu_si512(o, _mm512_permutex2var_epi32(lo, first, hi));
      _mm512_storeu_si512(o + 16, _mm512_permutex2var_epi32(lo, second, hi));
    }
}
#else
template <typename T>
inline void unpermute32(T*, int64_t, int64_t, int64_t, int64_t) {}  // no permuting path without AVX-512
#endif

// Columns [c0, c1) of out = x @ w, w [K, N] row-major: accumulated over k in ascending order from 0.
#ifdef __AVX512BF16__
// bf16 x and w where the CPU has AVX512_BF16: vdpbf16ps multiplies pairs of bf16 along k into fp32
// lanes, half the instructions of widening then FMA, which is what bounds a bf16 verify (5 FMAs per
// 32 bytes of weights). Rows k, k+1 of w are interleaved into pairs: in-lane unpacks over 32
// columns (out held permuted, see unpermute32), a vpermw for a last block of 16.
// Each 32-column step reads one 64-byte line of each row. With several rows of x the dot products
// slow the loads down, and prefetching the line 4 steps ahead keeps more misses in flight than the
// hardware prefetchers do: on a Zen 4 core the 1.5B's 5-token verify went from ~207 to ~195 ms. A
// one-row decode streams at bandwidth already and gained nothing in the model (so it does not).
constexpr int64_t kDpPrefetch = 128;  // bf16 elements: 4 lines
template <int MR>
inline void nn_panel_dp(const uint16_t* xh, int64_t K, const uint16_t* w, int64_t N, float* out,
                        int64_t k0, int64_t c0, int64_t c1) {
  static_assert(kRowsPerPass % 2 == 0, "rows are taken in pairs");
  constexpr int P = kRowsPerPass / 2;
  alignas(64) static const uint16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                  21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                  11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kPairs);
  __m512bh xs[MR][P];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < P; ++p) {
      const uint32_t pair = uint32_t(xh[m * K + k0 + 2 * p]) | (uint32_t(xh[m * K + k0 + 2 * p + 1]) << 16);
      xs[m][p] = (__m512bh)_mm512_set1_epi32(int(pair));
    }
  const uint16_t* wp = w + k0 * N;
  int64_t n = c0;
  // 32 columns at a time: whole 64-byte rows of w, paired in-lane by vpunpck{l,h}wd (one uop, where
  // vpermw needs an insert and a lane-crossing shuffle). Out's 32 columns are then held permuted
  // (lo: 0-3, 8-11, 16-19, 24-27; hi: the others) until `unpermute32` after the last pass.
  for (; n + 32 <= c1; n += 32) {
    __m512bh lo[P], hi[P];
    if constexpr (MR >= 2)
      for (int r = 0; r < 2 * P; ++r) _mm_prefetch(reinterpret_cast<const char*>(wp + r * N + n + kDpPrefetch), _MM_HINT_T0);
    for (int p = 0; p < P; ++p) {
      const __m512i a = _mm512_loadu_si512(wp + (2 * p) * N + n);
      const __m512i b = _mm512_loadu_si512(wp + (2 * p + 1) * N + n);
      lo[p] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      hi[p] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int m = 0; m < MR; ++m) {
      __m512 al = _mm512_loadu_ps(out + m * N + n), ah = _mm512_loadu_ps(out + m * N + n + 16);
      for (int p = 0; p < P; ++p) {
        al = _mm512_dpbf16_ps(al, lo[p], xs[m][p]);
        ah = _mm512_dpbf16_ps(ah, hi[p], xs[m][p]);
      }
      _mm512_storeu_ps(out + m * N + n, al);
      _mm512_storeu_ps(out + m * N + n + 16, ah);
    }
  }
  for (; n + 16 <= c1; n += 16) {
    __m512bh wv[P];
    for (int p = 0; p < P; ++p) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (2 * p) * N + n));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (2 * p + 1) * N + n));
      wv[p] = (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
    for (int m = 0; m < MR; ++m) {
      __m512 acc = _mm512_loadu_ps(out + m * N + n);
      for (int p = 0; p < P; ++p) acc = _mm512_dpbf16_ps(acc, wv[p], xs[m][p]);
      _mm512_storeu_ps(out + m * N + n, acc);
    }
  }
  for (; n < c1; ++n)  // ragged last columns: one lane, in k order
    for (int m = 0; m < MR; ++m) {
      float a = out[m * N + n];
      for (int j = 0; j < kRowsPerPass; ++j)
        a = __builtin_fmaf(scalar(xh[m * K + k0 + j]), scalar(wp[j * N + n]), a);
      out[m * N + n] = a;
    }
}

inline void nn_rows_dp(const uint16_t* xh, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                       float* out, int64_t k0, int64_t c0, int64_t c1) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) nn_panel_dp<6>(xh + m * K, K, w, N, out + m * N, k0, c0, c1);
  switch (M - m) {
    case 5: nn_panel_dp<5>(xh + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 4: nn_panel_dp<4>(xh + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 3: nn_panel_dp<3>(xh + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 2: nn_panel_dp<2>(xh + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 1: nn_panel_dp<1>(xh + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    default: break;
  }
}
constexpr bool kHasDp = true;
#else
inline void nn_rows_dp(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t,
                       int64_t, int64_t) {}
constexpr bool kHasDp = false;
#endif

// int8 weights (models/quant.py) times x quantized per row to int16 (SmallMMatmulInt8): exact
// integer products summed in int32 lanes. Widening int8 to fp32 then an FMA bounded the int8 path
// at ~13 GB/s a core (3 vector ops per 16 weights); vpdpwssd multiplies pairs of int16 along k into
// int32 lanes, so 32 weights cost a sign-extend, half an unpack and one vpdpwssd per row of x.
// An int32 lane sums at most kIntChunk products of |x| <= 32767 and |q| <= 128 (< 2^31), then is
// added to out in fp32 in k order, so nothing wraps and the sum is the same whatever M.
constexpr int64_t kIntChunk = 512;  // a multiple of 16 (rows per pass)
constexpr int64_t kTileRows = 16, kTileCols = 32;  // tiled int8 weights: see tile_panel_vnni
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasTiles = true;  // only the VNNI path reads tiled q
// Narrow full-width int8 rows (wo, w_down, wqkv of a small draft: under 4 KiB) are too short a run
// for the hardware prefetchers, so a pass over rows [k0, k0 + rows) prefetches the next pass's rows
// (one contiguous block), spread over its 32-column steps; null where none is wanted. Measured on a
// Zen 4 core: w_down 4864 x 896 of the 0.5B in 0.29 ms instead of 0.48; bf16 rows of 3 KiB (the
// 1.5B's) gained nothing and its verify lost. Wider rows with 2+ rows of x (tree branches, the
// draft's catch-up) prefetch each row 4 lines ahead instead, as nn_panel_dp does: the 0.5B's head
// at M = 3 in ~8.4 ms instead of ~9.7-12.
constexpr int64_t kPrefetchBelow = 4096;
constexpr int64_t kVnniPrefetch = 256;  // int8 elements: 4 lines ahead in each row
inline const int8_t* ahead(const int8_t* w, int64_t N, int64_t c0, int64_t c1, int64_t k0, int64_t rows, int64_t ke) {
  const bool narrow = c0 == 0 && c1 == N && N % 32 == 0 && N <= kPrefetchBelow;
  return narrow && k0 + 2 * rows <= ke ? w + (k0 + rows) * N : nullptr;
}
// x's int16 pairs (k0 + 2p, k0 + 2p + 1) of rows 0..MR-1, each broadcast to every int32 lane.
template <int MR, int P>
inline void broadcast_pairs(const int16_t* xq, int64_t K, int64_t k0, __m512i (&xs)[MR][P]) {
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < P; ++p) {
      const uint32_t pair = uint32_t(uint16_t(xq[m * K + k0 + 2 * p])) |
                            (uint32_t(uint16_t(xq[m * K + k0 + 2 * p + 1])) << 16);
      xs[m][p] = _mm512_set1_epi32(int(pair));
    }
}
// acc[m, 0..31] (rows of stride ld) += the P pairs of weights in lo / hi times row m's pairs.
template <int MR, int P>
inline void dpwssd_block(int32_t* acc, int64_t ld, const __m512i (&lo)[P], const __m512i (&hi)[P],
                         const __m512i (&xs)[MR][P]) {
  for (int m = 0; m < MR; ++m) {
    int32_t* o = acc + m * ld;
    __m512i al = _mm512_loadu_si512(o), ah = _mm512_loadu_si512(o + 16);
    for (int p = 0; p < P; ++p) {
      al = _mm512_dpwssd_epi32(al, lo[p], xs[m][p]);
      ah = _mm512_dpwssd_epi32(ah, hi[p], xs[m][p]);
    }
    _mm512_storeu_si512(o, al);
    _mm512_storeu_si512(o + 16, ah);
  }
}
template <int MR, int P>
inline void nn_panel_vnni(const int16_t* xq, int64_t K, const int8_t* w, int64_t N, int32_t* acc,
                          int64_t ld, int64_t k0, int64_t c0, int64_t c1, const int8_t* pf) {
  __m512i xs[MR][P];
  broadcast_pairs<MR, P>(xq, K, k0, xs);
  const int8_t* wp = w + k0 * N;
  int64_t n = c0;
  // The same in-lane pairing as nn_panel_dp: acc's 32-column blocks are held permuted.
  for (; n + 32 <= c1; n += 32) {
    __m512i lo[P], hi[P];
    if (pf != nullptr) {
      for (int i = 0; i < P; ++i) _mm_prefetch(reinterpret_cast<const char*>(pf + ((n - c0) / 32 * P + i) * 64), _MM_HINT_T0);
    } else if (MR >= 2 && ((n - c0) & 63) == 0) {  // as nn_panel_dp: a line per row, 4 ahead
      for (int r = 0; r < 2 * P; ++r) _mm_prefetch(reinterpret_cast<const char*>(wp + r * N + n + kVnniPrefetch), _MM_HINT_T0);
    }
    for (int p = 0; p < P; ++p) {
      const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (2 * p) * N + n)));
      const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (2 * p + 1) * N + n)));
      lo[p] = _mm512_unpacklo_epi16(a, b);
      hi[p] = _mm512_unpackhi_epi16(a, b);
    }
    dpwssd_block<MR, P>(acc + (n - c0), ld, lo, hi, xs);
  }
  for (; n < c1; ++n)  // ragged last columns, in column order
    for (int m = 0; m < MR; ++m) {
      int32_t a = acc[m * ld + (n - c0)];
      for (int j = 0; j < 2 * P; ++j) a += int32_t(xq[m * K + k0 + j]) * int32_t(wp[j * N + n]);
      acc[m * ld + (n - c0)] = a;
    }
}

// Integer sums are exact in any order, so the rows of q per pass may depend on M: 16 for one or
// two rows of x (half the passes over acc), 8 where more broadcast x pairs must stay in registers.
template <int P>
inline void nn_rows_vnni(const int16_t* xq, int64_t M, int64_t K, const int8_t* w, int64_t N,
                         int32_t* acc, int64_t ld, int64_t k0, int64_t c0, int64_t c1, const int8_t* pf) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6, pf = nullptr) nn_panel_vnni<6, P>(xq + m * K, K, w, N, acc + m * ld, ld, k0, c0, c1, pf);
  switch (M - m) {
    case 5: nn_panel_vnni<5, P>(xq + m * K, K, w, N, acc + m * ld, ld, k0, c0, c1, pf); break;
    case 4: nn_panel_vnni<4, P>(xq + m * K, K, w, N, acc + m * ld, ld, k0, c0, c1, pf); break;
    case 3: nn_panel_vnni<3, P>(xq + m * K, K, w, N, acc + m * ld, ld, k0, c0, c1, pf); break;
    case 2: nn_panel_vnni<2, P>(xq + m * K, K, w, N, acc + m * ld, ld, k0, c0, c1, pf); break;
    case 1: nn_panel_vnni<1, P>(xq + m * K, K, w, N, acc + m * ld, ld, k0, c0, c1, pf); break;
    default: break;
  }
}

// Tiled int8 weights (models/quant.py, `Int8Weight.tiled`): for rows [16t, 16t + 16) and columns
// [32b, 32b + 32), 8 lines of 64 bytes in a row, line p holding rows 16t + 2p and 16t + 2p + 1 of
// those columns interleaved (column-major pairs). Why: a narrow row (w_down, wo, wqkv of a small
// draft: under 4 KiB) is too short a run for the hardware prefetchers, so 16 rows of [K, N] read
// as 16 short streams ran at ~13 GB/s on a Zen 4 core; tiled, a pass is one sequential stream (~25
// GB/s), and a line needs no unpack: its halves sign-extend straight into vpdpwssd's pairs, with the
// columns in order. Same integer sums as nn_panel_vnni (exact), so the same results.
// Rows of x are taken up to 3 at a time. Measured on the 0.5B's w_down: tiled is ~1.6x as fast
// as row-major for 1 or 2 rows (a draft step, its catch-up), even at 3 (a small tree), and up to
// ~1.2x slower from 4 rows (splitting a tile in halves to keep x in registers was slower still).
template <int MR>
inline void tile_panel_vnni(const int16_t* xq, int64_t K, const int8_t* w, int64_t N, int32_t* acc,
                            int64_t ld, int64_t k0, int64_t c0, int64_t c1) {
  constexpr int P = kTileRows / 2;
  __m512i xs[MR][P];
  broadcast_pairs<MR, P>(xq, K, k0, xs);
  const int8_t* t = w + k0 * N + c0 * kTileRows;
  for (int64_t n = c0; n < c1; n += kTileCols, t += kTileRows * kTileCols) {
    __m512i lo[P], hi[P];
    for (int p = 0; p < P; ++p) {
      lo[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * p)));
      hi[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * p + 32)));
    }
    dpwssd_block<MR, P>(acc + (n - c0), ld, lo, hi, xs);
  }
}
inline void tile_rows_vnni(const int16_t* xq, int64_t M, int64_t K, const int8_t* w, int64_t N,
                           int32_t* acc, int64_t ld, int64_t k0, int64_t c0, int64_t c1) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile_panel_vnni<3>(xq + m * K, K, w, N, acc + m * ld, ld, k0, c0, c1);
  switch (M - m) {
    case 2: tile_panel_vnni<2>(xq + m * K, K, w, N, acc + m * ld, ld, k0, c0, c1); break;
    case 1: tile_panel_vnni<1>(xq + m * K, K, w, N, acc + m * ld, ld, k0, c0, c1); break;
    default: break;
  }
}

// Rows [kb, ke) of q, columns [c0, c1): out (fp32) = the integer sums xq @ q, kIntChunk rows at a
// time. Tiled q: kb, ke, c0 and c1 are whole tiles (SmallMMatmulInt8 checks K and N; `matmul`
// aligns row ranges to 16 rows and column ranges to 64 columns).
void nn_columns(const int16_t* xq, const uint16_t*, int64_t M, int64_t K, const int8_t* w, int64_t N,
                float* out, int64_t c0, int64_t c1, int64_t kb, int64_t ke, bool tiled) {
  const int64_t width = c1 - c0;
  std::vector<int32_t> acc(M * width);
  for (int64_t m = 0; m < M; ++m) std::fill(out + m * N + c0, out + m * N + c1, 0.f);
  for (int64_t cb = kb; cb < ke; cb += kIntChunk) {
    const int64_t ce = std::min(ke, cb + kIntChunk);
    std::fill(acc.begin(), acc.end(), 0);
    int64_t k0 = cb;
    if (tiled) {
      for (; k0 < ce; k0 += kTileRows) tile_rows_vnni(xq, M, K, w, N, acc.data(), width, k0, c0, c1);
    } else if (M <= 2)
      for (; k0 + 16 <= ce; k0 += 16) nn_rows_vnni<8>(xq, M, K, w, N, acc.data(), width, k0, c0, c1, ahead(w, N, c0, c1, k0, 16, ke));
    for (; k0 + 8 <= ce; k0 += 8) nn_rows_vnni<4>(xq, M, K, w, N, acc.data(), width, k0, c0, c1, ahead(w, N, c0, c1, k0, 8, ke));
    if (k0 > cb && !tiled) unpermute32(acc.data(), M, width, 0, width);
    for (; k0 < ce; ++k0)  // the last rows when K is not a multiple of 8
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = c0; n < c1; ++n) acc[m * width + (n - c0)] += int32_t(xq[m * K + k0]) * int32_t(w[k0 * N + n]);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = c0; n < c1; ++n) out[m * N + n] += float(acc[m * width + (n - c0)]);
  }
}
#else
constexpr bool kHasTiles = false;
#endif

// Rows [kb, ke) of w only: out holds that part of the sum.
// xh: the same x as bf16 when both operands are bf16 and the CPU has AVX512_BF16, else null.
template <typename W>
void nn_columns(const float* x, const uint16_t* xh, int64_t M, int64_t K, const W* w, int64_t N,
                float* out, int64_t c0, int64_t c1, int64_t kb, int64_t ke, bool /*tiled: never*/) {
  for (int64_t m = 0; m < M; ++m) std::fill(out + m * N + c0, out + m * N + c1, 0.f);
  int64_t k0 = kb;
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (xh != nullptr && k0 + kRowsPerPass <= ke) {
      for (; k0 + kRowsPerPass <= ke; k0 += kRowsPerPass) nn_rows_dp(xh, M, K, w, N, out, k0, c0, c1);
      unpermute32(out, M, N, c0, c1);
    }
  }
  for (; k0 + kRowsPerPass <= ke; k0 += kRowsPerPass) nn_rows<kRowsPerPass, W>(x, M, K, w, N, out, k0, c0, c1);
  for (; k0 < ke; ++k0) nn_rows<1, W>(x, M, K, w, N, out, k0, c0, c1);
}

constexpr int kPartials = 4;
// out[m, n] = dot(x[m, :], w[n, :]) for one row n of w [N, K] and MR rows of x. Each dot keeps
// kPartials partial sums (k-steps of 16 taken round-robin) so the row streams without waiting on FMA
// latency; they are combined in a fixed order, the same for every M.
template <int MR, typename W>
inline void nt_tile(const float* x, int64_t K, const W* w, int64_t N, float* out, int64_t n) {
  v16 acc[MR][kPartials];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < kPartials; ++p) acc[m][p] = v16{};
  const W* wr = w + n * K;
  const int64_t kb = K / (16 * kPartials) * (16 * kPartials);
  for (int64_t k = 0; k < kb; k += 16 * kPartials) {
    for (int p = 0; p < kPartials; ++p) {
      const v16 wv = load(wr + k + 16 * p);
      for (int m = 0; m < MR; ++m) acc[m][p] += load(x + m * K + k + 16 * p) * wv;
    }
  }
  for (int64_t k = kb; k + 16 <= K; k += 16) {
    const v16 wv = load(wr + k);
    for (int m = 0; m < MR; ++m) acc[m][0] += load(x + m * K + k) * wv;
  }
  const int64_t kv = K / 16 * 16;
  for (int m = 0; m < MR; ++m) {
    v16 a = acc[m][0];
    for (int p = 1; p < kPartials; ++p) a += acc[m][p];
    float s = hsum(a);
    for (int64_t k = kv; k < K; ++k) s = __builtin_fmaf(x[m * K + k], scalar(wr[k]), s);
    out[m * N + n] = s;
  }
}

// Columns [c0, c1) of out = x @ w.T, w [N, K] row-major (a tied embedding used as the lm_head).
template <typename W>
void nt_columns(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* out,
                int64_t c0, int64_t c1) {
  for (int64_t n = c0; n < c1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) nt_tile<4, W>(x + m * K, K, w, N, out + m * N, n);
    switch (M - m) {
      case 3: nt_tile<3, W>(x + m * K, K, w, N, out + m * N, n); break;
      case 2: nt_tile<2, W>(x + m * K, K, w, N, out + m * N, n); break;
      case 1: nt_tile<1, W>(x + m * K, K, w, N, out + m * N, n); break;
      default: break;
    }
  }
}

#include "parallel.h"

// op [M, N] = xp [M, K] @ w, fp32 in and out, w [K, N] (or [N, K] with transpose_w) of type W.
template <typename X, typename W>
void matmul(ffi::ThreadPool& pool, const X* xp, const uint16_t* xh, const W* wp, float* op,
            int64_t M, int64_t K, int64_t N, bool transpose_w, bool tiled = false) {
  const int64_t pool_threads = std::max<int64_t>(pool.num_threads(), 1);
  // Work items. Wide w [K, N]: column ranges, each thread's a long contiguous run of every row.
  // Narrow w (a thread's share of a row under kMinRun columns: wo, w_down, qkv on 2+ threads):
  // row ranges instead, each one contiguous block of w, into per-range partial sums added in
  // range order at the end. Either way the split depends on K, N and the pool, never on M.
  const bool split_rows = !transpose_w && pool_threads > 1 && N < kMinRun * pool_threads &&
                          K >= 2 * kRowsPerPass * pool_threads;
  // int8 row ranges are whole tiles, tiled or not, so that both layouts sum the same ranges
  const int64_t row_align = std::is_same_v<X, int16_t> ? kTileRows : kRowsPerPass;
  int64_t chunks, step;
  if (split_rows) {
    chunks = pool_threads;
    step = ((K + chunks - 1) / chunks + row_align - 1) / row_align * row_align;
    chunks = (K + step - 1) / step;
  } else {
    // A multiple of the thread count, so that no thread is left with one item more than the others.
    const int64_t align = transpose_w ? 1 : 64;
    const int64_t per_thread = (N + pool_threads - 1) / pool_threads;
    // Many rows (a bf16 prefill): narrower items, so that out's [M, columns] tile stays in L2
    // while every group of rows passes over the same 8 rows of w.
    const int64_t max_cols = M <= 16 ? kColumnsPerItem : std::max<int64_t>(64, (1 << 16) / M);
    const int64_t items = pool_threads * ((per_thread + max_cols - 1) / max_cols);
    step = std::max<int64_t>(align, ((N + items - 1) / items + align - 1) / align * align);
    chunks = (N + step - 1) / step;
  }
  std::vector<float> partial(split_rows ? (chunks - 1) * M * N : 0);
  float* pp = partial.data();
  auto run = [=](int64_t c) {
    if (split_rows) {
      nn_columns(xp, xh, M, K, wp, N, c == 0 ? op : pp + (c - 1) * M * N, 0, N, c * step,
                 std::min(K, (c + 1) * step), tiled);
      return;
    }
    const int64_t c0 = c * step, c1 = std::min(N, c0 + step);
    if constexpr (std::is_same_v<X, float>) {
      if (transpose_w) return nt_columns(xp, M, K, wp, N, op, c0, c1);
    }
    nn_columns(xp, xh, M, K, wp, N, op, c0, c1, 0, K, tiled);
  };
  auto reduce = [&]() {
    if (!split_rows) return;
    for (int64_t c = 1; c < chunks; ++c) {
      const float* src = pp + (c - 1) * M * N;
      for (int64_t i = 0; i < M * N; ++i) op[i] += src[i];
    }
  };
  parallel_chunks(pool, chunks, run);
  reduce();
}

#include "bf16_strips.h"
#include "int4_groups.h"
#include "exp16.h"
#include "cache_attention.h"
#include "swiglu.h"

// op [M, N] = xh [M, K] @ w packed in strips (bf16_strips.h). Threads take runs of whole strips,
// each one contiguous block of w, from a list that starts with long runs (what the prefetchers
// need) and ends with single strips, so the thread that finishes first waits for at most one
// strip (w_down's: 573 KiB, ~40 us at half the bus). With four equal runs a thread a decode step
// of the 1.5B target took 1-3% longer (two runs of per-step interleaved A/B, the method of
// benchmarks/ab_decode_step.py, through a switch not kept).
void matmul_strips(ffi::ThreadPool& pool, const uint16_t* xh, const uint16_t* wp, float* op,
                   int64_t M, int64_t K, int64_t N) {
  const int64_t strips = N / kStripCols;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  std::vector<int64_t> bounds{0};
  for (int64_t left = strips; left > 0;) {
    int64_t run = (left + 2 * threads - 1) / (2 * threads);
    if (run > kStripGroup) run = std::min(left, (run + kStripGroup - 1) / kStripGroup * kStripGroup);
    left -= run;
    bounds.push_back(strips - left);
  }
  const int64_t* b = bounds.data();
  parallel_chunks(pool, int64_t(bounds.size()) - 1, [=](int64_t c) {
    strip_columns(xh, M, K, wp, N, op, b[c], b[c + 1]);
  });
}

bool f32_or_bf16(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

// Runs body(xp, xh, op) with x widened to fp32 (xp; xh: the raw bf16 x, or null) and op an fp32
// [M, N] out, rounded to bf16 afterwards where out is bf16. With widen_x false a bf16 x is passed
// as xh only (xp null): the packed path reads nothing else, and a prefill's x is megabytes.
template <typename Body>
ffi::Error with_f32_io(ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& out, int64_t M, int64_t K,
                       int64_t N, Body body, bool widen_x = true) {
  if (M == 0 || N == 0) return ffi::Error::Success();
  std::vector<float> xbuf, obuf;
  const float* xp = static_cast<const float*>(x.untyped_data());
  const uint16_t* xh = nullptr;
  if (x.element_type() == ffi::DataType::BF16) {
    xh = static_cast<const uint16_t*>(x.untyped_data());
    xp = nullptr;
    if (widen_x) {
      xbuf.resize(M * K);
      for (int64_t i = 0; i < M * K; ++i) xbuf[i] = scalar(xh[i]);
      xp = xbuf.data();
    }
  }
  const bool out_bf16 = out->element_type() == ffi::DataType::BF16;
  if (out_bf16) obuf.resize(M * N);
  float* op = out_bf16 ? obuf.data() : static_cast<float*>(out->untyped_data());
  if (K == 0) std::fill(op, op + M * N, 0.f);
  else body(xp, xh, op);
  if (out_bf16) {
    uint16_t* oh = static_cast<uint16_t*>(out->untyped_data());
    for (int64_t i = 0; i < M * N; ++i) oh[i] = to_bf16(obuf[i]);
  }
  return ffi::Error::Success();
}

// x [..., K] and out [..., N] fp32 or bf16 (widened / rounded here: they are small), w fp32 or bf16.
ffi::Error SmallMMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Result<ffi::AnyBuffer> out, bool transpose_w, bool packed) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 2)
    return ffi::Error::InvalidArgument("small_m_matmul: x must be [..., K] and w 2-D");
  if (!f32_or_bf16(x.element_type()) || !f32_or_bf16(w.element_type()) ||
      !f32_or_bf16(out->element_type()))
    return ffi::Error::InvalidArgument("small_m_matmul: operands must be float32 or bfloat16");
  const int64_t K = xd.back();
  const int64_t M = static_cast<int64_t>(x.element_count()) / std::max<int64_t>(K, 1);
  const int64_t N = transpose_w ? wd[0] : wd[1];
  if ((transpose_w ? wd[1] : wd[0]) != K)
    return ffi::Error::InvalidArgument("small_m_matmul: contraction sizes differ");
  const bool w_bf16 = w.element_type() == ffi::DataType::BF16;
  if (packed && (!kHasStrips || !w_bf16 || x.element_type() != ffi::DataType::BF16 || transpose_w ||
                 K % 2 != 0 || N % kStripCols != 0))
    return ffi::Error::InvalidArgument(
        "small_m_matmul: packed w needs AVX512_BF16, bf16 x and w, and K, N multiples of 2, 32");
  return with_f32_io(x, out, M, K, N, [&](const float* xp, const uint16_t* xh, float* op) {
    if (packed)
      matmul_strips(pool, xh, static_cast<const uint16_t*>(w.untyped_data()), op, M, K, N);
    else if (w_bf16)
      matmul(pool, xp, kHasDp ? xh : nullptr, static_cast<const uint16_t*>(w.untyped_data()), op,
             M, K, N, transpose_w);
    else
      matmul(pool, xp, nullptr, static_cast<const float*>(w.untyped_data()), op, M, K, N,
             transpose_w);
  }, /*widen_x=*/!packed);
}

// out = (x @ q) * scale: q [K, N] int8, scale [N] fp32 (one per column of q).
ffi::Error SmallMMatmulInt8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer q,
                            ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out, bool tiled) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  if (xd.size() < 1 || qd.size() != 2 || scale.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("small_m_matmul_int8: x must be [..., K], q 2-D, scale 1-D");
  if (!f32_or_bf16(x.element_type()) || !f32_or_bf16(out->element_type()) ||
      q.element_type() != ffi::DataType::S8 || scale.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(
        "small_m_matmul_int8: x and out must be float32 or bfloat16, q int8, scale float32");
  const int64_t K = xd.back();
  const int64_t M = static_cast<int64_t>(x.element_count()) / std::max<int64_t>(K, 1);
  const int64_t N = qd[1];
  if (qd[0] != K || scale.dimensions()[0] != N)
    return ffi::Error::InvalidArgument("small_m_matmul_int8: q must be [K, N] and scale [N]");
  if (tiled && (!kHasTiles || K % kTileRows != 0 || N % kTileCols != 0))
    return ffi::Error::InvalidArgument(
        "small_m_matmul_int8: tiled q needs AVX512_VNNI and K, N multiples of 16, 32");
  const int8_t* qp = static_cast<const int8_t*>(q.untyped_data());
  const float* sp = static_cast<const float*>(scale.untyped_data());
  return with_f32_io(x, out, M, K, N, [&](const float* xp, const uint16_t*, float* op) {
    // Each row of x as int16 with its own scale (cpu_matmul.quantize_rows_int16 is the reference):
    // xq = round(x * 32767 / max|x|), a row with a NaN or Inf gives a row of NaN.
    std::vector<int16_t> xq(M * K);
    std::vector<float> sx(M);
    for (int64_t m = 0; m < M; ++m) {
      const float* r = xp + m * K;
      float amax = 0.f;
      bool finite = true;
      for (int64_t k = 0; k < K; ++k) {
        finite = finite && std::isfinite(r[k]);
        amax = std::max(amax, std::fabs(r[k]));
      }
      const float safe = finite && amax > 0.f ? amax : 1.f;
      const float inv = 32767.f / safe;
      sx[m] = finite ? safe / 32767.f : std::numeric_limits<float>::quiet_NaN();
      for (int64_t k = 0; k < K; ++k)
        xq[m * K + k] = finite ? int16_t(std::clamp(std::nearbyint(r[k] * inv), -32767.f, 32767.f)) : 0;
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    matmul(pool, xq.data(), nullptr, qp, op, M, K, N, false, tiled);
#else  // the same integers, summed in fp32
    std::vector<float> xf(xq.begin(), xq.end());
    matmul(pool, xf.data(), nullptr, qp, op, M, K, N, false);
#endif
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) op[m * N + n] = op[m * N + n] * sp[n] * sx[m];
  });
}

// out = x @ w, w int4 in tiles [K/32, N/32, 640] uint8 (int4_groups.h, models/int4.py).
ffi::Error SmallMMatmulInt4(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer tiles,
                            ffi::Result<ffi::AnyBuffer> out) {
  if (!kHasInt4) return ffi::Error::InvalidArgument("small_m_matmul_int4: this CPU lacks AVX512_VNNI");
  auto xd = x.dimensions();
  auto td = tiles.dimensions();
  if (xd.size() < 1 || td.size() != 3 || td[2] != 640)
    return ffi::Error::InvalidArgument("small_m_matmul_int4: x must be [..., K] and tiles [K/32, N/32, 640]");
  if (!f32_or_bf16(x.element_type()) || !f32_or_bf16(out->element_type()) ||
      tiles.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument(
        "small_m_matmul_int4: x and out must be float32 or bfloat16, tiles uint8");
  const int64_t K = xd.back();
  const int64_t M = static_cast<int64_t>(x.element_count()) / std::max<int64_t>(K, 1);
  const int64_t N = td[1] * 32;
  if (td[0] * 32 != K) return ffi::Error::InvalidArgument("small_m_matmul_int4: contraction sizes differ");
  const uint8_t* tp = static_cast<const uint8_t*>(tiles.untyped_data());
  return with_f32_io(x, out, M, K, N, [&](const float* xp, const uint16_t*, float* op) {
    matmul_int4(pool, xp, tp, op, M, K, N);
  });
}

// out [B, T, H, D] = attention of q over the caches after writing k_new / v_new at positions
// (cache_attention.h); k_out / v_out are the caches, aliased to k_cache / v_cache by the caller.
ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_new,
                          ffi::AnyBuffer v_new, ffi::AnyBuffer positions, ffi::AnyBuffer k_cache,
                          ffi::AnyBuffer v_cache, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                          int64_t window, float scale) {
  auto qd = q.dimensions();
  auto kd = k_cache.dimensions();
  auto nd = k_new.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || nd.size() != 4 || positions.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(
        "cache_attention: q [B, T, H, D], k_new / v_new [B, T, KVH, D], positions [B, T] and "
        "caches [B, S, KVH, D]");
  const int64_t B = qd[0], Tn = qd[1], H = qd[2], D = qd[3], S = kd[1], KVH = kd[2];
  const auto t = q.element_type();
  const bool same = k_new.element_type() == t && v_new.element_type() == t &&
                    k_cache.element_type() == t && v_cache.element_type() == t &&
                    out->element_type() == t && f32_or_bf16(t);
  if (!same || positions.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument(
        "cache_attention: q, k_new, v_new, the caches and out must share one dtype (float32 or "
        "bfloat16), positions int32");
  auto same_dims = [](auto a, auto b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  };
  if (kd[0] != B || kd[3] != D || KVH <= 0 || H % KVH != 0 || nd[0] != B || nd[1] != Tn ||
      nd[2] != KVH || nd[3] != D || !same_dims(v_new.dimensions(), nd) ||
      !same_dims(v_cache.dimensions(), kd) ||
      positions.dimensions()[0] != B || positions.dimensions()[1] != Tn)
    return ffi::Error::InvalidArgument("cache_attention: inconsistent shapes");
  if (window < 1 || window > S)
    return ffi::Error::InvalidArgument("cache_attention: window must be in [1, S]");
  const size_t cache_bytes = k_cache.size_bytes();
  // XLA honours the aliasing; were it not to, the caches are copied first, as a scatter would.
  if (k_out->untyped_data() != k_cache.untyped_data())
    std::memcpy(k_out->untyped_data(), k_cache.untyped_data(), cache_bytes);
  if (v_out->untyped_data() != v_cache.untyped_data())
    std::memcpy(v_out->untyped_data(), v_cache.untyped_data(), cache_bytes);
  const int32_t* pos = static_cast<const int32_t*>(positions.untyped_data());
  if (t == ffi::DataType::BF16)
    cache_attention(pool, static_cast<const uint16_t*>(q.untyped_data()),
                    static_cast<const uint16_t*>(k_new.untyped_data()),
                    static_cast<const uint16_t*>(v_new.untyped_data()), pos,
                    static_cast<uint16_t*>(k_out->untyped_data()),
                    static_cast<uint16_t*>(v_out->untyped_data()),
                    static_cast<uint16_t*>(out->untyped_data()), B, Tn, H, KVH, D, S, window,
                    scale);
  else
    cache_attention(pool, static_cast<const float*>(q.untyped_data()),
                    static_cast<const float*>(k_new.untyped_data()),
                    static_cast<const float*>(v_new.untyped_data()), pos,
                    static_cast<float*>(k_out->untyped_data()),
                    static_cast<float*>(v_out->untyped_data()),
                    static_cast<float*>(out->untyped_data()), B, Tn, H, KVH, D, S, window, scale);
  return ffi::Error::Success();
}

// out [..., I] = silu(gate) * up for gate_up [..., 2I] (swiglu.h).
ffi::Error Swiglu(ffi::ThreadPool pool, ffi::AnyBuffer gate_up, ffi::Result<ffi::AnyBuffer> out) {
  const auto gd = gate_up.dimensions(), od = out->dimensions();
  const auto t = gate_up.element_type();
  if (!f32_or_bf16(t) || out->element_type() != t)
    return ffi::Error::InvalidArgument("swiglu: gate_up and out must share one dtype, float32 or bfloat16");
  if (gd.size() < 1 || gd.size() != od.size() || gd.back() != 2 * od.back() ||
      !std::equal(gd.begin(), gd.end() - 1, od.begin()))
    return ffi::Error::InvalidArgument("swiglu: gate_up [..., 2I] and out [..., I]");
  const int64_t I = od.back();
  const int64_t M = I == 0 ? 0 : int64_t(out->element_count()) / I;
  if (t == ffi::DataType::BF16)
    swiglu(pool, static_cast<const uint16_t*>(gate_up.untyped_data()),
           static_cast<uint16_t*>(out->untyped_data()), M, I);
  else
    swiglu(pool, static_cast<const float*>(gate_up.untyped_data()),
           static_cast<float*>(out->untyped_data()), M, I);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxSmallMMatmul, SmallMMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_w")
                                  .Attr<bool>("packed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxSmallMMatmulInt8, SmallMMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("tiled"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxSmallMMatmulInt4, SmallMMatmulInt4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxCacheAttention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxSwiglu, Swiglu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// Whether SsdJaxSmallMMatmulInt4 serves (models/int4.py `kernel_available`).
extern "C" int SsdJaxInt4() { return kHasInt4 ? 1 : 0; }

// Whether SsdJaxSmallMMatmulInt8 takes tiled q (models/cpu_matmul.py `int8_tiles`).
extern "C" int SsdJaxInt8Tiles() { return kHasTiles ? 1 : 0; }

// Whether SsdJaxSmallMMatmul takes packed bf16 w (models/cpu_matmul.py `bf16_strips`).
extern "C" int SsdJaxBf16Strips() { return kHasStrips ? 1 : 0; }

// Turns the kernels' helper thread on or off (parallel.h; models/cpu_matmul.py `use_helper_thread`).
extern "C" void SsdJaxUseHelper(int on) { g_use_helper = on != 0; }
