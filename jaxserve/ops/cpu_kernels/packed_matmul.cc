// y = x @ w for XLA:CPU with w pre-packed in column panels, called through the XLA FFI
// (see jaxserve/cpu_ffi.py); and the gated MLP's first half, y = silu(x @ w_gate) * (x @ w_up),
// from the same packing of [w_gate | w_up].
//
// w [K, N] is stored as [ceil(N / kPanelWidth), K, kPanelWidth]: each panel of kPanelWidth columns is
// one contiguous run of K rows, zero-padded past N. A tile of up to kRows rows of x is multiplied with
// one panel in registers: per k, the panel's row (kPanelWidth floats) is loaded once and used by every
// row of the tile, and x's values are broadcast. The weights stream from memory exactly once per
// call when M <= kRows; for larger M a panel stays in L2 while the row tiles pass over it (with AVX2's
// 2-row tiles, float32 goes in K blocks that stay in L1 instead: `BlockedRows`).
//
// XLA's own dot runs the few-row matmuls that decode steps are made of well below its large-matmul
// rate, which is why this kernel exists.
//
// The gated version takes gate panel b and then up panel b + N / 2 / kPanelWidth for each row tile
// (N / 2 a whole number of panels; the gate tile waits in L1 meanwhile) and writes only the product:
// the [M, N] intermediate and XLA's pass over it are gone. (Both panels at once, in tiles of half the
// rows, was slower for prompt-sized M.) Its `_add` form adds an [M, N] float32 array to the two
// products before the activation: LoRA adapters' deltas for gate and up (jaxserve/ops/lora.py).
//
// Only the first `rows` rows of x are multiplied (a step's real tokens; the rest of its shape bucket
// is padding): the rows past them get zeros. A 287-token step in the 512 bucket costs 287 rows.
//
// Column panels are spread over XLA's intra-op threads (parallel_for.h), on AMX tiles several to a work
// item where the rows take more than one pass (PanelsPerItem). While a thread's row tiles multiply
// with a panel that is already in L2, they prefetch the panel it does next, each tile an equal share
// spread over its steps (PrefetchShare), because otherwise the first tile of every panel waits on memory.
//
// Two weight types, one code: float32 (above), and bfloat16 pairs (`Bf16Pairs`): w stored as
// [panels, K / 2, kPanelWidth] 32-bit lanes, each holding w[2i, c] and w[2i + 1, c], and x as bfloat16
// [M, K], read as the same pairs. A panel row then carries two k, and one AVX512-BF16 instruction
// (vdpbf16ps) adds both products of 16 columns to float32 accumulators: twice float32's multiply rate
// and half its weight bytes. Without that instruction the pairs are widened to float32 and
// multiplied as such (the same products; only the summation order may differ).
//
// And int8 (`U8Quads`, W8A8): w stored as [panels, K / 4, kPanelWidth] 32-bit lanes of four k, each
// byte q[k, c] + 128 (offset binary, 1..255), with a float32 scale per column (w[k, c] ~= q[k, c] *
// w_scale[c]); x quantized here to int8 in groups of G consecutive k of a row (each group's largest |x|
// -> 127: one outlier channel coarsens only its group, where a scale per row cost this model's
// perplexity 4.5% against about 1%). The instruction (vpdpbusd, AVX512-VNNI) multiplies unsigned by
// signed bytes: four products of 16 columns per instruction into int32, twice bfloat16's rate and half
// its weight bytes; the weights are the unsigned side, so the offset's share of a group's sums,
// 128 sum(xq[r, g]), is the same in every column. A group's integer sums become float once, acc +=
// isum * x_scale[r, g], and the offsets of all groups come off at the end as one number per row:
// y = (acc - x_offset[r]) * w_scale[c], x_offset[r] = 128 sum_g x_scale[r, g] sum(xq[r, g]) (computed
// where x is quantized). The group's int sums stay in registers; its float sums are spilled between
// groups. On AVX2 (no AVX-512): vpmaddubsw on |q| and xq signed by q (`SignedQuadSteps`), whose sums hold
// no offset (x_offset = 0); elsewhere the bytes are widened to int32 and multiplied as such (the same
// integers every way).
//
// And float8 e4m3 (`F8Pairs`, W8A16): the bfloat16 pairs' layout with a byte per weight, each widened to
// bfloat16 in the register and multiplied by vdpbf16ps with x in bfloat16; a scale per column (see there).
// At 1-8 rows, bound by the weights' bytes, it takes about half bfloat16's time; at 512, about as long
// (widening every panel row for every 8-row tile costs what the bytes save).
//
// On a CPU with AMX (Intel Xeon since Sapphire Rapids), bfloat16 and int8 weights take the tile unit
// in blocks of 16 rows (`AmxBlock`): the packed panel already is AMX's B-operand layout (a
// 32-bit lane per column holding two bfloat16 or four int8 consecutive k, 16 columns = one 64-byte tile
// row), and x [M, K] (bfloat16, or the quantized int8) is its A operand as it lies. A block of 16 rows x
// 48 columns is three 16 x 16 accumulator tiles; per 32 k (bfloat16) or 64 k (int8) one x tile and three
// weight tiles are loaded and three tdpbf16ps (tdpbsud: signed x, unsigned w) issued; bfloat16 takes two
// whole blocks at a time where it can (`AmxPair`: six accumulators, each weight tile loaded once for 32
// rows, the same sums bit for bit). int8 sums are
// stored and scaled group by group, so the tile unit takes int8 only where a group is whole tiles of
// 64 k (packed_matmul.int8_group picks such groups on an AMX CPU). bfloat16's last block may be 1-15
// rows (tiles configured that short), so where K is a multiple of 32 every bfloat16 row takes the tiles
// (decode at batch 8 is then bound by the weights' bytes, not by vdpbf16ps's rate); int8's rows past
// the last whole block take the vector code above, whose sums equal the tiles' (`kMinAmxRows`). The
// process asks Linux for the tile state once (arch_prctl); where it is refused, or JaxserveSetAmx(0)
// turned it off (tests compare both paths), the vector code does all.

#include <algorithm>
#include <atomic>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <memory>
#include <vector>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "amx.h"
#include "parallel_for.h"
#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::FusedMulAdd;
using jaxserve::IntVec;
using jaxserve::kLanes;
using jaxserve::Load;
using jaxserve::Store;
using jaxserve::StoreBf16;
using jaxserve::Vec;

// AVX-512: 8 rows x 3 accumulator vectors and 3 weight vectors of 32 registers. AVX2 has 16: 2 rows x 6
// accumulators, the weights read as the multiply's memory operand (4 rows spilled 9 of their 24 to the stack).
constexpr int kFloatRows = kLanes == 16 ? 8 : 2;
// The int sums in registers, the float sums beside them in L1. AVX2 (`SignedQuadSteps`): two rows, whose
// 12 sums, two broadcast quads and a weight vector's temporaries fit its 16 registers (3 rows in two
// passes over half a panel, and 4 in three, measured the same).
#if defined(__AVX2__) && !defined(__AVX512F__)
#define JAXSERVE_SIGNED_QUADS 1
#else
#define JAXSERVE_SIGNED_QUADS 0
#endif
constexpr bool kSignedQuads = JAXSERVE_SIGNED_QUADS;
constexpr int kInt8Rows = kLanes == 16 ? kFloatRows : 2;
constexpr int kPanelWidth = 48;  // columns per packed panel; the Python side packs with the same number
constexpr int64_t kLineBytes = 64;  // a cache line
constexpr int kVectors = kPanelWidth / kLanes;
static_assert(kPanelWidth % kLanes == 0, "a panel is a whole number of vectors");

// The weights' element types. A panel row holds kPanelWidth elements of Elem; one element carries
// kSteps consecutive k. MulAdd adds x's element times the panel row's vector j to acc.
struct F32 {
  using Elem = float;
  using WElem = Elem;  // the packed weights' element (x's is Elem)
  using WVec = Vec;
  static constexpr int kSteps = 1;
  static constexpr int kRows = kFloatRows;
  static WVec LoadW(const Elem* w) { return Load(w); }
  static void MulAdd(Vec& acc, Elem x, WVec w) { acc += x * w; }
};

struct Bf16Pairs {
  using Elem = uint32_t;  // bfloat16 bits of k = 2i in the low half, of k = 2i + 1 in the high half
  using WElem = Elem;
  typedef uint32_t WVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  static constexpr int kSteps = 2;
  static constexpr int kRows = kFloatRows;
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

struct U8Quads {
  using Elem = uint32_t;  // four bytes of k = 4i .. 4i + 3, lowest first: x's int8, w's uint8
  using WElem = Elem;
  typedef uint32_t WVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  static constexpr int kSteps = 4;
  static constexpr int kRows = kInt8Rows;
  static WVec LoadW(const Elem* w) { return Bf16Pairs::LoadW(w); }
  static void MulAdd(IntVec& acc, Elem x, WVec w) {
#if defined(__AVX512VNNI__)
    if constexpr (kLanes == 16) {
      acc = (IntVec)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(static_cast<int32_t>(x)));
      return;
    }
#endif
    for (int b = 0; b < 4; ++b) {
      const int32_t xb = static_cast<int8_t>((x >> (8 * b)) & 0xffu);  // byte b, sign-extended
      acc += xb * (IntVec)((w >> (8 * b)) & 0xffu);  // byte b of each lane, unsigned
    }
  }
};

// float8 e4m3 weights (`F8Pairs`, W8A16): w stored as [panels, K / 2, kPanelWidth] 16-bit lanes, each the
// e4m3 bytes of w[2i, c] (low) and w[2i + 1, c] (high), with a float32 scale per column; x bfloat16 pairs as
// for Bf16Pairs. Each e4m3 byte becomes bfloat16 bits in the register by a shift and a mask: its exponent and
// mantissa bits moved up under bfloat16's (sign << 15 | (b & 0x7f) << 4), which is the e4m3 value times
// 2^-120, exact (bfloat16 has more mantissa and exponent bits) and normal for every normal e4m3 (exponent
// field >= 1). e4m3's subnormals would land on bfloat16 subnormals, which vdpbf16ps reads as zero, so
// packing rounds them to 0 or +-2^-6 (packed_matmul.py: at most 2^-7 of a column's scale, against e4m3's
// own rounding of up to 16 of it). So that no product falls under float32's normal range (vdpbf16ps flushes
// those too), x comes in multiplied by 2^kFp8XShift (exact: a power of two; ScaleRows); the column scale
// packed with the weights carries 2^(120 - kFp8XShift). Then one vdpbf16ps multiplies 16 columns by two k,
// as for bfloat16 weights, from half their bytes.
constexpr int kFp8XShift = 64;

struct F8Pairs {
  using Elem = uint32_t;   // x: bfloat16 bits of k = 2i (low half) and 2i + 1 (high half)
  using WElem = uint16_t;  // w: e4m3 bytes of k = 2i (low byte) and 2i + 1 (high byte)
  using WVec = Bf16Pairs::WVec;
  static constexpr int kSteps = 2;
  static constexpr int kRows = kFloatRows;
  // An e4m3 byte -> the bfloat16 bits of its value times 2^-120: the byte sign-extended to 16 bits and
  // shifted up by 4 puts its exponent and mantissa at bits 10..4 and copies of its sign at 15..11, of which
  // the mask keeps bit 15. Three instructions for 32 weights (vpmovsxbw, vpsllw, vpandd).
  static constexpr uint16_t kWidenMask = 0x87f0;
  static uint32_t Widen(uint32_t b) {
    return (static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(b)) << 4) & kWidenMask);
  }
  static WVec LoadW(const WElem* w) {
#if defined(__AVX512BW__)
    if constexpr (kLanes == 16) {
      const __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
      return (WVec)_mm512_and_si512(_mm512_slli_epi16(words, 4), _mm512_set1_epi16(static_cast<int16_t>(kWidenMask)));
    }
#endif
    WVec v;
    for (int lane = 0; lane < kLanes; ++lane) v[lane] = Widen(w[lane] & 0xffu) | (Widen(w[lane] >> 8) << 16);
    return v;
  }
  static void MulAdd(Vec& acc, Elem x, WVec w) { Bf16Pairs::MulAdd(acc, x, w); }
};

template <typename T>
struct Problem {
  using Elem = typename T::Elem;
  using WElem = typename T::WElem;
  const Elem* x;   // [M, steps]
  const WElem* w;  // [panels, steps, kPanelWidth]
  float* y;       // [M, N], or [M, N / 2] when gated
  int64_t m, steps, n, panels;  // m: the rows multiplied, at most M; steps: K / T::kSteps
  // int8 only: groups of group_steps steps; x_scale [m, groups]; x_offset [m], the weights' offset in
  // each row's sums; w_scale [panels * kPanelWidth] (fp8 too: its column scales)
  int64_t groups = 1, group_steps = 0;
  const float* x_scale = nullptr;
  const float* x_offset = nullptr;
  const float* w_scale = nullptr;
  // gated only, or null: [m, n] float32 added to x @ [w_gate | w_up] before the activation (LoRA's deltas)
  const float* add = nullptr;
  // gated only, or null: the output [M, N / 2] in bfloat16 bits, written here instead of y
  uint16_t* y_bf16 = nullptr;

  const WElem* panel(int64_t b) const { return b < 0 ? nullptr : w + b * steps * kPanelWidth; }
  // The output of a tile's accumulator for `row` and `column`'s vector: int8 sums still want the offset
  // taken off and the column scale.
  Vec out(const Vec& acc, int64_t row, int64_t column) const {
    if constexpr (std::is_same_v<T, U8Quads>) return (acc - x_offset[row]) * Load(w_scale + column);
    if constexpr (std::is_same_v<T, F8Pairs>) return acc * Load(w_scale + column);
    return acc;
  }
};

// The part of a panel that one row tile prefetches into L2 while it multiplies: `lines` cache lines from
// `begin`, `per_step` of them at each step k (k * per_step onward), so that they arrive spread over the
// tile's steps. Each of a panel's row tiles takes an equal share of the next panel (ShareOf), where one
// tile alone prefetching a whole panel asked for three lines a step: more than one core's share of the
// memory's rate, so that tile waited on it (at 32 rows on a Zen 5, 5.9 us a panel of the gated matmul for
// about 3.3 of multiplies).
struct PrefetchShare {
  const char* begin = nullptr;  // nullptr: nothing to prefetch
  int64_t lines = 0, per_step = 0;

  void At(int64_t k) const {
    if (begin == nullptr) return;
    for (int64_t line = k * per_step, last = std::min(line + per_step, lines); line < last; ++line)
      __builtin_prefetch(begin + line * kLineBytes, 0, 1);
  }
};

// Row tile `tile` of `tiles`' share of panel `panel` (none for panel -1, or no tiles).
template <typename T>
PrefetchShare ShareOf(const Problem<T>& p, int64_t panel, int64_t tile, int64_t tiles) {
  if (panel < 0 || tiles <= 0) return {};
  const auto start = reinterpret_cast<uintptr_t>(p.panel(panel));
  const uintptr_t first_line = start / kLineBytes * kLineBytes;
  const int64_t bytes = p.steps * kPanelWidth * static_cast<int64_t>(sizeof(typename T::WElem));
  const int64_t lines = (static_cast<int64_t>(start - first_line) + bytes + kLineBytes - 1) / kLineBytes;
  const int64_t from = lines * tile / tiles, to = lines * (tile + 1) / tiles;
  return {reinterpret_cast<const char*>(first_line) + from * kLineBytes, to - from, (to - from + p.steps - 1) / p.steps};
}

#if JAXSERVE_SIGNED_QUADS
// AVX2's int8 steps for R rows: acc[r][j] += x_rows[r] . the panel's column vector j over steps
// [begin, end), as signed products q * xq (so x_offset is 0 here). vpmaddubsw multiplies unsigned by
// signed bytes into 16-bit pair sums that saturate, so it takes |q| (at most 127) against xq with q's
// sign (vpsignb): a pair is at most 2 x 127 x 127 < 2^15, and vpmaddwd by ones adds the pairs into the
// lane's 32 bits. The same integers as vpdpbusd's; |q| is shared by the rows. On Zen 3 this is about
// 1.4x float32's FMA rate (vpmaddwd issues once a cycle), where widening the bytes to 16 bits for
// vpmaddwd alone was level with it.
template <int R>
__attribute__((always_inline)) inline void SignedQuadSteps(const uint32_t* x_rows, int64_t steps,
                                                           const uint32_t* w_panel, IntVec (&acc)[R][kVectors],
                                                           const PrefetchShare& prefetch, int64_t begin, int64_t end) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));  // (q + 128) ^ 0x80 = q
  __m256i sums[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) sums[r][j] = (__m256i)acc[r][j];
  for (int64_t k = begin; k < end; ++k) {
    const uint32_t* w_row = w_panel + k * kPanelWidth;
    prefetch.At(k);
    __m256i x[R];
    for (int r = 0; r < R; ++r) x[r] = _mm256_set1_epi32(static_cast<int32_t>(x_rows[r * steps + k]));
    for (int j = 0; j < kVectors; ++j) {
      const __m256i q =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_row + j * kLanes)), offset);
      const __m256i magnitude = _mm256_abs_epi8(q);
      for (int r = 0; r < R; ++r) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x[r], q));
        sums[r][j] = _mm256_add_epi32(sums[r][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) acc[r][j] = (IntVec)sums[r][j];
}
#endif

// acc[r][j] = x_rows[r] . the panel's column vector j, for R rows of x; `prefetch`'s lines for step k
// (a share of another panel, or none) are prefetched into L2 with row k of this one. Inlined, so that acc stays in
// registers (called twice from GatedTile, GCC otherwise keeps it out of line, spilling acc to memory).
template <typename T, int R, typename Acc>
__attribute__((always_inline)) inline void AccumulateSteps(const Problem<T>& p, const typename T::Elem* x_rows,
                                                           const typename T::WElem* w_panel, Acc (&acc)[R][kVectors],
                                                           const PrefetchShare& prefetch, int64_t begin,
                                                           int64_t end) {
  const int64_t steps = p.steps;
#if JAXSERVE_SIGNED_QUADS
  if constexpr (std::is_same_v<T, U8Quads>) return SignedQuadSteps<R>(x_rows, steps, w_panel, acc, prefetch, begin, end);
#endif
  for (int64_t k = begin; k < end; ++k) {
    prefetch.At(k);
#if defined(__AVX2__) && !defined(__AVX512F__)
    // AVX2, float32 weights: left to itself, GCC takes each weight vector as the memory operand of both
    // rows' multiplies, 12 loads a k for 12 multiplies. On Zen 1, which loads two 128-bit halves a cycle and
    // issues one 256-bit FMA, those loads (and two broadcasts) bound the tile: one load of each vector into
    // a register (the empty asm, an x86 register constraint) took one layer's matmuls from 64-66 to 71
    // GFLOP/s at 512 rows (the FMA peak: 80) and from 52-58 to 64-65 at 32 rows.
    if constexpr (std::is_same_v<T, F32>) {
      Vec xv[R];
      for (int r = 0; r < R; ++r) xv[r] = Vec{} + x_rows[r * steps + k];
      for (int j = 0; j < kVectors; ++j) {
        Vec w = T::LoadW(w_panel + k * kPanelWidth + j * kLanes);
        asm("" : "+x"(w));  // in a register: one load for the R multiplies
        for (int r = 0; r < R; ++r) acc[r][j] += xv[r] * w;
      }
      continue;
    }
#endif
    typename T::WVec w[kVectors];
    for (int j = 0; j < kVectors; ++j) w[j] = T::LoadW(w_panel + k * kPanelWidth + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const typename T::Elem xv = x_rows[r * steps + k];
      for (int j = 0; j < kVectors; ++j) T::MulAdd(acc[r][j], xv, w[j]);
    }
  }
}

// acc[r][j] += rows row.. of x . the column vectors of `panel` (int8: group by group, each group's
// integer sums scaled into acc).
template <typename T, int R>
__attribute__((always_inline)) inline void Accumulate(const Problem<T>& p, int64_t row, int64_t panel,
                                                      Vec (&acc)[R][kVectors], const PrefetchShare& prefetch) {
  const typename T::Elem* x_rows = p.x + row * p.steps;
  const typename T::WElem* w_panel = p.panel(panel);
  if constexpr (!std::is_same_v<T, U8Quads>) {
    AccumulateSteps<T, R>(p, x_rows, w_panel, acc, prefetch, 0, p.steps);
  } else {
    for (int64_t g = 0; g < p.groups; ++g) {
      IntVec sums[R][kVectors] = {};
      AccumulateSteps<T, R>(p, x_rows, w_panel, sums, prefetch, g * p.group_steps, (g + 1) * p.group_steps);
      for (int r = 0; r < R; ++r) {
        const float x_scale = p.x_scale[(row + r) * p.groups + g];
        for (int j = 0; j < kVectors; ++j) {
          acc[r][j] = FusedMulAdd(__builtin_convertvector(sums[r][j], Vec), Vec{} + x_scale, acc[r][j]);
        }
      }
    }
  }
}

// y[rows, panel's columns] for `rows` (<= kRows) rows of x starting at row `row`.
template <typename T, int R>
void Tile(const Problem<T>& p, int64_t row, int64_t panel, int64_t columns, const PrefetchShare& prefetch) {
  Vec acc[R][kVectors] = {};
  Accumulate<T, R>(p, row, panel, acc, prefetch);
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

// silu as the weights warrant: float32 weights keep the exact exp and division (the exact-parity mode);
// narrower ones, whose products already carry bfloat16's, float8's or int8's rounding, take
// SiluForRounding (about 3e-6 relative), no division.
template <typename T>
inline Vec GateSilu(Vec x) {
  if constexpr (std::is_same_v<T, F32>) {
    return jaxserve::Silu(x);
  } else {
    return jaxserve::SiluForRounding(x);
  }
}

// The gated output for row `row` + r and vector j of gate panel `panel`: silu(gate + add) * (up + add).
template <typename T>
inline void StoreGated(const Problem<T>& p, int64_t row, int64_t panel, int r, int j, Vec gate, Vec up_value) {
  const int64_t column = panel * kPanelWidth + j * kLanes;
  if (p.add != nullptr) {
    const float* add_row = p.add + (row + r) * p.n + column;
    gate += Load(add_row);
    up_value += Load(add_row + p.n / 2);
  }
  const int64_t at = (row + r) * (p.n / 2) + column;
  if (p.y_bf16 != nullptr) return StoreBf16(p.y_bf16 + at, GateSilu<T>(gate) * up_value);
  Store(p.y + at, GateSilu<T>(gate) * up_value);
}

// StoreGated for rows row..row + rows - 1 from their gate and up sums, [rows, kPanelWidth] each.
template <typename T>
void StoreGatedRows(const Problem<T>& p, int64_t row, int64_t panel, int64_t rows, const float* gate, const float* up) {
  const int64_t up_column = p.panels / 2 * kPanelWidth;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < kVectors; ++j) {
      const int64_t column = panel * kPanelWidth + j * kLanes;
      StoreGated(p, row, panel, r, j, p.out(Load(gate + r * kPanelWidth + j * kLanes), row + r, column),
                 p.out(Load(up + r * kPanelWidth + j * kLanes), row + r, column + up_column));
    }
}

// silu(gate) * up for R rows and gate panel `panel` (whole panels only); row tile `tile` of `tiles`' share
// of gate panel `prefetch` and of its up panel is prefetched meanwhile (-1: none).
template <typename T, int R>
void GatedTile(const Problem<T>& p, int64_t row, int64_t panel, int64_t prefetch, int64_t tile, int64_t tiles) {
  const auto up = [&p](int64_t b) { return b < 0 ? -1 : b + p.panels / 2; };
  Vec gate_acc[R][kVectors] = {}, up_acc[R][kVectors] = {};
  Accumulate<T, R>(p, row, panel, gate_acc, ShareOf(p, prefetch, tile, tiles));
  Accumulate<T, R>(p, row, up(panel), up_acc, ShareOf(p, up(prefetch), tile, tiles));
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) {
      const int64_t column = panel * kPanelWidth + j * kLanes;
      StoreGated(p, row, panel, r, j, p.out(gate_acc[r][j], row + r, column),
                 p.out(up_acc[r][j], row + r, column + p.panels / 2 * kPanelWidth));
    }
}

// AVX2 only, float32 weights, prompt-sized M: the rows in strips of kStripRows and K in blocks of
// kBlockSteps, so that a panel's block (128 x 48 floats, 24 KiB) stays in L1 while every row tile of the
// strip passes over it. Unblocked, each 2-row tile streams the whole panel (K x 192 bytes) from L2, 192
// bytes per 12 multiplies: as much as Zen 3's L2 gives L1 in a cycle, so the multiplies waited on it. A
// strip's sums wait in `gate` (and `up`) between blocks. AVX-512's 8-row tiles read a third of that per
// multiply and take the unblocked path.
constexpr int64_t kStripRows = 64;
constexpr int64_t kBlockSteps = 128;

template <typename T>
constexpr bool kBlocks = kLanes == 8 && std::is_same_v<T, F32>;

// c[r, :] (+)= rows row.. of x . w_panel over steps [begin, end): c holds the sums of the steps before begin.
template <typename T, int R>
void BlockTile(const Problem<T>& p, int64_t row, const typename T::WElem* w_panel, float* c, int64_t begin,
               int64_t end) {
  Vec acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) acc[r][j] = begin == 0 ? Vec{} : Load(c + r * kPanelWidth + j * kLanes);
  AccumulateSteps<T, R>(p, p.x + row * p.steps, w_panel, acc, PrefetchShare{}, begin, end);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) Store(c + r * kPanelWidth + j * kLanes, acc[r][j]);
}

// Every row against panel `panel` (y's `columns` of it; gated: with its up panel) in strips and blocks as
// above; returns the rows done: all of them, or none (other weights, AVX-512, few rows or a short K).
template <bool kGated, typename T, int... R>
int64_t BlockedRows(const Problem<T>& p, int64_t panel, int64_t columns, std::integer_sequence<int, R...>) {
  if constexpr (!kBlocks<T>) {
    return 0;
  } else {
  if (p.m <= 2 * T::kRows || p.steps <= kBlockSteps) return 0;
  using TileFn = void (*)(const Problem<T>&, int64_t, const typename T::WElem*, float*, int64_t, int64_t);
  static constexpr TileFn kTiles[] = {nullptr, &BlockTile<T, R + 1>...};
  alignas(64) float gate[kStripRows * kPanelWidth], up[kGated ? kStripRows * kPanelWidth : 1];
  for (int64_t strip = 0; strip < p.m; strip += kStripRows) {
    const int64_t strip_rows = std::min(kStripRows, p.m - strip);
    auto multiply = [&](int64_t of, float* c) {
      for (int64_t begin = 0; begin < p.steps; begin += kBlockSteps)
        for (int64_t row = 0; row < strip_rows; row += T::kRows)
          kTiles[std::min<int64_t>(T::kRows, strip_rows - row)](p, strip + row, p.panel(of), c + row * kPanelWidth,
                                                                begin, std::min(begin + kBlockSteps, p.steps));
    };
    multiply(panel, gate);
    if constexpr (kGated) {
      multiply(panel + p.panels / 2, up);
      StoreGatedRows(p, strip, panel, strip_rows, gate, up);
    } else {
      for (int64_t r = 0; r < strip_rows; ++r)
        std::memcpy(p.y + (strip + r) * p.n + panel * kPanelWidth, gate + r * kPanelWidth, columns * sizeof(float));
    }
  }
  return p.m;
  }
}

std::atomic<int> amx_wanted{1};  // JaxserveSetAmx
std::atomic<int64_t> amx_blocks{0};  // JaxserveAmxBlocks: 16-row blocks x panels done on tiles

#if JAXSERVE_AMX
using jaxserve::AmxPermitted;
using jaxserve::ConfigureTiles;
using jaxserve::kAmxRows;
static_assert(kPanelWidth == 3 * 16, "a panel is three AMX weight tiles wide");

// The fewest rows that take the tiles. bfloat16: one, so that every row of a call takes them and a row's
// result never depends on how many rows its step has (batch invariance); at 8 rows the tiles take half the
// vector code's time (LM head 576 x 49152: 2.25 against 3.76 ms), at 1-3 rows both are bound by the
// weights' bytes (decode steps within noise of each other). int8: whole blocks only, the rest on the vector
// code, whose sums are the tiles' bit for bit; at 2-8 rows VNNI's vpdpbusd beats the tiles, whose int32
// sums are stored and scaled every group (LM head, 8 rows: 1.14 against 1.43 ms).
template <typename T>
constexpr int64_t kMinAmxRows = std::is_same_v<T, U8Quads> ? kAmxRows : 1;

// Rows a pass takes on the tiles: bfloat16 two whole blocks (AmxPair), int8 one.
template <typename T>
constexpr int64_t kAmxPassRows = std::is_same_v<T, Bf16Pairs> ? 2 * kAmxRows : kAmxRows;

template <typename T>
bool UseAmx(const Problem<T>& p) {
  if (p.m < kMinAmxRows<T> || p.steps % kAmxRows != 0) return false;
  if constexpr (std::is_same_v<T, U8Quads>) {
    if (p.group_steps % kAmxRows != 0) return false;  // a group is whole tiles of 64 k
  }
  return amx_wanted.load(std::memory_order_relaxed) && AmxPermitted();
}

// Rows of `prefetch` (a panel, or nullptr) for steps k.. k + 15 into L2: a tile's worth.
inline void PrefetchTileRows(const uint32_t* prefetch, int64_t k) {
  if (prefetch == nullptr) return;
  for (int line = 0; line < kAmxRows * kPanelWidth / 16; ++line)
    jaxserve::PrefetchL2(prefetch + k * kPanelWidth + line * 16);
}

// The next step's weight rows into L1 meanwhile: +15-20% at 256 rows (the panel is in L2; the hardware
// prefetcher alone leaves the tile loads waiting). A prefetch past the array's end never faults.
inline void PrefetchNextWeightRows(const uint32_t* w, int64_t k) {
  for (int line = 0; line < kAmxRows * kPanelWidth / 16; ++line)
    jaxserve::PrefetchL1(w + (k + kAmxRows) * kPanelWidth + line * 16);
}

// Steps k.. k + 15 of x's rows and the panel w into accumulator tiles 0-2 (bfloat16 pairs or int8 quads).
template <typename T>
inline void AmxStep(const uint32_t* x_rows, int64_t x_stride, const uint32_t* w, int64_t k) {
  PrefetchNextWeightRows(w, k);
  _tile_loadd(3, x_rows + k, x_stride * sizeof(uint32_t));
  _tile_loadd(4, w + k * kPanelWidth, kPanelWidth * sizeof(uint32_t));
  _tile_loadd(5, w + k * kPanelWidth + 16, kPanelWidth * sizeof(uint32_t));
  _tile_loadd(6, w + k * kPanelWidth + 32, kPanelWidth * sizeof(uint32_t));
  if constexpr (std::is_same_v<T, Bf16Pairs>) {
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  } else {  // x signed, w unsigned (q + 128)
    _tile_dpbsud(0, 3, 4);
    _tile_dpbsud(1, 3, 5);
    _tile_dpbsud(2, 3, 6);
  }
}

inline void StoreTiles(void* c, int64_t stride) {
  _tile_stored(0, c, stride * 4);
  _tile_stored(1, static_cast<char*>(c) + 64, stride * 4);
  _tile_stored(2, static_cast<char*>(c) + 128, stride * 4);
  jaxserve::TileMemoryBarrier();  // c is read as memory after this
}

// c[rows, kPanelWidth] (row stride `stride` floats) = rows row..row + rows - 1 of x . `panel` (the
// tiles configured for `rows`), as the vector code's accumulators (int8: before the offset and the
// column scales); the panel `prefetch` (or nullptr) is fetched into L2 meanwhile, a tile's worth per
// tile step.
void AmxBlock(const Problem<Bf16Pairs>& p, int64_t row, int64_t panel, float* c, int64_t stride,
              const uint32_t* prefetch, int) {
  const uint32_t* x_rows = p.x + row * p.steps;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t k = 0; k < p.steps; k += kAmxRows) {
    PrefetchTileRows(prefetch, k);
    AmxStep<Bf16Pairs>(x_rows, p.steps, p.panel(panel), k);
  }
  StoreTiles(c, stride);
}

// Two whole blocks at once (bfloat16): c[32, kPanelWidth] = rows row..row + 31 of x . `panel`, in six
// accumulator tiles (0-2 the first block's, 3-5 the second's), x's tiles and the panel's loaded in turn
// into tiles 6 and 7. Per 32 k the panel's three tiles are loaded once for 32 rows (AmxBlock: for 16), and
// a reload of x's tile just loaded (L1) replaces a weight tile from L2. The weight tiles are loaded with
// the streaming hint (tileloaddt1) and not prefetched into L1: the panel (55 KiB at K = 576) passes
// through without evicting the pass's x rows, which every panel of the work item reads again from L1
// (AmxRows). The default model's layer at 512 rows: 2.7 -> 2.3-2.5 ms, at 32 rows within noise. Each
// accumulator takes the same tdpbf16ps in the same k order as in AmxBlock, so the sums are AmxBlock's bit
// for bit. The tiles configured for 16 rows.
void AmxPair(const Problem<Bf16Pairs>& p, int64_t row, int64_t panel, float* c, int64_t stride,
             const uint32_t* prefetch) {
  const uint32_t* x0 = p.x + row * p.steps;
  const uint32_t* x1 = x0 + kAmxRows * p.steps;
  const uint32_t* w = p.panel(panel);
  const int64_t x_stride = p.steps * sizeof(uint32_t), w_stride = kPanelWidth * sizeof(uint32_t);
  jaxserve::ZeroPair();
  for (int64_t k = 0; k < p.steps; k += kAmxRows) {
    PrefetchTileRows(prefetch, k);
    jaxserve::PairStep<true>(x0 + k, x1 + k, x_stride, w + k * kPanelWidth, w_stride);
  }
  jaxserve::StorePair(c, c + kAmxRows * stride, stride * sizeof(float));
}

// int8: group by group, each group's int32 sums stored and scaled into c by the rows' group scales.
void AmxBlock(const Problem<U8Quads>& p, int64_t row, int64_t panel, float* c, int64_t stride,
              const uint32_t* prefetch, int rows) {
  const uint32_t* x_rows = p.x + row * p.steps;
  alignas(64) int32_t sums[kAmxRows * kPanelWidth];
  for (int64_t g = 0; g < p.groups; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k = g * p.group_steps; k < (g + 1) * p.group_steps; k += kAmxRows) {
      PrefetchTileRows(prefetch, k);
      AmxStep<U8Quads>(x_rows, p.steps, p.panel(panel), k);
    }
    StoreTiles(sums, kPanelWidth);
    for (int r = 0; r < rows; ++r) {
      const float x_scale = p.x_scale[(row + r) * p.groups + g];
      for (int j = 0; j < kVectors; ++j) {
        IntVec group_sums;
        std::memcpy(&group_sums, sums + r * kPanelWidth + j * kLanes, sizeof(group_sums));
        float* out = c + r * stride + j * kLanes;
        // The vector code's sum, rounded as it rounds it (Accumulate).
        Store(out, FusedMulAdd(__builtin_convertvector(group_sums, Vec), Vec{} + x_scale, g == 0 ? Vec{} : Load(out)));
      }
    }
  }
}

// x's rows in blocks of 16, the last block the rest (if it has kMinAmxRows rows), against panels
// first_panel..first_panel + count - 1 (y's columns of each; gated: each with its up panel), a pass of rows
// over every panel before the next pass; returns the rows done (0 where the tile unit is not used).
// bfloat16 takes two whole blocks at a time where it can (AmxPair). Each panel's pass that holds the
// second block, or the only one, prefetches the panel after it (the last: `next`).
template <bool kGated, typename T>
int64_t AmxRows(const Problem<T>& p, int64_t first_panel, int64_t count, int64_t next) {
  if (!UseAmx(p)) return 0;
  jaxserve::TileMemoryBarrier();  // x and the panels are read by the tile loads below
  constexpr int64_t kMaxPass = kAmxPassRows<T>;
  alignas(64) float gate[kMaxPass * kPanelWidth], up[kMaxPass * kPanelWidth];
  const int64_t done = p.m % kAmxRows >= kMinAmxRows<T> ? p.m : p.m / kAmxRows * kAmxRows;
  const int64_t blocks = (done + kAmxRows - 1) / kAmxRows;
  const int64_t prefetching = std::min<int64_t>(1, blocks - 1) * kAmxRows;  // the row its pass holds
  const int64_t up_offset = kGated ? p.panels / 2 : 0;
  int configured = 0;
  for (int64_t row = 0; row < done;) {
    const int64_t pass = done - row >= kMaxPass ? kMaxPass : std::min<int64_t>(kAmxRows, done - row);
    const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, pass));  // the tiles' rows
    if (rows != configured) ConfigureTiles(configured = rows);
    for (int64_t panel = first_panel; panel < first_panel + count; ++panel) {
      const int64_t columns = kGated ? kPanelWidth : std::min<int64_t>(kPanelWidth, p.n - panel * kPanelWidth);
      const int64_t after = panel + 1 < first_panel + count ? panel + 1 : next;  // the panel to prefetch
      const bool prefetches = row <= prefetching && prefetching < row + pass && after >= 0;
      // rows row..row + pass - 1 of x . panel `of` into c (row stride `stride`), with panel `ahead` prefetched
      auto multiply = [&](int64_t of, float* c, int64_t stride, int64_t ahead) {
        const uint32_t* prefetch = prefetches ? p.panel(ahead) : nullptr;
        if constexpr (std::is_same_v<T, Bf16Pairs>) {
          if (pass == 2 * kAmxRows) return AmxPair(p, row, of, c, stride, prefetch);
        }
        AmxBlock(p, row, of, c, stride, prefetch, rows);
      };
      if constexpr (kGated) {
        multiply(panel, gate, kPanelWidth, after);
        multiply(panel + up_offset, up, kPanelWidth, after + up_offset);
        StoreGatedRows(p, row, panel, pass, gate, up);
      } else {
        float* y = p.y + row * p.n + panel * kPanelWidth;
        if (std::is_same_v<T, Bf16Pairs> && columns == kPanelWidth) {  // the tiles are the output
          multiply(panel, y, p.n, after);
        } else {
          multiply(panel, gate, kPanelWidth, after);
          for (int r = 0; r < pass; ++r) {
            alignas(64) float values[kPanelWidth];
            for (int j = 0; j < kVectors; ++j)
              Store(values + j * kLanes, p.out(Load(gate + r * kPanelWidth + j * kLanes), row + r,
                                               panel * kPanelWidth + j * kLanes));
            std::memcpy(y + r * p.n, values, columns * sizeof(float));
          }
        }
      }
    }
    row += pass;
  }
  _tile_release();
  amx_blocks.fetch_add(blocks * count, std::memory_order_relaxed);
  return done;
}
#endif

// The rows that the tile unit multiplies first (bfloat16 or int8 weights on an AMX CPU), 0 otherwise.
template <bool kGated, typename T>
int64_t TileUnitRows(const Problem<T>& p, int64_t first_panel, int64_t count, int64_t next) {
#if JAXSERVE_AMX
  if constexpr (std::is_same_v<T, Bf16Pairs> || std::is_same_v<T, U8Quads>) return AmxRows<kGated>(p, first_panel, count, next);
#endif
  (void)p, (void)first_panel, (void)count, (void)next;
  return 0;
}

// Panels a work item takes: one, or on the tile unit, where the rows take more than one pass, as many
// as keep the item's weights within kGroupBytes of L2 and leave each thread two items or more. Its
// passes then go row block by row block over the item's panels, each block's rows of x read from L1
// by every panel in turn rather than from L2 once per panel.
constexpr int64_t kGroupBytes = 1 << 20;

template <bool kGated, typename T>
int64_t PanelsPerItem(const Problem<T>& p, int64_t units, int64_t threads) {
#if JAXSERVE_AMX
  if constexpr (std::is_same_v<T, Bf16Pairs> || std::is_same_v<T, U8Quads>) {
    if (p.m > kAmxPassRows<T> && UseAmx(p)) {
      const int64_t unit_bytes = p.steps * kPanelWidth * static_cast<int64_t>(sizeof(uint32_t)) * (kGated ? 2 : 1);
      const int64_t fair = units / (2 * std::max<int64_t>(threads, 1));
      return std::max<int64_t>(1, std::min(kGroupBytes / unit_bytes, fair));
    }
  }
#endif
  (void)p, (void)units, (void)threads;
  return 1;
}

// The rows of x from `first` (those before it done on the tile unit, TileUnitRows) in tiles of kRows,
// then one tile of the rest, against one column panel; `next`, the panel this thread does next (-1:
// none), is prefetched meanwhile, a share by each tile, where every row is done here.
template <typename T, int... R>
void Panel(const Problem<T>& p, int64_t panel, int64_t next, int64_t first, std::integer_sequence<int, R...>) {
  using TileFn = void (*)(const Problem<T>&, int64_t, int64_t, int64_t, const PrefetchShare&);
  static constexpr TileFn kTiles[] = {nullptr, &Tile<T, R + 1>...};  // kTiles[r]: a tile of r rows
  const int64_t columns = std::min<int64_t>(kPanelWidth, p.n - panel * kPanelWidth);
  if (first == 0) first = BlockedRows<false>(p, panel, columns, std::integer_sequence<int, R...>());
  const int64_t tiles = first == 0 ? (p.m + T::kRows - 1) / T::kRows : 0;
  for (int64_t row = first; row < p.m; row += T::kRows) {
    const int64_t rows = std::min<int64_t>(T::kRows, p.m - row);
    kTiles[rows](p, row, panel, columns, ShareOf(p, next, row / T::kRows, tiles));
  }
}

// The same for gate panel `panel` and its up panel.
template <typename T, int... R>
void GatedPanel(const Problem<T>& p, int64_t panel, int64_t next, int64_t first, std::integer_sequence<int, R...>) {
  using TileFn = void (*)(const Problem<T>&, int64_t, int64_t, int64_t, int64_t, int64_t);
  static constexpr TileFn kTiles[] = {nullptr, &GatedTile<T, R + 1>...};
  if (first == 0) first = BlockedRows<true>(p, panel, kPanelWidth, std::integer_sequence<int, R...>());
  const int64_t tiles = first == 0 ? (p.m + T::kRows - 1) / T::kRows : 0;
  for (int64_t row = first; row < p.m; row += T::kRows) {
    const int64_t rows = std::min<int64_t>(T::kRows, p.m - row);
    kTiles[rows](p, row, panel, next, row / T::kRows, tiles);
  }
}

// XLA's buffer types for each weight type's x and w: float32, bfloat16, or float32 x and uint8 w (fp8's
// handlers bind their own: MatmulFp8).
template <typename T>
constexpr ffi::DataType kXType = std::is_same_v<T, Bf16Pairs> ? ffi::BF16 : ffi::F32;
template <typename T>
constexpr ffi::DataType kWType = std::is_same_v<T, F32> ? ffi::F32 : std::is_same_v<T, Bf16Pairs> ? ffi::BF16 : ffi::U8;

template <typename T, bool kGated>
std::string KernelName() {
  const char* suffix = std::is_same_v<T, F32>         ? ""
                       : std::is_same_v<T, Bf16Pairs> ? "_bf16"
                       : std::is_same_v<T, F8Pairs>   ? "_fp8"
                                                      : "_int8";
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
  const int64_t units = kGated ? problem.panels / 2 : problem.panels;
  const int64_t per_item = PanelsPerItem<kGated>(problem, units, pool.num_threads());
  jaxserve::ParallelFor(pool, (units + per_item - 1) / per_item, [problem, units, per_item] {
    return [problem, units, per_item](int64_t item, int64_t next_item) {
      const int64_t first = item * per_item, count = std::min(per_item, units - first);
      const int64_t next = next_item < 0 ? -1 : next_item * per_item;
      const int64_t done = TileUnitRows<kGated>(problem, first, count, next);  // rows done on every panel
      for (int64_t panel = first; panel < first + count; ++panel) {
        const int64_t after = panel + 1 < first + count ? panel + 1 : next;
        if constexpr (kGated) {
          GatedPanel(problem, panel, after, done, std::make_integer_sequence<int, T::kRows>());
        } else {
          Panel(problem, panel, after, done, std::make_integer_sequence<int, T::kRows>());
        }
      }
    };
  });
}

// The rows past the first m (a padded step's padding) are zeros, in y's type (float32 or bfloat16).
template <ffi::DataType kYType>
int64_t ZeroPadding(ffi::Buffer<ffi::S32>& rows, ffi::Result<ffi::Buffer<kYType>>& y) {
  const auto y_dims = y->dimensions();
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, y_dims[0]);
  const int64_t row_bytes = y_dims[1] * static_cast<int64_t>(ffi::ByteWidth(kYType));
  std::memset(static_cast<char*>(y->untyped_data()) + m * row_bytes, 0, (y_dims[0] - m) * row_bytes);
  return m;
}

// y = x @ w (gated: silu(x @ w_gate + add_gate) * (x @ w_up + add_up), `add` [M, N] or null), float32 or
// bfloat16 weights; see ShapesMatch.
template <typename T, bool kGated>
ffi::Error RunMatmul(ffi::ThreadPool& pool, ffi::Buffer<kXType<T>>& x, ffi::Buffer<kWType<T>>& w,
                     ffi::Buffer<ffi::S32>& rows, const float* add, ffi::ResultBuffer<ffi::F32>& y) {
  if (!ShapesMatch<T, kGated>(x.dimensions(), w.dimensions(), y->dimensions()) || rows.element_count() != 1) {
    return ffi::Error::InvalidArgument(KernelName<T, kGated>() + ": operand shapes do not match");
  }
  const int64_t m = ZeroPadding(rows, y), k = x.dimensions()[1];
  using Elem = typename T::Elem;
  const int64_t n = y->dimensions()[1] * (kGated ? 2 : 1);
  Problem<T> problem{reinterpret_cast<const Elem*>(x.untyped_data()),
                     reinterpret_cast<const typename T::WElem*>(w.untyped_data()),
                     y->typed_data(), m, k / T::kSteps, n, w.dimensions()[0]};
  problem.add = add;
  Run<T, kGated>(pool, problem);
  return ffi::Error::Success();
}

template <typename T, bool kGated>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<kXType<T>> x, ffi::Buffer<kWType<T>> w,
                  ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  return RunMatmul<T, kGated>(pool, x, w, rows, nullptr, y);
}

// The bfloat16 gated matmul with its output in bfloat16, rounded as XLA's convert would round it: the
// input of down_proj's bfloat16 matmul, which then needs no convert between the two calls.
ffi::Error GatedMatmulBf16Out(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                              ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::BF16> y) {
  const auto y_dims = y->dimensions();
  if (!ShapesMatch<Bf16Pairs, true>(x.dimensions(), w.dimensions(), y_dims) || rows.element_count() != 1) {
    return ffi::Error::InvalidArgument(KernelName<Bf16Pairs, true>() + "_bf16_out: operand shapes do not match");
  }
  const int64_t m = ZeroPadding(rows, y);
  Problem<Bf16Pairs> problem{static_cast<const uint32_t*>(x.untyped_data()),
                             static_cast<const uint32_t*>(w.untyped_data()), nullptr, m, x.dimensions()[1] / 2,
                             2 * y_dims[1], w.dimensions()[0]};
  problem.y_bf16 = static_cast<uint16_t*>(y->untyped_data());
  Run<Bf16Pairs, true>(pool, problem);
  return ffi::Error::Success();
}

// The gated matmul with add [M, N] (float32) added to x @ [w_gate | w_up] before the activation: a LoRA
// adapter's deltas for the two projections (jaxserve/ops/lora.py), without unfusing the kernel.
template <typename T>
ffi::Error GatedMatmulAdd(ffi::ThreadPool pool, ffi::Buffer<kXType<T>> x, ffi::Buffer<kWType<T>> w,
                          ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> add, ffi::ResultBuffer<ffi::F32> y) {
  const auto add_dims = add.dimensions(), y_dims = y->dimensions();
  if (add_dims.size() != 2 || y_dims.size() != 2 || add_dims[0] != y_dims[0] || add_dims[1] != 2 * y_dims[1]) {
    return ffi::Error::InvalidArgument(KernelName<T, true>() + "_add: the added deltas' shape does not match");
  }
  return RunMatmul<T, true>(pool, x, w, rows, add.typed_data(), y);
}

typedef int8_t ByteVec __attribute__((vector_size(kLanes)));

// v rounded to the nearest integer, ties to even (as lrintf in the default rounding mode), lane by lane.
// (GCC 12's own header trips -Wmaybe-uninitialized inside _mm512_cvtps_epi32: not ours to fix.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
inline IntVec RoundToInt(Vec v) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) return (IntVec)_mm512_cvtps_epi32((__m512)v);
#endif
  IntVec out;
  for (int lane = 0; lane < kLanes; ++lane) out[lane] = static_cast<int32_t>(std::lrintf(v[lane]));
  return out;
}
#pragma GCC diagnostic pop

// row_fn(r) for rows 0..m-1 of k elements: on this thread for up to kInlineElements (a decode step's rows),
// else spread over the pool's threads 16 rows an item (a prompt step's rows pay for it). Handing 32 rows of
// 576 to the pool cost more than it saved: on a 2-core Zen 5, int8 qkv, o_proj and gate_up at 32 rows took
// 2-4 us less a call on this thread (about 30, 21 and 80 us); down_proj's 1,536 took as long either way.
constexpr int64_t kInlineElements = 64 * 576;

template <typename RowFn>
void ForEachRow(ffi::ThreadPool& pool, int64_t m, int64_t k, RowFn row_fn) {
  constexpr int64_t kRowsPerItem = 16;
  if (m <= kRowsPerItem || m * k <= kInlineElements) {
    for (int64_t r = 0; r < m; ++r) row_fn(r);
    return;
  }
  jaxserve::ParallelFor(pool, (m + kRowsPerItem - 1) / kRowsPerItem, [row_fn, m] {
    return [row_fn, m](int64_t item) {
      for (int64_t r = item * kRowsPerItem; r < std::min(m, (item + 1) * kRowsPerItem); ++r) row_fn(r);
    };
  });
}

// x's rows [m, k] in groups of k / groups: int8 (as 32-bit quads), each group's scale [m, groups] (its
// largest |x| -> 127), and each row's x_offset [m]: 128 sum_g x_scale[g] sum(xq in g), what the weights'
// offset of 128 adds to the row's products (0 where the products are signed: kSignedQuads). ForEachRow.
void QuantizeRows(ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k, int64_t groups, int8_t* bytes,
                  float* x_scale, float* x_offset) {
  const int64_t size = k / groups;
  auto quantize = [=](int64_t r) {
    float offset = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const float* in = x + r * k + g * size;
      const int64_t whole = size - size % kLanes;  // whole vectors, then the rest one by one
      Vec largest_lanes = {};
      for (int64_t i = 0; i < whole; i += kLanes) {
        const Vec v = Load(in + i);
        const Vec magnitude = v < 0.0f ? -v : v;
        largest_lanes = magnitude > largest_lanes ? magnitude : largest_lanes;
      }
      float largest = 0.0f;
      for (int lane = 0; lane < kLanes; ++lane) largest = std::max(largest, largest_lanes[lane]);
      for (int64_t i = whole; i < size; ++i) largest = std::max(largest, std::fabs(in[i]));
      const float scale = largest > 0.0f ? largest / 127.0f : 1.0f;
      x_scale[r * groups + g] = scale;
      const float inverse = 1.0f / scale;
      int8_t* out = bytes + r * k + g * size;
      IntVec sum_lanes = {};
      for (int64_t i = 0; i < whole; i += kLanes) {
        const IntVec q = RoundToInt(Load(in + i) * inverse);
        sum_lanes += q;
        const ByteVec packed = __builtin_convertvector(q, ByteVec);
        std::memcpy(out + i, &packed, sizeof(packed));
      }
      int64_t sum = 0;
      for (int lane = 0; lane < kLanes; ++lane) sum += sum_lanes[lane];
      for (int64_t i = whole; i < size; ++i) {
        out[i] = static_cast<int8_t>(std::lrintf(in[i] * inverse));
        sum += out[i];
      }
      if constexpr (!kSignedQuads) offset += 128.0f * scale * static_cast<float>(sum);
    }
    x_offset[r] = offset;
  };
  ForEachRow(pool, m, k, quantize);
}

// The same for int8 weights, as uint8 q + 128, with their column scales [panels * kPanelWidth]: x [M, K]
// float32 is quantized here in groups of `group` consecutive k (a multiple of 4 that divides K).
template <bool kGated>
ffi::Error MatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                      int64_t group) {
  const int64_t columns = w.dimensions().size() == 3 ? w.dimensions()[0] * kPanelWidth : -1;
  const int64_t k = x.dimensions().size() == 2 ? x.dimensions()[1] : -1;
  if (!ShapesMatch<U8Quads, kGated>(x.dimensions(), w.dimensions(), y->dimensions()) || rows.element_count() != 1
      || static_cast<int64_t>(w_scale.element_count()) != columns) {
    return ffi::Error::InvalidArgument(KernelName<U8Quads, kGated>() + ": operand shapes do not match");
  }
  if (group < 4 || group % 4 != 0 || k % group != 0) {
    return ffi::Error::InvalidArgument(KernelName<U8Quads, kGated>() + ": the activation group " + std::to_string(group)
                                       + " is no multiple of 4 that divides K = " + std::to_string(k));
  }
  const int64_t m = ZeroPadding(rows, y), groups = k / group;
  // The quantized rows, their scales and offsets, in buffers this thread keeps from call to call: new ones
  // each call (a prompt step's are 0.8 MB, past malloc's mmap threshold) cost fresh zeroed pages every time.
  // A call runs on one thread, and ParallelFor's helpers only read them.
  thread_local std::vector<uint32_t> quads;
  thread_local std::vector<float> x_scale, x_offset;
  quads.resize(std::max<size_t>(quads.size(), m * k / 4));
  x_scale.resize(std::max<size_t>(x_scale.size(), m * groups));
  x_offset.resize(std::max<size_t>(x_offset.size(), m));
  QuantizeRows(pool, x.typed_data(), m, k, groups, reinterpret_cast<int8_t*>(quads.data()), x_scale.data(),
               x_offset.data());
  Problem<U8Quads> problem{quads.data(), reinterpret_cast<const uint32_t*>(w.untyped_data()), y->typed_data(), m,
                           k / 4, y->dimensions()[1] * (kGated ? 2 : 1), w.dimensions()[0]};
  problem.groups = groups;
  problem.group_steps = k / groups / 4;
  problem.x_scale = x_scale.data();
  problem.x_offset = x_offset.data();
  problem.w_scale = w_scale.typed_data();
  Run<U8Quads, kGated>(pool, problem);
  return ffi::Error::Success();
}

// x's rows [m, k] (bfloat16 pairs, `pairs` = k / 2 a row) times 2^kFp8XShift into `out`, exactly (a power
// of two: the same bits but the exponent; zero stays zero, +-inf and NaN stay what they are). ForEachRow.
void ScaleRows(ffi::ThreadPool& pool, const uint32_t* x, int64_t m, int64_t pairs, uint32_t* out) {
  const float factor = std::ldexp(1.0f, kFp8XShift);
  // A lane vector of pairs (UintVec) or one pair (uint32_t): each half widened, scaled, and its bfloat16
  // bits put back (exact, so no rounding).
  const auto scaled = [factor](auto bits) {
    using Bits = decltype(bits);
    const auto low = Bf16Pairs::Widen(bits << 16) * factor, high = Bf16Pairs::Widen(bits & 0xffff0000u) * factor;
    Bits low_bits, high_bits;
    std::memcpy(&low_bits, &low, sizeof(low_bits));
    std::memcpy(&high_bits, &high, sizeof(high_bits));
    return Bits((high_bits & 0xffff0000u) | (low_bits >> 16));
  };
  auto scale = [=](int64_t r) {
    const uint32_t* in = x + r * pairs;
    uint32_t* to = out + r * pairs;
    const int64_t whole = pairs - pairs % kLanes;
    for (int64_t i = 0; i < whole; i += kLanes) {
      jaxserve::UintVec v;
      std::memcpy(&v, in + i, sizeof(v));
      v = scaled(v);
      std::memcpy(to + i, &v, sizeof(v));
    }
    for (int64_t i = whole; i < pairs; ++i) to[i] = scaled(in[i]);
  };
  ForEachRow(pool, m, 2 * pairs, scale);
}

// The same for float8 e4m3 weights (F8Pairs) with their column scales [panels * kPanelWidth] (times
// 2^(120 - kFp8XShift), as packed): x [M, K] bfloat16. The result in float32, or (gated only) in
// bfloat16, rounded as GatedMatmulBf16Out rounds it.
template <bool kGated, ffi::DataType kYType>
ffi::Error MatmulFp8(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> w_scale,
                     ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<kYType> y) {
  static_assert(kGated || kYType == ffi::F32, "a bfloat16 result comes from the gated kernel");
  if (w.element_type() != ffi::F8E4M3FN) {
    return ffi::Error::InvalidArgument(KernelName<F8Pairs, kGated>() + ": the weights are not float8_e4m3fn");
  }
  const int64_t columns = w.dimensions().size() == 3 ? w.dimensions()[0] * kPanelWidth : -1;
  if (!ShapesMatch<F8Pairs, kGated>(x.dimensions(), w.dimensions(), y->dimensions()) || rows.element_count() != 1
      || static_cast<int64_t>(w_scale.element_count()) != columns) {
    return ffi::Error::InvalidArgument(KernelName<F8Pairs, kGated>() + ": operand shapes do not match");
  }
  const int64_t m = ZeroPadding(rows, y), pairs = x.dimensions()[1] / 2;
  thread_local std::vector<uint32_t> scaled;  // kept from call to call, as MatmulInt8's buffers
  scaled.resize(std::max<size_t>(scaled.size(), m * pairs));
  ScaleRows(pool, static_cast<const uint32_t*>(x.untyped_data()), m, pairs, scaled.data());
  Problem<F8Pairs> problem{scaled.data(), static_cast<const uint16_t*>(w.untyped_data()), nullptr, m, pairs,
                           y->dimensions()[1] * (kGated ? 2 : 1), w.dimensions()[0]};
  if constexpr (kYType == ffi::F32) {
    problem.y = y->typed_data();
  } else {
    problem.y_bf16 = static_cast<uint16_t*>(y->untyped_data());
  }
  problem.w_scale = w_scale.typed_data();
  Run<F8Pairs, kGated>(pool, problem);
  return ffi::Error::Success();
}

}  // namespace

extern "C" int JaxservePackedMatmulPanelWidth() { return kPanelWidth; }

// Whether bfloat16 and int8 matmuls may use AMX tiles (1: yes, where the CPU and OS allow).
extern "C" void JaxserveSetAmx(int enabled) { amx_wanted.store(enabled != 0); }

// Whether they can: built for AMX-BF16 and AMX-INT8, and the tile state granted.
extern "C" int JaxserveAmxAvailable() {
#if JAXSERVE_AMX
  return AmxPermitted();
#else
  return 0;
#endif
}

// How many blocks of 16 rows x one panel the tiles have multiplied in this process (tests count them).
extern "C" int64_t JaxserveAmxBlocks() { return amx_blocks.load(); }

// Whether they do: available, and not turned off.
extern "C" int JaxserveAmxInUse() { return amx_wanted.load() && JaxserveAmxAvailable(); }

namespace {

// The handlers' signatures: (x, packed w, rows) -> y, and (x, w, w_scale, rows; group) -> y for int8, on
// XLA's intra-op thread pool.
template <typename T>
auto MatmulBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().template Arg<ffi::Buffer<kXType<T>>>()
      .template Arg<ffi::Buffer<kWType<T>>>().template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

auto MatmulInt8Binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::U8>>()
      .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>()
      .Attr<int64_t>("group");
}

template <ffi::DataType kYType>
auto MatmulFp8Binding() {
  // the weights untyped, their type checked: the FFI's typed buffers take no float8 (no C++ element type)
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().template Ret<ffi::Buffer<kYType>>();
}

template <typename T>
auto GatedMatmulAddBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().template Arg<ffi::Buffer<kXType<T>>>()
      .template Arg<ffi::Buffer<kWType<T>>>().template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>().template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmul, (Matmul<F32, false>), MatmulBinding<F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmul, (Matmul<F32, true>), MatmulBinding<F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmulBf16, (Matmul<Bf16Pairs, false>), MatmulBinding<Bf16Pairs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmulBf16, (Matmul<Bf16Pairs, true>), MatmulBinding<Bf16Pairs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmulBf16Out, GatedMatmulBf16Out,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmulAdd, GatedMatmulAdd<F32>, GatedMatmulAddBinding<F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmulAddBf16, GatedMatmulAdd<Bf16Pairs>,
                              GatedMatmulAddBinding<Bf16Pairs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmulInt8, MatmulInt8<false>, MatmulInt8Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmulInt8, MatmulInt8<true>, MatmulInt8Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmulFp8, (MatmulFp8<false, ffi::F32>), MatmulFp8Binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmulFp8, (MatmulFp8<true, ffi::F32>), MatmulFp8Binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedGatedMatmulFp8Bf16Out, (MatmulFp8<true, ffi::BF16>),
                              MatmulFp8Binding<ffi::BF16>());
