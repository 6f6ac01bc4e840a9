// y = x @ w for XLA:CPU with w pre-packed in column blocks, called through the XLA FFI
// (see jaxserve/cpu_ffi.py).
//
// w [K, N] is stored as [ceil(N / kBlock), K, kBlock]: each block of kBlock columns is one
// contiguous run of K rows, zero-padded past N. A tile of up to kRows rows of x is multiplied with
// one block in registers: per k, the block's row (kBlock floats) is loaded once and used by every
// row of the tile, and x's values are broadcast. The weights stream from memory exactly once per
// call when M <= kRows; for larger M a block stays in L2 while the row tiles pass over it.
//
// XLA's own dot (YNNPACK here) reaches about 47 GFLOP/s at M = 8 on the machine this was written
// for, a quarter of its large-matmul rate; decode steps are made of such matmuls.
//
// Column blocks are spread over XLA's intra-op threads (parallel_for.h). float32 only.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kRows = 8;  // 8 x 3 accumulator vectors and 3 weight vectors of the 32 registers
#else
constexpr int kLanes = 8;
constexpr int kRows = 4;
#endif
constexpr int kBlock = 48;  // columns per packed block; the Python side packs with the same number
constexpr int kVectors = kBlock / kLanes;
static_assert(kBlock % kLanes == 0, "a block is a whole number of vectors");

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float UnalignedVec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // [blocks, K, kBlock]
  float* y;        // [M, N]
  int64_t m, k, n, blocks;
};

// y[rows, block's columns] for `rows` (<= kRows) rows of x starting at x_rows.
template <int R>
void Tile(const Problem& p, const float* x_rows, const float* w_block, float* y_rows, int64_t columns) {
  Vec acc[R][kVectors] = {};
  const int64_t k_dim = p.k;
  for (int64_t k = 0; k < k_dim; ++k) {
    const float* w_row = w_block + k * kBlock;
    Vec w[kVectors];
    for (int j = 0; j < kVectors; ++j) w[j] = *reinterpret_cast<const UnalignedVec*>(w_row + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = x_rows[r * k_dim + k];
      for (int j = 0; j < kVectors; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = y_rows + r * p.n;
    if (columns == kBlock) {
      for (int j = 0; j < kVectors; ++j) *reinterpret_cast<UnalignedVec*>(out + j * kLanes) = acc[r][j];
    } else {
      float tmp[kBlock];
      std::memcpy(tmp, acc[r], sizeof(tmp));
      std::memcpy(out, tmp, columns * sizeof(float));
    }
  }
}

// The rows of x in tiles of kRows, then one tile of the rest, against one column block.
template <int... R>
void Block(const Problem& p, int64_t block, std::integer_sequence<int, R...>) {
  using TileFn = void (*)(const Problem&, const float*, const float*, float*, int64_t);
  static constexpr TileFn kTiles[] = {nullptr, &Tile<R + 1>...};  // kTiles[r]: a tile of r rows
  const int64_t columns = std::min<int64_t>(kBlock, p.n - block * kBlock);
  const float* w_block = p.w + block * p.k * kBlock;
  for (int64_t row = 0; row < p.m; row += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, p.m - row);
    kTiles[rows](p, p.x + row * p.k, w_block, p.y + row * p.n + block * kBlock, columns);
  }
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions(), y_dims = y->dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || y_dims.size() != 2) {
    return ffi::Error::InvalidArgument("packed_matmul: unexpected operand ranks");
  }
  const int64_t m = x_dims[0], k = x_dims[1], n = y_dims[1], blocks = w_dims[0];
  if (w_dims[1] != k || w_dims[2] != kBlock || y_dims[0] != m || blocks != (n + kBlock - 1) / kBlock) {
    return ffi::Error::InvalidArgument("packed_matmul: operand shapes do not match");
  }
  const Problem problem{x.typed_data(), w.typed_data(), y->typed_data(), m, k, n, blocks};
  if (m == 0) return ffi::Error::Success();
  jaxserve::ParallelFor(pool, blocks, [problem] {
    return [problem](int64_t block) { Block(problem, block, std::make_integer_sequence<int, kRows>()); };
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int JaxservePackedMatmulBlock() { return kBlock; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
