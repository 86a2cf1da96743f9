// SwiGLU: out [M, I] = silu(gate) * up for gate_up [M, 2I] (gate columns first), included by
// small_m_matmul.cc (it uses v16, load, splat, bf16_round, exp16 and parallel_chunks from there).
//
// Why: between w_gate_up and w_down XLA:CPU ran this as one fusion split in two tasks for its
// intra-op pool, and waking a pool thread cost 40-90 us a call (28 a decode step of the 1.5B
// target) for ~5 us of work. Here it is one thread's work below a prefill's size.
//
// Semantics: the ops of the reference `jax.nn.silu(gate) * up` as XLA runs them, each rounded to
// the operands' dtype (for bf16 XLA rounds after every op): e = exp(-g), a = e + 1, d = 1 / a,
// s = g * d, out = s * up. With exp16 the results equal XLA:CPU's bit for bit (every bf16 gate
// value, 2M random fp32 ones; tests/test_cpu_swiglu.py). Elementwise, so a token's value does not
// depend on M or on the other rows.

inline v16 op_round(v16 x, uint16_t*) { return bf16_round(x); }
inline v16 op_round(v16 x, float*) { return x; }

inline void store16(float* p, v16 v) { store(p, v); }
inline void store16(uint16_t* p, v16 v) {  // v holds bf16 values: their top halves
  u32x16 u;
  std::memcpy(&u, &v, sizeof(u));
  const u16x16 h = __builtin_convertvector(u >> 16, u16x16);
  std::memcpy(p, &h, sizeof(h));
}

template <typename T>
inline v16 swiglu16(v16 g, v16 u) {
  T* tag = nullptr;
  const v16 e = op_round(exp16(-g), tag);
  const v16 a = op_round(e + splat(1.f), tag);
  const v16 d = op_round(splat(1.f) / a, tag);
  const v16 s = op_round(g * d, tag);
  return op_round(s * u, tag);
}

// Rows [r0, r1) of gate_up [M, 2I] into out [M, I]; a row's last I % 16 values go through a
// padded 16-lane buffer, so every value takes the same vector path.
template <typename T>
void swiglu_rows(const T* gu, T* out, int64_t I, int64_t r0, int64_t r1) {
  for (int64_t m = r0; m < r1; ++m) {
    const T* g = gu + m * 2 * I;
    const T* u = g + I;
    T* o = out + m * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) store16(o + i, swiglu16<T>(load(g + i), load(u + i)));
    if (i < I) {
      T gt[16] = {}, ut[16] = {}, ot[16];
      std::memcpy(gt, g + i, (I - i) * sizeof(T));
      std::memcpy(ut, u + i, (I - i) * sizeof(T));
      store16(ot, swiglu16<T>(load(gt), load(ut)));
      std::memcpy(o + i, ot, (I - i) * sizeof(T));
    }
  }
}

template <typename T>
void swiglu(ffi::ThreadPool& pool, const T* gu, T* out, int64_t M, int64_t I) {
  // Threads only for a prefill's worth (~1 us a thousand values on one thread): a fork and join
  // costs more than a decode's 9k values.
  constexpr int64_t kValuesPerChunk = int64_t(1) << 16;
  const int64_t rows = std::max<int64_t>(1, kValuesPerChunk / std::max<int64_t>(I, 1));
  const int64_t chunks = (M + rows - 1) / rows;
  if (chunks <= 1) return swiglu_rows(gu, out, I, 0, M);
  parallel_chunks(pool, chunks, [=](int64_t c) {
    swiglu_rows(gu, out, I, c * rows, std::min(M, (c + 1) * rows));
  });
}
