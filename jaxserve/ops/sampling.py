"""Sampling parameters (vLLM's names and defaults) and the on-device sampler.

Every per-request setting reaches the device as a per-row array, never as a static argument, so
greedy and random rows, top-k/top-p/min-p, penalties and logit biases share one executable per
bucket; optional work (penalties, truncation, logprobs) sits behind `lax.cond` on whether any row
asked for it. On a GPU a `lax.cond` on device data makes XLA copy the predicate to the host and wait
before it can go on, so there (`branches=False`) every part runs and a select keeps what the rows asked
for: the same tokens, no host round trip inside the step. A row's random key is derived from its request's seed and the position of the token
being sampled, so a seeded request samples the same tokens whatever else shares its batch.

Logprobs are the log-softmax of the model's raw logits (before penalties, biases, temperature and
truncation), as in vLLM's default `logprobs_mode="raw_logprobs"`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.config.sampling_params import MAX_LOGPROBS

_BISECT_STEPS = 32


class SamplingTensors(NamedTuple):
    """Per-row sampling settings; padded rows are greedy with everything off."""

    temperature: jax.Array  # [S] f32, 0 = greedy
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] f32
    min_p: jax.Array  # [S] f32
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    repetition_penalty: jax.Array  # [S] f32
    seeds: jax.Array  # [S] uint32
    positions: jax.Array  # [S] int32, the position the sampled token will take
    bias_ids: jax.Array  # [S, B] int32, vocab_size where unused
    bias_values: jax.Array  # [S, B] f32
    history: jax.Array  # [S, H] int32: prompt then output token ids, -1 padded (penalty rows only)
    prompt_lens: jax.Array  # [S] int32, where the output part of `history` starts
    want_logprobs: jax.Array  # [S] bool
    # [S, ceil(vocab / 32)] int32: the tokens the row's grammar allows this step (structured output), bit j
    # of word w for token 32 w + j; -1 (all allowed) in unconstrained rows
    token_bitmask: jax.Array


class PromptLogprobs(NamedTuple):
    """Per row: the logprob and rank of a given (target) token, and the top alternatives."""

    logprobs: jax.Array  # [R] f32, of the target token
    ranks: jax.Array  # [R] int32: 1 + the tokens more likely than the target (vLLM's rank)
    top_ids: jax.Array  # [R, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [R, MAX_LOGPROBS] f32


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] f32, of the sampled token (zeros unless some row wanted logprobs)
    top_ids: jax.Array  # [S, MAX_LOGPROBS] int32 (zeros unless some row wanted logprobs)
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] f32


def apply_penalties(logits, t: SamplingTensors):
    """Repetition (prompt + output, HF-style), frequency and presence (output only) penalties."""
    num_seqs, vocab = logits.shape
    rows = jnp.arange(num_seqs)[:, None]
    ids = jnp.where(t.history >= 0, t.history, vocab)  # vocab = a dropped column
    is_output = jnp.arange(t.history.shape[1])[None, :] >= t.prompt_lens[:, None]
    counts = jnp.zeros((num_seqs, vocab + 1), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32))
    seen = jnp.zeros((num_seqs, vocab + 1), jnp.bool_).at[rows, ids].set(True)
    counts, seen = counts[:, :vocab], seen[:, :vocab]
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency_penalty[:, None] * counts - t.presence_penalty[:, None] * (counts > 0)


def apply_token_bitmask(logits, token_bitmask):
    """Bans (-inf) what each row's packed bitmask [S, ceil(vocab / 32)] int32 leaves out: bit j of word w
    allows token 32 w + j (llguidance's layout); -1 words allow everything."""
    num_seqs, vocab = logits.shape
    bits = (token_bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, words, 32]
    allowed = bits.reshape(num_seqs, -1)[:, :vocab].astype(jnp.bool_)
    return jnp.where(allowed, logits, -jnp.inf)


def choose(branches: bool, pred, on_true, on_false, *operands):
    """`lax.cond(pred, on_true, on_false, *operands)` where `branches`; otherwise both sides run and
    `pred` selects between their results, so no predicate has to reach the host."""
    if branches:
        return jax.lax.cond(pred, on_true, on_false, *operands)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true(*operands), on_false(*operands))


def _bisect(lo, hi, holds, unroll: bool = False):
    """Largest x in [lo, hi] (per row, to float precision) with holds(x), given holds(lo) and monotone.
    unroll: the steps are written out instead of looped (no loop for a GPU to test on the host)."""

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECT_STEPS, step, (lo, hi), unroll=unroll)
    return jnp.where(holds(hi), hi, lo)  # `hi` itself may be a logit value that qualifies


def truncation_threshold(scaled, probs, top_k, top_p, unroll: bool = False):
    """Per row, the logit threshold of top-k, then top-p within the renormalized top-k set.

    Bisections over logit values instead of a full-vocabulary sort, which XLA:CPU runs far slower (and
    slower than this: `cpu_truncation_threshold`). Rows with top_k = 0 and top_p = 1 get -inf (keep all);
    rows with top_p = 1 keep their whole top-k set.
    """
    finite = jnp.isfinite(scaled)
    lo = jnp.min(jnp.where(finite, scaled, jnp.inf), axis=-1, keepdims=True)  # keeps every finite logit
    hi = jnp.max(scaled, axis=-1, keepdims=True)  # the top token is always kept
    k = jnp.where(top_k > 0, top_k, scaled.shape[-1])[:, None]
    top_k_threshold = _bisect(lo, hi, lambda x: (scaled >= x).sum(-1, keepdims=True) >= k, unroll)
    top_k_mass = (probs * (scaled >= top_k_threshold)).sum(-1, keepdims=True)
    target = top_p[:, None] * top_k_mass * (1 - 1e-6)
    top_p_threshold = _bisect(lo, hi, lambda x: (probs * (scaled >= x)).sum(-1, keepdims=True) >= target,
                              unroll)
    threshold = jnp.maximum(top_k_threshold, jnp.where(top_p[:, None] < 1.0, top_p_threshold, -jnp.inf))
    off = ((top_k <= 0) & (top_p >= 1.0))[:, None]
    return jnp.where(off, -jnp.inf, threshold)


def cpu_truncation_threshold(scaled, probs, top_k, top_p):
    """`truncation_threshold` by the C++ kernel (cpu_kernels/truncation.cc): a selection per row instead of
    64 passes over [S, vocab]; the same kept tokens but where a running mass lands within float32's rounding
    of its target. XLA:CPU only, with the kernels built (cpu_ffi.kernel_error() is None)."""
    out = jax.ShapeDtypeStruct((scaled.shape[0], 1), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_truncation_threshold", out)(
        scaled.astype(jnp.float32), probs.astype(jnp.float32), top_k.astype(jnp.int32), top_p.astype(jnp.float32))


_VOCAB_CHUNK = 128


def _chunks(x, fill):
    """x [S, n] as [S, ceil(n / 128), 128], the last chunk filled out with `fill`."""
    pad = -x.shape[1] % _VOCAB_CHUNK
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
    return x.reshape(x.shape[0], -1, _VOCAB_CHUNK)


def argmax(x, cpu_kernel: bool = False):
    """First index of the row maximum of x [S, vocab].

    XLA:CPU's argmax, and a masked min of the indices over the whole row, are several times slower than
    a max; so the row is cut into chunks of 128: a max per chunk, then the first index in the first chunk
    that holds the row's maximum. A row with a NaN gives an index inside the vocabulary. cpu_kernel (XLA:CPU
    with the C++ kernels built): the same index by `cpu_argmax`, one pass over the row (a row with a NaN:
    the last index).
    """
    if cpu_kernel:
        return cpu_argmax(x)
    vocab = x.shape[1]
    chunks = _chunks(x, -jnp.inf)
    chunk_max = chunks.max(axis=-1)  # [S, num_chunks]
    row_max = chunk_max.max(axis=-1, keepdims=True)
    num_chunks = chunk_max.shape[1]
    first = jnp.min(jnp.where(chunk_max == row_max, jnp.arange(num_chunks), num_chunks - 1), axis=-1)
    chunk = jnp.take_along_axis(chunks, first[:, None, None], axis=1)[:, 0]  # [S, 128]
    within = jnp.min(jnp.where(chunk == row_max, jnp.arange(_VOCAB_CHUNK), _VOCAB_CHUNK - 1), axis=-1)
    return jnp.minimum(first * _VOCAB_CHUNK + within, vocab - 1).astype(jnp.int32)


def cpu_argmax(x):
    """`argmax` by the C++ kernel (cpu_kernels/truncation.cc, ArgmaxRows): the same index, rows spread over
    XLA's threads, each read once (XLA:CPU reduced the whole [S, vocab] twice: about 0.97 ms of a batch-32
    decode step of the default model on a 2-core Xeon). XLA:CPU only, with the kernels built."""
    out = jax.ShapeDtypeStruct((x.shape[0],), jnp.int32)
    return jax.ffi.ffi_call("jaxserve_argmax_rows", out)(x.astype(jnp.float32))


def inverse_cdf_sample(weights, u):
    """For weights [S, vocab] (>= 0, some > 0 in each row) and u [S] in [0, 1): the index i with
    cumsum[i - 1] <= u * total < cumsum[i], a draw from weights / total.

    Chunked like argmax: the running sum of chunk sums picks the chunk, the running sum inside it the
    index. Rounding can put u * total just past either sum; the index is then clamped to the chunk's
    (and the chunk to the row's) first or last nonzero weight, so a zero weight is never drawn.
    """
    chunks = _chunks(weights, 0.0)
    chunk_sums = chunks.sum(axis=-1)  # [S, num_chunks]
    chunk_ends = jnp.cumsum(chunk_sums, axis=-1)
    target = u[:, None] * chunk_ends[:, -1:]
    first_chunk, last_chunk = _nonzero_span(chunk_sums)
    chunk = jnp.clip((chunk_ends <= target).sum(axis=-1), first_chunk, last_chunk)
    inside = jnp.take_along_axis(chunks, chunk[:, None, None], axis=1)[:, 0]  # [S, 128]
    start = jnp.take_along_axis(chunk_ends - chunk_sums, chunk[:, None], axis=1)
    first, last = _nonzero_span(inside)
    within = jnp.clip((start + jnp.cumsum(inside, axis=-1) <= target).sum(axis=-1), first, last)
    return (chunk * _VOCAB_CHUNK + within).astype(jnp.int32)


def _nonzero_span(x):
    """The first and last index of each row of x [S, n] that is > 0."""
    positive = x > 0
    return jnp.argmax(positive, axis=-1), x.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)


def _sample_random(processed, t: SamplingTensors, branches: bool = True, cpu_kernel: bool = False):
    """Temperature, min-p, top-k and top-p, then one uniform draw per row, inverted through the kept
    probabilities' running sum: [S] token ids. (A Gumbel-max draw needs a random number per vocabulary
    entry, which costs far more on a CPU.) cpu_kernel: top-k and top-p by the C++ kernel."""
    num_seqs = processed.shape[0]
    scaled = processed / jnp.maximum(t.temperature, 1e-6)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = probs >= t.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    probs = jnp.where(keep, probs, 0.0)  # top-p counts mass after min-p, as vLLM does
    truncate = cpu_truncation_threshold if cpu_kernel else (
        lambda s, p, k, tp: truncation_threshold(s, p, k, tp, unroll=not branches))
    threshold = choose(
        branches, jnp.any((t.top_k > 0) | (t.top_p < 1.0)), truncate,
        lambda s, p, k, tp: jnp.full((num_seqs, 1), -jnp.inf),
        scaled, probs, t.top_k, t.top_p,
    )
    probs = jnp.where(scaled >= threshold, probs, 0.0)

    def uniform(seed, position):
        return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), position), (), jnp.float32)

    return inverse_cdf_sample(probs, jax.vmap(uniform)(t.seeds, t.positions))


def no_logprobs(num_seqs: int, dtype):
    """SamplerOutput's logprob fields for a step where no row asked for them: zeros."""
    return (jnp.zeros((num_seqs,), dtype), jnp.zeros((num_seqs, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((num_seqs, MAX_LOGPROBS), dtype))


def sample(logits, t: SamplingTensors, branches: bool = True, cpu_kernel: bool = False) -> SamplerOutput:
    """Samples one token per row from logits [S, vocab] f32.

    A batch of greedy rows with no penalties, no logit bias and no grammar (the common serving case) takes
    the argmax of the logits and nothing else; otherwise the penalties, the bias, the grammar's bitmask
    (`t.token_bitmask`) and the random draw each run
    only when a row asks for them, and so do logprobs, which are of the raw logits, as vLLM reports them
    (with a grammar's banned tokens at -inf, as vLLM applies the bitmask before its sampler).
    branches=False (a GPU): every part runs and selects replace the branches (`choose`); same tokens.
    cpu_kernel (XLA:CPU with the C++ kernels): top-k and top-p thresholds by `cpu_truncation_threshold`, the
    greedy token by `cpu_argmax`.
    """
    num_seqs = logits.shape[0]
    uses_grammar = jnp.any(t.token_bitmask != -1)
    uses_penalties = jnp.any((t.presence_penalty != 0) | (t.frequency_penalty != 0) | (t.repetition_penalty != 1))
    uses_bias = jnp.any(t.bias_values != 0)  # logit_bias, and min_tokens' suppressed stop tokens
    uses_random = jnp.any(t.temperature > 0)

    def processed_tokens():
        rows = jnp.arange(num_seqs)[:, None]
        processed = choose(branches, uses_penalties, apply_penalties, lambda logits, t: logits, logits, t)
        processed = choose(
            branches, uses_bias, lambda p: p.at[rows, t.bias_ids].add(t.bias_values, mode="drop"), lambda p: p,
            processed,
        )
        processed = choose(branches, uses_grammar, apply_token_bitmask, lambda p, m: p, processed,
                           t.token_bitmask)
        greedy = argmax(processed, cpu_kernel)
        return choose(
            branches, uses_random,
            lambda: jnp.where(t.temperature > 0, _sample_random(processed, t, branches, cpu_kernel), greedy),
            lambda: greedy,
        )

    # The branches return token ids only: a branch that handed the logits through unchanged would copy
    # them, [S, vocab] float32, in every step that takes it.
    tokens = choose(branches, uses_penalties | uses_bias | uses_random | uses_grammar, processed_tokens,
                    lambda: argmax(logits, cpu_kernel)).astype(jnp.int32)

    def logprobs():
        masked = apply_token_bitmask(logits, t.token_bitmask)
        log_normalizer = jax.nn.logsumexp(masked, axis=-1)
        token_logprobs = jnp.take_along_axis(masked, tokens[:, None], axis=-1)[:, 0] - log_normalizer
        top_logprobs, top_ids = jax.lax.top_k(masked - log_normalizer[:, None], MAX_LOGPROBS)
        return token_logprobs, top_ids.astype(jnp.int32), top_logprobs

    token_logprobs, top_ids, top_logprobs = choose(branches, jnp.any(t.want_logprobs), logprobs,
                                                   lambda: no_logprobs(num_seqs, logits.dtype))
    return SamplerOutput(tokens, token_logprobs, top_ids, top_logprobs)


def target_logprobs(logits, targets) -> PromptLogprobs:
    """The log-softmax of logits [R, vocab] f32 at targets [R] (their rank counted as vLLM does: the
    tokens whose logprob is >= the target's), and each row's top MAX_LOGPROBS."""
    logprobs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    target = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)  # [R, 1]
    ranks = (logprobs >= target).sum(axis=-1).astype(jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return PromptLogprobs(target[:, 0], ranks, top_ids.astype(jnp.int32), top_logprobs)
