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

// A prefetch of the cache line at p into L1 (prefetcht0) or L2 (prefetcht2), written as an asm statement
// the compiler must keep: GCC 12 silently dropped `__builtin_prefetch` calls from the functions that issue
// tile instructions (the built AmxPair and AmxBlock had lost their prefetch of the next panel).
inline void PrefetchL1(const void* p) { __asm__ volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void PrefetchL2(const void* p) { __asm__ volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p))); }
#endif

}  // namespace jaxserve
