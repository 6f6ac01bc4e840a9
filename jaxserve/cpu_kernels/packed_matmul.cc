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
// panel waits on memory. float32 only.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "parallel_for.h"
#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::kLanes;
using jaxserve::Load;
using jaxserve::Store;
using jaxserve::Vec;

constexpr int kRows = kLanes == 16 ? 8 : 4;  // 8 x 3 accumulator vectors and 3 weight vectors of 32
constexpr int kPanelWidth = 48;  // columns per packed panel; the Python side packs with the same number
constexpr int kVectors = kPanelWidth / kLanes;
static_assert(kPanelWidth % kLanes == 0, "a panel is a whole number of vectors");

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // [panels, K, kPanelWidth]
  float* y;        // [M, N], or [M, N / 2] when gated
  int64_t m, k, n, panels;  // m: the rows multiplied, at most M
};

// acc[r][j] = x_rows[r] . the panel's column vector j, for R rows of x; row k of `prefetch` (another
// panel, or nullptr) is prefetched into L2 with row k of this one. Inlined, so that acc stays in
// registers (called twice from GatedTile, GCC otherwise keeps it out of line, spilling acc to memory).
template <int R>
__attribute__((always_inline)) inline void Accumulate(const Problem& p, const float* x_rows, const float* w_panel,
                                                      Vec (&acc)[R][kVectors], const float* prefetch) {
  const int64_t k_dim = p.k;
  for (int64_t k = 0; k < k_dim; ++k) {
    if (prefetch) {
      for (int j = 0; j < kVectors; ++j) __builtin_prefetch(prefetch + k * kPanelWidth + j * kLanes, 0, 1);
    }
    Vec w[kVectors];
    for (int j = 0; j < kVectors; ++j) w[j] = Load(w_panel + k * kPanelWidth + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = x_rows[r * k_dim + k];
      for (int j = 0; j < kVectors; ++j) acc[r][j] += xv * w[j];
    }
  }
}

// y[rows, panel's columns] for `rows` (<= kRows) rows of x starting at x_rows.
template <int R>
void Tile(const Problem& p, const float* x_rows, const float* w_panel, float* y_rows, int64_t columns,
          const float* prefetch) {
  Vec acc[R][kVectors] = {};
  Accumulate<R>(p, x_rows, w_panel, acc, prefetch);
  for (int r = 0; r < R; ++r) {
    float* out = y_rows + r * p.n;
    if (columns == kPanelWidth) {
      for (int j = 0; j < kVectors; ++j) Store(out + j * kLanes, acc[r][j]);
    } else {
      float tmp[kPanelWidth];
      std::memcpy(tmp, acc[r], sizeof(tmp));
      std::memcpy(out, tmp, columns * sizeof(float));
    }
  }
}

// silu(gate) * up for R rows and gate panel `panel` (whole panels only); gate panel `prefetch` and
// its up panel are prefetched meanwhile (-1: none).
template <int R>
void GatedTile(const Problem& p, const float* x_rows, int64_t panel, float* y_rows, int64_t prefetch) {
  const auto gate_panel = [&p](int64_t b) { return b < 0 ? nullptr : p.w + b * p.k * kPanelWidth; };
  const auto up_panel = [&p](int64_t b) { return b < 0 ? nullptr : p.w + (b + p.panels / 2) * p.k * kPanelWidth; };
  Vec gate[R][kVectors] = {}, up[R][kVectors] = {};
  Accumulate<R>(p, x_rows, gate_panel(panel), gate, gate_panel(prefetch));
  Accumulate<R>(p, x_rows, up_panel(panel), up, up_panel(prefetch));
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) {
      Store(y_rows + r * (p.n / 2) + j * kLanes, jaxserve::Silu(gate[r][j]) * up[r][j]);
    }
}

// The row tile that prefetches the thread's next panel: the second, or the only one.
int64_t PrefetchingRow(const Problem& p) { return p.m > kRows ? kRows : 0; }

// The rows of x in tiles of kRows, then one tile of the rest, against one column panel; `next`, the
// panel this thread does next (-1: none), is prefetched meanwhile.
template <int... R>
void Panel(const Problem& p, int64_t panel, int64_t next, std::integer_sequence<int, R...>) {
  using TileFn = void (*)(const Problem&, const float*, const float*, float*, int64_t, const float*);
  static constexpr TileFn kTiles[] = {nullptr, &Tile<R + 1>...};  // kTiles[r]: a tile of r rows
  const int64_t columns = std::min<int64_t>(kPanelWidth, p.n - panel * kPanelWidth);
  const float* w_panel = p.w + panel * p.k * kPanelWidth;
  const float* next_panel = next < 0 ? nullptr : p.w + next * p.k * kPanelWidth;
  for (int64_t row = 0; row < p.m; row += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, p.m - row);
    kTiles[rows](p, p.x + row * p.k, w_panel, p.y + row * p.n + panel * kPanelWidth, columns,
                 row == PrefetchingRow(p) ? next_panel : nullptr);
  }
}

// The same for gate panel `panel` and its up panel.
template <int... R>
void GatedPanel(const Problem& p, int64_t panel, int64_t next, std::integer_sequence<int, R...>) {
  using TileFn = void (*)(const Problem&, const float*, int64_t, float*, int64_t);
  static constexpr TileFn kTiles[] = {nullptr, &GatedTile<R + 1>...};
  for (int64_t row = 0; row < p.m; row += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, p.m - row);
    kTiles[rows](p, p.x + row * p.k, panel, p.y + row * (p.n / 2) + panel * kPanelWidth,
                 row == PrefetchingRow(p) ? next : -1);
  }
}

// The operands' shapes, checked: y is [M, N] (gated: [M, N / 2], N / 2 a whole number of panels).
ffi::Error CheckShapes(const char* name, const Problem& p, int64_t x_rows, int64_t y_rows, int64_t y_columns,
                       bool gated) {
  const bool ok = gated ? p.panels % 2 == 0 && y_columns * 2 == p.panels * kPanelWidth
                        : p.panels == (p.n + kPanelWidth - 1) / kPanelWidth;
  if (!ok || y_rows != x_rows) {
    return ffi::Error::InvalidArgument(std::string(name) + ": operand shapes do not match");
  }
  return ffi::Error::Success();
}

template <bool kGated>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> rows,
                  ffi::ResultBuffer<ffi::F32> y) {
  const char* name = kGated ? "packed_gated_matmul" : "packed_matmul";
  const auto x_dims = x.dimensions(), w_dims = w.dimensions(), y_dims = y->dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || y_dims.size() != 2) {
    return ffi::Error::InvalidArgument(std::string(name) + ": unexpected operand ranks");
  }
  const int64_t k = x_dims[1], panels = w_dims[0];
  const int64_t n = kGated ? 2 * y_dims[1] : y_dims[1];
  if (w_dims[1] != k || w_dims[2] != kPanelWidth || rows.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(name) + ": operand shapes do not match");
  }
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, x_dims[0]);
  const Problem problem{x.typed_data(), w.typed_data(), y->typed_data(), m, k, n, panels};
  if (ffi::Error error = CheckShapes(name, problem, x_dims[0], y_dims[0], y_dims[1], kGated); error.failure()) {
    return error;
  }
  std::fill(y->typed_data() + m * y_dims[1], y->typed_data() + x_dims[0] * y_dims[1], 0.0f);
  if (m == 0) return ffi::Error::Success();
  jaxserve::ParallelFor(pool, kGated ? panels / 2 : panels, [problem] {
    return [problem](int64_t panel, int64_t next) {
      if constexpr (kGated) {
        GatedPanel(problem, panel, next, std::make_integer_sequence<int, kRows>());
      } else {
        Panel(problem, panel, next, std::make_integer_sequence<int, kRows>());
      }
    };
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int JaxservePackedMatmulPanelWidth() { return kPanelWidth; }

namespace {

// Both handlers' signature: (x, packed w, rows) -> y, on XLA's intra-op thread pool.
auto MatmulBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmul, Matmul<false>, MatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmul, Matmul<true>, MatmulBinding());
