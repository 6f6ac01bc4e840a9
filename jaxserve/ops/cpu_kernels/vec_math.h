// Vectors of floats for the CPU kernels, through GCC's and clang's vector extensions (AVX-512 when
// the machine has it, else 8 lanes), and the lane-by-lane math they share.

#pragma once

#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace jaxserve {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IntVec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef float UnalignedVec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline Vec Load(const float* x) { return *reinterpret_cast<const UnalignedVec*>(x); }
inline void Store(float* x, Vec v) { *reinterpret_cast<UnalignedVec*>(x) = v; }

// a * b + c rounded once, in every lane, whatever the compiler would contract on its own (-ffp-contract
// fuses a product into its sum only where the product has no other use, so two spellings of one sum may
// round differently): where two paths must give the same bits (the int8 matmul's tiles and its vector
// code), both call this.
inline Vec FusedMulAdd(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (Vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  for (int i = 0; i < kLanes; ++i) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return c;
#endif
}

// bfloat16 bits (uint16_t), widened to float32 as they are read: Load (kLanes of them) and Widen (one).
using Bf16 = uint16_t;
typedef Bf16 UnalignedBf16Vec __attribute__((vector_size(kLanes * sizeof(Bf16)), aligned(2)));
typedef uint32_t UintVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline Vec Load(const Bf16* x) {
  const UintVec bits = __builtin_convertvector(*reinterpret_cast<const UnalignedBf16Vec*>(x), UintVec) << 16;
  Vec v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}
// v rounded to bfloat16 (to nearest even, as XLA's convert rounds; NaN stays NaN) into out[0..kLanes-1].
// With AVX512-BF16 one vcvtneps2bf16, which rounds the same way but flushes float32 subnormals (below
// 2^-126) to zero: values no activation rounded here comes near.
inline void StoreBf16(Bf16* out, Vec v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
  UintVec bits;
  __builtin_memcpy(&bits, &v, sizeof(bits));
  const UintVec rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const auto nan = (UintVec)((bits & 0x7fffffffu) > 0x7f800000u);  // all ones where v is NaN
  const UintVec result = (rounded & ~nan) | (((bits >> 16) | 0x40u) & nan);
  *reinterpret_cast<UnalignedBf16Vec*>(out) = __builtin_convertvector(result, UnalignedBf16Vec);
#endif
}
inline float Widen(float x) { return x; }
inline float Widen(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for x <= 0, lane by lane: x = n ln2 + r, exp(r) by Cephes' polynomial for expf (relative
// error about 1e-7), 2^n from the exponent bits. Below -87 it gives about 1e-38 rather than less,
// which neither a softmax's sum (it holds the maximum's 1) nor Silu's product can notice.
inline Vec ExpNonPositive(Vec x) {
  x = x < -87.0f ? Vec{} - 87.0f : x;
  const IntVec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, IntVec);  // about x / ln2
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  Vec poly = 1.9875691500e-4f * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const IntVec bits = (n + 127) << 23;
  Vec two_n;
  __builtin_memcpy(&two_n, &bits, sizeof(two_n));
  return poly * two_n;
}

#ifdef __AVX512F__
// exp(x) for x <= 0 to a relative error of about 3e-6, in half ExpNonPositive's instructions, for softmax
// weights that are rounded to bfloat16 next (whose rounding is a thousand times coarser): x / ln2 = n + f with
// f in [-1/2, 1/2], 2^f by a degree-4 polynomial fitted for relative error, 2^n applied by vscalefps (which
// also takes n past float32's exponent range to 0 or a subnormal). x must not be -inf (f would be NaN).
inline Vec ExpNonPositiveForRounding(Vec x) {
  const __m512 t = (__m512)(x * 1.44269504088896341f);
  // The zero-masked forms with every lane kept: the plain intrinsics' undefined pass-through operand draws
  // GCC 12's -Wmaybe-uninitialized, which the build would print to every user.
  const __m512 n = _mm512_maskz_roundscale_ps(0xffff, t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Vec f = (Vec)_mm512_sub_ps(t, n);
  Vec poly = 9.58279613405466e-3f * f + 5.590630695223808e-2f;
  poly = poly * f + 2.4024099111557007e-1f;
  poly = poly * f + 6.931242346763611e-1f;
  poly = poly * f + 1.0f;
  return (Vec)_mm512_maskz_scalef_ps(0xffff, (__m512)poly, n);
}
#else
// Without AVX-512 (no vscalefps, and no bfloat16 products to round for): the exact exp.
inline Vec ExpNonPositiveForRounding(Vec x) { return ExpNonPositive(x); }
#endif

// silu(x) = x * sigmoid(x), lane by lane, from exp(-|x|) (ExpNonPositive): x / (1 + e) where x >= 0,
// x e / (1 + e) below, so no lane overflows.
inline Vec Silu(Vec x) {
  const Vec e = ExpNonPositive(x < 0.0f ? x : -x);
  return (x < 0.0f ? x * e : x) / (1.0f + e);
}

#ifdef __AVX512F__
// silu(x) for a product that is rounded to bfloat16 or multiplied by bfloat16 weights next: exp(-|x|) by
// ExpNonPositiveForRounding (about 3e-6 relative) and 1 / (1 + e) by vrcp14ps with one Newton step (about
// 1e-7), no division: Silu's vdivps and exact exp were most of the gated matmul's epilogue.
inline Vec SiluForRounding(Vec x) {
  const Vec a = x < 0.0f ? x : -x;  // -|x|, held above -126 (ExpNonPositiveForRounding takes no -inf)
  const Vec e = ExpNonPositiveForRounding(a < -126.0f ? Vec{} - 126.0f : a);
  const Vec d = 1.0f + e;
  Vec r = (Vec)_mm512_maskz_rcp14_ps(0xffff, (__m512)d);
  r = r * (2.0f - d * r);
  return (x < 0.0f ? x * e : x) * r;
}
#else
inline Vec SiluForRounding(Vec x) { return Silu(x); }
#endif

}  // namespace jaxserve
