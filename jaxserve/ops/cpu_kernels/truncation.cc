// The sampler's kernels for XLA:CPU, row by row, called through the XLA FFI: the top-k / top-p threshold (see
// jaxserve/ops/sampling.py, `truncation_threshold`, whose bisections over the vocabulary are the reference) and
// the greedy token (`argmax`, below).
//
// For each row of scaled logits s [S, V] and their probabilities p [S, V] (after min-p), with top_k (0: off)
// and top_p (1: off), the threshold t such that the tokens with s >= t are the ones kept:
//
//   t_k = the k-th largest finite s (the smallest finite s where k is 0 or reaches the finite count);
//   t_p = the largest s whose tokens and every token above them carry at least
//         top_p * (the mass of the tokens >= t_k) * (1 - 1e-6) of the probability;
//   t   = max(t_k, t_p), or -inf where top_k <= 0 and top_p >= 1 (keep everything).
//
// Ties are kept together (a threshold is a value, not a count), as the reference keeps them. The reference's two
// bisections are 64 passes of XLA's reductions over [S, V]: about 120 ms of a batch-32 step of the default
// model's 49,152 tokens on a 2-core AVX2 EPYC. Here a row takes three passes and a small sort: its finite range;
// each token's bucket of that range (kBuckets of equal width, a vector at a time) with each bucket's count and
// mass; then the one bucket where the count from the top reaches k, or the mass from the top reaches its target,
// gathered and sorted, and the threshold read off it (about 0.2 ms a row there, whatever the distribution's
// shape). The bucket masses are float32 sums taken in another order than the reference's, so a token whose
// running mass lands within float32's rounding of the target may fall on the other side (the 1e-6 margin keeps
// the last kept token away from the top-k set's own total).
//
// And the greedy token (ArgmaxRows): the first index of each row's maximum, as sampling.argmax gives it, in one
// pass over the row (the last index where a row holds a NaN, which XLA's reductions treat as they happen to).
// XLA:CPU's version, two reductions over the whole [S, V] logits (the row maximum, then each chunk's), took
// about 0.97 ms of a batch-32 decode step of the default model on a 2-core Xeon.
//
// Rows are spread over XLA's intra-op threads (parallel_for.h), each thread with its own scratch.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int32_t kBuckets = 1024;  // of the row's finite range, equal widths
constexpr int kCopies = 4;  // histograms filled side by side (token i into copy i % 4), so that runs of tokens
                            // in one bucket do not wait on each other's stores
constexpr int kCopyStride = kBuckets + 9;  // a bin more for kNoBucket, and copies not a multiple of 4 KiB apart
constexpr uint16_t kNoBucket = kBuckets;  // a token that is not finite

struct Candidate {  // a token of the gathered bucket
  float value, prob;
};

struct Bin {
  float mass;
  int32_t count;
};

// A row's scratch, one per thread: each token's bucket; each bucket's mass and token count (kCopies
// histograms, summed into the first); the tokens of one bucket.
struct Scratch {
  std::vector<uint16_t> bucket_of;
  std::vector<Bin> bins = std::vector<Bin>(kCopies * kCopyStride);
  std::vector<Candidate> bucket;
};

struct Row {
  const float* scaled;
  const float* probs;
  int64_t vocab;
  int32_t top_k;
  float top_p;
};

// p (>= 0), or 0 where p is subnormal (below 1.2e-38), told apart by its bits: an addition or a comparison with a
// subnormal operand can take a microcode assist of about a hundred cycles on x86 cores, and a sharp softmax
// leaves thousands of them in a row; their mass could not move a sum of float32 probabilities anyway.
inline float Normal(float p) {
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits = bits >= 0x00800000u ? bits : 0u;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

inline jaxserve::IntVec Finite(jaxserve::Vec v) {
  jaxserve::IntVec bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7f800000) != 0x7f800000;
}

// The row's lowest and highest finite value (lowest > highest where none is finite).
std::pair<float, float> FiniteRange(const Row& row) {
  using jaxserve::Vec;
  Vec lo = Vec{} + kInf, hi = Vec{} - kInf;
  int64_t i = 0;
  for (; i + jaxserve::kLanes <= row.vocab; i += jaxserve::kLanes) {
    const Vec v = jaxserve::Load(row.scaled + i);
    const auto finite = Finite(v);
    lo = (finite & (v < lo)) ? v : lo;
    hi = (finite & (v > hi)) ? v : hi;
  }
  float lowest = kInf, highest = -kInf;
  for (int j = 0; j < jaxserve::kLanes; ++j) lowest = std::min(lowest, lo[j]), highest = std::max(highest, hi[j]);
  for (; i < row.vocab; ++i) {
    if (std::isfinite(row.scaled[i])) lowest = std::min(lowest, row.scaled[i]), highest = std::max(highest, row.scaled[i]);
  }
  return {lowest, highest};
}

// Each finite token's bucket of [lowest, highest] by value, into scratch.bucket_of (kNoBucket where not
// finite), and each bucket's count and mass; returns the count of finite tokens. Monotone: v * scale - offset
// rounds monotonically, so a larger value never lands in a lower bucket, and equal values share one; the
// product cannot overflow (scale = kBuckets / (highest - lowest) in double). The buckets are computed a vector
// at a time, then added up token by token (the non-finite ones into a bin of their own, kNoBucket, without a
// branch).
int64_t FillBuckets(const Row& row, float lowest, float highest, Scratch& scratch) {
  using jaxserve::IntVec;
  using jaxserve::kLanes;
  using jaxserve::Vec;
  const float scale = static_cast<float>(kBuckets / (static_cast<double>(highest) - lowest));
  const float offset = lowest * scale;
  scratch.bucket_of.resize(row.vocab);
  uint16_t* bucket_of = scratch.bucket_of.data();
  int64_t i = 0;
  for (; i + kLanes <= row.vocab; i += kLanes) {
    const Vec v = jaxserve::Load(row.scaled + i);
    IntVec b = __builtin_convertvector(v * scale - offset, IntVec);
    b = b < 0 ? 0 : b;
    b = b > kBuckets - 1 ? kBuckets - 1 : b;
    b = Finite(v) ? b : kNoBucket;
    for (int j = 0; j < kLanes; ++j) bucket_of[i + j] = static_cast<uint16_t>(b[j]);
  }
  for (; i < row.vocab; ++i) {
    const float v = row.scaled[i];
    bucket_of[i] = std::isfinite(v) ? static_cast<uint16_t>(std::clamp(static_cast<int32_t>(v * scale - offset), 0,
                                                                        kBuckets - 1))
                                    : kNoBucket;
  }
  std::fill(scratch.bins.begin(), scratch.bins.end(), Bin{0.0f, 0});
  Bin* bins = scratch.bins.data();
  for (i = 0; i < row.vocab; ++i) {
    Bin& bin = bins[(i % kCopies) * kCopyStride + bucket_of[i]];
    bin.mass += Normal(row.probs[i]);
    ++bin.count;
  }
  for (int c = 1; c < kCopies; ++c) {
    for (int32_t b = 0; b <= kBuckets; ++b) {
      bins[b].mass += bins[c * kCopyStride + b].mass;
      bins[b].count += bins[c * kCopyStride + b].count;
    }
  }
  return row.vocab - bins[kNoBucket].count;
}

// The tokens of bucket b with values >= floor, highest first (ties together), into scratch.bucket.
void Gather(const Row& row, int32_t b, float floor, Scratch& scratch) {
  auto& out = scratch.bucket;
  out.clear();
  for (int64_t i = 0; i < row.vocab; ++i) {
    if (scratch.bucket_of[i] == b && row.scaled[i] >= floor) out.push_back({row.scaled[i], Normal(row.probs[i])});
  }
  std::sort(out.begin(), out.end(), [](const Candidate& x, const Candidate& y) { return x.value > y.value; });
}

// The k-th largest finite value of the row (k at most the finite count) and its bucket, by the buckets'
// counts, then within that bucket, whose tokens stay in scratch.bucket.
std::pair<float, int32_t> KthLargest(const Row& row, Scratch& scratch, int64_t k) {
  int32_t b = kBuckets - 1;
  for (; b > 0 && scratch.bins[b].count < k; --b) k -= scratch.bins[b].count;
  Gather(row, b, -kInf, scratch);
  return {scratch.bucket[std::min<int64_t>(k, static_cast<int64_t>(scratch.bucket.size())) - 1].value, b};
}

// The largest value v >= floor (in bucket floor_bucket) whose tokens with values in [v, highest] carry at
// least `need` of the mass; floor where even all of them carry less (rounding).
float ValueReachingMass(const Row& row, Scratch& scratch, float floor, int32_t floor_bucket, double need) {
  int32_t b = kBuckets - 1;
  for (; b > floor_bucket && scratch.bins[b].mass < need; --b) need -= scratch.bins[b].mass;
  Gather(row, b, floor, scratch);
  double mass = 0;
  const auto& tokens = scratch.bucket;
  for (size_t i = 0; i < tokens.size(); ++i) {
    mass += tokens[i].prob;
    if (mass >= need && (i + 1 == tokens.size() || tokens[i + 1].value != tokens[i].value)) return tokens[i].value;
  }
  return floor;
}

float Threshold(const Row& row, Scratch& scratch) {
  if (row.top_k <= 0 && row.top_p >= 1.0f) return -kInf;
  const auto [lowest, highest] = FiniteRange(row);
  if (lowest > highest) return -kInf;  // nothing finite: nothing to choose between
  if (lowest == highest) return lowest;  // one value: ties keep every finite token
  const int64_t finite = FillBuckets(row, lowest, highest, scratch);
  float t_k = lowest;
  int32_t t_k_bucket = 0;
  double top_k_mass = 0;  // the mass of the tokens >= t_k: the buckets above t_k's, and t_k's own part
  if (row.top_k > 0 && row.top_k < finite) {
    std::tie(t_k, t_k_bucket) = KthLargest(row, scratch, row.top_k);
    for (const Candidate& token : scratch.bucket) top_k_mass += token.value >= t_k ? token.prob : 0.0;
  } else {
    top_k_mass = scratch.bins[0].mass;  // every token of the lowest bucket is >= lowest
  }
  if (row.top_p >= 1.0f) return t_k;
  for (int32_t b = kBuckets - 1; b > t_k_bucket; --b) top_k_mass += scratch.bins[b].mass;
  const double need = static_cast<double>(row.top_p) * top_k_mass * (1 - 1e-6);
  return std::max(t_k, ValueReachingMass(row, scratch, t_k, t_k_bucket, need));
}

ffi::Error TruncationThreshold(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scaled, ffi::Buffer<ffi::F32> probs,
                               ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                               ffi::ResultBuffer<ffi::F32> threshold) {
  const auto dims = scaled.dimensions(), probs_dims = probs.dimensions();
  if (dims.size() != 2 || probs_dims.size() != 2 || probs_dims[0] != dims[0] || probs_dims[1] != dims[1]
      || static_cast<int64_t>(top_k.element_count()) != dims[0]
      || static_cast<int64_t>(top_p.element_count()) != dims[0]
      || static_cast<int64_t>(threshold->element_count()) != dims[0]) {
    return ffi::Error::InvalidArgument("jaxserve_truncation_threshold: operand shapes do not match");
  }
  const int64_t rows = dims[0], vocab = dims[1];
  const float* s = scaled.typed_data();
  const float* p = probs.typed_data();
  const int32_t* k = top_k.typed_data();
  const float* tp = top_p.typed_data();
  float* out = threshold->typed_data();
  jaxserve::ParallelFor(pool, rows, [=] {
    return [=, scratch = Scratch()](int64_t r) mutable {
      out[r] = Threshold(Row{s + r * vocab, p + r * vocab, vocab, k[r], tp[r]}, scratch);
    };
  });
  return ffi::Error::Success();
}

// The first index of the row's maximum; the last index (vocab - 1) where the row holds a NaN. kArgmaxChains
// running maxima over interleaved vectors (vector i into chain i % kArgmaxChains), each lane keeping the
// vector where its maximum first appeared, so that no compare waits on the one before it; then the
// smallest index among the lanes that hold the row's maximum.
constexpr int kArgmaxChains = 4;

int32_t ArgmaxRow(const float* row, int64_t vocab) {
  using jaxserve::IntVec;
  using jaxserve::kLanes;
  using jaxserve::Vec;
  Vec best[kArgmaxChains];
  IntVec where[kArgmaxChains] = {}, nan = {};
  for (Vec& b : best) b = Vec{} - kInf;
  const auto take = [&](int c, int64_t v) {  // vector v into chain c
    const Vec x = jaxserve::Load(row + v * kLanes);
    const IntVec greater = x > best[c];
    best[c] = greater ? x : best[c];
    where[c] = greater ? IntVec{} + static_cast<int32_t>(v) : where[c];
    nan |= x != x;
  };
  const int64_t vectors = vocab / kLanes;
  int64_t v = 0;
  for (; v + kArgmaxChains <= vectors; v += kArgmaxChains) {
    for (int c = 0; c < kArgmaxChains; ++c) take(c, v + c);
  }
  for (int c = 0; v < vectors; ++v, ++c) take(c, v);  // fewer than kArgmaxChains left
  float top = -kInf;
  int64_t index = 0;
  bool any_nan = false;
  for (int j = 0; j < kLanes; ++j) any_nan |= nan[j] != 0;
  for (int c = 0; c < kArgmaxChains; ++c) {
    for (int j = 0; j < kLanes; ++j) {
      const int64_t at = static_cast<int64_t>(where[c][j]) * kLanes + j;
      if (best[c][j] > top || (best[c][j] == top && at < index)) top = best[c][j], index = at;
    }
  }
  for (int64_t i = vectors * kLanes; i < vocab; ++i) {  // the last vocab % kLanes, after every vector
    any_nan |= row[i] != row[i];
    if (row[i] > top) top = row[i], index = i;
  }
  return any_nan ? static_cast<int32_t>(vocab - 1) : static_cast<int32_t>(index);
}

ffi::Error ArgmaxRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> tokens) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || static_cast<int64_t>(tokens->element_count()) != dims[0] || dims[1] < 1) {
    return ffi::Error::InvalidArgument("jaxserve_argmax_rows: logits must be [S, V >= 1] and the result [S]");
  }
  const int64_t vocab = dims[1];
  const float* x = logits.typed_data();
  int32_t* out = tokens->typed_data();
  jaxserve::ParallelFor(pool, dims[0], [=] { return [=](int64_t r) { out[r] = ArgmaxRow(x + r * vocab, vocab); }; });
  return ffi::Error::Success();
}

}  // namespace

// (scaled [S, V], probs [S, V] float32, top_k [S] int32, top_p [S] float32) -> threshold [S, 1] float32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveTruncationThreshold, TruncationThreshold,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// logits [S, V] float32 -> tokens [S] int32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveArgmaxRows, ArgmaxRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
