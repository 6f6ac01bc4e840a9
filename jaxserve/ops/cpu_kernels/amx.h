// What the C++ kernels share to use AMX tiles (Intel Xeon since Sapphire Rapids): whether the library
// is built for them, the process's permission, and the one tile configuration every kernel uses.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__linux__)
#define JAXSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define JAXSERVE_AMX 0
#endif

#include <cstdint>

// Whether the kernels may use the tiles now: built for them, granted, and not turned off
// (JaxserveSetAmx); defined in packed_matmul.cc.
extern "C" int JaxserveAmxInUse();

namespace jaxserve {

#if JAXSERVE_AMX
constexpr int kAmxRows = 16;  // rows per tile; a tile row is 64 bytes: 16 32-bit lanes

// Linux hands out the 8 KiB of tile registers only to a process that asks (once, for all its threads).
inline bool AmxPermitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
  return permitted;
}

// Every tile 64 bytes wide; tiles 0-3 `rows` rows (1-16), tiles 4-7 16. The kernels give tiles 0-2 to
// accumulators and 3 to the A operand, whose row counts must agree, so a block of fewer than 16 rows
// (the last of a matmul's) is that many rows of tiles 0-3; the B operands (4-7) are always 16 rows.
inline void ConfigureTiles(int rows = kAmxRows) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t < 4 ? rows : kAmxRows;
  }
  _tile_loadconfig(&config);
}

// GCC 12's tile intrinsics are asm statements without memory operands: the compiler is not told that a tile
// load reads memory or that a tile store writes it. A kernel puts this barrier between its own stores to a
// buffer and the tile loads of it, and between tile stores and its own reads of what they wrote, so that
// the compiler neither moves nor drops those accesses. It emits no instruction.
inline void TileMemoryBarrier() { __asm__ volatile("" : : : "memory"); }

// The six-accumulator pattern of the bfloat16 kernels (the matmul's AmxPair, the attention's AmxScores): two
// 16-row blocks of the A operand (a0, a1: tiles 0-2 and 3-5 accumulate them) against three B tiles side by side
// (b, b + 64 bytes, b + 128 bytes), A and B loaded in turn into tiles 6 and 7, so each B tile is loaded once for
// 32 rows. ZeroPair, then PairStep per 32 k (a0, a1 and b advanced by the caller), then StorePair.
inline void ZeroPair() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
}

// kStreamB: B's tiles loaded with the streaming hint (tileloaddt1), for B that passes through once.
template <bool kStreamB>
inline void PairStep(const void* a0, const void* a1, int64_t a_stride, const void* b, int64_t b_stride) {
  const char* bytes = static_cast<const char*>(b);
  const auto load_b = [&](int offset) {
    if constexpr (kStreamB) {
      _tile_stream_loadd(7, bytes + offset, b_stride);
    } else {
      _tile_loadd(7, bytes + offset, b_stride);
    }
  };
  _tile_loadd(6, a0, a_stride);
  load_b(0);
  _tile_dpbf16ps(0, 6, 7);
  _tile_loadd(6, a1, a_stride);
  _tile_dpbf16ps(3, 6, 7);
  load_b(64);
  _tile_dpbf16ps(4, 6, 7);
  _tile_loadd(6, a0, a_stride);
  _tile_dpbf16ps(1, 6, 7);
  load_b(128);
  _tile_dpbf16ps(2, 6, 7);
  _tile_loadd(6, a1, a_stride);
  _tile_dpbf16ps(5, 6, 7);
}

// The six accumulators to c0 (a0's rows) and c1 (a1's), three 64-byte tiles side by side in each.
inline void StorePair(void* c0, void* c1, int64_t stride) {
  _tile_stored(0, c0, stride);
  _tile_stored(1, static_cast<char*>(c0) + 64, stride);
  _tile_stored(2, static_cast<char*>(c0) + 128, stride);
  _tile_stored(3, c1, stride);
  _tile_stored(4, static_cast<char*>(c1) + 64, stride);
  _tile_stored(5, static_cast<char*>(c1) + 128, stride);
  TileMemoryBarrier();  // c0 and c1 are read as memory after this
}

// A prefetch of the cache line at p into L1 (prefetcht0) or L2 (prefetcht2), written as an asm statement
// the compiler must keep: GCC 12 silently dropped `__builtin_prefetch` calls from the functions that issue
// tile instructions (the built AmxPair and AmxBlock had lost their prefetch of the next panel).
inline void PrefetchL1(const void* p) { __asm__ volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void PrefetchL2(const void* p) { __asm__ volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p))); }
#endif

}  // namespace jaxserve
