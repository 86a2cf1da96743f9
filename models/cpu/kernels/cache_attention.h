// Attention of a few new tokens over the KV cache, with the cache write, in one call (models/
// cpu_attention.py): included by small_m_matmul.cc (it uses v16, load, scalar, to_bf16,
// bf16_round, hsum, exp16 and parallel_chunks from there).
//
// Why: in a decode step XLA ran each layer's attention as ~15 small thunks: the KV write (a
// scatter with a bounds check, so not in place, then a copy of the cache into the output), a
// transposed copy of the whole K and V cache for each of the two dots, two YNNPACK dots and the
// softmax's reductions. On the 1.5B target at a 256-slot cache that was ~4 ms of a ~100 ms step on
// two cores, and the copies grow with the cache. Here the new K/V rows are written in place (the
// caches are aliased to the outputs) and each query reads only its visible slots, once.
//
// Semantics (models.cpu_attention's `write`, then `attention` over the first `window` slots):
// k_new / v_new [B, T, KVH, D] go to slot positions[b, t] of the caches [B, S, KVH, D] (dropped
// when outside [0, S)); then query (b, t, h) attends to slots s < window with s <= positions[b, t],
// kv head h / G: fp32 logits q . k * scale, softmax in fp32, the probabilities rounded to the
// cache dtype (as the reference's p.astype(v.dtype)), p @ v summed in fp32, rounded to the output
// dtype. Positions are cache lengths plus offsets, so >= 0; a negative one (which the reference
// would count from the end) writes nothing and its queries give zeros.
//
// Order of sums: a logit is 16 lanes over d then a fixed tree (hsum); the softmax and p @ v run over
// the visible slots in ascending order. Nothing depends on T, B or the thread split, so a token's
// output in a T-token call equals its output in a one-token call bit for bit.

// hsum's pairwise tree (lanes i + 8, then + 4, + 2, + 1), on the vector unit where there is one.
inline float hsum_tree(v16 v) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  __m512 z;
  std::memcpy(&z, &v, sizeof(z));
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps(z, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
#else
  return hsum(v);
#endif
}

// x / l rounded to the cache dtype, 16 lanes (bf16: to nearest even, as to_bf16).
inline v16 normalise(v16 x, float l, uint16_t*) { return bf16_round(x / splat(l)); }
inline v16 normalise(v16 x, float l, float*) { return x / splat(l); }

// Logit of one query row against one cache row (both fp32 here): per-lane products, then hsum.
inline float row_dot(const float* q, const float* k, int64_t D) {
  v16 acc{};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) acc += load(q + d) * load(k + d);
  float tail = 0.f;
  for (; d < D; ++d) tail = __builtin_fmaf(q[d], k[d], tail);
  return hsum_tree(acc) + tail;
}

// o [D] (+)= p * v [D], per lane.
inline void row_axpy(float p, const float* v, float* o, int64_t D) {
  const v16 ps = splat(p);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) store(o + d, load(o + d) + ps * load(v + d));
  for (; d < D; ++d) o[d] = __builtin_fmaf(p, v[d], o[d]);
}

inline uint16_t store_as(float f, uint16_t*) { return to_bf16(f); }
inline float store_as(float f, float*) { return f; }

template <typename T>
inline void widen(const T* src, float* dst, int64_t D) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) store(dst + d, load(src + d));
  for (; d < D; ++d) dst[d] = scalar(src[d]);
}

// The G queries of one kv head at one position: q [G, D] (rows D apart), the head's cache rows at
// stride `row` (= KVH * D), n visible slots (none: zeros), out [G, D].
// Each cache row is widened once and used for all G queries.
template <typename T>
void attend_group(const T* q, const T* k, const T* v, int64_t row, int64_t n, int64_t G,
                  int64_t D, float scale, T* out) {
  std::vector<float> qf(G * D), o(G * D, 0.f), buf(D);
  for (int64_t g = 0; g < G; ++g) widen(q + g * D, qf.data() + g * D, D);
  if (n > 0) {
    const int64_t np = (n + 15) / 16 * 16;  // logits padded to whole vectors
    std::vector<float> e(G * np);
    for (int64_t s = 0; s < n; ++s) {
      widen(k + s * row, buf.data(), D);
      for (int64_t g = 0; g < G; ++g)
        e[g * np + s] = row_dot(qf.data() + g * D, buf.data(), D) * scale;
    }
    for (int64_t g = 0; g < G; ++g) {
      float* eg = e.data() + g * np;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < n; ++s) m = std::max(m, eg[s]);
      for (int64_t s = n; s < np; ++s) eg[s] = -std::numeric_limits<float>::infinity();
      v16 acc{};
      for (int64_t s = 0; s < np; s += 16) {
        const v16 x = exp16(load(eg + s) - splat(m));
        store(eg + s, x);
        acc += x;
      }
      const float l = hsum_tree(acc);
      for (int64_t s = 0; s < np; s += 16)
        store(eg + s, normalise(load(eg + s), l, static_cast<T*>(nullptr)));
    }
    for (int64_t s = 0; s < n; ++s) {
      widen(v + s * row, buf.data(), D);
      for (int64_t g = 0; g < G; ++g) row_axpy(e[g * np + s], buf.data(), o.data() + g * D, D);
    }
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = store_as(o[i], out);
}

template <typename T>
void cache_attention(ffi::ThreadPool& pool, const T* q, const T* k_new, const T* v_new,
                     const int32_t* positions, T* k, T* v, T* out, int64_t B, int64_t Tn,
                     int64_t H, int64_t KVH, int64_t D, int64_t S, int64_t window, float scale) {
  const int64_t row = KVH * D, G = H / KVH;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t p = positions[b * Tn + t];
      if (p < 0 || p >= S) continue;  // the reference's scatter drops it
      std::memcpy(k + (b * S + p) * row, k_new + (b * Tn + t) * row, row * sizeof(T));
      std::memcpy(v + (b * S + p) * row, v_new + (b * Tn + t) * row, row * sizeof(T));
    }
  // Work items: (b, t, kv head), each one pass over that head's visible slots for its G queries.
  const int64_t items = B * Tn * KVH;
  auto run = [=](int64_t c) {
    const int64_t bt = c / KVH, h = c % KVH, b = bt / Tn;
    const int64_t pos = positions[bt];
    const int64_t n = pos < 0 ? 0 : std::min<int64_t>(window, pos + 1);
    attend_group(q + (bt * H + h * G) * D, k + b * S * row + h * D, v + b * S * row + h * D, row,
                 n, G, D, scale, out + (bt * H + h * G) * D);
  };
  // One thread for little work (a decode over a few hundred slots): a fork and join would cost more.
  int64_t work = 0;
  for (int64_t bt = 0; bt < B * Tn; ++bt)
    work += std::min<int64_t>(window, std::max<int64_t>(positions[bt] + 1, 1));
  if (work * H * D < (int64_t(1) << 20)) {
    for (int64_t c = 0; c < items; ++c) run(c);
  } else {
    parallel_chunks(pool, items, run);
  }
}
