"""Sampling parameters (vLLM's names and defaults) and the on-device sampler.

Every per-request setting reaches the device as a per-row array, never as a static argument, so
greedy and random rows share one executable per bucket. A row's random key is derived from its
request's seed and the position of the token being sampled, so a seeded request samples the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class SamplingParams:
    """What to generate for one prompt. Defaults follow vLLM's `SamplingParams`."""

    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 means off
    seed: int | None = None
    max_tokens: int | None = 16  # None means up to max_model_len
    min_tokens: int = 0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        def check(ok: bool, message: str):
            if not ok:
                raise ValueError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 0, f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check(self.seed is None or 0 <= self.seed < 2**32, f"seed must be in [0, 2**32), got {self.seed}")
        # Until the full sampler lands, refuse settings we would otherwise silently ignore.
        check(self.top_p == 1.0, "top_p other than 1.0 is not supported yet")
        check(self.top_k in (0, -1), "top_k is not supported yet")
        check(self.n == 1, "n > 1 is not supported yet")


def sample(logits, temperature, seeds, positions):
    """Samples one token per row.

    logits [S, vocab] f32; temperature [S] (0 = greedy); seeds [S] uint32; positions [S] int32
    (the position the sampled token will take). Returns token ids [S] int32.
    """
    greedy = jnp.argmax(logits, axis=-1)

    def gumbel(seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.gumbel(key, logits.shape[-1:], jnp.float32)

    noise = jax.vmap(gumbel)(seeds, positions)  # [S, vocab]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sampled = jnp.argmax(scaled + noise, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
