"""The shape buckets steps are compiled for: token counts of prompt steps, batch sizes of decode steps.

Every step is padded up to the smallest bucket that holds it (`pick_bucket`), so a fixed set of
executables, all compiled at warm-up, serves any batch.
"""

from __future__ import annotations

from jaxserve.config.engine_config import EngineConfig


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... below hi, then hi."""
    buckets, size = [], lo
    while size < hi:
        buckets.append(size)
        size *= 2
    return buckets + [hi]


def prefill_buckets(cfg: EngineConfig) -> list[int]:
    """Token counts: powers of two from min_prefill_bucket up to max_num_batched_tokens."""
    return powers_of_two(cfg.min_prefill_bucket, cfg.max_num_batched_tokens)


def decode_buckets(cfg: EngineConfig) -> list[int]:
    """Batch sizes: powers of two from min_decode_bucket up to max_num_seqs."""
    return powers_of_two(min(cfg.min_decode_bucket, cfg.max_num_seqs), cfg.max_num_seqs)


def pick_bucket(buckets: list[int], size: int) -> int:
    assert size <= buckets[-1], f"{size=} exceeds the largest bucket {buckets[-1]}"
    return next(b for b in buckets if b >= size)
