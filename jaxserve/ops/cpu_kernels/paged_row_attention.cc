// Paged attention by query rows for XLA:CPU, called through the XLA FFI (see jaxserve/cpu_ffi.py).
//
// Every query row (a decode row, or one row of a prompt chunk) attends to its keys 0..kv_len-1,
// kv_len being the row's own position + 1, read in place from the page arrays
// [num_layers, num_pages, page_size, num_kv_heads, head_dim] through its sequence's block table.
// Work is spread over XLA's intra-op threads (parallel_for.h). A single row (a decode row) makes two
// passes, scores over the keys and then the softmax-weighted sum of the values, each key and value
// row read straight from its page; common shapes go one KV head at a time (AttendGrouped). The rows
// of a prompt chunk (one sequence at consecutive positions) share their keys: they go in tiles of
// several tokens, one KV head at a time, as two small matrix products (AttendTile), so each key and
// value is loaded once per tile rather than once per row; a job takes several consecutive tiles of one
// KV head (AttendTiles), which share the keys and values they have converted. Needs GCC 12+ or clang
// (__builtin_shufflevector); with an older compiler the build fails and the engine keeps XLA.
// XLA's gather-based version (attention.py) copies every page first, on one thread.
//
// Queries and the output are float32; pages float32, bfloat16 or float8 e4m3 (kv_cache_dtype "fp8",
// scale 1.0), widened to float32 as they are read. With `bf16_products` set, on a CPU with AVX512-BF16, a
// tile's two products take bfloat16 operands (queries, keys, the softmax weights and values rounded
// to nearest, float32 sums; see TileBf16): one vdpbf16ps adds two products to 16 float32 sums,
// twice float32's multiply rate; and a row attended on its own over bfloat16 or float8 pages multiplies
// its keys and values as they lie in the page (float8 widened to bfloat16 bits in the register, its
// subnormals read as zero) by its query and its softmax weights rounded to bfloat16 (GroupedScores,
// GroupedValues), float32 sums. Elsewhere the flag is ignored (float32 is then the fast path). A row with
// kv_len 0 (padding) gets zeros.

#include <algorithm>
#include <array>
#if defined(__AVX512BF16__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "parallel_for.h"
#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::ExpNonPositive;
using jaxserve::IntVec;
using jaxserve::kLanes;
using jaxserve::Load;
using jaxserve::Store;
using jaxserve::Vec;
using jaxserve::Bf16;
using jaxserve::UintVec;
using jaxserve::Widen;

constexpr int64_t kLineBytes = 64;  // a cache line

// A page element: float, bfloat16 bits (Bf16, vec_math.h) or float8 e4m3 bits (Fp8). Load (8 or 16 of
// them, as float32) and Widen (one) read each kind.

// float8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities; written clipped to
// +-448 (WritePages), so never the NaN codes 0x7f / 0xff (read here as +-480). Every e4m3 value is a
// float16 with the exponent 8 lower: the byte b becomes the float16 bits sign << 15 | (b & 0x7f) << 7,
// widened by the CPU's float16 conversion (F16C; exact, subnormals included, whatever the denormal
// mode) and multiplied by 2^8. Without F16C, the float32 bits are put together (subnormals, exponent
// field 0, as m * 2^-9).
enum class Fp8 : uint8_t {};
typedef uint8_t UnalignedFp8Vec __attribute__((vector_size(kLanes), aligned(1)));

inline float Widen(Fp8 x) {
  const uint32_t b = static_cast<uint8_t>(x), sign = (b & 0x80u) << 24, magnitude = b & 0x7fu;
  const uint32_t bits = magnitude >= 8 ? sign | ((magnitude << 20) + (120u << 23)) : 0u;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return magnitude >= 8 ? f : (sign ? -1.0f : 1.0f) * static_cast<float>(magnitude) * (1.0f / 512.0f);
}

inline Vec Load(const Fp8* x) {
#if defined(__AVX512F__)  // kLanes 16
  const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  // b << 8 shifted right by one with its sign: the sign at bits 15 and 14, b & 0x7f at 13..7; clear 14
  const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(words, 8), 1), _mm256_set1_epi16(0x3fff | 0x8000));
  // (the masked form: GCC 12 warns of the plain one's undefined pass-through operand)
  return (Vec)_mm512_mul_ps(_mm512_maskz_cvtph_ps(0xffff, half), _mm512_set1_ps(256.0f));
#elif defined(__F16C__)  // kLanes 8
  const __m128i words = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
  const __m128i half = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(words, 8), 1), _mm_set1_epi16(0x3fff | 0x8000));
  return (Vec)_mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
#else
  const UintVec b = __builtin_convertvector(*reinterpret_cast<const UnalignedFp8Vec*>(x), UintVec);
  const UintVec sign = (b & 0x80u) << 24, magnitude = b & 0x7fu;
  const UintVec normal = sign | ((magnitude << 20) + (120u << 23));
  const Vec subnormal = __builtin_convertvector(magnitude, Vec) * (1.0f / 512.0f);
  UintVec sub_bits;
  std::memcpy(&sub_bits, &subnormal, sizeof(sub_bits));
  const UintVec bits = magnitude >= 8u ? normal : sub_bits | sign;
  Vec v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

// x rounded to the nearest float8 e4m3 (ties to even), clipped to +-448; NaN stays NaN (0x7f).
inline uint8_t RoundFp8(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (std::isnan(x)) return sign | 0x7fu;
  const float a = std::min(std::fabs(x), 448.0f);
  if (a < 0.015625f) {  // below 2^-6: subnormal, m * 2^-9 (m = 8 is the smallest normal's code)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  std::memcpy(&bits, &a, sizeof(bits));
  bits = (bits + 0x7ffffu + ((bits >> 20) & 1u)) & 0xfff00000u;  // 3 mantissa bits, to nearest even
  return sign | static_cast<uint8_t>((((bits >> 23) - 120u) << 3) | ((bits >> 20) & 7u));
}

// Everything the rows' attention needs; pointers into XLA's buffers, `k`/`v` at the layer's start.
template <typename Page>
struct Problem {
  const float* q;
  const Page *k, *v;
  const int32_t *kv_lens, *row_seqs, *tables;
  float* out;
  int64_t num_table_rows, num_heads, head_dim, group, num_pages, page_size, token_stride, table_width, window;
  float scale, soft_cap;
  bool bf16_products;
};

// A dot product over vectors leaves a vector of partial sums; the partial vectors of kLanes keys are
// folded into one vector of kLanes sums (log2(kLanes) rounds, each pairing vector k with vector
// k + n/2 by two shuffles and an add) instead of reducing every dot on its own. Round S takes lanes
// in runs of S, alternately from a and b; the two shuffles take the first and second S of each 2S.
constexpr int FoldLane(int lane, int s) {
  return (lane / s) / 2 * 2 * s + lane % s + ((lane / s) % 2 ? kLanes : 0);
}

template <int S, int... L>
Vec FoldPair(Vec a, Vec b, std::integer_sequence<int, L...>) {
  return __builtin_shufflevector(a, b, FoldLane(L, S)...) + __builtin_shufflevector(a, b, (FoldLane(L, S) + S)...);
}

// v[0..N-1] -> lane l of v[0] is the sum of v[l]'s lanes (v is overwritten). Inlined: called out of line
// from a decode row's scores loop, every 16 keys of a head paid a call and a vzeroupper.
template <int N>
__attribute__((always_inline)) inline void FoldLanes(Vec* v) {
  if constexpr (N > 1) {
    for (int k = 0; k < N / 2; ++k) {
      v[k] = FoldPair<N / 2>(v[k], v[k + N / 2], std::make_integer_sequence<int, kLanes>());
    }
    FoldLanes<N / 2>(v);
  }
}

#ifdef __AVX512BF16__
constexpr bool kBf16Products = kLanes == 16;
#else
constexpr bool kBf16Products = false;
#endif

// A tile's two products with bfloat16 operands: each 32-bit lane of a PairVec holds a pair of
// bfloat16 (the element for the even index in the low half), and DotPairs adds both products of a
// broadcast pair and a vector of pairs to float32 sums (vdpbf16ps). The scores pair along D
// (queries [D / 2, kTileLanes], each key [D / 2]); the weighted sum pairs along keys (weights
// [keys / 2, kTileLanes], values [keys / 2, D]). Every operand is rounded once per tile, before its
// products; the values are read from their pages once for all the tile's lanes.
using PairVec = UintVec;  // two bfloat16 in each 32-bit lane
typedef uint32_t UnalignedPairVec __attribute__((vector_size(kLanes * sizeof(uint32_t)), aligned(4)));

inline PairVec LoadPairs(const uint32_t* x) { return *reinterpret_cast<const UnalignedPairVec*>(x); }
inline void StorePairs(uint32_t* x, PairVec v) { *reinterpret_cast<UnalignedPairVec*>(x) = v; }

// bfloat16 bits of x rounded to nearest even, in the high half of each lane (x finite).
inline PairVec RoundHigh(Vec x) {
  PairVec bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
}
inline uint32_t RoundHigh(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
}
inline PairVec Pairs(Vec even, Vec odd) { return (RoundHigh(even) >> 16) | RoundHigh(odd); }
inline uint32_t Pair(float even, float odd) { return (RoundHigh(even) >> 16) | RoundHigh(odd); }

// acc + both products of each lane's pairs a and b (a row of bfloat16 as it lies in memory is a run of
// such pairs, which is how a decode row's scores read bfloat16 pages: GroupedScores).
inline Vec DotPairs(Vec acc, PairVec a, PairVec b) {
#ifdef __AVX512BF16__
  if constexpr (kLanes == 16) return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#endif
  const auto widen = [](PairVec bits) {
    Vec v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  };
  return acc + widen(a << 16) * widen(b << 16) + widen(a & 0xffff0000u) * widen(b & 0xffff0000u);
}

// The same with one pair broadcast to every lane.
inline Vec DotPairs(Vec acc, uint32_t pair, PairVec pairs) { return DotPairs(acc, PairVec{} + pair, pairs); }

struct Scratch {
  std::vector<float> scores, acc, row_max, row_sum;
  std::vector<Vec> parts;
  std::vector<float> tile_queries, tile_scores, tile_inv_sums, tile_out;  // AttendTile's
  std::vector<const void*> key_rows, value_rows;  // a tile's [D] rows, of Page elements
  std::vector<const void*> stream_pages;           // a decode row's PageStream
  int64_t streamed_row = -1;                       // the row whose first pages the last row's stream fetched
  std::vector<uint32_t> query_pairs, key_pairs, key_columns, weight_pairs, value_pairs;  // TileBf16's
  // The tiles of a job share their keys (see AttendTiles): the rows above and their bfloat16 pairs
  // hold the keys from `lo` of one sequence's KV head, the first `*_valid` of them real (past those,
  // a tile's padding). A tile of the same sequence, head and lo only adds the keys past them. They may
  // hold more keys than a tile needs (a later job of its run ran first on this thread): a tile masks
  // the scores past its own keys, and their softmax weights are zero, so the values there add nothing.
  int64_t table_row = -1, kv_head = -1, lo = -1;
  int64_t rows_valid = 0, key_pairs_valid = 0, key_columns_valid = 0, value_pairs_valid = 0;  // pairs: of keys

  // Forgets what it holds unless it holds these keys.
  void Keep(int64_t new_table_row, int64_t new_kv_head, int64_t new_lo) {
    if (new_table_row == table_row && new_kv_head == kv_head && new_lo == lo) return;
    table_row = new_table_row, kv_head = new_kv_head, lo = new_lo;
    rows_valid = key_pairs_valid = key_columns_valid = value_pairs_valid = 0;
  }
};

// The keys start..kv_len-1 of one row, page by page through its block table.
template <typename Page>
struct RowKeys {
  const Problem<Page>& p;
  const int32_t* table;
  int64_t start, kv_len;
  int64_t row = -1;  // the query row, for a decode row's PageStream

  int64_t PageOf(int64_t pos) const { return std::clamp<int64_t>(table[pos / p.page_size], 0, p.num_pages - 1); }

  // The pages the keys lie in, and the t-th of them in `pages` (p.k or p.v).
  int64_t NumPages() const { return kv_len > start ? (kv_len - 1) / p.page_size - start / p.page_size + 1 : 0; }
  const Page* PageAt(const Page* pages, int64_t t) const {
    return pages + PageOf((start / p.page_size + t) * p.page_size) * p.page_size * p.token_stride;
  }

  // fn(index from start of the page's first row, that row's [KVH, D] in the page, rows in the page,
  // the next page or nullptr) for each page in turn.
  template <typename Fn>
  void ForEachPage(const Page* pages, Fn&& fn) const {
    const int64_t page_size = p.page_size, page_elems = page_size * p.token_stride;
    for (int64_t pos = start; pos < kv_len;) {
      const int64_t page_end = (pos / page_size + 1) * page_size, end = std::min(kv_len, page_end);
      const Page* next = page_end < kv_len ? pages + PageOf(page_end) * page_elems : nullptr;
      fn(pos - start, pages + PageOf(pos) * page_elems + (pos % page_size) * p.token_stride, end - pos, next);
      pos = end;
    }
  }

  // fn(index from start, the key's or value's [KVH, D] row), row by row; the page after the current
  // one is prefetched into L2 when it starts (into L1, most of a page's prefetches were lost).
  template <typename Fn>
  void ForEach(const Page* pages, Fn&& fn) const {
    const int64_t page_bytes = p.page_size * p.token_stride * sizeof(Page);
    ForEachPage(pages, [&](int64_t first, const Page* rows, int64_t n, const Page* next) {
      if (next) {
        const char* bytes = reinterpret_cast<const char*>(next);
        for (int64_t line = 0; line < page_bytes; line += kLineBytes) __builtin_prefetch(bytes + line, 0, 1);
      }
      for (int64_t i = 0; i < n; ++i) fn(first + i, rows + i * p.token_stride);
    });
  }
};

// Prefetches a page a few lines per step, spread over the steps that read the page before it, because a
// burst of a whole page's prefetches at once stalls the loads queued behind it. The hint is non-temporal
// (prefetchnta): a decode row reads each line of its pages once. On a Zen 5 it gave 32 rows at context
// 160 over 30 layers' bfloat16 pages 0.100-0.118 ms a layer against prefetcht2's 0.133-0.135 (fp8 pages:
// 0.062-0.067 against 0.081-0.084), level at context 512 (bench_cpu_attention.py --layers 30).
class SpreadPrefetch {
 public:
  SpreadPrefetch(const void* page, int64_t page_bytes, int64_t steps)
      : page_(static_cast<const char*>(page)),
        lines_(page ? page_bytes / kLineBytes : 0),
        per_step_((lines_ + steps - 1) / std::max<int64_t>(steps, 1)) {}

  void Step() {
    for (const int64_t end = std::min(lines_, next_ + per_step_); next_ < end; ++next_) {
      __builtin_prefetch(page_ + next_ * kLineBytes, 0, 0);
    }
  }

 private:
  const char* page_;
  int64_t lines_, per_step_, next_ = 0;
};

// The pages a decode row reads, in the order it reads them (its keys' pages, then its values'), and after
// them the first pages of the row its thread attends next. While the row reads page t it prefetches page
// t + kAheadPages of the stream, spread over page t's steps (SpreadPrefetch): so the values' first pages
// arrive while the last keys are scored, the next row's first keys while the last values are summed, and
// each page has kAheadPages pages' time to come from memory, not one.
class PageStream {
 public:
  static constexpr int64_t kAheadPages = 2;

  PageStream(std::vector<const void*>& pages, int64_t page_bytes) : pages_(pages), page_bytes_(page_bytes) {
    pages_.clear();
  }
  void Add(const void* page) { pages_.push_back(page); }

  // The first kAheadPages pages at once, for a row whose pages no earlier row's stream fetched.
  void FetchFirst() const {
    for (int64_t t = 0; t < std::min<int64_t>(kAheadPages, pages_.size()); ++t) {
      const char* bytes = static_cast<const char*>(pages_[t]);
      for (int64_t line = 0; line < page_bytes_; line += kLineBytes) __builtin_prefetch(bytes + line, 0, 0);
    }
  }

  // The prefetch for the walk over the next page of the stream, which takes `steps` steps.
  SpreadPrefetch Next(int64_t steps) {
    const int64_t ahead = next_++ + kAheadPages;
    return SpreadPrefetch(ahead < static_cast<int64_t>(pages_.size()) ? pages_[ahead] : nullptr, page_bytes_, steps);
  }

 private:
  std::vector<const void*>& pages_;
  int64_t page_bytes_, next_ = 0;
};

// One row's attention when head_dim is DV vectors and a KV head serves G query heads, page by page:
// each page's rows are read once from memory and used for one KV head after another while they are
// in the cache (the pages two further on arriving meanwhile, see PageStream). A KV head's G queries stay in
// registers while its keys in the page are scored, its G accumulators while its values are summed;
// dot products are folded kLanes at a time (see FoldLanes).
// Whether AttendGrouped multiplies a page's keys and values as bfloat16 pairs with vdpbf16ps (see
// GroupedScores, GroupedValues): bfloat16 pages as they lie, float8 pages widened to bfloat16 bits in the
// register (Fp8Words).
template <typename Page>
constexpr bool kPairPages = kBf16Products && (std::is_same_v<Page, Bf16> || std::is_same_v<Page, Fp8>);

// A float8 page's pairs hold its values times 2^-120 (Fp8Words). The queries and the softmax weights that
// multiply them come in times 2^64, so that no product of a normal e4m3 value falls under float32's normal
// range (vdpbf16ps flushes those to zero; a query's or weight's element would need to be under 2^-70 of
// its own), and the sums go out times 2^56. Powers of two: the same roundings as bfloat16 pages'. 1 for
// those.
template <typename Page>
constexpr float kPairIn = std::is_same_v<Page, Fp8> ? 0x1p64f : 1.0f;
template <typename Page>
constexpr float kPairOut = std::is_same_v<Page, Fp8> ? 0x1p56f : 1.0f;

// 32 float8 e4m3 elements as the bfloat16 bits of their values times 2^-120, in order (a vector of pairs,
// the even element in each lane's low half): each byte sign-extended to 16 bits and shifted up by 4 puts
// its exponent and mantissa under bfloat16's (bits 10..4) and copies of its sign at 15..11, of which the
// mask keeps bit 15. Exact for every normal e4m3; its subnormals (under 2^-6) land on bfloat16 subnormals,
// which vdpbf16ps reads as zero, so a page's elements under 2^-6 in magnitude count as zero here (e4m3 itself
// rounds an element of 2^-3..2^-2 by up to 2^-7). Three instructions (vpmovsxbw, vpsllw, vpandd).
inline uint16_t Fp8Bf16Bits(uint8_t b) {
  return static_cast<uint16_t>((static_cast<int32_t>(static_cast<int8_t>(b)) << 4) & 0x87f0);
}
inline PairVec Fp8Words(const Fp8* x) {
#if defined(__AVX512BW__)
  if constexpr (kLanes == 16) {
    const __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return (PairVec)_mm512_and_si512(_mm512_slli_epi16(words, 4), _mm512_set1_epi16(static_cast<int16_t>(0x87f0)));
  }
#endif
  const auto* b = reinterpret_cast<const uint8_t*>(x);
  PairVec v;
  for (int l = 0; l < kLanes; ++l) v[l] = Fp8Bf16Bits(b[2 * l]) | static_cast<uint32_t>(Fp8Bf16Bits(b[2 * l + 1])) << 16;
  return v;
}

// Elements 2 kLanes v .. 2 kLanes (v + 1) - 1 of a page's row as pairs (kPairPages).
inline PairVec PagePairs(const Bf16* row, int v) { return LoadPairs(reinterpret_cast<const uint32_t*>(row) + v * kLanes); }
inline PairVec PagePairs(const Fp8* row, int v) { return Fp8Words(row + 2 * kLanes * v); }

// The scores pass of AttendGrouped: scores[h, i] = q_h . key i (q scaled), each page's keys read once
// for every KV head. kPairs (bfloat16 or float8 pages with bf16_products): a key's D elements are used as
// they lie in the page (float8: widened to bfloat16 bits, PagePairs), D / 2 pairs of bfloat16, against
// queries rounded once into the same pairs, and one vdpbf16ps adds 32 products into 16 float32 partial
// sums: half the instructions a key, and none to widen a bfloat16 key. Otherwise keys are widened to
// float32 and multiplied by float32 queries.
template <typename Page, int DV, int G, bool kPairs>
void GroupedScores(const Problem<Page>& p, const RowKeys<Page>& keys, const float* q_rows, int64_t padded,
                   Scratch& scratch, PageStream& stream) {
  constexpr int64_t D = DV * kLanes;
  constexpr int kPairVectors = DV / 2;  // a row's D / 2 pairs, kLanes to a vector
  const int64_t kv_heads = p.num_heads / G, stride = p.token_stride;
  const int64_t count = keys.kv_len - keys.start;
  float* scores = scratch.scores.data();
  scratch.parts.resize(kv_heads * G * kLanes);  // a KV head's lanes may straddle pages
  uint32_t* query_pairs = nullptr;  // [KVH * G, D / 2]
  if constexpr (kPairs) {
    scratch.query_pairs.resize(kv_heads * G * D / 2);
    query_pairs = scratch.query_pairs.data();
    for (int64_t e = 0; e < kv_heads * G * D / 2; ++e) {
      query_pairs[e] = Pair(q_rows[2 * e] * p.scale * kPairIn<Page>, q_rows[2 * e + 1] * p.scale * kPairIn<Page>);
    }
  }
  keys.ForEachPage(p.k, [&](int64_t first, const Page* rows, int64_t n, const Page*) {
    SpreadPrefetch prefetch = stream.Next(kv_heads * n);
    for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
      Vec q[G][kPairs ? 1 : DV];
      [[maybe_unused]] PairVec q_pairs[G][kPairs ? kPairVectors : 1];
      if constexpr (kPairs) {
        const uint32_t* group_pairs = query_pairs + kv_head * G * D / 2;
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < kPairVectors; ++v) q_pairs[j][v] = LoadPairs(group_pairs + j * D / 2 + v * kLanes);
      } else {
        const float* q_group = q_rows + kv_head * G * D;
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < DV; ++v) q[j][v] = Load(q_group + j * D + v * kLanes) * p.scale;
      }
      Vec* parts = scratch.parts.data() + kv_head * G * kLanes;
      float* head_scores = scores + kv_head * G * padded;
      const Page* key = rows + kv_head * D;
      for (int64_t i = first; i < first + n; ++i, key += stride) {
        prefetch.Step();
        const int64_t lane = i & (kLanes - 1);  // i >= 0: a mask, not a signed remainder
        if constexpr (kPairs) {
          PairVec k[kPairVectors];
          for (int v = 0; v < kPairVectors; ++v) k[v] = PagePairs(key, v);
          for (int j = 0; j < G; ++j) {
            Vec part = DotPairs(Vec{}, q_pairs[j][0], k[0]);
            for (int v = 1; v < kPairVectors; ++v) part = DotPairs(part, q_pairs[j][v], k[v]);
            parts[j * kLanes + lane] = part;
          }
        } else {
          Vec k[DV];
          for (int v = 0; v < DV; ++v) k[v] = Load(key + v * kLanes);
          for (int j = 0; j < G; ++j) {
            Vec part = q[j][0] * k[0];
            for (int v = 1; v < DV; ++v) part += q[j][v] * k[v];
            parts[j * kLanes + lane] = part;
          }
        }
        if (lane == kLanes - 1 || i == count - 1) {
          for (int j = 0; j < G; ++j) {
            Vec* head_parts = parts + j * kLanes;
            for (int64_t l = lane + 1; l < kLanes; ++l) head_parts[l] = Vec{};
            FoldLanes<kLanes>(head_parts);
            if constexpr (kPairs) head_parts[0] *= kPairOut<Page>;
            Store(head_scores + j * padded + i - lane, head_parts[0]);
          }
        }
      }
    }
  });
}

// Two keys' rows of bfloat16 as they lie in the page, a and b (kLanes == 16: 32 elements each), as two
// vectors of pairs (a[d], b[d]): the low and high four d of each 128-bit lane (vpunpcklwd, vpunpckhwd),
// so lane l of the low vector holds d = 8 (l / 4) + l % 4 and of the high one that + 4 (PairLaneDim).
inline void InterleavePairs(const Bf16* a, const Bf16* b, PairVec& low, PairVec& high) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
  low = (PairVec)_mm512_unpacklo_epi16(x, y);
  high = (PairVec)_mm512_unpackhi_epi16(x, y);
#else
  for (int l = 0; l < kLanes; ++l) {
    const int d = 8 * (l / 4) + l % 4;
    low[l] = a[d] | static_cast<uint32_t>(b[d]) << 16;
    high[l] = a[d + 4] | static_cast<uint32_t>(b[d + 4]) << 16;
  }
#endif
}

// The same for two keys' rows of float8 e4m3, widened as Fp8Words widens them.
inline void InterleavePairs(const Fp8* a, const Fp8* b, PairVec& low, PairVec& high) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const __m512i x = (__m512i)Fp8Words(a), y = (__m512i)Fp8Words(b);
  low = (PairVec)_mm512_unpacklo_epi16(x, y);
  high = (PairVec)_mm512_unpackhi_epi16(x, y);
#else
  const auto *x = reinterpret_cast<const uint8_t*>(a), *y = reinterpret_cast<const uint8_t*>(b);
  for (int l = 0; l < kLanes; ++l) {
    const int d = 8 * (l / 4) + l % 4;
    low[l] = Fp8Bf16Bits(x[d]) | static_cast<uint32_t>(Fp8Bf16Bits(y[d])) << 16;
    high[l] = Fp8Bf16Bits(x[d + 4]) | static_cast<uint32_t>(Fp8Bf16Bits(y[d + 4])) << 16;
  }
#endif
}

// Softmax weights w [n] (n even) times `in` (kPairIn) as n / 2 pairs of consecutive keys, rounded to bfloat16 as
// Pair rounds them: 32 at a time by vcvtne2ps2bf16, which flushes float32 subnormals to zero (what vdpbf16ps
// reads a bfloat16 subnormal as), instead of two scalar roundings for every head and pair of keys in the
// values pass.
inline void WeightPairs(const float* w, int64_t n, float in, uint32_t* pairs) {
  int64_t i = 0;
#ifdef __AVX512BF16__
  if constexpr (kLanes == 16) {
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
      const Vec first = Load(w + i) * in, second = Load(w + i + kLanes) * in;
      StorePairs(pairs + i / 2, (PairVec)_mm512_cvtne2ps_pbh((__m512)second, (__m512)first));
    }
  }
#endif
  for (; i < n; i += 2) pairs[i / 2] = Pair(w[i] * in, w[i + 1] * in);
}

// The d of element e of a pair-summed accumulator row (GroupedValues): vector e / kLanes is the low
// (even) or high (odd) half of 32 elements' InterleavePairs.
inline int64_t PairLaneDim(int64_t e) {
  const int64_t v = e / kLanes, l = e % kLanes;
  return 32 * (v / 2) + 8 * (l / 4) + l % 4 + 4 * (v % 2);
}

// out [D] = acc [D] (a pair-summed row, PairLaneDim's order) times `scale`, in d's order. With 16 lanes each 32
// elements are two shuffles of their two vectors (the low and high four d of each 128-bit lane interleaved).
// An element at a time, with its index arithmetic, 32 rows at context 160 took 0.067-0.072 ms a layer against
// 0.062-0.065 (bfloat16 pages, a 2-core Zen 5).
template <int DV>
inline void StoreInDimOrder(const float* acc, float scale, float* out) {
#if defined(__AVX512F__)  // kLanes 16 (a preprocessor test: the shuffles' indices do not exist for 8 lanes)
  for (int c = 0; c < DV / 2; ++c) {
    const Vec low = Load(acc + 2 * c * kLanes) * scale, high = Load(acc + (2 * c + 1) * kLanes) * scale;
    Store(out + 2 * c * kLanes,
          __builtin_shufflevector(low, high, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23));
    Store(out + (2 * c + 1) * kLanes,
          __builtin_shufflevector(low, high, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31));
  }
#else
  for (int64_t e = 0; e < DV * kLanes; ++e) out[PairLaneDim(e)] = acc[e] * scale;
#endif
}

// The values pass of AttendGrouped: acc[h] += weights[h, i] * value i over the row's keys (the softmax's
// numerators in scores), page by page, each page's values read once for every KV head. kPairs
// (bfloat16 or float8 pages with bf16_products): two keys at a time, their values interleaved into pairs d by d
// and each head's two weights rounded to a bfloat16 pair, one vdpbf16ps adding 32 products; the
// accumulators then hold d in InterleavePairs' order (PairLaneDim), undone once by the caller. A page's
// odd last key pairs with itself at weight 0.
//
// The weights: head h's at key i in scores [h, padded] (kPairs: pair_of(h, i, two) gives the rounded pair of
// keys i and i + 1, the second weighted 0 where `two` is false; see AttendGrouped and AttendRowTiles).
template <typename Page, int DV, int G, bool kPairs, typename PairOf>
void GroupedValues(const Problem<Page>& p, const RowKeys<Page>& keys, int64_t padded, Scratch& scratch,
                   PageStream& stream, PairOf&& pair_of) {
  constexpr int64_t D = DV * kLanes;
  const int64_t kv_heads = p.num_heads / G, stride = p.token_stride;
  const float* scores = scratch.scores.data();
  float* acc_rows = scratch.acc.data();
  keys.ForEachPage(p.v, [&](int64_t first, const Page* rows, int64_t n, const Page*) {
    SpreadPrefetch prefetch = stream.Next(kv_heads * (kPairs ? (n + 1) / 2 : n));  // a step a key, or a pair
    for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
      float* acc_group = acc_rows + kv_head * G * D;
      const float* head_weights = scores + kv_head * G * padded;
      Vec acc[G][DV];
      for (int j = 0; j < G; ++j)
        for (int v = 0; v < DV; ++v) acc[j][v] = Load(acc_group + j * D + v * kLanes);
      const Page* value = rows + kv_head * D;
      if constexpr (kPairs) {
        for (int64_t i = first; i < first + n; i += 2, value += 2 * stride) {
          prefetch.Step();
          const bool two = i + 1 < first + n;
          PairVec val[DV];
          for (int c = 0; c < DV / 2; ++c) {
            InterleavePairs(value + 32 * c, (two ? value + stride : value) + 32 * c, val[2 * c], val[2 * c + 1]);
          }
          for (int j = 0; j < G; ++j) {
            const uint32_t pair = pair_of(kv_head * G + j, i, two);
            for (int v = 0; v < DV; ++v) acc[j][v] = DotPairs(acc[j][v], pair, val[v]);
          }
        }
      } else {
        for (int64_t i = first; i < first + n; ++i, value += stride) {
          prefetch.Step();
          Vec val[DV];
          for (int v = 0; v < DV; ++v) val[v] = Load(value + v * kLanes);
          for (int j = 0; j < G; ++j) {
            const float w = head_weights[j * padded + i];
            for (int v = 0; v < DV; ++v) acc[j][v] += w * val[v];
          }
        }
      }
      for (int j = 0; j < G; ++j)
        for (int v = 0; v < DV; ++v) Store(acc_group + j * D + v * kLanes, acc[j][v]);
    }
  });
}

#if JAXSERVE_AMX
// A decode row on the tile unit (bfloat16 pages and products on AMX): every query head's scores in one
// pass over the keys, as a matrix product. A chunk of 16 keys as it lies in its page ([16, KVH * D]
// bfloat16 at the token stride) is the A operand, 32 elements of each key at a time (slice s: the key's
// elements 32 s .. 32 s + 31, of KV head 32 s / D); the queries are the B operands, a tile per slice:
// B_s[r, h] the pair of q_h's elements 2 r, 2 r + 1 of slice s, scaled, for the G heads of that slice's KV
// head, zero for the others. So C[key, h] = q_h . key, summed over the slices, for all heads at once,
// without touching a key outside the tile unit: scores [keys, 16], head h in lane h. The softmax takes
// every head in one vector a key, and leaves the weights as bfloat16 pairs [keys / 2, 16] for the values
// pass (GroupedValues), whose vdpbf16ps broadcast them. Needs at most 16 heads, D a multiple of 32 and
// pages of a multiple of 16 tokens (RowTilesFit); other shapes stay on GroupedScores' vector code.
constexpr int64_t kRowChunk = 16;  // keys a tile of scores; heads a tile's lanes

inline bool RowTilesFit(const Problem<Bf16>& p) {
  return p.num_heads <= kRowChunk && p.head_dim % 32 == 0 && p.page_size % kRowChunk == 0;
}

// The B tiles [slices, 16 pairs, 16 heads] of a row's queries (scaled, rounded to bfloat16 pairs).
inline void RowQueryTiles(const Problem<Bf16>& p, const float* q_rows, uint32_t* tiles) {
  const int64_t D = p.head_dim, slices = p.token_stride / 32;
  std::fill(tiles, tiles + slices * kRowChunk * kRowChunk, 0u);
  for (int64_t h = 0; h < p.num_heads; ++h) {
    const float* q = q_rows + h * D;
    uint32_t* head_slices = tiles + (h / p.group) * (D / 32) * kRowChunk * kRowChunk + h;
    for (int64_t e = 0; e < D / 2; ++e) head_slices[e * kRowChunk] = Pair(q[2 * e] * p.scale, q[2 * e + 1] * p.scale);
  }
}

// scores [rows, 16] of the keys from `base` (a multiple of 16; rows a multiple of 32), two chunks at a
// time in two accumulator tiles (0, 1) so that neither waits on the other's products; past the row's last
// chunk (an odd count) the first of the pair is multiplied again into the scores' tail. Keys in a chunk
// past kv_len are scored as whatever the page holds there and never read after. No software prefetch:
// the next chunks' lines into L2 measured no faster in a decode step and slower with the pages in cache.
inline void RowTileScores(const Problem<Bf16>& p, const RowKeys<Bf16>& keys, int64_t base, int64_t rows,
                          const uint32_t* query_tiles, float* scores) {
  const int64_t stride_bytes = p.token_stride * sizeof(Bf16), slices = p.token_stride / 32;
  const auto chunk_at = [&](int64_t pos) {
    return p.k + (keys.PageOf(pos) * p.page_size + pos % p.page_size) * p.token_stride;
  };
  jaxserve::ConfigureTiles();
  jaxserve::TileMemoryBarrier();  // the query tiles, written by the caller, are read by tile loads
  for (int64_t i0 = 0; i0 < rows; i0 += 2 * kRowChunk) {
    const Bf16* c0 = chunk_at(base + i0);
    const Bf16* c1 = base + i0 + kRowChunk < keys.kv_len ? chunk_at(base + i0 + kRowChunk) : c0;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t s = 0; s < slices; ++s) {
      _tile_loadd(4, query_tiles + s * kRowChunk * kRowChunk, kRowChunk * sizeof(uint32_t));
      _tile_loadd(2, c0 + 32 * s, stride_bytes);
      _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(3, c1 + 32 * s, stride_bytes);
      _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, scores + i0 * kRowChunk, kRowChunk * sizeof(float));
    _tile_stored(1, scores + (i0 + kRowChunk) * kRowChunk, kRowChunk * sizeof(float));
  }
  jaxserve::TileMemoryBarrier();  // the caller reads the scores
  _tile_release();
}

template <int DV, int G>
void AttendRowTiles(const Problem<Bf16>& p, const RowKeys<Bf16>& keys, float* out_rows, const float* q_rows,
                    Scratch& scratch) {
  constexpr int64_t D = DV * kLanes;
  const int64_t heads = p.num_heads, base = keys.start / kRowChunk * kRowChunk;
  const int64_t lo = keys.start - base, hi = keys.kv_len - base;  // the row's keys in the scores
  const int64_t rows = (hi + 2 * kRowChunk - 1) / (2 * kRowChunk) * (2 * kRowChunk);
  scratch.query_pairs.resize(p.token_stride / 32 * kRowChunk * kRowChunk);
  RowQueryTiles(p, q_rows, scratch.query_pairs.data());
  auto& scores = scratch.scores;  // [rows, 16]
  scores.resize(rows * kRowChunk);
  RowTileScores(p, keys, base, rows, scratch.query_pairs.data(), scores.data());
  float* s = scores.data();
  if (p.soft_cap > 0.0f) {
    for (int64_t e = lo * kRowChunk; e < hi * kRowChunk; ++e) s[e] = p.soft_cap * std::tanh(s[e] / p.soft_cap);
  }
  Vec max = Vec{} - std::numeric_limits<float>::max(), sum{};
  for (int64_t i = lo; i < hi; ++i) {
    const Vec x = Load(s + i * kRowChunk);
    max = x > max ? x : max;
  }
  for (int64_t i = lo; i < hi; ++i) {
    const Vec e = ExpNonPositive(Load(s + i * kRowChunk) - max);
    Store(s + i * kRowChunk, e);
    sum += e;
  }
  // The weights as pairs of keys [rows / 2, 16] from the pair of lo; zero outside [lo, hi).
  const int64_t first_pair = lo / 2, end_pair = (hi + 1) / 2;
  for (int64_t i = 2 * first_pair; i < lo; ++i) Store(s + i * kRowChunk, Vec{});
  if (hi % 2) Store(s + hi * kRowChunk, Vec{});
  auto& pairs = scratch.weight_pairs;
  pairs.resize(rows / 2 * kRowChunk);
  for (int64_t m = first_pair; m < end_pair; ++m) {
    StorePairs(pairs.data() + m * kRowChunk, Pairs(Load(s + 2 * m * kRowChunk), Load(s + (2 * m + 1) * kRowChunk)));
  }
  scratch.acc.assign(heads * D, 0.0f);
  const RowKeys<Bf16> value_keys{p, keys.table, base + 2 * first_pair, keys.kv_len};
  const uint32_t* weight_pairs = pairs.data() + first_pair * kRowChunk;
  PageStream stream(scratch.stream_pages, p.page_size * p.token_stride * sizeof(Bf16));
  for (int64_t t = 0; t < value_keys.NumPages(); ++t) stream.Add(value_keys.PageAt(p.v, t));
  GroupedValues<Bf16, DV, G, true>(p, value_keys, 0, scratch, stream, [weight_pairs](int64_t head, int64_t i, bool) {
    return weight_pairs[i / 2 * kRowChunk + head];
  });
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f;
    const float* acc = scratch.acc.data() + h * D;
    for (int64_t e = 0; e < D; ++e) out_rows[h * D + PairLaneDim(e)] = acc[e] * inv;
  }
}
#endif

template <typename Page, int DV, int G>
void AttendGrouped(const Problem<Page>& p, const RowKeys<Page>& keys, const RowKeys<Page>* next, float* out_rows,
                   const float* q_rows, Scratch& scratch) {
#if JAXSERVE_AMX
  if constexpr (kBf16Products && std::is_same_v<Page, Bf16>) {
    if (p.bf16_products && RowTilesFit(p) && JaxserveAmxInUse()) {
      AttendRowTiles<DV, G>(p, keys, out_rows, q_rows, scratch);
      return;
    }
  }
#endif
  constexpr int64_t D = DV * kLanes;
  const int64_t kv_heads = p.num_heads / G;
  const int64_t count = keys.kv_len - keys.start, padded = (count + kLanes - 1) / kLanes * kLanes;
  auto& scores = scratch.scores;  // [KVH * G, padded]
  scores.resize(kv_heads * G * padded);
  const bool pairs = kPairPages<Page> && p.bf16_products;
  PageStream stream(scratch.stream_pages, p.page_size * p.token_stride * sizeof(Page));
  const int64_t num_pages = keys.NumPages();
  for (int64_t t = 0; t < num_pages; ++t) stream.Add(keys.PageAt(p.k, t));
  for (int64_t t = 0; t < num_pages; ++t) stream.Add(keys.PageAt(p.v, t));
  if (next != nullptr) {
    for (int64_t t = 0; t < std::min(PageStream::kAheadPages, next->NumPages()); ++t) stream.Add(next->PageAt(p.k, t));
  }
  if (scratch.streamed_row != keys.row) stream.FetchFirst();
  scratch.streamed_row = next != nullptr ? next->row : -1;
  if (pairs) {
    GroupedScores<Page, DV, G, kPairPages<Page>>(p, keys, q_rows, padded, scratch, stream);
  } else {
    GroupedScores<Page, DV, G, false>(p, keys, q_rows, padded, scratch, stream);
  }
  auto& inv_sums = scratch.row_sum;  // [KVH * G]
  inv_sums.resize(kv_heads * G);
  for (int64_t h = 0; h < kv_heads * G; ++h) {
    float* s = scores.data() + h * padded;
    if (p.soft_cap > 0.0f) {
      for (int64_t i = 0; i < count; ++i) s[i] = p.soft_cap * std::tanh(s[i] / p.soft_cap);
    }
    // The max kLanes at a time (a scalar max is a chain of dependent vmaxss, a tenth of a decode step's
    // attention at c=32 on an AMX Xeon), over the padded tail set to -inf first.
    for (int64_t i = count; i < padded; ++i) s[i] = -std::numeric_limits<float>::infinity();
    Vec lane_max = Vec{} - std::numeric_limits<float>::max();
    for (int64_t i = 0; i < padded; i += kLanes) {
      const Vec x = Load(s + i);
      lane_max = x > lane_max ? x : lane_max;
    }
    float max = lane_max[0];
    for (int l = 1; l < kLanes; ++l) max = std::max(max, lane_max[l]);
    Vec sum{};
    for (int64_t i = 0; i < padded; i += kLanes) {
      const Vec e = ExpNonPositive(Load(s + i) - max);
      const Vec kept = i + kLanes <= count ? e : Vec{};  // the padded tail is summed below
      Store(s + i, e);
      sum += kept;
    }
    float total = 0.0f;
    for (int l = 0; l < kLanes; ++l) total += sum[l];
    for (int64_t i = count / kLanes * kLanes; i < count; ++i) total += s[i];
    inv_sums[h] = total > 0.0f ? 1.0f / total : 0.0f;
  }
  auto& acc_rows = scratch.acc;  // [KVH * G, D], summed page by page
  acc_rows.assign(kv_heads * G * D, 0.0f);
  // Where every page's keys start at an even index (the row's first key at one, pages of an even size), the
  // values pass pairs keys 2m and 2m + 1 only, so the weights are paired once, a row of heads at a time (a
  // page's odd last key is the row's last, paired with the padding's weight 0); else pair by pair.
  const bool paired_once = pairs && keys.start % 2 == 0 && p.page_size % 2 == 0;
  uint32_t* weight_pairs = nullptr;
  if (paired_once) {
    scratch.weight_pairs.resize(kv_heads * G * padded / 2);
    weight_pairs = scratch.weight_pairs.data();
    for (int64_t h = 0; h < kv_heads * G; ++h) {
      WeightPairs(scores.data() + h * padded, padded, kPairIn<Page>, weight_pairs + h * padded / 2);
    }
  }
  const auto pair_of = [&scores, padded, weight_pairs](int64_t head, int64_t i, bool two) {
    if (weight_pairs != nullptr) return weight_pairs[head * (padded / 2) + (i >> 1)];  // i even, >= 0
    const float* w = scores.data() + head * padded + i;
    return Pair(w[0] * kPairIn<Page>, two ? w[1] * kPairIn<Page> : 0.0f);
  };
  if (pairs) {
    GroupedValues<Page, DV, G, kPairPages<Page>>(p, keys, padded, scratch, stream, pair_of);
  } else {
    GroupedValues<Page, DV, G, false>(p, keys, padded, scratch, stream, pair_of);
  }
  for (int64_t h = 0; h < kv_heads * G; ++h) {
    const float* acc = acc_rows.data() + h * D;
    float* out = out_rows + h * D;
    if (pairs) {
      StoreInDimOrder<DV>(acc, inv_sums[h] * kPairOut<Page>, out);
    } else {
      for (int v = 0; v < DV; ++v) Store(out + v * kLanes, Load(acc + v * kLanes) * inv_sums[h]);
    }
  }
}

template <typename Page>
using GroupedFn = void (*)(const Problem<Page>&, const RowKeys<Page>&, const RowKeys<Page>*, float*, const float*,
                           Scratch&);

template <typename Page, int DV, int... G>
constexpr std::array<GroupedFn<Page>, 9> GroupedFns(std::integer_sequence<int, G...>) {
  return {nullptr, (G + 1 <= std::max(16 / DV, 4) ? &AttendGrouped<Page, DV, G + 1> : nullptr)...};
}

// AttendGrouped for (head_dim, group), or nullptr: head_dim 2, 4 or 8 vectors, groups up to 8 with at
// most 16 registers of queries per group, and groups up to 4 at any of those head_dims. Past 16 registers
// (AVX2's 8 vectors of D = 64 at group 3 or 4) the queries are read from L1 as the multiplies' memory
// operands: still several times the general loop's rate, which reduces every key's dot on its own
// (one 8-row decode step at context 1,600 on AVX2: about 0.9 against 1.5-2.9 ms a layer).
template <typename Page>
GroupedFn<Page> GroupedFor(int64_t head_dim, int64_t group) {
  static constexpr auto kDv2 = GroupedFns<Page, 2>(std::make_integer_sequence<int, 8>());
  static constexpr auto kDv4 = GroupedFns<Page, 4>(std::make_integer_sequence<int, 8>());
  static constexpr auto kDv8 = GroupedFns<Page, 8>(std::make_integer_sequence<int, 8>());
  if (head_dim % kLanes != 0 || group < 1 || group > 8) return nullptr;
  switch (head_dim / kLanes) {
    case 2: return kDv2[group];
    case 4: return kDv4[group];
    case 8: return kDv8[group];
    default: return nullptr;
  }
}

// The keys query row `row` attends to (none: kv_len <= start).
template <typename Page>
RowKeys<Page> KeysOf(const Problem<Page>& p, int64_t row) {
  const int64_t kv_len = std::min<int64_t>(p.kv_lens[row], p.table_width * p.page_size);
  const int64_t start = p.window > 0 ? std::max<int64_t>(kv_len - p.window, 0) : 0;
  const int32_t* table = p.tables + std::clamp<int64_t>(p.row_seqs[row], 0, p.num_table_rows - 1) * p.table_width;
  return {p, table, start, std::max(kv_len, start), row};
}

// Attention of query row `row`: a pass over its keys for the scores, the softmax, and a pass over
// its values. Each page is one contiguous [page_size, KVH, D] array, read in place. Common shapes
// go to AttendGrouped; the rest are computed here, all heads at once per key. next_row: the decode row
// this thread attends next (-1: none, or a tile), whose first pages AttendGrouped prefetches.
template <typename Page>
void AttendOne(const Problem<Page>& p, int64_t row, int64_t next_row, Scratch& scratch) {
  const int64_t num_heads = p.num_heads, head_dim = p.head_dim;
  const float* q_rows = p.q + row * num_heads * head_dim;
  float* out_rows = p.out + row * num_heads * head_dim;
  const RowKeys<Page> keys = KeysOf(p, row);
  const int64_t count = keys.kv_len - keys.start;
  if (count == 0) {  // a padding row: zeros, without scratch or tile set-up
    std::fill(out_rows, out_rows + num_heads * head_dim, 0.0f);
    return;
  }
  if (const GroupedFn<Page> grouped = GroupedFor<Page>(head_dim, p.group)) {
    const RowKeys<Page> next = next_row >= 0 ? KeysOf(p, next_row) : keys;
    grouped(p, keys, next_row >= 0 && next.kv_len > next.start ? &next : nullptr, out_rows, q_rows, scratch);
    return;
  }
  auto& scores = scratch.scores;
  auto& acc = scratch.acc;
  auto& row_max = scratch.row_max;
  auto& row_sum = scratch.row_sum;
  acc.assign(num_heads * head_dim, 0.0f);
  row_max.assign(num_heads, -std::numeric_limits<float>::max());
  row_sum.assign(num_heads, 0.0f);
  scores.resize(count * num_heads);
  keys.ForEach(p.k, [&](int64_t i, const Page* key_rows) {
    float* row_scores = scores.data() + i * num_heads;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* query = q_rows + h * head_dim;
      const Page* key = key_rows + (h / p.group) * head_dim;
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot += query[d] * Widen(key[d]);
      float s = dot * p.scale;
      if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
      row_scores[h] = s;
      row_max[h] = std::max(row_max[h], s);
    }
  });
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const float e = std::exp(scores[i * num_heads + h] - row_max[h]);
      scores[i * num_heads + h] = e;
      row_sum[h] += e;
    }
  }
  keys.ForEach(p.v, [&](int64_t i, const Page* values) {
    const float* weights = scores.data() + i * num_heads;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float w = weights[h];
      const Page* value = values + (h / p.group) * head_dim;
      float* a = acc.data() + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * Widen(value[d]);
    }
  });
  for (int64_t h = 0; h < num_heads; ++h) {
    const float inv = row_sum[h] > 0.0f ? 1.0f / row_sum[h] : 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) out_rows[h * head_dim + d] = acc[h * head_dim + d] * inv;
  }
}

// A tile: `tokens` consecutive rows of one sequence, row first_row + t at kv_len first_kv_len + t,
// attended for one KV head. Its tokens x G queries (lane = token * G + head in group) lie across
// kTileVectors vectors, so both passes are register-tiled matrix products:
//   scores [keys, lanes] = keys [keys, D] . queries^T [D, lanes], kKeyTile keys at a time, a key's
//   element broadcast against a vector of lanes' query elements (the queries transposed once);
//   out [lanes, D] = weights^T [lanes, keys] . values [keys, D], R lanes at a time, a lane's weight
//   broadcast against the value's D elements (with AVX-512; for AVX2's 16 registers, see WeightedSumByD).
// Every lane's softmax is masked to its own causal (and window) range; lanes past tokens x G repeat
// the first token's range and are not written.
constexpr int kTileVectors = 3;  // 48 lanes with AVX-512, 24 with AVX2: 16 or 8 tokens at group 3
constexpr int kTileLanes = kTileVectors * kLanes;
constexpr int kKeyTile = kLanes == 16 ? 8 : 4;  // kKeyTile x kTileVectors accumulators + kTileVectors
constexpr int64_t kMinTileTokens = 4;           // shorter runs go row by row

struct TileJob {
  int64_t first_row, tokens, kv_head;  // kv_head -1: the single row first_row, every head
};

// queries^T [D, kTileLanes] of a tile's lanes, scaled; unused lanes zero.
template <int DV, typename Page, typename Fn>
void ForEachTileQuery(const Problem<Page>& p, const TileJob& job, Fn&& fn) {
  constexpr int64_t D = DV * kLanes;
  for (int64_t lane = 0; lane < job.tokens * p.group; ++lane) {
    fn(lane, p.q + (job.first_row + lane / p.group) * p.num_heads * D + (job.kv_head * p.group + lane % p.group) * D);
  }
}

// out rows of lanes lane0..lane0+R-1 (those that exist): acc[r] times the lane's 1 / softmax sum.
template <int DV, int R, typename Page>
void TileStore(const Problem<Page>& p, const TileJob& job, int64_t lane0, const Vec (&acc)[R][DV], const float* inv_sums) {
  constexpr int64_t D = DV * kLanes;
  const int64_t lanes = job.tokens * p.group;
  for (int r = 0; r < R && lane0 + r < lanes; ++r) {
    const int64_t lane = lane0 + r;
    float* out = p.out + (job.first_row + lane / p.group) * p.num_heads * D + (job.kv_head * p.group + lane % p.group) * D;
    for (int dv = 0; dv < DV; ++dv) Store(out + dv * kLanes, acc[r][dv] * inv_sums[lane]);
  }
}

// scores [padded keys, kTileLanes] = keys . queries^T in float32, kKeyTile keys at a time.
template <int DV, typename Page>
void TileScores(const Problem<Page>& p, const TileJob& job, int64_t padded, Scratch& scratch) {
  constexpr int64_t D = DV * kLanes;
  auto& queries = scratch.tile_queries;
  queries.assign(D * kTileLanes, 0.0f);
  ForEachTileQuery<DV>(p, job, [&](int64_t lane, const float* q) {
    for (int64_t d = 0; d < D; ++d) queries[d * kTileLanes + lane] = q[d] * p.scale;
  });
  float* scores = scratch.tile_scores.data();
  for (int64_t i0 = 0; i0 < padded; i0 += kKeyTile) {
    Vec acc[kKeyTile][kTileVectors] = {};
    const Page* tile_keys[kKeyTile];
    for (int j = 0; j < kKeyTile; ++j) tile_keys[j] = static_cast<const Page*>(scratch.key_rows[i0 + j]);
    for (int64_t d = 0; d < D; ++d) {
      Vec qd[kTileVectors];
      for (int v = 0; v < kTileVectors; ++v) qd[v] = Load(queries.data() + d * kTileLanes + v * kLanes);
      for (int j = 0; j < kKeyTile; ++j) {
        const float kd = Widen(tile_keys[j][d]);
        for (int v = 0; v < kTileVectors; ++v) acc[j][v] += kd * qd[v];
      }
    }
    for (int j = 0; j < kKeyTile; ++j)
      for (int v = 0; v < kTileVectors; ++v) Store(scores + (i0 + j) * kTileLanes + v * kLanes, acc[j][v]);
  }
}

template <int DV>
struct TileBf16 {
  static constexpr int64_t D = DV * kLanes, kHalfD = D / 2;

  // scores [padded keys, kTileLanes] as TileScores, from rounded queries and keys.
  template <typename Page>
  static void Scores(const Problem<Page>& p, const TileJob& job, int64_t padded, Scratch& scratch) {
    auto& queries = scratch.query_pairs;  // [D / 2, kTileLanes]
    queries.assign(kHalfD * kTileLanes, 0u);
    ForEachTileQuery<DV>(p, job, [&](int64_t lane, const float* q) {
      for (int64_t e = 0; e < kHalfD; ++e) queries[e * kTileLanes + lane] = Pair(q[2 * e] * p.scale, q[2 * e + 1] * p.scale);
    });
    auto& keys = scratch.key_pairs;  // [padded, D / 2]
    keys.resize(padded * kHalfD);
    for (int64_t i = scratch.key_pairs_valid; i < padded; ++i) {
      const Page* key = static_cast<const Page*>(scratch.key_rows[i]);
      for (int64_t e = 0; e < kHalfD; e += kLanes) {
        // lanes e..e+15 pair the key's elements 2e..2e+31: evens and odds of two vectors
        const Vec a = Load(key + 2 * e), b = Load(key + 2 * e + kLanes);
        StorePairs(keys.data() + i * kHalfD + e, Pairs(Evens(a, b), Odds(a, b)));
      }
    }
    float* scores = scratch.tile_scores.data();
    for (int64_t i0 = 0; i0 < padded; i0 += kKeyTile) {
      Vec acc[kKeyTile][kTileVectors] = {};
      const uint32_t* tile_keys = keys.data() + i0 * kHalfD;
      for (int64_t e = 0; e < kHalfD; ++e) {
        PairVec qe[kTileVectors];
        for (int v = 0; v < kTileVectors; ++v) qe[v] = LoadPairs(queries.data() + e * kTileLanes + v * kLanes);
        for (int j = 0; j < kKeyTile; ++j) {
          const uint32_t ke = tile_keys[j * kHalfD + e];
          for (int v = 0; v < kTileVectors; ++v) acc[j][v] = DotPairs(acc[j][v], ke, qe[v]);
        }
      }
      for (int j = 0; j < kKeyTile; ++j)
        for (int v = 0; v < kTileVectors; ++v) Store(scores + (i0 + j) * kTileLanes + v * kLanes, acc[j][v]);
    }
  }

  // values [rows, D] pairs: pair i the values of keys 2i and 2i + 1, zero past key count - 1. Only the
  // pairs past those the tile before left whole are written (see Scratch::Keep).
  template <typename Page>
  static void ValuePairs(int64_t count, int64_t rows, Scratch& scratch) {
    auto& values = scratch.value_pairs;
    values.resize(rows * D);
    for (int64_t i = scratch.value_pairs_valid; i < rows; ++i) {
      const bool even = 2 * i < count, odd = 2 * i + 1 < count;
      const Page* even_row = even ? static_cast<const Page*>(scratch.value_rows[2 * i]) : nullptr;
      const Page* odd_row = odd ? static_cast<const Page*>(scratch.value_rows[2 * i + 1]) : nullptr;
      for (int dv = 0; dv < DV; ++dv) {
        const Vec first = even_row ? Load(even_row + dv * kLanes) : Vec{};
        const Vec next = odd_row ? Load(odd_row + dv * kLanes) : Vec{};
        StorePairs(values.data() + i * D + dv * kLanes, Pairs(first, next));
      }
    }
    scratch.value_pairs_valid = count / 2;
  }

  // out = weights^T . values for the tile's lanes, R at a time, from rounded weights (the softmax's
  // numerators in tile_scores) and values; an odd last key pairs with a zero.
  template <int R, typename Page>
  static void WeightedSum(const Problem<Page>& p, const TileJob& job, int64_t count, Scratch& scratch) {
    const int64_t pairs = (count + 1) / 2;
    const float* scores = scratch.tile_scores.data();
    auto& weights = scratch.weight_pairs;  // [pairs, kTileLanes]
    auto& values = scratch.value_pairs;    // [pairs, D]
    weights.resize(pairs * kTileLanes);
    ValuePairs<Page>(count, pairs, scratch);
    for (int64_t i = 0; i < pairs; ++i) {
      const bool odd = 2 * i + 1 < count;
      for (int v = 0; v < kTileVectors; ++v) {
        const Vec even = Load(scores + 2 * i * kTileLanes + v * kLanes);
        const Vec next = odd ? Load(scores + (2 * i + 1) * kTileLanes + v * kLanes) : Vec{};
        StorePairs(weights.data() + i * kTileLanes + v * kLanes, Pairs(even, next));
      }
    }
    for (int64_t lane0 = 0; lane0 < job.tokens * p.group; lane0 += R) {
      Vec acc[R][DV] = {};
      for (int64_t i = 0; i < pairs; ++i) {
        PairVec val[DV];
        for (int dv = 0; dv < DV; ++dv) val[dv] = LoadPairs(values.data() + i * D + dv * kLanes);
        const uint32_t* w = weights.data() + i * kTileLanes + lane0;
        for (int r = 0; r < R; ++r)
          for (int dv = 0; dv < DV; ++dv) acc[r][dv] = DotPairs(acc[r][dv], w[r], val[dv]);
      }
      TileStore<DV, R>(p, job, lane0, acc, scratch.tile_inv_sums.data());
    }
  }

#if JAXSERVE_AMX
  // rows[0..15], a 16 x 16 matrix of 32-bit lanes, transposed in place: round B swaps bit B of the
  // row and the lane index of every element where they differ, by two-input shuffles (vpermt2d).
  template <int B, int... L>
  static void SwapBit(PairVec& a, PairVec& b, std::integer_sequence<int, L...>) {
    const PairVec low = __builtin_shufflevector(a, b, ((L & B) ? 16 + L - B : L)...);
    const PairVec high = __builtin_shufflevector(a, b, ((L & B) ? 16 + L : L + B)...);
    a = low;
    b = high;
  }
  template <int B>
  static void TransposeRound(PairVec (&rows)[16]) {
    for (int r = 0; r < 16; ++r) {
      if (!(r & B)) SwapBit<B>(rows[r], rows[r + B], std::make_integer_sequence<int, 16>());
    }
  }
  static void Transpose(PairVec (&rows)[16]) {
    static_assert(kLanes == 16, "AMX tiles come with AVX-512");
    TransposeRound<8>(rows);
    TransposeRound<4>(rows);
    TransposeRound<2>(rows);
    TransposeRound<1>(rows);
  }

  // A tile on AMX tiles, lane by lane along rows: scores [lanes, keys] = queries [lanes, D / 2 pairs] .
  // keys^T [D / 2 pairs, keys] (A: 16 lanes by 16 pairs of D; B: 16 pairs of D by 16 keys, KeyColumns), then
  // out [lanes, D] = weights [lanes, keys / 2 pairs] . values [keys / 2 pairs, D] (A: 16 lanes by 16 pairs
  // of keys, a lane's consecutive weights as they lie; B: 16 pairs of keys by 16 of D, ValuePairs). No
  // operand is transposed per tile: the keys are turned into columns once per job (Scratch::Keep), a lane's
  // softmax runs along its own row, and its weights become pairs of neighbours by one conversion. (Scores
  // as [keys, lanes], the layout before, needed the weights transposed, 16 x 16 at a time, in every tile.)
  // The keys are padded to whole pairs of 16 (count rounded up to 32); the scores past a lane's own range
  // are masked, and its weights there are zero.
  static constexpr int64_t kRows = jaxserve::kAmxRows, kSteps = kHalfD / kRows;
  static constexpr int64_t kKeyPad = 2 * kRows;
  static constexpr int64_t kReferenceKeys = 128;  // a lane's first keys, whose largest score its weights are taken against
  static constexpr float kLazy = 8.0f;  // how far past that a later score may go before the row takes its own maximum

  // The pairs 16 c..16 c + 15 of a key's D / 2 (bfloat16 pages: as they lie).
  template <typename Page>
  static PairVec KeyPairs(const Page* key, int64_t c) {
    if constexpr (std::is_same_v<Page, Bf16>) {
      return LoadPairs(reinterpret_cast<const uint32_t*>(key) + c * kLanes);
    } else {
      const Vec a = Load(key + 2 * c * kLanes), b = Load(key + 2 * c * kLanes + kLanes);
      return Pairs(Evens(a, b), Odds(a, b));
    }
  }

  // key_columns [padded / 16][D / 2][16]: the B tiles of the scores, tile (keys 16 j.., step s) the pairs
  // 16 s..16 s + 15 of keys 16 j..16 j + 15, a key to a column. Only the groups of 16 past those the tile
  // before left whole are written.
  template <typename Page>
  static void KeyColumns(int64_t padded, Scratch& scratch) {
    auto& columns = scratch.key_columns;
    columns.resize(padded * kHalfD);
    for (int64_t j = scratch.key_columns_valid / kRows * kRows; j < padded; j += kRows) {
      for (int64_t c = 0; c < kSteps; ++c) {
        PairVec block[kRows];
        for (int64_t i = 0; i < kRows; ++i) block[i] = KeyPairs(static_cast<const Page*>(scratch.key_rows[j + i]), c);
        Transpose(block);
        for (int64_t r = 0; r < kRows; ++r) StorePairs(columns.data() + j * kHalfD + (c * kRows + r) * kRows, block[r]);
      }
    }
  }

  // scores [kTileLanes, padded] = queries . key columns: three lane tiles against two key tiles in six
  // accumulators (AmxPair's pattern, the other way round), A and B loaded in turn into tiles 6 and 7.
  static void AmxScores(const uint32_t* queries, const uint32_t* columns, int64_t padded, float* scores) {
    constexpr int64_t kQueryStride = kHalfD * sizeof(uint32_t), kColumnStride = kRows * sizeof(uint32_t);
    constexpr int64_t kLaneTile = kRows * kHalfD;
    const int64_t stride = padded * sizeof(float), score_tile = kRows * padded;
    for (int64_t j = 0; j < padded; j += 2 * kRows) {
      const uint32_t* k0 = columns + j * kHalfD;
      const uint32_t* k1 = k0 + kRows * kHalfD;
      jaxserve::ZeroPair();
      for (int64_t s = 0; s < kSteps; ++s) {
        const uint32_t* q = queries + s * kRows;
        _tile_loadd(7, k0 + s * kRows * kRows, kColumnStride);
        _tile_loadd(6, q, kQueryStride);
        _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(6, q + kLaneTile, kQueryStride);
        _tile_dpbf16ps(1, 6, 7);
        _tile_loadd(6, q + 2 * kLaneTile, kQueryStride);
        _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(7, k1 + s * kRows * kRows, kColumnStride);
        _tile_dpbf16ps(5, 6, 7);
        _tile_loadd(6, q + kLaneTile, kQueryStride);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(6, q, kQueryStride);
        _tile_dpbf16ps(3, 6, 7);
      }
      float* s0 = scores + j;
      _tile_stored(0, s0, stride);
      _tile_stored(1, s0 + score_tile, stride);
      _tile_stored(2, s0 + 2 * score_tile, stride);
      _tile_stored(3, s0 + kRows, stride);
      _tile_stored(4, s0 + score_tile + kRows, stride);
      _tile_stored(5, s0 + 2 * score_tile + kRows, stride);
    }
    jaxserve::TileMemoryBarrier();  // the caller reads the scores
  }

  // out [kTileLanes, D] = weights [kTileLanes, pairs] . values [pairs, D] (pairs a multiple of 16): a lane tile
  // at a time, 4 accumulator tiles of 16 of D at a time, held over all the pairs.
  static void AmxWeightedSum(const uint32_t* weights, const uint32_t* values, int64_t pairs, float* out) {
    constexpr int64_t kValueStride = D * sizeof(uint32_t), kOutStride = D * sizeof(float);
    const int64_t weight_stride = pairs * sizeof(uint32_t);
    for (int64_t g = 0; g < kTileVectors; ++g) {
      float* o = out + g * kRows * D;
      const uint32_t* w = weights + g * kRows * pairs;
      for (int64_t d0 = 0; d0 < D; d0 += 4 * kRows) {  // D is a multiple of 32: 2 or 4 tiles a pass
        const bool four = d0 + 4 * kRows <= D;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < pairs; k += kRows) {
          const uint32_t* v = values + k * D + d0;
          _tile_loadd(4, w + k, weight_stride);
          _tile_loadd(5, v, kValueStride);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, v + kRows, kValueStride);
          _tile_dpbf16ps(1, 4, 6);
          if (four) {
            _tile_loadd(7, v + 2 * kRows, kValueStride);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, v + 3 * kRows, kValueStride);
            _tile_dpbf16ps(3, 4, 5);
          }
        }
        _tile_stored(0, o + d0, kOutStride);
        _tile_stored(1, o + d0 + kRows, kOutStride);
        if (four) {
          _tile_stored(2, o + d0 + 2 * kRows, kOutStride);
          _tile_stored(3, o + d0 + 3 * kRows, kOutStride);
        }
      }
    }
    jaxserve::TileMemoryBarrier();  // the caller reads out
  }

  // The largest lane and the sum of the lanes (GCC 12's _mm512_reduce_* draw -Wmaybe-uninitialized, which the
  // build would print to every user).
  static float ReduceMax(Vec v) {
    float m = v[0];
    for (int l = 1; l < kLanes; ++l) m = std::max(m, v[l]);
    return m;
  }
  static float ReduceAdd(Vec v) {
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += v[l];
    return sum;
  }

  // Two vectors of weights (keys i..i + 15 and i + 16..i + 31 of a lane) as 16 pairs of consecutive keys.
  // vcvtne2ps2bf16 rounds to nearest even, as Pairs does, but flushes subnormals to zero: weights below
  // 2^-126 of the lane's largest, which add nothing a bfloat16 sum keeps.
  static PairVec RowPairs(Vec first, Vec second) {
#ifdef __AVX512BF16__
    return (PairVec)_mm512_cvtne2ps_pbh((__m512)second, (__m512)first);
#else
    return Pairs(Evens(first, second), Odds(first, second));
#endif
  }

  // The tile's attention: keys [0, count) (positions from lo, padded with copies of the last key to
  // `padded`, a multiple of kKeyPad), lane l attending to [starts[l], ends[l]).
  template <typename Page>
  static void AmxAttend(const Problem<Page>& p, const TileJob& job, int64_t count, int64_t padded,
                        const IntVec (&starts)[kTileVectors], const IntVec (&ends)[kTileVectors], Scratch& scratch) {
    static_assert(kTileLanes == 3 * kRows && kHalfD % kRows == 0, "whole tiles");
    auto& queries = scratch.query_pairs;  // [kTileLanes, D / 2]
    queries.assign(kTileLanes * kHalfD, 0u);
    ForEachTileQuery<DV>(p, job, [&](int64_t lane, const float* q) {
      for (int64_t e = 0; e < kHalfD; ++e) queries[lane * kHalfD + e] = Pair(q[2 * e] * p.scale, q[2 * e + 1] * p.scale);
    });
    KeyColumns<Page>(padded, scratch);
    ValuePairs<Page>(count, padded / 2, scratch);
    auto& scores = scratch.tile_scores;  // [kTileLanes, padded]
    auto& weights = scratch.weight_pairs;  // [kTileLanes, padded / 2]
    auto& out = scratch.tile_out;  // [kTileLanes, D]
    scores.resize(kTileLanes * padded);
    weights.resize(kTileLanes * padded / 2);
    out.resize(kTileLanes * D);
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    float sum[kTileLanes];
    IntVec index;
    for (int l = 0; l < kLanes; ++l) index[l] = l;

    jaxserve::ConfigureTiles();
    jaxserve::TileMemoryBarrier();  // the pairs written above are read by tile loads
    AmxScores(queries.data(), scratch.key_columns.data(), padded, scores.data());
    for (int64_t lane = 0; lane < kTileLanes; ++lane) {
      float* row = scores.data() + lane * padded;
      uint32_t* w = weights.data() + lane * (padded / 2);
      const int32_t first = starts[lane / kLanes][lane % kLanes], last = ends[lane / kLanes][lane % kLanes];
      if (p.soft_cap > 0.0f) {
        for (int64_t i = first; i < last; ++i) row[i] = p.soft_cap * std::tanh(row[i] / p.soft_cap);
      }
      // The weights exp(s - reference) of the keys [first, last), in the whole pairs of vectors [begin, end)
      // that hold them, zero elsewhere. The reference is the largest score of the first kReferenceKeys: one
      // pass over the rest, not two, unless a later score passes it by more than kLazy (weights then up to
      // e^8, well inside float32's and bfloat16's range), which takes a second pass against the row's maximum.
      const int64_t begin = first / (2 * kLanes) * (2 * kLanes), end = (last + 2 * kLanes - 1) / (2 * kLanes) * (2 * kLanes);
      std::fill(w, w + begin / 2, 0u);
      std::fill(w + end / 2, w + padded / 2, 0u);
      const auto load_masked = [&](int64_t i) {
        const IntVec key = index + static_cast<int32_t>(i);
        return (key >= first) & (key < last) ? Load(row + i) : Vec{} + kNegInf;
      };
      Vec seen = Vec{} + kNegInf;
      for (int64_t i = begin; i < std::min(end, begin + kReferenceKeys); i += kLanes) {
        const Vec s = load_masked(i);
        seen = s > seen ? s : seen;
      }
      const auto weigh = [&](float reference) {
        const Vec m = Vec{} + reference;
        Vec total = {};
        seen = Vec{} + kNegInf;
        for (int64_t i = begin; i < end; i += 2 * kLanes) {
          Vec e[2];
          if (first <= i && i + 2 * kLanes <= last) {  // inside the range: no mask
            for (int h = 0; h < 2; ++h) {
              const Vec s = Load(row + i + h * kLanes);
              seen = s > seen ? s : seen;
              e[h] = jaxserve::ExpNonPositiveForRounding(s - m);
            }
          } else {
            for (int h = 0; h < 2; ++h) {
              const Vec s = load_masked(i + h * kLanes);
              seen = s > seen ? s : seen;
              e[h] = s == kNegInf ? Vec{} : jaxserve::ExpNonPositiveForRounding(s == kNegInf ? Vec{} : s - m);
            }
          }
          total += e[0] + e[1];
          StorePairs(w + i / 2, RowPairs(e[0], e[1]));
        }
        return total;
      };
      const float reference = ReduceMax(seen);
      Vec total = weigh(reference);
      const float row_max = ReduceMax(seen);
      if (row_max > reference + kLazy) total = weigh(row_max);
      sum[lane] = ReduceAdd(total);
    }
    jaxserve::TileMemoryBarrier();  // the weights written above are read by tile loads
    AmxWeightedSum(weights.data(), scratch.value_pairs.data(), padded / 2, out.data());
    _tile_release();
    const int64_t lanes = job.tokens * p.group;
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const float inv_sum = sum[lane] > 0.0f ? 1.0f / sum[lane] : 0.0f;
      float* dst = p.out + (job.first_row + lane / p.group) * p.num_heads * D + (job.kv_head * p.group + lane % p.group) * D;
      for (int dv = 0; dv < DV; ++dv) Store(dst + dv * kLanes, Load(out.data() + lane * D + dv * kLanes) * inv_sum);
    }
  }
#endif

  // The even and odd lanes of the 2 kLanes elements a, b.
  template <int... L>
  static Vec Evens(Vec a, Vec b, std::integer_sequence<int, L...>) { return __builtin_shufflevector(a, b, (2 * L)...); }
  template <int... L>
  static Vec Odds(Vec a, Vec b, std::integer_sequence<int, L...>) { return __builtin_shufflevector(a, b, (2 * L + 1)...); }
  static Vec Evens(Vec a, Vec b) { return Evens(a, b, std::make_integer_sequence<int, kLanes>()); }
  static Vec Odds(Vec a, Vec b) { return Odds(a, b, std::make_integer_sequence<int, kLanes>()); }
};

// The weighted sum for 16 vector registers (AVX2), where out [lanes, D] with R lanes at a time either
// spills its accumulators (R = 2 takes 16 of them beside a value's 8 vectors at D = 64) or reads
// every value once per lane: out^T [D, lanes] = values^T [D, keys] . weights [keys, lanes] instead,
// kDBlock elements of D at a time, each broadcast against the weights' kTileVectors lane vectors
// (kDBlock x kTileVectors accumulators). The keys go in blocks of kKeyBlock, whose values stay in L1
// while D's blocks pass over them; out^T is carried between blocks in scratch and transposed back at
// the end, times each lane's 1 / softmax sum.
template <int DV, typename Page>
void WeightedSumByD(const Problem<Page>& p, const TileJob& job, int64_t count, Scratch& scratch) {
  constexpr int64_t D = DV * kLanes, kDBlock = 4, kKeyBlock = 64;
  static_assert(D % kDBlock == 0, "whole blocks of D");
  auto& out_t = scratch.tile_out;  // [D, kTileLanes]
  out_t.assign(D * kTileLanes, 0.0f);
  const float* weights = scratch.tile_scores.data();
  for (int64_t k0 = 0; k0 < count; k0 += kKeyBlock) {
    const int64_t k1 = std::min(count, k0 + kKeyBlock);
    for (int64_t d0 = 0; d0 < D; d0 += kDBlock) {
      float* sums = out_t.data() + d0 * kTileLanes;
      Vec acc[kDBlock][kTileVectors];
      for (int d = 0; d < kDBlock; ++d)
        for (int v = 0; v < kTileVectors; ++v) acc[d][v] = Load(sums + d * kTileLanes + v * kLanes);
      for (int64_t i = k0; i < k1; ++i) {
        const Page* value = static_cast<const Page*>(scratch.value_rows[i]) + d0;
        Vec w[kTileVectors];
        for (int v = 0; v < kTileVectors; ++v) w[v] = Load(weights + i * kTileLanes + v * kLanes);
        for (int d = 0; d < kDBlock; ++d) {
          const float x = Widen(value[d]);
          for (int v = 0; v < kTileVectors; ++v) acc[d][v] += x * w[v];
        }
      }
      for (int d = 0; d < kDBlock; ++d)
        for (int v = 0; v < kTileVectors; ++v) Store(sums + d * kTileLanes + v * kLanes, acc[d][v]);
    }
  }
  const float* inv_sums = scratch.tile_inv_sums.data();
  for (int64_t lane = 0; lane < job.tokens * p.group; ++lane) {
    float* out = p.out + (job.first_row + lane / p.group) * p.num_heads * D + (job.kv_head * p.group + lane % p.group) * D;
    for (int64_t d = 0; d < D; ++d) out[d] = out_t[d * kTileLanes + lane] * inv_sums[lane];
  }
}

template <typename Page, int DV, int R>
void AttendTile(const Problem<Page>& p, const TileJob& job, Scratch& scratch) {
  constexpr int64_t D = DV * kLanes;
  const int64_t group = p.group, lanes = job.tokens * group;
  const int64_t cap = p.table_width * p.page_size;
  const int64_t first_kv_len = std::min<int64_t>(p.kv_lens[job.first_row], cap);
  const int64_t last_kv_len = std::min<int64_t>(first_kv_len + job.tokens - 1, cap);
  const auto start_of = [&](int64_t kv_len) { return p.window > 0 ? std::max<int64_t>(kv_len - p.window, 0) : 0; };
  const int64_t lo = start_of(first_kv_len), count = last_kv_len - lo;
#if JAXSERVE_AMX
  // bfloat16 products on AMX tiles where the kernels use them (TileBf16::AmxAttend)
  const bool amx = kBf16Products && p.bf16_products && JaxserveAmxInUse();
  const int64_t key_tile = amx ? TileBf16<DV>::kKeyPad : kKeyTile;
#else
  const int64_t key_tile = kKeyTile;
#endif
  const int64_t padded = (count + key_tile - 1) / key_tile * key_tile;
  const int64_t table_row = std::clamp<int64_t>(p.row_seqs[job.first_row], 0, p.num_table_rows - 1);
  const int32_t* table = p.tables + table_row * p.table_width;
  auto& key_rows = scratch.key_rows;
  auto& value_rows = scratch.value_rows;
  scratch.Keep(table_row, job.kv_head, lo);
  key_rows.resize(padded);
  value_rows.resize(padded);
  const int64_t head_offset = job.kv_head * D, known = scratch.rows_valid;
  const RowKeys<Page> new_keys{p, table, lo + known, last_kv_len};
  new_keys.ForEach(p.k, [&](int64_t i, const Page* rows) { key_rows[known + i] = rows + head_offset; });
  new_keys.ForEach(p.v, [&](int64_t i, const Page* rows) { value_rows[known + i] = rows + head_offset; });
  for (int64_t i = count; i < padded; ++i) key_rows[i] = key_rows[count - 1];  // scored, never weighted
  scratch.rows_valid = count;

  // Each lane's key range [start, kv_len), as positions relative to lo; unused lanes take lane 0's.
  IntVec ends[kTileVectors], starts[kTileVectors];
  for (int v = 0; v < kTileVectors; ++v) {
    for (int l = 0; l < kLanes; ++l) {
      const int64_t lane = v * kLanes + l, token = lane < lanes ? lane / group : 0;
      const int64_t kv_len = std::min<int64_t>(first_kv_len + token, cap);
      ends[v][l] = static_cast<int32_t>(kv_len - lo);
      starts[v][l] = static_cast<int32_t>(start_of(kv_len) - lo);
    }
  }
#if JAXSERVE_AMX
  if (amx) {
    TileBf16<DV>::AmxAttend(p, job, count, padded, starts, ends, scratch);
    scratch.key_columns_valid = count;
    return;
  }
#endif

  auto& scores = scratch.tile_scores;  // [padded keys, kTileLanes]
  scores.resize(padded * kTileLanes);
  if (kBf16Products && p.bf16_products) {
    TileBf16<DV>::Scores(p, job, padded, scratch);
    scratch.key_pairs_valid = count;
  } else {
    TileScores<DV>(p, job, padded, scratch);
  }

  // Keys [open_lo, open_hi) are in every lane's range (a causal tile's keys before its first token, all
  // of them but the last few): they skip the mask, and their exp the test for a masked key.
  int64_t open_lo = 0, open_hi = count;
  for (int v = 0; v < kTileVectors; ++v) {
    for (int l = 0; l < kLanes; ++l) {
      open_lo = std::max<int64_t>(open_lo, starts[v][l]);
      open_hi = std::min<int64_t>(open_hi, ends[v][l]);
    }
  }
  open_hi = std::max(open_hi, open_lo);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  Vec max[kTileVectors];
  for (int v = 0; v < kTileVectors; ++v) max[v] = Vec{} + kNegInf;
  for (int64_t i = 0; i < count; ++i) {
    float* row = scores.data() + i * kTileLanes;
    if (p.soft_cap > 0.0f) {
      for (int64_t lane = 0; lane < kTileLanes; ++lane) row[lane] = p.soft_cap * std::tanh(row[lane] / p.soft_cap);
    }
    const int32_t key = static_cast<int32_t>(i);
    const bool open = open_lo <= i && i < open_hi;
    for (int v = 0; v < kTileVectors; ++v) {
      Vec s = Load(row + v * kLanes);
      if (!open) {
        s = (key < ends[v]) & (key >= starts[v]) ? s : Vec{} + kNegInf;
        Store(row + v * kLanes, s);
      }
      max[v] = s > max[v] ? s : max[v];
    }
  }
  // The numerators: rounded to bfloat16 before they weight the values where the products are bfloat16's,
  // so there exp needs only ExpNonPositiveForRounding's precision.
  Vec sum[kTileVectors] = {};
  const auto exponentiate = [&](auto exp) {
    for (int64_t i = 0; i < count; ++i) {
      float* row = scores.data() + i * kTileLanes;
      const bool open = open_lo <= i && i < open_hi;
      for (int v = 0; v < kTileVectors; ++v) {
        const Vec s = Load(row + v * kLanes);
        const Vec e = open ? exp(s - max[v]) : s == kNegInf ? Vec{} : exp(s - max[v]);
        Store(row + v * kLanes, e);
        sum[v] += e;
      }
    }
  };
  if (kBf16Products && p.bf16_products) {
    exponentiate([](Vec x) { return jaxserve::ExpNonPositiveForRounding(x); });
  } else {
    exponentiate([](Vec x) { return ExpNonPositive(x); });
  }
  auto& inv_sums = scratch.tile_inv_sums;
  inv_sums.resize(kTileLanes);
  for (int v = 0; v < kTileVectors; ++v)
    for (int l = 0; l < kLanes; ++l) inv_sums[v * kLanes + l] = sum[v][l] > 0.0f ? 1.0f / sum[v][l] : 0.0f;

  if (kBf16Products && p.bf16_products) {
    TileBf16<DV>::template WeightedSum<R>(p, job, count, scratch);
    return;
  }
  if constexpr (kLanes == 8) {
    WeightedSumByD<DV>(p, job, count, scratch);
    return;
  }
  for (int64_t lane0 = 0; lane0 < lanes; lane0 += R) {
    Vec acc[R][DV] = {};
    for (int64_t i = 0; i < count; ++i) {
      const Page* value = static_cast<const Page*>(scratch.value_rows[i]);
      Vec val[DV];
      for (int dv = 0; dv < DV; ++dv) val[dv] = Load(value + dv * kLanes);
      const float* weights = scores.data() + i * kTileLanes + lane0;
      for (int r = 0; r < R; ++r)
        for (int dv = 0; dv < DV; ++dv) acc[r][dv] += weights[r] * val[dv];
    }
    TileStore<DV, R>(p, job, lane0, acc, scratch.tile_inv_sums.data());
  }
}

// A job of several tiles of one sequence and KV head, in order: each tile converts only the keys and
// values the tile before did not reach (Scratch::Keep).
template <typename Page, int DV, int R>
void AttendTiles(const Problem<Page>& p, const TileJob& job, Scratch& scratch) {
  const int64_t tile_tokens = kTileLanes / p.group;
  for (int64_t t = 0; t < job.tokens; t += tile_tokens) {
    AttendTile<Page, DV, R>(p, {job.first_row + t, std::min(tile_tokens, job.tokens - t), job.kv_head}, scratch);
  }
}

template <typename Page>
using TileFn = void (*)(const Problem<Page>&, const TileJob&, Scratch&);

// AttendTile for head_dim of 2, 4 or 8 vectors (R lanes of 8, 4 or 2 vectors of accumulators), or
// nullptr; groups up to kTileLanes / kMinTileTokens query heads per KV head.
template <typename Page>
TileFn<Page> TileFor(int64_t head_dim, int64_t group) {
  if (head_dim % kLanes != 0 || group < 1 || group * kMinTileTokens > kTileLanes) return nullptr;
  switch (head_dim / kLanes) {
    case 2: return &AttendTiles<Page, 2, std::min(8, kLanes)>;
    case 4: return &AttendTiles<Page, 4, 4>;
    case 8: return &AttendTiles<Page, 8, 2>;
    default: return nullptr;
  }
}

// The step's work: runs of at least kMinTileTokens rows of one sequence at consecutive positions
// split into tiles, every other row on its own. A job takes up to kMaxJobTiles consecutive tiles of one
// KV head (AttendTiles), fewer where that leaves under kJobsPerThread jobs for each of `threads`; a
// run's later jobs, which attend to more keys, come first, and the single rows last.
constexpr int64_t kMaxJobTiles = 8, kJobsPerThread = 4;

template <typename Page>
std::vector<TileJob> Jobs(const Problem<Page>& p, int64_t num_rows, bool tiles, int64_t threads) {
  const int64_t tile_tokens = kTileLanes / p.group, num_kv_heads = p.num_heads / p.group;
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first row, end) of the rows that go in tiles
  std::vector<TileJob> jobs, singles;
  int64_t num_tiles = 0;
  for (int64_t row = 0; row < num_rows;) {
    int64_t end = row + 1;
    while (tiles && end < num_rows && p.row_seqs[end] == p.row_seqs[row] && p.kv_lens[row] > 0 &&
           p.kv_lens[end] == p.kv_lens[end - 1] + 1) {
      ++end;
    }
    const int64_t rest = (end - row) % tile_tokens;
    const int64_t tiled = end - row - (rest < kMinTileTokens ? rest : 0);
    if (tiled > 0) runs.emplace_back(row, row + tiled);
    num_tiles += (tiled + tile_tokens - 1) / tile_tokens;
    for (row += tiled; row < end; ++row) singles.push_back({row, 1, -1});
  }
  const int64_t wanted = std::max<int64_t>(threads, 1) * kJobsPerThread;
  const int64_t job_tiles = std::clamp<int64_t>(num_tiles * num_kv_heads / wanted, 1, kMaxJobTiles);
  const int64_t job_tokens = job_tiles * tile_tokens;
  for (const auto& [first, end] : runs) {
    for (int64_t start = first + (end - first - 1) / job_tokens * job_tokens; start >= first; start -= job_tokens) {
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        jobs.push_back({start, std::min(job_tokens, end - start), kv_head});
      }
    }
  }
  jobs.insert(jobs.end(), singles.begin(), singles.end());
  return jobs;
}

// XLA's buffer type of a page element.
template <typename Page>
constexpr ffi::DataType kPageType = std::is_same_v<Page, float>  ? ffi::F32
                                    : std::is_same_v<Page, Bf16> ? ffi::BF16
                                                                 : ffi::F8E4M3FN;

// The FFI's buffer type of pages: typed, but for float8, which the FFI's typed buffers do not take
// (no C++ element type): an untyped buffer whose element type the handler checks (PageTypeError).
template <typename Page>
struct PageBufferOf {
  using type = ffi::Buffer<kPageType<Page>>;
};
template <>
struct PageBufferOf<Fp8> {
  using type = ffi::AnyBuffer;
};
template <typename Page>
using PageBuffer = typename PageBufferOf<Page>::type;

template <typename Page>
bool WrongPageType(const PageBuffer<Page>& pages) {
  if constexpr (std::is_same_v<Page, Fp8>) {
    return pages.element_type() != ffi::F8E4M3FN;
  } else {
    return false;
  }
}

// bfloat16 out: each job rounds what it wrote (float32, in the call's `wide` rows) into out: a decode row
// all its heads, a tile its KV head's query heads of its rows, lanes as StoreBf16 rounds them (the tail
// past whole vectors as RoundHigh does).
template <typename Page>
void RoundJob(const Problem<Page>& p, const TileJob& job, Bf16* out) {
  const int64_t width = p.num_heads * p.head_dim;
  const int64_t first = job.kv_head < 0 ? 0 : job.kv_head * p.group * p.head_dim;
  const int64_t count = job.kv_head < 0 ? width : p.group * p.head_dim;
  for (int64_t r = job.first_row; r < job.first_row + job.tokens; ++r) {
    const float* from = p.out + r * width + first;
    Bf16* to = out + r * width + first;
    int64_t i = 0;
    for (; i + kLanes <= count; i += kLanes) jaxserve::StoreBf16(to + i, Load(from + i));
    for (; i < count; ++i) to[i] = static_cast<Bf16>(RoundHigh(from[i]) >> 16);
  }
}

// The result's element: float32, or bfloat16 bits for a bfloat16 matmul after it (o_proj).
template <typename Out>
constexpr ffi::DataType kOutType = std::is_same_v<Out, float> ? ffi::F32 : ffi::BF16;

template <typename Page, typename Out = float>
ffi::Error PagedRowAttention(ffi::ThreadPool pool,
                             ffi::Buffer<ffi::F32> q,                  // [R, H, D]
                             PageBuffer<Page> k_pages,              // [L, P, page, KVH, D]
                             PageBuffer<Page> v_pages,              // [L, P, page, KVH, D]
                             ffi::Buffer<ffi::S32> layer,           // []
                             ffi::Buffer<ffi::S32> kv_lens,         // [R]
                             ffi::Buffer<ffi::S32> row_seqs,        // [R], the row's block table
                             ffi::Buffer<ffi::S32> block_tables,    // [S, W]
                             ffi::Buffer<ffi::S32> sliding_window,  // [], 0 = none
                             float scale, float soft_cap, int32_t bf16_products,
                             ffi::ResultBuffer<kOutType<Out>> out) {  // [R, H, D]
  const auto q_dims = q.dimensions();
  const auto kv_dims = k_pages.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 5 || block_tables.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged_row_attention: unexpected operand ranks");
  }
  if (WrongPageType<Page>(k_pages) || WrongPageType<Page>(v_pages)) {
    return ffi::Error::InvalidArgument("paged_row_attention: the pages are not float8_e4m3fn");
  }
  const int64_t num_rows = q_dims[0], num_heads = q_dims[1], head_dim = q_dims[2];
  const int64_t num_pages = kv_dims[1], page_size = kv_dims[2], num_kv_heads = kv_dims[3];
  if (kv_dims[4] != head_dim || num_heads % num_kv_heads != 0) {
    return ffi::Error::InvalidArgument("paged_row_attention: head shapes do not match");
  }
  const int64_t layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= kv_dims[0]) {
    return ffi::Error::InvalidArgument("paged_row_attention: layer index out of range");
  }
  const int64_t layer_offset = layer_index * num_pages * page_size * num_kv_heads * head_dim;
  const auto* k = reinterpret_cast<const Page*>(k_pages.untyped_data());
  const auto* v = reinterpret_cast<const Page*>(v_pages.untyped_data());
  // The kernels write float32 rows: into the result, or under bfloat16 out into the calling thread's buffer
  // (its helpers write there too), each job's part then rounded into the result (RoundJob).
  static thread_local std::vector<float> wide;
  float* rows_out = reinterpret_cast<float*>(out->untyped_data());
  if constexpr (!std::is_same_v<Out, float>) {
    wide.resize(num_rows * num_heads * head_dim);
    rows_out = wide.data();
  }
  Out* result = reinterpret_cast<Out*>(out->untyped_data());
  const Problem<Page> problem{q.typed_data(), k + layer_offset, v + layer_offset,
                        kv_lens.typed_data(), row_seqs.typed_data(), block_tables.typed_data(), rows_out,
                        block_tables.dimensions()[0], num_heads, head_dim, num_heads / num_kv_heads, num_pages, page_size,
                        num_kv_heads * head_dim, block_tables.dimensions()[1], sliding_window.typed_data()[0],
                        scale, soft_cap, bf16_products != 0};
  const TileFn<Page> tile = TileFor<Page>(head_dim, problem.group);
  auto jobs = std::make_shared<const std::vector<TileJob>>(Jobs(problem, num_rows, tile != nullptr, pool.num_threads()));
  // Job i, whose thread does job `next` after it (-1: none, or not known): a decode row prefetches the next
  // one's first pages (see PageStream).
  const auto run = [problem, tile, jobs, result](int64_t i, int64_t next, Scratch& scratch) {
    const TileJob& job = (*jobs)[i];
    if (job.kv_head < 0) {
      const int64_t next_row = next >= 0 && (*jobs)[next].kv_head < 0 ? (*jobs)[next].first_row : -1;
      AttendOne(problem, job.first_row, next_row, scratch);
    } else {
      tile(problem, job, scratch);
    }
    if constexpr (!std::is_same_v<Out, float>) RoundJob(problem, job, result);
  };
  // A thread learns its next job by claiming it before it starts the current one (ParallelFor's (item, next)
  // form), which leaves a helper that starts later nothing to do when there are under two jobs a thread: two
  // decode rows on two threads would run on one. Fewer jobs go one at a time, without the next row's pages.
  const int64_t count = jobs->size();
  if (count >= 2 * static_cast<int64_t>(pool.num_threads())) {
    jaxserve::ParallelFor(pool, count, [run] {
      return [run, scratch = Scratch()](int64_t i, int64_t next) mutable { run(i, next, scratch); };
    });
  } else {
    jaxserve::ParallelFor(pool, count, [run] {
      return [run, scratch = Scratch()](int64_t i) mutable { run(i, -1, scratch); };
    });
  }
  return ffi::Error::Success();
}

}  // namespace

namespace {

// The handlers' signature, for float32, bfloat16 or float8 e4m3 pages, a float32 or bfloat16 result.
template <typename Page, typename Out = float>
auto AttentionBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<PageBuffer<Page>>()
      .template Arg<PageBuffer<Page>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int32_t>("bf16_products")
      .template Ret<ffi::Buffer<kOutType<Out>>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedRowAttention, PagedRowAttention<float>, AttentionBinding<float>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedRowAttentionBf16Pages, PagedRowAttention<Bf16>,
                              AttentionBinding<Bf16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedRowAttentionFp8Pages, PagedRowAttention<Fp8>, AttentionBinding<Fp8>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedRowAttentionBf16PagesBf16Out, (PagedRowAttention<Bf16, Bf16>),
                              (AttentionBinding<Bf16, Bf16>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedRowAttentionFp8PagesBf16Out, (PagedRowAttention<Fp8, Bf16>),
                              (AttentionBinding<Fp8, Bf16>()));

// Writes a step's keys and values [T, KVH, D] (float32) into bfloat16 or float8 e4m3 pages at their
// slots (page * page_size + offset), rounded to nearest even (float8 clipped to +-448), in place: the
// page arrays are aliased to the outputs. XLA:CPU has no scatter in either dtype; it would widen the
// whole page array to float32 and back around one.
namespace {

inline uint16_t Round(float x, Bf16) { return static_cast<uint16_t>(RoundHigh(x) >> 16); }
inline uint8_t Round(float x, Fp8) { return RoundFp8(x); }

// What a page writer (`name`) checks of its pages: aliased to its results, float8 e4m3 where Page says so,
// and the layer index within them (set in `layer_index`).
template <typename Page>
ffi::Error CheckWrittenPages(const char* name, const PageBuffer<Page>& k_pages, const PageBuffer<Page>& v_pages,
                             const void* k_out, const void* v_out, const ffi::Buffer<ffi::S32>& layer,
                             int64_t& layer_index) {
  const std::string what = name;
  if (k_out != k_pages.untyped_data() || v_out != v_pages.untyped_data()) {
    return ffi::Error::InvalidArgument(what + ": the pages are not aliased to the results");
  }
  if (WrongPageType<Page>(k_pages) || WrongPageType<Page>(v_pages)) {
    return ffi::Error::InvalidArgument(what + ": the pages are not float8_e4m3fn");
  }
  layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= k_pages.dimensions()[0]) {
    return ffi::Error::InvalidArgument(what + ": layer index out of range");
  }
  return ffi::Error::Success();
}

template <typename Page>
ffi::Error WritePages(PageBuffer<Page> k_pages, PageBuffer<Page> v_pages, ffi::Buffer<ffi::F32> k,
                      ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                      ffi::Result<PageBuffer<Page>> k_out, ffi::Result<PageBuffer<Page>> v_out) {
  const auto kv_dims = k_pages.dimensions(), row_dims = k.dimensions();
  if (kv_dims.size() != 5 || row_dims.size() != 3 || row_dims[1] != kv_dims[3] || row_dims[2] != kv_dims[4] ||
      static_cast<int64_t>(slots.element_count()) != row_dims[0] || v.element_count() != k.element_count()) {
    return ffi::Error::InvalidArgument("write_pages: operand shapes do not match");
  }
  int64_t layer_index = 0;
  if (ffi::Error error = CheckWrittenPages<Page>("write_pages", k_pages, v_pages, k_out->untyped_data(),
                                                 v_out->untyped_data(), layer, layer_index);
      error.failure()) {
    return error;
  }
  const int64_t num_slots = kv_dims[1] * kv_dims[2];
  using Bits = decltype(Round(0.0f, Page{}));
  const int64_t row = kv_dims[3] * kv_dims[4];
  const auto write = [&](const float* rows, Bits* pages) {
    pages += layer_index * num_slots * row;
    for (int64_t t = 0; t < row_dims[0]; ++t) {
      const int64_t slot = std::clamp<int64_t>(slots.typed_data()[t], 0, num_slots - 1);
      for (int64_t i = 0; i < row; ++i) pages[slot * row + i] = Round(rows[t * row + i], Page{});
    }
  };
  write(k.typed_data(), reinterpret_cast<Bits*>(k_out->untyped_data()));
  write(v.typed_data(), reinterpret_cast<Bits*>(v_out->untyped_data()));
  return ffi::Error::Success();
}

template <typename Page>
auto WriteBinding() {
  return ffi::Ffi::Bind()
      .Arg<PageBuffer<Page>>()
      .template Arg<PageBuffer<Page>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<PageBuffer<Page>>()
      .template Ret<PageBuffer<Page>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteBf16Pages, WritePages<Bf16>, WriteBinding<Bf16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteFp8Pages, WritePages<Fp8>, WriteBinding<Fp8>());

// The layer's step between its qkv matmul and its attention, in one call: the matmul's rows
// [T, (H + 2 KVH) D] (q | k | v, float32) in; q and k rotated by their tokens' rope, the halves convention
// of transformer.apply_rope (x1 cos - x2 sin | x2 cos + x1 sin, x1 and x2 a head's halves); k and v
// written into the pages at their slots as WritePages writes them; q [T, H, D] float32 out. XLA took
// the rows apart, rotated and joined the halves in passes of their own before the writer's call.
namespace {

constexpr int64_t kRopeTokens = 16;  // consecutive slots that go to one work item
constexpr int64_t kRopeItems = 8;  // work items at most

// out[0, D) = x rotated by cos c and sin s [D / 2]: each half one fused multiply-add onto the other
// product (the form XLA:CPU compiled transformer.apply_rope to in the layer's step, where measured).
inline void Rotate(const float* x, const float* c, const float* s, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = std::fma(x1, c[i], -(x2 * s[i]));
    out[i + half] = std::fma(x2, c[i], x1 * s[i]);
  }
}

template <typename Page>
ffi::Error RopeWritePages(ffi::ThreadPool pool, PageBuffer<Page> k_pages, PageBuffer<Page> v_pages,
                          ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots, ffi::Result<PageBuffer<Page>> k_out,
                          ffi::Result<PageBuffer<Page>> v_out, ffi::ResultBuffer<ffi::F32> q_out) {
  const auto kv_dims = k_pages.dimensions(), q_dims = q_out->dimensions(), qkv_dims = qkv.dimensions();
  if (kv_dims.size() != 5 || q_dims.size() != 3 || qkv_dims.size() != 2 || cos.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("rope_write_pages: unexpected operand ranks");
  }
  const int64_t tokens = q_dims[0], heads = q_dims[1], head_dim = q_dims[2], kv_heads = kv_dims[3];
  const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
  if (kv_dims[4] != head_dim || head_dim % 2 != 0 || qkv_dims[0] != tokens || qkv_dims[1] != width ||
      cos.dimensions()[0] != tokens || cos.dimensions()[1] != half || sin.element_count() != cos.element_count() ||
      static_cast<int64_t>(slots.element_count()) != tokens) {
    return ffi::Error::InvalidArgument("rope_write_pages: operand shapes do not match");
  }
  int64_t layer_index = 0;
  if (ffi::Error error = CheckWrittenPages<Page>("rope_write_pages", k_pages, v_pages, k_out->untyped_data(),
                                                 v_out->untyped_data(), layer, layer_index);
      error.failure()) {
    return error;
  }
  const int64_t num_slots = kv_dims[1] * kv_dims[2];
  using Bits = decltype(Round(0.0f, Page{}));
  const int64_t row = kv_heads * head_dim;
  Bits* k = reinterpret_cast<Bits*>(k_out->untyped_data()) + layer_index * num_slots * row;
  Bits* v = reinterpret_cast<Bits*>(v_out->untyped_data()) + layer_index * num_slots * row;
  const float* x = qkv.typed_data();
  const float *c = cos.typed_data(), *s = sin.typed_data();
  const int32_t* slot_of = slots.typed_data();
  float* q = q_out->typed_data();
  // Item i takes the tokens whose slots lie in groups of kRopeTokens slots numbered i modulo the items, in
  // token order: tokens that share a slot (the padding rows' in the dummy page) are one thread's, the
  // later one's values kept, as the writer's.
  const int64_t items = std::clamp<int64_t>(tokens / kRopeTokens, 1, kRopeItems);
  jaxserve::ParallelFor(pool, items, [=] {
    return [=, rotated = std::vector<float>(row)](int64_t item) mutable {
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = std::clamp<int64_t>(slot_of[t], 0, num_slots - 1);
        if (slot / kRopeTokens % items != item) continue;
        const float* in = x + t * width;
        const float *ct = c + t * half, *st = s + t * half;
        for (int64_t h = 0; h < heads; ++h) Rotate(in + h * head_dim, ct, st, half, q + (t * heads + h) * head_dim);
        for (int64_t h = 0; h < kv_heads; ++h) Rotate(in + (heads + h) * head_dim, ct, st, half, rotated.data() + h * head_dim);
        const float* values = in + (heads + kv_heads) * head_dim;
        for (int64_t i = 0; i < row; ++i) {
          k[slot * row + i] = Round(rotated[i], Page{});
          v[slot * row + i] = Round(values[i], Page{});
        }
      }
    };
  });
  return ffi::Error::Success();
}

template <typename Page>
auto RopeWriteBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<PageBuffer<Page>>()
      .template Arg<PageBuffer<Page>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<PageBuffer<Page>>()
      .template Ret<PageBuffer<Page>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRopeWriteBf16Pages, RopeWritePages<Bf16>, RopeWriteBinding<Bf16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRopeWriteFp8Pages, RopeWritePages<Fp8>, RopeWriteBinding<Fp8>());
