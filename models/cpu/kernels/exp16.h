// exp for 16 fp32 lanes, included by small_m_matmul.cc (it uses v16 and splat from there): the
// softmax of cache_attention.h (x <= 0) and the SiLU of swiglu.h (any x).

typedef int32_t i32x16 __attribute__((vector_size(64)));

// As Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r times 2^n; ~1 ulp.
// Lanes under -87.3 (exp below the smallest normal float) give 0, lanes over 88.76 (past the
// largest float) inf, and NaN stays NaN. 2^n is built in the exponent bits, as 2^(n-1) * 2 for
// n > 0 so that n = 128 fits; for x <= 0 the arithmetic is the one the attention was tested with.
// A scalar expf per element cost more than the attention's dots.
inline v16 exp16(v16 x) {
  const v16 xc = x < splat(-87.3f) ? splat(-87.3f) : (x > splat(88.76f) ? splat(88.76f) : x);
  const v16 magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const v16 n = (xc * splat(1.44269504f) + magic) - magic;
  const v16 r = xc - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v16 y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * (r * r) + r + splat(1.f);
  const i32x16 ni = __builtin_convertvector(n, i32x16);
  const i32x16 high = ni > 0;  // -1 where n > 0
  const i32x16 e = (ni + high + 127) << 23;
  v16 two_n;
  std::memcpy(&two_n, &e, sizeof(two_n));
  v16 out = y * two_n;
  out = high != 0 ? out * splat(2.f) : out;
  out = x < splat(-87.3f) ? splat(0.f) : out;
  out = x > splat(88.76f) ? splat(__builtin_inff()) : out;
  return x != x ? x : out;
}
