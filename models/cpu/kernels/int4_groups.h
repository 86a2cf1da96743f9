// Int4 weights in groups of 32 (models/int4.py) times x in groups of 32 as int8: included by
// small_m_matmul.cc (it uses parallel_chunks and kMinRun from there).
//
// Why: a draft step's time is its bytes. Int8 weights through vpdpwssd (x as int16) streamed the
// 0.5B draft's layers at ~20 GB/s on a Zen 4 core, short of the ~26 GB/s a plain read reaches,
// and int4 through the same instructions (nibbles widened to int16) was still bound by the
// widening. Here a 64-byte line of nibbles is two vpdpbusd (u8 weights x s8 activations, four
// products a lane) after one AND and one shift+AND: no widening at all. A tile (one group of 32
// rows by 32 columns) is 512 bytes of nibbles and 128 of bf16 scales and offsets, one contiguous
// run, and the tiles of a group lie side by side, so a pass over a matrix is one sequential stream.
// Measured on the 0.5B's layers (24 x wqkv, wo, w_gate_up, w_down) at M = 1: ~10.3 ms on one core
// where int8 took ~16.7 ms (a plain read of the same bytes: ~8.5 ms), ~8.3 ms on two (int8 ~12.3).
// Software prefetching (2, 4 or 8 tiles ahead) made one core slower (13-14 ms): the tiles are one
// sequential stream, which the hardware prefetchers follow.
//
// Sums: a group's integer products are exact in int32 (32 products of |x| <= 127 and q <= 15);
// then out += scale * (acc * sx) and out += offset * (sx * sum(xq)) in fp32, groups in ascending
// order. Neither the order nor the thread split depends on M, so a token's logits in a verify equal
// its logits in a one-token decode bit for bit.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasInt4 = true;
constexpr int64_t kInt4Group = 32, kInt4Block = 32, kInt4Tile = 640, kInt4Nibbles = 512;

inline __m512 widen_bf16(const uint8_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// out[0:MR, 32b0:32b1] += rows [32g0, 32g1) of w times x, MR rows of x (stride K, groups of 32 as
// int8), sx / bs [MR][G]: each group's scale and scale * sum(xq).
template <int MR>
inline void int4_panel(const int8_t* xq, int64_t K, const float* sx, const float* bs, int64_t G,
                       const uint8_t* tiles, int64_t NB, float* out, int64_t N, int64_t g0,
                       int64_t g1, int64_t b0, int64_t b1) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t g = g0; g < g1; ++g) {
    int32_t xg[MR][8];  // x's 32 int8 of this group as 8 quads, each broadcast to every lane
    for (int m = 0; m < MR; ++m) std::memcpy(xg[m], xq + m * K + g * kInt4Group, sizeof(xg[m]));
    const uint8_t* t = tiles + (g * NB + b0) * kInt4Tile;
    for (int64_t b = b0; b < b1; ++b, t += kInt4Tile) {
      __m512i lo[MR], hi[MR];
      for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {
        const __m512i v = _mm512_loadu_si512(t + 64 * i);
        const __m512i vl = _mm512_and_si512(v, mask);
        const __m512i vh = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        for (int m = 0; m < MR; ++m) {
          const __m512i xv = _mm512_set1_epi32(xg[m][i]);
          lo[m] = _mm512_dpbusd_epi32(lo[m], vl, xv);
          hi[m] = _mm512_dpbusd_epi32(hi[m], vh, xv);
        }
      }
      const __m512 s0 = widen_bf16(t + kInt4Nibbles), s1 = widen_bf16(t + kInt4Nibbles + 32);
      const __m512 o0 = widen_bf16(t + kInt4Nibbles + 64), o1 = widen_bf16(t + kInt4Nibbles + 96);
      for (int m = 0; m < MR; ++m) {
        float* o = out + m * N + b * kInt4Block;
        const __m512 sxv = _mm512_set1_ps(sx[m * G + g]), bsv = _mm512_set1_ps(bs[m * G + g]);
        __m512 r0 = _mm512_loadu_ps(o), r1 = _mm512_loadu_ps(o + 16);
        r0 = _mm512_fmadd_ps(s0, _mm512_mul_ps(_mm512_cvtepi32_ps(lo[m]), sxv), r0);
        r1 = _mm512_fmadd_ps(s1, _mm512_mul_ps(_mm512_cvtepi32_ps(hi[m]), sxv), r1);
        r0 = _mm512_fmadd_ps(o0, bsv, r0);
        r1 = _mm512_fmadd_ps(o1, bsv, r1);
        _mm512_storeu_ps(o, r0);
        _mm512_storeu_ps(o + 16, r1);
      }
    }
  }
}

// out [M, N] (zeroed over its part first) += groups [g0, g1), blocks [b0, b1), up to 4 rows of x
// per pass over the weights.
inline void int4_part(const int8_t* xq, int64_t M, int64_t K, const float* sx, const float* bs,
                      int64_t G, const uint8_t* tiles, int64_t NB, float* out, int64_t N,
                      int64_t g0, int64_t g1, int64_t b0, int64_t b1) {
  for (int64_t m = 0; m < M; ++m)
    std::fill(out + m * N + b0 * kInt4Block, out + m * N + b1 * kInt4Block, 0.f);
  int64_t m = 0;
  auto at = [&](int64_t r) { return std::make_tuple(xq + r * K, sx + r * G, bs + r * G, out + r * N); };
  for (; m + 4 <= M; m += 4) {
    auto [x, s, c, o] = at(m);
    int4_panel<4>(x, K, s, c, G, tiles, NB, o, N, g0, g1, b0, b1);
  }
  auto [x, s, c, o] = at(m);
  switch (M - m) {
    case 3: int4_panel<3>(x, K, s, c, G, tiles, NB, o, N, g0, g1, b0, b1); break;
    case 2: int4_panel<2>(x, K, s, c, G, tiles, NB, o, N, g0, g1, b0, b1); break;
    case 1: int4_panel<1>(x, K, s, c, G, tiles, NB, o, N, g0, g1, b0, b1); break;
    default: break;
  }
}

// op [M, N] = x [M, K] (fp32) @ the int4 w of tiles [K/32, N/32, 640].
void matmul_int4(ffi::ThreadPool& pool, const float* xp, const uint8_t* tiles, float* op,
                 int64_t M, int64_t K, int64_t N) {
  const int64_t G = K / kInt4Group, NB = N / kInt4Block;
  // x's groups as int8 (models.int4.quantize_groups_int8 is the reference): round(x * 127 / max|x|)
  // with scale max|x| / 127; a row holding NaN or Inf gives a row of NaN.
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * G), bs(M * G);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * K;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) finite = finite && std::isfinite(r[k]);
    for (int64_t g = 0; g < G; ++g) {
      const float* rg = r + g * kInt4Group;
      float amax = 0.f;
      for (int64_t k = 0; k < kInt4Group; ++k) amax = std::max(amax, std::fabs(rg[k]));
      const float safe = finite && amax > 0.f ? amax : 1.f;
      const float inv = 127.f / safe;
      int32_t sum = 0;
      for (int64_t k = 0; k < kInt4Group; ++k) {
        const int8_t q = finite ? int8_t(std::clamp(std::nearbyint(rg[k] * inv), -127.f, 127.f)) : 0;
        xq[m * K + g * kInt4Group + k] = q;
        sum += q;
      }
      const float s = finite ? safe / 127.f : std::numeric_limits<float>::quiet_NaN();
      sx[m * G + g] = s;
      bs[m * G + g] = s * float(sum);
    }
  }
  const int8_t* x8 = xq.data();
  const float* sxp = sx.data();
  const float* bsp = bs.data();
  // Work items as in `matmul`: column ranges of whole blocks, or, where a thread's share of a row
  // would be a short run (wo, w_down, wqkv of a small draft on 2+ threads), ranges of groups into
  // per-range partial sums added in range order. Either way the split depends on K, N and the
  // pool, never on M.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const bool split_groups = threads > 1 && N < kMinRun * threads && G >= 2 * threads;
  int64_t chunks, step;
  if (split_groups) {
    step = (G + threads - 1) / threads;
    chunks = (G + step - 1) / step;
  } else {
    const int64_t per_thread = (NB + threads - 1) / threads;
    const int64_t max_blocks = kColumnsPerItem / kInt4Block;
    const int64_t items = threads * ((per_thread + max_blocks - 1) / max_blocks);
    step = std::max<int64_t>(1, (NB + items - 1) / items);
    chunks = (NB + step - 1) / step;
  }
  std::vector<float> partial(split_groups ? (chunks - 1) * M * N : 0);
  float* pp = partial.data();
  parallel_chunks(pool, chunks, [=](int64_t c) {
    if (split_groups)
      int4_part(x8, M, K, sxp, bsp, G, tiles, NB, c == 0 ? op : pp + (c - 1) * M * N, N, c * step,
                std::min(G, (c + 1) * step), 0, NB);
    else
      int4_part(x8, M, K, sxp, bsp, G, tiles, NB, op, N, 0, G, c * step, std::min(NB, (c + 1) * step));
  });
  for (int64_t c = 1; split_groups && c < chunks; ++c) {
    const float* src = pp + (c - 1) * M * N;
    for (int64_t i = 0; i < M * N; ++i) op[i] += src[i];
  }
}
#else
constexpr bool kHasInt4 = false;
inline void matmul_int4(ffi::ThreadPool&, const float*, const uint8_t*, float*, int64_t, int64_t,
                        int64_t) {}
#endif
