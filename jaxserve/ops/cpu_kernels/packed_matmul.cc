// y = x @ w for XLA:CPU with w pre-packed in column panels, called through the XLA FFI
// (see jaxserve/cpu_ffi.py); and the gated MLP's first half, y = silu(x @ w_gate) * (x @ w_up),
// from the same packing of [w_gate | w_up].
//
// w [K, N] is stored as [ceil(N / kPanelWidth), K, kPanelWidth]: each panel of kPanelWidth columns is
// one contiguous run of K rows, zero-padded past N. A tile of up to kRows rows of x is multiplied with
// one panel in registers: per k, the panel's row (kPanelWidth floats) is loaded once and used by every
// row of the tile, and x's values are broadcast. The weights stream from memory exactly once per
// call when M <= kRows; for larger M a panel stays in L2 while the row tiles pass over it.
//
// XLA's own dot runs the few-row matmuls that decode steps are made of well below its large-matmul
// rate, which is why this kernel exists.
//
// The gated version takes gate panel b and then up panel b + N / 2 / kPanelWidth for each row tile
// (N / 2 a whole number of panels; the gate tile waits in L1 meanwhile) and writes only the product:
// the [M, N] intermediate and XLA's pass over it are gone. (Both panels at once, in tiles of half the
// rows, was slower for prompt-sized M.)
//
// Only the first `rows` rows of x are multiplied (a step's real tokens; the rest of its shape bucket
// is padding): the rows past them get zeros. A 287-token step in the 512 bucket costs 287 rows.
//
// Column panels are spread over XLA's intra-op threads (parallel_for.h). While a thread multiplies
// its second row tile with a panel that is already in L2 (or its only tile, when M <= kRows), it
// prefetches the panel it does next, one row of it per k, because otherwise the first tile of every
// panel waits on memory.
//
// Two weight types, one code: float32 (above), and bfloat16 pairs (`Bf16Pairs`): w stored as
// [panels, K / 2, kPanelWidth] 32-bit lanes, each holding w[2i, c] and w[2i + 1, c], and x as bfloat16
// [M, K], read as the same pairs. A panel row then carries two k, and one AVX512-BF16 instruction
// (vdpbf16ps) adds both products of 16 columns to float32 accumulators: twice float32's multiply rate
// and half its weight bytes. Without that instruction the pairs are widened to float32 and
// multiplied as such (the same products; only the summation order may differ).
//
// And int8 (`S8Quads`, W8A8): w stored as [panels, K / 4, kPanelWidth] 32-bit lanes of four int8 k
// with a float32 scale per column (w[k, c] ~= q[k, c] * w_scale[c]); x quantized here per row (its
// largest |x| -> 127) and offset by 128 into uint8, because the instruction (vpdpbusd, AVX512-VNNI)
// multiplies unsigned by signed bytes: four products of 16 columns per instruction into int32, twice
// bfloat16's rate and half its weight bytes. The offset adds 128 * sum_k q[k, c] to every sum, taken
// off with the column sums the packing stored: y = (acc - 128 w_sum[c]) * x_scale[r] * w_scale[c].
// Without VNNI the bytes are widened to int32 and multiplied as such (the same integers).

#include <algorithm>
#include <cstdint>
#if defined(__AVX512BF16__) || defined(__AVX512VNNI__)
#include <immintrin.h>
#endif
#include <cmath>
#include <memory>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "parallel_for.h"
#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::IntVec;
using jaxserve::kLanes;
using jaxserve::Load;
using jaxserve::Store;
using jaxserve::Vec;

constexpr int kRows = kLanes == 16 ? 8 : 4;  // 8 x 3 accumulator vectors and 3 weight vectors of 32
constexpr int kPanelWidth = 48;  // columns per packed panel; the Python side packs with the same number
constexpr int kVectors = kPanelWidth / kLanes;
static_assert(kPanelWidth % kLanes == 0, "a panel is a whole number of vectors");

// The weights' element types. A panel row holds kPanelWidth elements of Elem; one element carries
// kSteps consecutive k. MulAdd adds x's element times the panel row's vector j to acc.
struct F32 {
  using Elem = float;
  using WVec = Vec;
  using Acc = Vec;
  static constexpr int kSteps = 1;
  static WVec LoadW(const Elem* w) { return Load(w); }
  static void MulAdd(Vec& acc, Elem x, WVec w) { acc += x * w; }
};

struct Bf16Pairs {
  using Elem = uint32_t;  // bfloat16 bits of k = 2i in the low half, of k = 2i + 1 in the high half
  typedef uint32_t WVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  using Acc = Vec;
  static constexpr int kSteps = 2;
  static WVec LoadW(const Elem* w) {
    WVec v;
    std::memcpy(&v, w, sizeof(v));
    return v;
  }
  // float32 from bfloat16 bits in the high half of each lane
  static float Widen(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static Vec Widen(WVec bits) {
    Vec v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  }
  static void MulAdd(Vec& acc, Elem x, WVec w) {
#if defined(__AVX512BF16__)
    if constexpr (kLanes == 16) {
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x)), (__m512bh)w);
      return;
    }
#endif
    acc += Widen(x << 16) * Widen(w << 16) + Widen(x & 0xffff0000u) * Widen(w & 0xffff0000u);
  }
};

struct S8Quads {
  using Elem = uint32_t;  // four bytes of k = 4i .. 4i + 3, lowest first: x's uint8, w's int8
  typedef uint32_t WVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  using Acc = IntVec;
  static constexpr int kSteps = 4;
  static WVec LoadW(const Elem* w) { return Bf16Pairs::LoadW(w); }
  static void MulAdd(IntVec& acc, Elem x, WVec w) {
#if defined(__AVX512VNNI__)
    if constexpr (kLanes == 16) {
      acc = (IntVec)_mm512_dpbusd_epi32((__m512i)acc, _mm512_set1_epi32(static_cast<int32_t>(x)), (__m512i)w);
      return;
    }
#endif
    const IntVec signed_w = (IntVec)w;
    for (int b = 0; b < 4; ++b) {
      const int32_t xb = static_cast<int32_t>((x >> (8 * b)) & 0xffu);
      acc += xb * ((signed_w << (24 - 8 * b)) >> 24);  // byte b of each lane, sign-extended
    }
  }
};

// What a tile's accumulator for column vector j of `panel` and row `row` (of the whole x) becomes.
template <typename T>
struct Output {
  static Vec Of(const typename T::Acc& acc, const float*, const float*, const int32_t*, int64_t, int64_t) {
    return acc;
  }
};

template <>
struct Output<S8Quads> {
  static Vec Of(const IntVec& acc, const float* x_scale, const float* w_scale, const int32_t* w_sum, int64_t row,
                int64_t column) {
    const IntVec sums = *reinterpret_cast<const IntVec*>(w_sum + column);  // no alignment needed: see Load
    return __builtin_convertvector(acc - 128 * sums, Vec) * (x_scale[row] * Load(w_scale + column));
  }
};

template <typename T>
struct Problem {
  using Elem = typename T::Elem;
  const Elem* x;  // [M, steps]
  const Elem* w;  // [panels, steps, kPanelWidth]
  float* y;       // [M, N], or [M, N / 2] when gated
  int64_t m, steps, n, panels;  // m: the rows multiplied, at most M; steps: K / T::kSteps
  const float* x_scale = nullptr;  // int8: [m] each row's scale
  const float* w_scale = nullptr;  // int8: [panels * kPanelWidth] each column's scale
  const int32_t* w_sum = nullptr;  // int8: [panels * kPanelWidth] each column's sum of q

  const Elem* panel(int64_t b) const { return b < 0 ? nullptr : w + b * steps * kPanelWidth; }
  Vec out(const typename T::Acc& acc, int64_t row, int64_t column) const {
    return Output<T>::Of(acc, x_scale, w_scale, w_sum, row, column);
  }
};

// acc[r][j] = x_rows[r] . the panel's column vector j, for R rows of x; row k of `prefetch` (another
// panel, or nullptr) is prefetched into L2 with row k of this one. Inlined, so that acc stays in
// registers (called twice from GatedTile, GCC otherwise keeps it out of line, spilling acc to memory).
template <typename T, int R>
__attribute__((always_inline)) inline void Accumulate(const Problem<T>& p, const typename T::Elem* x_rows,
                                                      const typename T::Elem* w_panel,
                                                      typename T::Acc (&acc)[R][kVectors],
                                                      const typename T::Elem* prefetch) {
  const int64_t steps = p.steps;
  for (int64_t k = 0; k < steps; ++k) {
    if (prefetch) {
      for (int j = 0; j < kVectors; ++j) __builtin_prefetch(prefetch + k * kPanelWidth + j * kLanes, 0, 1);
    }
    typename T::WVec w[kVectors];
    for (int j = 0; j < kVectors; ++j) w[j] = T::LoadW(w_panel + k * kPanelWidth + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const typename T::Elem xv = x_rows[r * steps + k];
      for (int j = 0; j < kVectors; ++j) T::MulAdd(acc[r][j], xv, w[j]);
    }
  }
}

// y[rows, panel's columns] for `rows` (<= kRows) rows of x starting at row `row`.
template <typename T, int R>
void Tile(const Problem<T>& p, int64_t row, int64_t panel, int64_t columns, const typename T::Elem* prefetch) {
  typename T::Acc acc[R][kVectors] = {};
  Accumulate<T, R>(p, p.x + row * p.steps, p.panel(panel), acc, prefetch);
  for (int r = 0; r < R; ++r) {
    float* out = p.y + (row + r) * p.n + panel * kPanelWidth;
    Vec values[kVectors];
    for (int j = 0; j < kVectors; ++j) values[j] = p.out(acc[r][j], row + r, panel * kPanelWidth + j * kLanes);
    if (columns == kPanelWidth) {
      for (int j = 0; j < kVectors; ++j) Store(out + j * kLanes, values[j]);
    } else {
      std::memcpy(out, values, columns * sizeof(float));
    }
  }
}

// silu(gate) * up for R rows and gate panel `panel` (whole panels only); gate panel `prefetch` and
// its up panel are prefetched meanwhile (-1: none).
template <typename T, int R>
void GatedTile(const Problem<T>& p, int64_t row, int64_t panel, int64_t prefetch) {
  const auto up = [&p](int64_t b) { return b < 0 ? -1 : b + p.panels / 2; };
  const typename T::Elem* x_rows = p.x + row * p.steps;
  typename T::Acc gate_acc[R][kVectors] = {}, up_acc[R][kVectors] = {};
  Accumulate<T, R>(p, x_rows, p.panel(panel), gate_acc, p.panel(prefetch));
  Accumulate<T, R>(p, x_rows, p.panel(up(panel)), up_acc, p.panel(up(prefetch)));
  float* y_rows = p.y + row * (p.n / 2) + panel * kPanelWidth;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) {
      const int64_t column = panel * kPanelWidth + j * kLanes;
      const Vec gate = p.out(gate_acc[r][j], row + r, column);
      const Vec up_value = p.out(up_acc[r][j], row + r, column + p.panels / 2 * kPanelWidth);
      Store(y_rows + r * (p.n / 2) + j * kLanes, jaxserve::Silu(gate) * up_value);
    }
}

// The row tile that prefetches the thread's next panel: the second, or the only one.
template <typename T>
int64_t PrefetchingRow(const Problem<T>& p) { return p.m > kRows ? kRows : 0; }

// The rows of x in tiles of kRows, then one tile of the rest, against one column panel; `next`, the
// panel this thread does next (-1: none), is prefetched meanwhile.
template <typename T, int... R>
void Panel(const Problem<T>& p, int64_t panel, int64_t next, std::integer_sequence<int, R...>) {
  using TileFn = void (*)(const Problem<T>&, int64_t, int64_t, int64_t, const typename T::Elem*);
  static constexpr TileFn kTiles[] = {nullptr, &Tile<T, R + 1>...};  // kTiles[r]: a tile of r rows
  const int64_t columns = std::min<int64_t>(kPanelWidth, p.n - panel * kPanelWidth);
  for (int64_t row = 0; row < p.m; row += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, p.m - row);
    kTiles[rows](p, row, panel, columns, row == PrefetchingRow(p) ? p.panel(next) : nullptr);
  }
}

// The same for gate panel `panel` and its up panel.
template <typename T, int... R>
void GatedPanel(const Problem<T>& p, int64_t panel, int64_t next, std::integer_sequence<int, R...>) {
  using TileFn = void (*)(const Problem<T>&, int64_t, int64_t, int64_t);
  static constexpr TileFn kTiles[] = {nullptr, &GatedTile<T, R + 1>...};
  for (int64_t row = 0; row < p.m; row += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, p.m - row);
    kTiles[rows](p, row, panel, row == PrefetchingRow(p) ? next : -1);
  }
}

// XLA's buffer types for each weight type's x and w: float32, bfloat16, or float32 x and int8 w.
template <typename T>
constexpr ffi::DataType kXType = std::is_same_v<T, Bf16Pairs> ? ffi::BF16 : ffi::F32;
template <typename T>
constexpr ffi::DataType kWType = std::is_same_v<T, F32> ? ffi::F32 : std::is_same_v<T, Bf16Pairs> ? ffi::BF16 : ffi::S8;

template <typename T, bool kGated>
std::string KernelName() {
  const char* suffix = std::is_same_v<T, F32> ? "" : std::is_same_v<T, Bf16Pairs> ? "_bf16" : "_int8";
  return std::string(kGated ? "packed_gated_matmul" : "packed_matmul") + suffix;
}

// Whether x [M, K], w packed [panels, K / kSteps, kPanelWidth] (in T's elements: bfloat16 pairs are
// 2 * kPanelWidth bfloat16, int8 quads 4 * kPanelWidth int8) and y [M, N] (gated: [M, N / 2], N / 2 a
// whole number of panels) fit together.
template <typename T, bool kGated>
bool ShapesMatch(ffi::Span<const int64_t> x_dims, ffi::Span<const int64_t> w_dims, ffi::Span<const int64_t> y_dims) {
  if (x_dims.size() != 2 || w_dims.size() != 3 || y_dims.size() != 2) return false;
  const int64_t k = x_dims[1], panels = w_dims[0];
  const int64_t n = kGated ? 2 * y_dims[1] : y_dims[1];
  const bool gated_ok = panels % 2 == 0 && y_dims[1] * 2 == panels * kPanelWidth;
  return k % T::kSteps == 0 && w_dims[1] * T::kSteps == k && w_dims[2] == kPanelWidth * T::kSteps
         && y_dims[0] == x_dims[0] && (kGated ? gated_ok : panels == (n + kPanelWidth - 1) / kPanelWidth);
}

// The problem's column panels spread over XLA's intra-op threads.
template <typename T, bool kGated>
void Run(ffi::ThreadPool& pool, const Problem<T>& problem) {
  if (problem.m == 0) return;
  jaxserve::ParallelFor(pool, kGated ? problem.panels / 2 : problem.panels, [problem] {
    return [problem](int64_t panel, int64_t next) {
      if constexpr (kGated) {
        GatedPanel(problem, panel, next, std::make_integer_sequence<int, kRows>());
      } else {
        Panel(problem, panel, next, std::make_integer_sequence<int, kRows>());
      }
    };
  });
}

// The rows past the first m (a padded step's padding) are zeros.
int64_t ZeroPadding(ffi::Buffer<ffi::S32>& rows, ffi::Result<ffi::Buffer<ffi::F32>>& y) {
  const auto y_dims = y->dimensions();
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, y_dims[0]);
  std::fill(y->typed_data() + m * y_dims[1], y->typed_data() + y_dims[0] * y_dims[1], 0.0f);
  return m;
}

// y = x @ w (gated: silu(x @ w_gate) * (x @ w_up)), float32 or bfloat16 weights; see ShapesMatch.
template <typename T, bool kGated>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<kXType<T>> x, ffi::Buffer<kWType<T>> w,
                  ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  if (!ShapesMatch<T, kGated>(x.dimensions(), w.dimensions(), y->dimensions()) || rows.element_count() != 1) {
    return ffi::Error::InvalidArgument(KernelName<T, kGated>() + ": operand shapes do not match");
  }
  const int64_t m = ZeroPadding(rows, y), k = x.dimensions()[1];
  using Elem = typename T::Elem;
  const int64_t n = y->dimensions()[1] * (kGated ? 2 : 1);
  Run<T, kGated>(pool, Problem<T>{reinterpret_cast<const Elem*>(x.untyped_data()),
                                  reinterpret_cast<const Elem*>(w.untyped_data()), y->typed_data(), m,
                                  k / T::kSteps, n, w.dimensions()[0]});
  return ffi::Error::Success();
}

// The same for int8 weights with their column scales and sums ([panels * kPanelWidth] each, the sums
// [1, panels * kPanelWidth]: this device's rows' share under tensor parallelism): x [M, K] float32 is
// quantized here, row by row, to uint8 with the offset of 128.
template <bool kGated>
ffi::Error MatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> w_sum, ffi::Buffer<ffi::S32> rows,
                      ffi::ResultBuffer<ffi::F32> y) {
  const int64_t columns = w.dimensions().size() == 3 ? w.dimensions()[0] * kPanelWidth : -1;
  if (!ShapesMatch<S8Quads, kGated>(x.dimensions(), w.dimensions(), y->dimensions()) || rows.element_count() != 1
      || static_cast<int64_t>(w_scale.element_count()) != columns
      || static_cast<int64_t>(w_sum.element_count()) != columns) {
    return ffi::Error::InvalidArgument(KernelName<S8Quads, kGated>() + ": operand shapes do not match");
  }
  const int64_t m = ZeroPadding(rows, y), k = x.dimensions()[1];
  std::unique_ptr<uint32_t[]> quads(new uint32_t[m * k / 4]);
  std::unique_ptr<float[]> x_scale(new float[m]);
  auto* bytes = reinterpret_cast<uint8_t*>(quads.get());
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x.typed_data() + r * k;
    float largest = 0.0f;
    for (int64_t i = 0; i < k; ++i) largest = std::max(largest, std::fabs(row[i]));
    x_scale[r] = largest > 0.0f ? largest / 127.0f : 1.0f;
    const float inverse = 1.0f / x_scale[r];
    for (int64_t i = 0; i < k; ++i) bytes[r * k + i] = static_cast<uint8_t>(std::lrintf(row[i] * inverse) + 128);
  }
  Problem<S8Quads> problem{quads.get(), reinterpret_cast<const uint32_t*>(w.untyped_data()), y->typed_data(), m,
                           k / 4, y->dimensions()[1] * (kGated ? 2 : 1), w.dimensions()[0]};
  problem.x_scale = x_scale.get();
  problem.w_scale = w_scale.typed_data();
  problem.w_sum = w_sum.typed_data();
  Run<S8Quads, kGated>(pool, problem);
  return ffi::Error::Success();
}

}  // namespace

extern "C" int JaxservePackedMatmulPanelWidth() { return kPanelWidth; }

namespace {

// The handlers' signatures: (x, packed w, rows) -> y, and (x, w, w_scale, w_sum, rows) -> y for int8, on
// XLA's intra-op thread pool.
template <typename T>
auto MatmulBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().template Arg<ffi::Buffer<kXType<T>>>()
      .template Arg<ffi::Buffer<kWType<T>>>().template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

auto MatmulInt8Binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S8>>()
      .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmul, (Matmul<F32, false>), MatmulBinding<F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmul, (Matmul<F32, true>), MatmulBinding<F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmulBf16, (Matmul<Bf16Pairs, false>), MatmulBinding<Bf16Pairs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmulBf16, (Matmul<Bf16Pairs, true>), MatmulBinding<Bf16Pairs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmulInt8, MatmulInt8<false>, MatmulInt8Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmulInt8, MatmulInt8<true>, MatmulInt8Binding());
