"""2 MiB pages for the KV page arrays on a Linux CPU (transparent huge pages, asked for with madvise).

The attention reads each row's KV pages wherever the pool put them. Once a server has run a while, the
pool hands out pages in the order they were freed (page_pool.py), scattered over the whole array, and on
4 KiB pages every scattered KV page (6 KiB a layer for the default model) is a TLB miss or two of its own.
Measured on a 2-core AMD EPYC Zen 5 (avx512_bf16, 2026-12-06): one layer's decode attention for 32 rows at
context 315 took 345-378 us with its pages scattered at random over a 1 GiB pool against 273-300 us with
them packed at the pool's start, and 293 us scattered in 2 MiB pages; served at concurrency 32 the
output throughput fell from about 800 to 690-750 tokens/s over a dozen runs of vLLM's bench client.

Linux maps 2 MiB pages into memory marked MADV_HUGEPAGE where /sys/kernel/mm/transparent_hugepage/enabled
reads "madvise" (the default of most distributions) or "always"; "never" refuses them, and then this
changes nothing. The arrays are still the zeros they were created as, so their whole 2 MiB pages can be
given back first (MADV_DONTNEED, which for private anonymous memory, as XLA's allocations are, reads back
as zeros): the step that next touches one maps a fresh 2 MiB page there, and nothing is copied. Memory
of any other kind is left as it is. Only the arrays' whole 2 MiB pages are touched; their first and last
partial pages stay 4 KiB pages, and nothing outside the arrays is touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import logging
import sys

import jax

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclasses.dataclass
class HugePageAdvice:
    marked_bytes: int = 0  # bytes marked MADV_HUGEPAGE (whole 2 MiB pages of the arrays)
    skipped: str | None = None  # why some or all of the arrays were left as they were

    def describe(self) -> str:
        setting = thp_setting()
        if self.marked_bytes == 0:
            return f"KV pages on the system's page size ({self.skipped or 'nothing to mark'})"
        where = f"transparent huge pages {setting!r}" if setting else "transparent huge pages"
        refused = ": the system refuses them" if setting == "never" else ""
        return f"KV pages: {self.marked_bytes / 2**20:.0f} MiB asked for in 2 MiB pages ({where}){refused}"


def thp_setting() -> str | None:
    """The bracketed word of the transparent-huge-page setting ("always", "madvise", "never"), or None."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


@functools.cache
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _private_anonymous(start: int, end: int) -> bool:
    """Whether [start, end) lies in private anonymous mappings only (/proc/self/maps: 'p', and no path but
    malloc's [heap], where an allocation under glibc's mmap threshold lands)."""
    covered = start
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if high <= covered or low >= end:
                continue
            if low > covered or not fields[1].endswith("p") or fields[5:] not in ([], ["[heap]"]):
                return False
            covered = high
            if covered >= end:
                return True
    return False


def _madvise(start: int, length: int, advice: int) -> None:
    if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise({advice}) failed")


def advise_zeroed_arrays(arrays) -> HugePageAdvice:
    """Asks for 2 MiB pages under each CPU buffer of `arrays` (jax.Arrays of zeros, nothing reading or writing
    them meanwhile): their whole 2 MiB pages are given back and marked MADV_HUGEPAGE. Off Linux, or for arrays
    not on the CPU, does nothing and says so."""
    advice = HugePageAdvice()
    if not sys.platform.startswith("linux"):
        advice.skipped = "not Linux"
        return advice
    for array in jax.tree.leaves(arrays):
        array.block_until_ready()  # XLA's zeros written before their pages are given back
        for shard in array.addressable_shards:
            if shard.device.platform != "cpu":
                advice.skipped = "not on the CPU"
                continue
            buffer = shard.data
            address, size = buffer.unsafe_buffer_pointer(), buffer.nbytes
            start = -(-address // HUGE_PAGE) * HUGE_PAGE
            end = (address + size) // HUGE_PAGE * HUGE_PAGE
            if end <= start:
                continue
            if not _private_anonymous(start, end):
                advice.skipped = "a buffer not in private anonymous memory"
                continue
            try:
                _madvise(start, end - start, MADV_HUGEPAGE)
                _madvise(start, end - start, MADV_DONTNEED)
            except OSError as e:
                advice.skipped = f"madvise refused: {e.strerror or e}"
                logger.debug("huge pages for a KV buffer: %s", e)
                continue
            advice.marked_bytes += end - start
    return advice
