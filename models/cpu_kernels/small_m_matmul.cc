// Small-M fp32 matmul for XLA:CPU, called through the XLA FFI.
//
// Why: XLA:CPU streams a one-row matmul (decode) at memory bandwidth, but for 2..8 rows (a K+1-token
// verify, a few tree branches) it switches to a GEMM that costs 1.5-2.8x the one-row time although
// the weights are read once either way. This kernel streams each weight once for all rows, keeping
// the M x columns accumulators in registers, so M = 5 costs little more than M = 1.
//
// Determinism across M: every output element is accumulated in the same order whatever M and the
// blocking (a lane-wise FMA over k from zero; for the transposed layout, a fixed 16-lane reduction
// after), so a token's logits in a verify equal its logits in a one-token decode bit for bit.
//
// Portable C++ with GCC/Clang vector extensions: -march=native turns them into AVX-512 (or AVX2 halves).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
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
inline v16 splat(float s) { return v16{} + s; }

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
template <int MR, int KB>
inline void nn_panel(const float* x, int64_t K, const float* w, int64_t N, float* out, int64_t k0,
                     int64_t c0, int64_t c1) {
  v16 xs[MR][KB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < KB; ++j) xs[m][j] = splat(x[m * K + k0 + j]);
  const float* wp = w + k0 * N;
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
      for (int j = 0; j < KB; ++j) a = __builtin_fmaf(x[m * K + k0 + j], wp[j * N + n], a);
      out[m * N + n] = a;
    }
}

template <int KB>
inline void nn_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out,
                    int64_t k0, int64_t c0, int64_t c1) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) nn_panel<6, KB>(x + m * K, K, w, N, out + m * N, k0, c0, c1);
  switch (M - m) {
    case 5: nn_panel<5, KB>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 4: nn_panel<4, KB>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 3: nn_panel<3, KB>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 2: nn_panel<2, KB>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    case 1: nn_panel<1, KB>(x + m * K, K, w, N, out + m * N, k0, c0, c1); break;
    default: break;
  }
}

// Measured on a Zen 4 core (1536 x 17920 and 1536 x 151936 weights): 8 rows of w per pass and
// work items of 32768 columns (long contiguous runs the prefetchers follow) stream at 80-95% of the
// bandwidth XLA's one-row GEMV reaches, and M = 5 costs 1.15-1.3x M = 1.
constexpr int kRowsPerPass = 8;
constexpr int64_t kColumnsPerItem = 32768;
constexpr int64_t kMinRun = 4096;  // columns (16 KiB) of a row one thread streams before row ranges win
// Columns [c0, c1) of out = x @ w, w [K, N] row-major: accumulated over k in ascending order from 0.
// Rows [kb, ke) of w only: out holds that part of the sum.
void nn_columns(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out,
                int64_t c0, int64_t c1, int64_t kb, int64_t ke) {
  for (int64_t m = 0; m < M; ++m) std::fill(out + m * N + c0, out + m * N + c1, 0.f);
  int64_t k0 = kb;
  for (; k0 + kRowsPerPass <= ke; k0 += kRowsPerPass) nn_rows<kRowsPerPass>(x, M, K, w, N, out, k0, c0, c1);
  for (; k0 < ke; ++k0) nn_rows<1>(x, M, K, w, N, out, k0, c0, c1);
}

constexpr int kPartials = 4;
// out[m, n0+r] = dot(x[m, :], w[n0+r, :]) for NR rows of w [N, K] and MR rows of x. Each dot keeps
// kPartials partial sums (k-steps of 16 taken round-robin) so one row streams without waiting on FMA
// latency; they are combined in a fixed order, the same for every M.
template <int MR, int NR>
inline void nt_tile(const float* x, int64_t K, const float* w, int64_t N, float* out, int64_t n0) {
  v16 acc[MR][NR][kPartials];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r)
      for (int p = 0; p < kPartials; ++p) acc[m][r][p] = v16{};
  const float* wr = w + n0 * K;
  const int64_t kb = K / (16 * kPartials) * (16 * kPartials);
  for (int64_t k = 0; k < kb; k += 16 * kPartials) {
    for (int p = 0; p < kPartials; ++p) {
      v16 wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = load(wr + r * K + k + 16 * p);
      for (int m = 0; m < MR; ++m) {
        v16 xv = load(x + m * K + k + 16 * p);
        for (int r = 0; r < NR; ++r) acc[m][r][p] += xv * wv[r];
      }
    }
  }
  for (int64_t k = kb; k + 16 <= K; k += 16) {
    for (int m = 0; m < MR; ++m) {
      v16 xv = load(x + m * K + k);
      for (int r = 0; r < NR; ++r) acc[m][r][0] += xv * load(wr + r * K + k);
    }
  }
  const int64_t kv = K / 16 * 16;
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      v16 a = acc[m][r][0];
      for (int p = 1; p < kPartials; ++p) a += acc[m][r][p];
      float s = hsum(a);
      for (int64_t k = kv; k < K; ++k) s = __builtin_fmaf(x[m * K + k], wr[r * K + k], s);
      out[m * N + n0 + r] = s;
    }
}

template <int NR>
inline void nt_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out,
                    int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) nt_tile<4, NR>(x + m * K, K, w, N, out + m * N, n0);
  switch (M - m) {
    case 3: nt_tile<3, NR>(x + m * K, K, w, N, out + m * N, n0); break;
    case 2: nt_tile<2, NR>(x + m * K, K, w, N, out + m * N, n0); break;
    case 1: nt_tile<1, NR>(x + m * K, K, w, N, out + m * N, n0); break;
    default: break;
  }
}

// Columns [c0, c1) of out = x @ w.T, w [N, K] row-major (a tied embedding used as the lm_head).
void nt_columns(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out,
                int64_t c0, int64_t c1) {
  int64_t n = c0;
  for (; n < c1; ++n) nt_rows<1>(x, M, K, w, N, out, n);
}

struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks = 0;
};

ffi::Error SmallMMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> out, bool transpose_w) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 2)
    return ffi::Error::InvalidArgument("small_m_matmul: x must be [..., K] and w 2-D");
  const int64_t K = xd.back();
  const int64_t M = static_cast<int64_t>(x.element_count()) / std::max<int64_t>(K, 1);
  const int64_t N = transpose_w ? wd[0] : wd[1];
  if ((transpose_w ? wd[1] : wd[0]) != K)
    return ffi::Error::InvalidArgument("small_m_matmul: contraction sizes differ");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(op, op + M * N, 0.f);
    return ffi::Error::Success();
  }
  const int64_t pool_threads = std::max<int64_t>(pool.num_threads(), 1);
  // Work items. Wide w [K, N]: column ranges, each thread's a long contiguous run of every row.
  // Narrow w (a thread's share of a row under kMinRun columns: wo, w_down, qkv on 2+ threads):
  // row ranges instead, each one contiguous block of w, into per-range partial sums added in
  // range order at the end. Either way the split depends on K, N and the pool, never on M.
  const bool split_rows = !transpose_w && pool_threads > 1 && N < kMinRun * pool_threads &&
                          K >= 2 * kRowsPerPass * pool_threads;
  int64_t chunks, step;
  if (split_rows) {
    chunks = pool_threads;
    step = ((K + chunks - 1) / chunks + kRowsPerPass - 1) / kRowsPerPass * kRowsPerPass;
    chunks = (K + step - 1) / step;
  } else {
    // A multiple of the thread count, so that no thread is left with one item more than the others.
    const int64_t align = transpose_w ? 1 : 64;
    const int64_t per_thread = (N + pool_threads - 1) / pool_threads;
    const int64_t items = pool_threads * ((per_thread + kColumnsPerItem - 1) / kColumnsPerItem);
    step = std::max<int64_t>(align, ((N + items - 1) / items + align - 1) / align * align);
    chunks = (N + step - 1) / step;
  }
  std::vector<float> partial(split_rows ? (chunks - 1) * M * N : 0);
  float* pp = partial.data();
  auto run = [=](int64_t c) {
    if (split_rows) {
      nn_columns(xp, M, K, wp, N, c == 0 ? op : pp + (c - 1) * M * N, 0, N, c * step,
                 std::min(K, (c + 1) * step));
      return;
    }
    const int64_t c0 = c * step, c1 = std::min(N, c0 + step);
    if (transpose_w) nt_columns(xp, M, K, wp, N, op, c0, c1);
    else nn_columns(xp, M, K, wp, N, op, c0, c1, 0, K);
  };
  auto reduce = [&]() {
    if (!split_rows) return;
    for (int64_t c = 1; c < chunks; ++c) {
      const float* src = pp + (c - 1) * M * N;
      for (int64_t i = 0; i < M * N; ++i) op[i] += src[i];
    }
  };
  const int64_t threads = std::min(pool_threads, chunks);
  if (threads <= 1) {
    for (int64_t c = 0; c < chunks; ++c) run(c);
    reduce();
    return ffi::Error::Success();
  }
  auto work = std::make_shared<Work>();
  work->chunks = chunks;
  // Workers take chunks until none is left; one scheduled late finds none and touches nothing,
  // so the caller only waits for chunks actually taken and cannot deadlock on a busy pool.
  auto drain = [work, run]() {
    for (int64_t c; (c = work->next.fetch_add(1)) < work->chunks;) {
      run(c);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([drain]() { drain(); });
  drain();
  while (work->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
  reduce();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxSmallMMatmul, SmallMMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_w"));
