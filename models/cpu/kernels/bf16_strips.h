// Packed bf16 weights ("strips", models/cpu_matmul.py `pack_bf16`), included by small_m_matmul.cc.
//
// Layout: w [K, N] (K even, N a multiple of 32) as N / 32 strips of 32 columns, strip after strip;
// a strip is K / 2 blocks of 128 bytes, one per pair of rows (2p, 2p + 1): columns 0-15 then
// 16-31, each column's two values adjacent, the pair vdpbf16ps multiplies:
//   packed[s][p][h][c][j] = w[2p + j][32 s + 16 h + c].
//
// Why: the row-major kernel walks 8 rows of w side by side over a run of columns and keeps out in
// memory. On the 1.5B's narrow weights (rows of 3-4 KiB) that is 8 short streams the prefetchers
// never ramp up on, and with 5 rows of x the out loads and stores and the in-register pairing
// crowd the loads of w. Here a strip is one sequential stream read once, already paired, with
// out's [rows, 32] tile in registers over all of K. Measured on one Zen 4 core, from DRAM
// (GB/s of weights, row-major -> strips): w_down 8960 x 1536 at M = 1 18 -> 27, at M = 5 14 -> 27;
// wqkv 1536 x 2048 19 -> 27 and 14 -> 25; w_gate_up 1536 x 17920 23 -> 27 and 18 -> 26.
//
// Sums: every out element is acc = 0, then acc = vdpbf16ps(acc, pair p) for p = 0, 1, ... in
// order, the sequence the row-major vdpbf16ps path runs, so the two layouts agree bit for bit
// where that path sums a column over all of K in one range; and it is the same for any number of
// rows (many rows only split K into blocks, with acc stored and reloaded between them, exact).
// Threads take whole strips, so the result does not depend on the thread count either.
constexpr int64_t kStripCols = 32;
// Many rows (a prefill): K is taken in blocks of this many pairs, so that a block of 4 strips
// (4 x 1024 x 128 bytes = 512 KiB) stays in L2 while every group of rows passes over it.
constexpr int64_t kStripBlockPairs = 1024, kStripGroup = 4;
#ifdef __AVX512BF16__
constexpr bool kHasStrips = true;

// out[0:MR, strips [s0, s0 + S)] = (or +=, from pair pb > 0) x[0:MR, pairs [pb, pe)] @ those strips.
template <int MR, int S>
inline void strip_panel(const uint16_t* xh, int64_t K, const uint16_t* w, int64_t N, float* out,
                        int64_t s0, int64_t pb, int64_t pe) {
  const int64_t stride = K * kStripCols;  // bf16 elements per strip
  __m512 acc[MR][S][2];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < S; ++s)
      for (int h = 0; h < 2; ++h)
        acc[m][s][h] = pb == 0 ? _mm512_setzero_ps()
                               : _mm512_loadu_ps(out + m * N + (s0 + s) * kStripCols + 16 * h);
  const uint16_t* base = w + s0 * stride;
  for (int64_t p = pb; p < pe; ++p) {
    __m512bh lo[S], hi[S];
    for (int s = 0; s < S; ++s) {
      const uint16_t* t = base + s * stride + p * 64;
      lo[s] = (__m512bh)_mm512_loadu_si512(t);
      hi[s] = (__m512bh)_mm512_loadu_si512(t + 32);
    }
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      std::memcpy(&pair, xh + m * K + 2 * p, sizeof(pair));  // x[m, 2p] low, x[m, 2p + 1] high
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int s = 0; s < S; ++s) {
        acc[m][s][0] = _mm512_dpbf16_ps(acc[m][s][0], lo[s], xs);
        acc[m][s][1] = _mm512_dpbf16_ps(acc[m][s][1], hi[s], xs);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < S; ++s)
      for (int h = 0; h < 2; ++h)
        _mm512_storeu_ps(out + m * N + (s0 + s) * kStripCols + 16 * h, acc[m][s][h]);
}

// Strips [sa, sb) for MR rows of x: S at a time (as many as the registers hold), then one at a time.
template <int MR>
inline void strip_rows(const uint16_t* xh, int64_t K, const uint16_t* w, int64_t N, float* out,
                       int64_t sa, int64_t sb, int64_t pb, int64_t pe) {
  constexpr int S = MR <= 2 ? 4 : 2;  // accumulators 2 * MR * S and 2 * S of w: at most 28 zmm
  int64_t s = sa;
  for (; s + S <= sb; s += S) strip_panel<MR, S>(xh, K, w, N, out, s, pb, pe);
  for (; s < sb; ++s) strip_panel<MR, 1>(xh, K, w, N, out, s, pb, pe);
}

// out [M, N] columns of strips [sa, sb) = xh [M, K] @ packed w: rows 6 at a time; K in blocks only
// when there is more than one group of rows to reuse a block.
inline void strip_columns(const uint16_t* xh, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                          float* out, int64_t sa, int64_t sb) {
  const int64_t pairs = K / 2;
  const int64_t block = M <= 6 ? pairs : kStripBlockPairs;
  const int64_t group = M <= 6 ? sb - sa : kStripGroup;
  for (int64_t g = sa; g < sb; g += group) {
    const int64_t ge = std::min(sb, g + group);
    for (int64_t pb = 0; pb < pairs; pb += block) {
      const int64_t pe = std::min(pairs, pb + block);
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) strip_rows<6>(xh + m * K, K, w, N, out + m * N, g, ge, pb, pe);
      switch (M - m) {
        case 5: strip_rows<5>(xh + m * K, K, w, N, out + m * N, g, ge, pb, pe); break;
        case 4: strip_rows<4>(xh + m * K, K, w, N, out + m * N, g, ge, pb, pe); break;
        case 3: strip_rows<3>(xh + m * K, K, w, N, out + m * N, g, ge, pb, pe); break;
        case 2: strip_rows<2>(xh + m * K, K, w, N, out + m * N, g, ge, pb, pe); break;
        case 1: strip_rows<1>(xh + m * K, K, w, N, out + m * N, g, ge, pb, pe); break;
        default: break;
      }
    }
  }
}
#else  // SmallMMatmul refuses packed w here: the Python side packs only where kHasStrips
constexpr bool kHasStrips = false;
inline void strip_columns(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*,
                          int64_t, int64_t) {}
#endif
