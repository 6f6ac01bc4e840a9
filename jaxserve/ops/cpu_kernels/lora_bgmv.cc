// The LoRA deltas of a batch that mixes adapters, for XLA:CPU (Punica's BGMV: a gathered matrix-vector
// product per token), called through the XLA FFI (see jaxserve/ops/lora.py and cpu_ffi.py).
//
// a [K, S * r] and b [S * r, N] hold the adapters of S device slots side by side (slot s in columns /
// rows (s - 1) * r .. s * r), float32 or bfloat16 (widened as read), the scaling folded into b. Token t with slot s > 0 gets
//
//     delta[t] = (x[t] @ a[:, slot s's r columns]) @ b[slot s's r rows, :],
//
// and a token with slot 0 (the base model), or past the first `rows` tokens (a step's padding), zeros.
// Each token reads only its own slot's r columns and rows: r (K + N) products a token, where XLA's
// masked form multiplies every slot's and needs four small dots and two passes besides, each well
// below the machine's rate at a decode step's few rows.
//
// The tokens are grouped by slot, in tiles of up to kTile tokens of one slot: a tile's u = x @ a_s
// [tile, r] is built reading a_s's rows once, and its delta = u @ b_s column block by column block,
// each block of b_s's rows loaded once for every token of the tile, the tile's accumulators in
// registers. Tiles are spread over XLA's intra-op threads (parallel_for.h) when a call holds enough
// work to pay for waking one (a prompt step; a decode step's few tiles run on the calling thread).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_for.h"
#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve::kLanes;
using jaxserve::Vec;

namespace {

using jaxserve::Bf16;  // bfloat16 slots: half the bytes, and a decode step's deltas are bound by reading them

constexpr int64_t kMaxRank = 256;  // the largest max_lora_rank the kernel takes (u lives on the stack)
constexpr int64_t kTile = 8;  // tokens of one slot computed together
constexpr int64_t kParallelProducts = int64_t{1} << 20;  // below this many products a call, one thread

template <typename W>
struct Problem {
  const float* x;  // [T, k]
  const W* a;  // [k, width]
  const W* b;  // [width, n]
  float* y;  // [T, n]
  int64_t k, width, n, rank;
};

// delta = u @ b[offset:offset + rank] into the G tokens' rows of y, column block by column block.
template <typename W, int G>
void Expand(const Problem<W>& p, const float (*u)[kMaxRank], const int32_t* tokens, int64_t offset) {
  const W* b = p.b + offset * p.n;
  int64_t c = 0;
  for (; c + 2 * kLanes <= p.n; c += 2 * kLanes) {
    Vec acc[G][2] = {};
    for (int64_t j = 0; j < p.rank; ++j) {
      const Vec b0 = jaxserve::Load(b + j * p.n + c), b1 = jaxserve::Load(b + j * p.n + c + kLanes);
      for (int g = 0; g < G; ++g) {
        acc[g][0] += u[g][j] * b0;
        acc[g][1] += u[g][j] * b1;
      }
    }
    for (int g = 0; g < G; ++g) {
      jaxserve::Store(p.y + tokens[g] * p.n + c, acc[g][0]);
      jaxserve::Store(p.y + tokens[g] * p.n + c + kLanes, acc[g][1]);
    }
  }
  for (; c < p.n; ++c) {
    for (int g = 0; g < G; ++g) {
      float sum = 0.0f;
      for (int64_t j = 0; j < p.rank; ++j) sum += u[g][j] * jaxserve::Widen(b[j * p.n + c]);
      p.y[tokens[g] * p.n + c] = sum;
    }
  }
}

// y[tokens[g]] = x[tokens[g]] @ a[:, offset:offset + rank] @ b[offset:offset + rank] for the G tokens.
// NV > 0: rank = NV vectors, u's accumulators held in registers over all of K; 0: any rank.
template <typename W, int G, int NV>
void TileDelta(const Problem<W>& p, const int32_t* tokens, int64_t offset) {
  alignas(64) float u[G][kMaxRank];
  const float* x_rows[G];
  for (int g = 0; g < G; ++g) x_rows[g] = p.x + tokens[g] * p.k;
  if constexpr (NV > 0) {
    Vec acc[G][NV] = {};
    for (int64_t i = 0; i < p.k; ++i) {
      Vec a_row[NV];
      for (int v = 0; v < NV; ++v) a_row[v] = jaxserve::Load(p.a + i * p.width + offset + v * kLanes);
      for (int g = 0; g < G; ++g) {
        const float xv = x_rows[g][i];
        for (int v = 0; v < NV; ++v) acc[g][v] += xv * a_row[v];
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int v = 0; v < NV; ++v) jaxserve::Store(u[g] + v * kLanes, acc[g][v]);
    }
  } else {
    for (int g = 0; g < G; ++g) std::fill(u[g], u[g] + p.rank, 0.0f);
    for (int64_t i = 0; i < p.k; ++i) {
      const W* a_row = p.a + i * p.width + offset;
      for (int g = 0; g < G; ++g) {
        const float xv = x_rows[g][i];
        for (int64_t j = 0; j < p.rank; ++j) u[g][j] += xv * jaxserve::Widen(a_row[j]);
      }
    }
  }
  Expand<W, G>(p, u, tokens, offset);
}

template <typename W>
using TileFn = void (*)(const Problem<W>&, const int32_t*, int64_t);

template <typename W, int NV>
constexpr TileFn<W> kTiles[] = {nullptr, &TileDelta<W, 1, NV>, &TileDelta<W, 2, NV>, &TileDelta<W, 3, NV>,
                                &TileDelta<W, 4, NV>, &TileDelta<W, 5, NV>, &TileDelta<W, 6, NV>,
                                &TileDelta<W, 7, NV>, &TileDelta<W, 8, NV>};
static_assert(sizeof(kTiles<float, 0>) / sizeof(kTiles<float, 0>[0]) == kTile + 1);

// The tile function for `count` tokens of rank `rank`: u in registers for ranks of 1, 2 or 4 vectors.
template <typename W>
TileFn<W> TileFor(int64_t count, int64_t rank) {
  switch (rank == kLanes ? 1 : rank == 2 * kLanes ? 2 : rank == 4 * kLanes ? 4 : 0) {
    case 1: return kTiles<W, 1>[count];
    case 2: return kTiles<W, 2>[count];
    case 4: return kTiles<W, 4>[count];
    default: return kTiles<W, 0>[count];
  }
}

struct Tile {
  int64_t slot, start, count;  // tokens order[start, start + count), all of slot `slot`
};

template <typename W, ffi::DataType kW>
ffi::Error Bgmv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kW> a, ffi::Buffer<kW> b,
                ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                int64_t rank) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || ad.size() != 2 || bd.size() != 2 || yd.size() != 2 || ad[0] != xd[1] || bd[0] != ad[1]
      || yd[0] != xd[0] || yd[1] != bd[1] || static_cast<int64_t>(slots.element_count()) != xd[0]
      || rows.element_count() != 1 || rank < 1 || rank > kMaxRank || ad[1] % rank != 0) {
    return ffi::Error::InvalidArgument("jaxserve_lora_bgmv: operand shapes do not match");
  }
  const Problem<W> p{x.typed_data(), reinterpret_cast<const W*>(a.untyped_data()),
                     reinterpret_cast<const W*>(b.untyped_data()), y->typed_data(), xd[1], ad[1], bd[1], rank};
  const int64_t t_all = xd[0], num_slots = p.width / rank;
  const int64_t t_real = std::clamp<int64_t>(rows.typed_data()[0], 0, t_all);
  const int32_t* sp = slots.typed_data();
  // Tokens by slot (counting sort); the base model's and the padding's rows are zeros
  std::vector<int64_t> first(num_slots + 2, 0);
  for (int64_t t = 0; t < t_real; ++t) {
    if (sp[t] >= 1 && sp[t] <= num_slots) ++first[sp[t] + 1];
  }
  for (int64_t s = 1; s <= num_slots + 1; ++s) first[s] += first[s - 1];
  std::vector<int32_t> order(first[num_slots + 1]);
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t t = 0; t < t_all; ++t) {
    if (t < t_real && sp[t] >= 1 && sp[t] <= num_slots) {
      order[fill[sp[t]]++] = static_cast<int32_t>(t);
    } else {
      std::memset(p.y + t * p.n, 0, sizeof(float) * p.n);
    }
  }
  std::vector<Tile> tiles;
  for (int64_t s = 1; s <= num_slots; ++s) {
    for (int64_t start = first[s]; start < first[s + 1]; start += kTile) {
      tiles.push_back({s, start, std::min<int64_t>(kTile, first[s + 1] - start)});
    }
  }
  const Tile* tp = tiles.data();
  const int32_t* op = order.data();
  auto run = [p, tp, op, rank](int64_t item) {
    const Tile& tile = tp[item];
    TileFor<W>(tile.count, rank)(p, op + tile.start, (tile.slot - 1) * rank);
  };
  const int64_t products = static_cast<int64_t>(order.size()) * rank * (p.k + p.n);
  if (tiles.size() < 2 || products < kParallelProducts) {
    for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) run(i);
  } else {
    jaxserve::ParallelFor(pool, static_cast<int64_t>(tiles.size()), [run] { return run; });
  }
  return ffi::Error::Success();
}

template <ffi::DataType kW>
auto Binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().template Arg<ffi::Buffer<kW>>()
      .template Arg<ffi::Buffer<kW>>().template Arg<ffi::Buffer<ffi::S32>>().template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>().template Attr<int64_t>("rank");
}

}  // namespace

// (x [T, K] float32, a [K, S r], b [S r, N] float32 or bfloat16, slots [T], rows []) -> delta [T, N]
// float32, attribute rank = r.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLoraBgmv, (Bgmv<float, ffi::F32>), Binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLoraBgmvBf16, (Bgmv<Bf16, ffi::BF16>), Binding<ffi::BF16>());
