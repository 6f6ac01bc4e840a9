"""Sampling: the on-device sampler against NumPy references, and the sampling parameters end to end.

Direct tests call `jaxserve.ops.sampling.sample` on hand-built SamplingTensors, padded exactly as the
model runner pads them (bias and history widths included), with one logit vector replicated over
many rows that differ only in seed and position; frequencies are checked with a chi-square test on
fixed seeds, so they are deterministic. Engine tests share one tiny random llama (byte tokenizer,
one token per byte) compiled once for the module, with compilation forbidden after warm-up.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import scipy.stats
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.runner.resolve import resolve_config
from jaxserve.runner.step_inputs import StepInputBuilder
from jaxserve.ops import cpu_ffi
from jaxserve.ops.sampling import (SamplingTensors, apply_penalties, argmax, cpu_truncation_threshold,
                                   inverse_cdf_sample, sample, truncation_threshold)

VOCAB = 32  # direct tests; >= MAX_LOGPROBS, since the logprobs branch is traced for every call
HISTORY_LEN = 128  # the model runner sizes `history` as max_model_len
NUM_DRAWS = 20_000
CHI2_P = 1e-4  # fixed seeds make this deterministic; a real distribution bug gives p ~ 0

# Distinct, non-tied probabilities 0.8**i, shuffled so the most likely token is not id 0.
_RANK_TO_ID = np.random.default_rng(0).permutation(VOCAB)
PROBS = np.empty(VOCAB)
PROBS[_RANK_TO_ID] = 0.8 ** np.arange(VOCAB)
PROBS /= PROBS.sum()
LOGITS = np.log(PROBS).astype(np.float32)
TOP = _RANK_TO_ID  # TOP[r] is the token of rank r

_sample = jax.jit(sample)
_sample_cpu_kernel = jax.jit(functools.partial(sample, cpu_kernel=True))
_apply_penalties = jax.jit(apply_penalties)


def _tensors(num_rows: int, vocab: int = VOCAB, bias: dict[int, float] | None = None, **fields) -> SamplingTensors:
    """`num_rows` rows padded as the engine pads them (StepInputBuilder.empty_sampling), seeds 0.. and
    random positions.

    `fields` override SamplingTensors entries (a scalar or one row, broadcast to every row); `bias`
    fills the same {token: bias} into every row's bias slots.
    """
    builder = StepInputBuilder(SimpleNamespace(vocab_size=vocab, eos_token_ids=(0,)),
                               SimpleNamespace(max_model_len=HISTORY_LEN))
    t = builder.empty_sampling(num_rows)
    t.temperature[:] = 1.0
    t.seeds[:] = np.arange(num_rows, dtype=np.uint32)
    t.positions[:] = np.random.default_rng(1).integers(0, HISTORY_LEN, num_rows)
    for token, value in (bias or {}).items():
        slot = int(np.argmax(t.bias_ids[0] == vocab))
        t.bias_ids[:, slot], t.bias_values[:, slot] = token, value
    for name, value in fields.items():
        old = getattr(t, name)
        t = t._replace(**{name: np.broadcast_to(np.asarray(value, old.dtype), old.shape).copy()})
    return t


def _draw(logits: np.ndarray, num_rows: int = NUM_DRAWS, cpu_kernel: bool = False, **fields) -> np.ndarray:
    """Sampled token ids [num_rows] for `logits` [vocab] replicated over every row (cpu_kernel: top-k and top-p
    thresholds by the C++ kernel)."""
    t = _tensors(num_rows, vocab=len(logits), **fields)
    return np.asarray((_sample_cpu_kernel if cpu_kernel else _sample)(np.tile(logits, (num_rows, 1)), t).token_ids)


def _expected_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, bias=None, order="vllm"):
    """The distribution a sampler must draw from, in float64.

    order="vllm": bias, temperature, min_p on the full distribution, top_k, top_p over what is left
    (renormalized). order="hf": transformers' warper order (top_k, top_p, then min_p).
    """
    z = np.asarray(logits, np.float64).copy()
    for token, value in (bias or {}).items():
        z[token] += value
    z /= temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    ranked = np.argsort(-p, kind="stable")
    keep = np.ones(len(p), bool)

    def apply_min_p():
        keep[p < min_p * p[keep].max()] = False

    def apply_top_k():
        if top_k > 0:
            keep[ranked[top_k:]] = False

    def apply_top_p():
        if top_p < 1:
            q = np.where(keep, p, 0.0)[ranked]
            q /= q.sum()
            mass_above = np.cumsum(q) - q
            keep[ranked[mass_above >= top_p]] = False

    steps = [apply_min_p, apply_top_k, apply_top_p] if order == "vllm" else [apply_top_k, apply_top_p, apply_min_p]
    for step in steps:
        step()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _assert_distribution(samples: np.ndarray, expected: np.ndarray) -> None:
    """No token outside the support; chi-square goodness of fit (bins with expected count < 5 pooled)."""
    counts = np.bincount(samples, minlength=len(expected))
    outside = np.nonzero((expected == 0) & (counts > 0))[0]
    assert outside.size == 0, f"tokens {outside.tolist()} are outside the kept set but were sampled {counts[outside]}"
    e = expected * len(samples)
    big, small = e >= 5, (e < 5) & (expected > 0)
    observed = np.append(counts[big], counts[small].sum())
    wanted = np.append(e[big], e[small].sum())
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    if len(wanted) < 2:
        return
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    critical = float(scipy.stats.chi2.isf(CHI2_P, len(wanted) - 1))
    assert chi2 < critical, (
        f"chi2={chi2:.1f} >= {critical:.1f} (df={len(wanted) - 1}); by rank, observed "
        f"{counts[TOP][:12].tolist()} vs expected {np.round(e[TOP][:12]).astype(int).tolist()}"
    )


# ------------------------------------------------------------------------------------------------
# The sampler on its own


@pytest.mark.parametrize("fields", [
    dict(temperature=0.0),
    dict(temperature=0.0, top_k=5, top_p=0.5, min_p=0.5, seeds=7),
    dict(top_k=1),
    dict(top_p=1e-6),
    dict(min_p=1.0),
    dict(temperature=1.5, top_k=1, min_p=0.01),
], ids=["temperature_0", "temperature_0_ignores_truncation", "top_k_1", "top_p_tiny", "min_p_1", "top_k_1_hot"])
def test_degenerate_settings_are_greedy(fields):
    """temperature=0, top_k=1, a tiny top_p and min_p=1 all pick the argmax, whatever the seed and position."""
    tokens = _draw(LOGITS, num_rows=2048, **fields)
    assert np.all(tokens == TOP[0]), np.bincount(tokens, minlength=VOCAB)[TOP][:8]


_DISTRIBUTIONS = [
    ("t1", dict(temperature=1.0)),
    ("t0.5", dict(temperature=0.5)),
    ("t1.5", dict(temperature=1.5)),
    ("top_k", dict(top_k=5)),
    ("top_p", dict(top_p=0.55)),
    ("t0.7_top_k", dict(temperature=0.7, top_k=3)),
    ("t1.5_top_p", dict(temperature=1.5, top_p=0.8)),
    ("min_p", dict(min_p=0.3)),
    ("t0.5_min_p", dict(temperature=0.5, min_p=0.1)),
    ("top_k_top_p", dict(top_k=6, top_p=0.5)),
    ("min_p_binds_over_top_k", dict(min_p=0.3, top_k=10)),
    ("top_k_binds_over_min_p", dict(min_p=0.1, top_k=8)),
    ("t1.5_min_p_top_p", dict(temperature=1.5, min_p=0.1, top_p=0.42)),
    ("t0.8_all", dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02)),
    ("bias", dict(bias={int(TOP[5]): 3.0, int(TOP[0]): -1.0, int(TOP[20]): float("-inf")})),
    ("bias_top_k", dict(temperature=0.9, top_k=4, bias={int(TOP[9]): 2.5})),
    ("neg_inf_top_k", dict(top_k=4, bias={int(TOP[-1]): float("-inf")})),
    ("neg_inf_top_k_top_p", dict(top_k=4, top_p=0.5, bias={int(TOP[-1]): float("-inf")})),
]


@pytest.mark.parametrize("fields", [
    pytest.param(fields, id=name) for name, fields in _DISTRIBUTIONS
])
@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["xla", "cpu_kernel"])
def test_sampling_frequencies_match_the_truncated_distribution(fields, cpu_kernel):
    """Over 20k seeded draws, frequencies fit the temperature-scaled, truncated, renormalized
    distribution (chi-square, p > 1e-4), and no token outside the kept set is ever drawn: with XLA's
    bisections, and with the C++ kernel's thresholds (`cpu_truncation_threshold`)."""
    if cpu_kernel:
        _need_cpu_kernels()
    reference = {k: v for k, v in fields.items() if k in ("temperature", "top_k", "top_p", "min_p", "bias")}
    expected = _expected_probs(LOGITS, **reference)
    # The test data avoids the cases where vLLM's and transformers' orders of truncation disagree.
    np.testing.assert_allclose(expected, _expected_probs(LOGITS, **reference, order="hf"))
    _assert_distribution(_draw(LOGITS, cpu_kernel=cpu_kernel, **fields), expected)


def _need_cpu_kernels():
    if jax.default_backend() != "cpu" or cpu_ffi.kernel_error() is not None:
        pytest.skip(f"the C++ CPU kernels do not run here: {cpu_ffi.kernel_error() or jax.default_backend()}")


def _threshold_rows(rng, vocab: int, num_rows: int):
    """Scaled logits, their min-p'd probabilities, top_k and top_p for rows of every kind the sampler meets:
    sharp and flat distributions, top-k alone, top-p alone, both, neither, banned (-inf) tokens, ties, a
    top_k past the finite tokens, and a row of one value."""
    temperature = rng.choice([0.1, 0.7, 2.0], num_rows)[:, None]
    scaled = (rng.normal(0, 3, (num_rows, vocab)) / temperature).astype(np.float32)
    scaled[1::4, : vocab // 3] = -np.inf  # a grammar's or a bias's banned tokens
    scaled[2::4] = np.round(scaled[2::4])  # many ties
    scaled[3] = 1.5  # one value everywhere
    probs = np.asarray(jax.nn.softmax(scaled, axis=-1))
    probs = np.where(probs >= 0.001 * probs.max(-1, keepdims=True), probs, 0).astype(np.float32) if vocab < 64 \
        else probs  # min-p on the small vocabulary
    top_k = rng.choice([0, 0, 1, 5, 50, vocab - 1, vocab + 7], num_rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.9, 0.5, 0.1], num_rows).astype(np.float32)
    top_k[0], top_p[0] = 0, 1.0  # off
    return scaled, probs, top_k, top_p


@pytest.mark.parametrize("vocab", [48, 49152])
def test_the_cpu_threshold_kernel_keeps_the_tokens_the_bisections_keep(vocab):
    """The C++ top-k / top-p threshold (a histogram of the row, then its one bucket sorted) keeps exactly the
    tokens that XLA's two bisections keep, row by row, on every kind of row (`_threshold_rows`), and keeps
    them all where a row has no top-k or top-p."""
    _need_cpu_kernels()
    rng = np.random.default_rng(11)
    scaled, probs, top_k, top_p = _threshold_rows(rng, vocab, 64)
    want = np.asarray(jax.jit(truncation_threshold)(scaled, probs, top_k, top_p))
    got = np.asarray(jax.jit(cpu_truncation_threshold)(scaled, probs, top_k, top_p))
    assert got.shape == (64, 1)
    kept_want, kept_got = scaled >= want, scaled >= got
    for row in range(64):
        np.testing.assert_array_equal(kept_got[row], kept_want[row],
                                      err_msg=f"row {row}: top_k {top_k[row]}, top_p {top_p[row]}")
    assert got[0, 0] == -np.inf
    assert kept_got[3].all()  # one value: ties keep every token
    sizes = kept_got.sum(-1)
    assert sizes.min() == 1 and sizes.max() > vocab // 2  # the rows span sharp and flat cuts


def test_the_cpu_threshold_kernel_gives_the_reference_samplers_tokens():
    """`sample` with the C++ thresholds draws exactly the tokens it draws with XLA's bisections, on a batch of
    the default model's vocabulary mixing greedy rows, top-k, top-p, min-p, both and neither."""
    _need_cpu_kernels()
    rng = np.random.default_rng(12)
    n, vocab = 32, 49152
    logits = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    t = _tensors(n, vocab=vocab, temperature=np.where(np.arange(n) % 5 == 0, 0.0, rng.choice([0.2, 0.7, 1.5], n)),
                 top_k=rng.choice([0, 1, 20, 1000], n), top_p=rng.choice([1.0, 0.9, 0.5], n),
                 min_p=rng.choice([0.0, 0.05], n))
    want = jax.jit(sample)(logits, t).token_ids
    got = jax.jit(functools.partial(sample, cpu_kernel=True))(logits, t).token_ids
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(set(np.asarray(got).tolist())) > n // 2  # not all one token


def test_row_results_do_not_depend_on_the_batch():
    """A row's token depends only on its logits, settings, seed and position: permuting the rows of a
    mixed batch permutes the tokens (the engine's per-request reproducibility rests on this)."""
    rng = np.random.default_rng(2)
    n = 256
    logits = rng.normal(0, 2, (n, VOCAB)).astype(np.float32)
    t = _tensors(n, temperature=rng.choice([0.0, 0.5, 1.0, 1.5], n), top_k=rng.choice([0, 1, 3, 10], n),
                 top_p=rng.choice([1.0, 0.9, 0.5], n), min_p=rng.choice([0.0, 0.05, 0.3], n),
                 seeds=rng.integers(0, 2**32, n), want_logprobs=rng.random(n) < 0.5)
    out = _sample(logits, t)
    perm = rng.permutation(n)
    permuted = _sample(logits[perm], SamplingTensors(*(np.asarray(a)[perm] for a in t)))
    np.testing.assert_array_equal(np.asarray(out.token_ids)[perm], np.asarray(permuted.token_ids))
    np.testing.assert_array_equal(np.asarray(out.logprobs)[perm], np.asarray(permuted.logprobs))


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["xla", "kernel"])
@pytest.mark.parametrize("vocab", [1, 15, 127, 128, 300, 1000, 49152])
def test_chunked_argmax_is_the_first_index_of_the_maximum(vocab, cpu_kernel):
    """The sampler's greedy argmax (XLA: a max per chunk of 128, then the first index in the first chunk
    with the row max; the C++ kernel: one pass, four interleaved running maxima) against numpy's argmax:
    ties inside a chunk and across chunks, the maximum in the padded last chunk or in the kernel's tail
    past its last whole vector, rows of -inf; a row with a NaN gives an index inside the vocabulary (the
    kernel's: the last)."""
    if cpu_kernel:
        _need_cpu_kernels()
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 4, (14, vocab)).astype(np.float32)  # few distinct values: many ties
    x[1] = rng.standard_normal(vocab)
    x[2, -1] = 100.0  # the maximum at the very end (the padded chunk when vocab % 128 != 0)
    x[3] = -np.inf
    x[4, [0, vocab - 1]] = 50.0  # a tie between the first and the last index
    x[5, vocab // 2:] = 60.0  # a run of ties starting mid-row
    x[6, (vocab * 5) // 7:] = 70.0  # ties from one chain's vector into the next chains'
    x[7, vocab // 3] = x[7, vocab // 3 + 16 if vocab // 3 + 16 < vocab else vocab // 3] = 80.0  # one lane, two vectors
    greedy = jax.jit(functools.partial(argmax, cpu_kernel=cpu_kernel))
    np.testing.assert_array_equal(np.asarray(greedy(x)), np.argmax(x, axis=-1))
    x[8] = np.nan
    x[9, vocab // 2] = np.nan  # one NaN among finite values
    got = np.asarray(greedy(x))
    np.testing.assert_array_equal(got[:8], np.argmax(x[:8], axis=-1))
    if cpu_kernel:  # XLA's reductions treat a NaN as they happen to: an index inside the vocabulary
        assert got[8] == vocab - 1 and got[9] == vocab - 1, got
    assert np.all((0 <= got) & (got < vocab)), got


@pytest.mark.parametrize("vocab", [1, 127, 128, 300, 49152])
def test_inverse_cdf_draw_matches_numpy_and_never_draws_a_zero_weight(vocab):
    """The random sampler's draw (a chunked running sum, one uniform per row) against numpy's float64
    searchsorted, for u away from a boundary; and at the edges (u = 0, u just below 1, zero weights
    before, between and after the only positive ones, across a chunk boundary; u = 1, past the end) the
    drawn weight is positive."""
    rng = np.random.default_rng(vocab)
    rows = 64
    w = rng.random((rows, vocab)).astype(np.float32) * (rng.random((rows, vocab)) < 0.3)
    w[:, 0] += 0.01  # every row has mass
    w[1] = 0.0
    w[1, vocab - 1] = 1.0  # one positive weight, at the very end
    w[2] = 0.0
    w[2, [0, vocab // 2]] = [1e-30, 1.0]  # a negligible one and a dominant one
    if vocab > 130:
        w[3] = 0.0
        w[3, [127, 128]] = 0.5  # either side of a chunk boundary
    u = rng.random(rows).astype(np.float32)
    u[:8] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.0, 0.99999, 0.5, 0.0, 1e-7, 0.999]
    u[8:10] = 1.0  # outside [0, 1): as if rounding had put u * total at the end
    drawn = np.asarray(jax.jit(inverse_cdf_sample)(w, u))
    assert np.all(w[np.arange(rows), drawn] > 0), "a zero weight was drawn"
    cum = np.cumsum(w.astype(np.float64), axis=-1)
    target = u * cum[:, -1]
    expected = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cum, target)])
    gap = np.abs(cum - target[:, None]).min(axis=-1) / cum[:, -1]  # how close u lies to a boundary
    clear = gap > 1e-5
    assert clear.sum() > rows // 2
    np.testing.assert_array_equal(drawn[clear], expected[clear])


def _reference_penalties(logits, history, prompt_len, repetition, frequency, presence):
    """vLLM/HF semantics: repetition over prompt + output (positive logits divided, negative
    multiplied); frequency by count and presence by appearance in the output only."""
    tokens = [int(x) for x in history if x >= 0]
    out = np.asarray(logits, np.float64).copy()
    for token in set(tokens):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    counts = np.bincount(np.asarray(tokens[prompt_len:], np.int64), minlength=len(out))
    return out - frequency * counts - presence * (counts > 0)


def _random_penalty_batch(rng, n: int, vocab: int):
    """Random logits, histories (-1 padded, ragged) with prompt lengths, and penalty settings; a
    quarter of the rows have every penalty off but a non-empty history."""
    logits = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    history = np.full((n, HISTORY_LEN), -1, np.int32)
    prompt_lens = np.zeros(n, np.int32)
    for i in range(n):
        length = int(rng.integers(1, HISTORY_LEN + 1))
        history[i, :length] = rng.integers(0, vocab, length) if i % 2 else rng.integers(0, 12, length)  # repeats
        prompt_lens[i] = rng.integers(0, length + 1)
    repetition = rng.choice([1.0, 0.5, 1.3, 2.0], n).astype(np.float32)
    frequency = rng.uniform(-2, 2, n).astype(np.float32)
    presence = rng.uniform(-2, 2, n).astype(np.float32)
    off = np.arange(n) % 4 == 0
    repetition[off], frequency[off], presence[off] = 1.0, 0.0, 0.0
    return logits, history, prompt_lens, repetition, frequency, presence, off


def test_penalties_match_numpy_reference():
    """apply_penalties equals the NumPy reference row by row; rows with every penalty off are untouched."""
    rng = np.random.default_rng(3)
    n, vocab = 64, 48
    logits, history, prompt_lens, repetition, frequency, presence, off = _random_penalty_batch(rng, n, vocab)
    t = _tensors(n, vocab=vocab, history=history, prompt_lens=prompt_lens, repetition_penalty=repetition,
                 frequency_penalty=frequency, presence_penalty=presence)
    got = np.asarray(_apply_penalties(logits, t))
    for i in range(n):
        want = _reference_penalties(logits[i], history[i], prompt_lens[i], repetition[i], frequency[i], presence[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
    np.testing.assert_array_equal(got[off], logits[off])


def test_the_branchless_sampler_gives_exactly_the_branching_ones_tokens_and_logprobs():
    """On a GPU the sampler selects instead of branching (no predicate goes to the host); on every mix of
    greedy and random rows, top-k/top-p/min-p, penalties, bias and logprobs it returns the same tokens,
    logprobs and top ids, including batches where no row (and where every row) asks for each part."""
    rng = np.random.default_rng(7)
    n, vocab = 24, 48
    branching, branchless = jax.jit(sample), jax.jit(functools.partial(sample, branches=False))
    logits, history, prompt_lens, repetition, frequency, presence, _ = _random_penalty_batch(rng, n, vocab)
    mixes = {
        "greedy": {},
        "random": dict(temperature=rng.uniform(0.5, 1.5, n)),
        "everything": dict(temperature=np.where(np.arange(n) % 3 == 0, 0.0, rng.uniform(0.5, 1.5, n)),
                           top_k=rng.choice([0, 3, 10], n), top_p=rng.choice([1.0, 0.9, 0.5], n),
                           min_p=rng.choice([0.0, 0.05], n), history=history, prompt_lens=prompt_lens,
                           repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence,
                           want_logprobs=np.arange(n) % 2 == 0),
    }
    for name, fields in mixes.items():
        fields = {"temperature": 0.0, **fields}
        t = _tensors(n, vocab=vocab, bias={5: 3.0} if name == "everything" else None, **fields)
        want, got = branching(logits, t), branchless(logits, t)
        for field in want._fields:
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)),
                                          err_msg=f"{name}: {field}")
    lowered = jax.jit(functools.partial(sample, branches=False)).trace(logits, t)
    assert not re.search(r"stablehlo\.(while|case|if)\b", lowered.lower(lowering_platforms=("cuda",)).as_text())


def test_greedy_follows_penalties_and_logit_bias():
    """Through `sample` (penalty cond + bias scatter): greedy tokens are the argmax of the reference
    penalties plus logit_bias; rows without penalties or bias get the raw argmax."""
    rng = np.random.default_rng(4)
    n, vocab = 64, 48
    logits, history, prompt_lens, repetition, frequency, presence, off = _random_penalty_batch(rng, n, vocab)
    t = _tensors(n, vocab=vocab, temperature=0.0, history=history, prompt_lens=prompt_lens,
                 repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence)
    biases = []
    for i in range(n):
        bias = {} if i % 3 == 0 else {int(k): float(rng.uniform(-5, 5)) for k in rng.choice(vocab, 4, replace=False)}
        t.bias_ids[i, :len(bias)], t.bias_values[i, :len(bias)] = list(bias), list(bias.values())
        biases.append(bias)
    got = np.asarray(_sample(logits, t).token_ids)
    for i in range(n):
        want = _reference_penalties(logits[i], history[i], prompt_lens[i], repetition[i], frequency[i], presence[i])
        for token, value in biases[i].items():
            want[token] += value
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] > 1e-4:  # skip numerical near-ties
            assert got[i] == np.argmax(want), (i, got[i], np.argmax(want))
        if off[i] and not biases[i]:
            assert got[i] == np.argmax(logits[i])


# ------------------------------------------------------------------------------------------------
# Through the engine, on a tiny random llama

# float32 by name: test_logprobs_match_transformers compares with Hugging Face's float32 logprobs.
ENGINE = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, block_size=8, num_kv_pages=300,
              dtype="float32", forbid_compilation_after_warmup=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **ENGINE)


def _gen(llm, prompts, params):
    """Generates for token-id prompts; returns the CompletionOutputs of each prompt."""
    prompts = [{"prompt_token_ids": list(p)} for p in prompts]
    return [r.outputs for r in llm.generate(prompts, params, use_tqdm=False)]


def _ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _random_prompt(rng: random.Random, lo: int = 1, hi: int = 90) -> list[int]:
    return [rng.randrange(256) for _ in range(rng.randint(lo, hi))]


def _mixed_params(rng: random.Random, max_tokens: int | None = None) -> SamplingParams:
    """Random settings covering every sampling parameter."""
    max_tokens = max_tokens or rng.randint(1, 24)
    return SamplingParams(
        n=rng.choice([1, 1, 1, 2]),
        temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
        top_k=rng.choice([0, -1, 1, 5, 50]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05, 0.2]),
        presence_penalty=rng.choice([0.0, 0.0, -1.0, 1.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.5]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        seed=rng.choice([None, rng.randrange(2**32)]),
        max_tokens=max_tokens,
        min_tokens=rng.choice([0, 0, min(3, max_tokens)]),
        stop=rng.choice([None, "ab", ["x", "\n\n"]]),
        stop_token_ids=rng.choice([[], [rng.randrange(256)]]),
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, 0, 3, 20]),
        logit_bias=rng.choice([None, {rng.randrange(320): rng.uniform(-5, 5) for _ in range(rng.randint(1, 6))}]),
        include_stop_str_in_output=rng.random() < 0.3,
    )


def test_the_engine_on_a_cpu_takes_its_thresholds_from_the_kernel(llm):
    """Where the C++ kernels run, every step executable calls the threshold kernel (inside the sampler's
    branch for rows with top-k or top-p) and the greedy-token kernel; a step compiled for a GPU keeps XLA's
    bisections and chunked argmax."""
    _need_cpu_kernels()
    runner = llm.engine.runner
    assert runner.resolved.sampler_kernel
    for bucket in runner.decode_buckets:
        assert "jaxserve_truncation_threshold" in runner.compiled_text("decode", bucket), bucket
        assert "jaxserve_argmax_rows" in runner.compiled_text("decode", bucket), bucket
    for_gpu = resolve_config(runner.resolved.requested, runner.model_cfg, platform="gpu")
    assert not for_gpu.sampler_kernel and not for_gpu.sampler_branches


def test_seeded_requests_reproduce_alone_and_in_mixed_batches(llm):
    """A seeded request samples the same tokens alone or among 15 requests of other settings (any
    order, chunked prefills, decode buckets); a different seed samples different tokens."""
    rng = random.Random(5)
    seeded = [
        (list(range(40, 60)), SamplingParams(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)),
        (_random_prompt(rng, 30, 70), SamplingParams(
            temperature=1.2, top_k=40, top_p=0.95, min_p=0.01, presence_penalty=0.5, frequency_penalty=0.3,
            repetition_penalty=1.2, logit_bias={65: 2.0, 66: -3.0}, logprobs=2, seed=77, max_tokens=16,
            ignore_eos=True)),
    ]
    alone = [_gen(llm, [p], params)[0][0].token_ids for p, params in seeded]
    others = [(_random_prompt(rng), dataclasses.replace(_mixed_params(rng, rng.randint(8, 20)), n=1))
              for _ in range(14)]
    for order in (seeded + others, others + seeded[::-1]):
        outs = _gen(llm, [p for p, _ in order], [params for _, params in order])
        got = {id(params): o[0].token_ids for (_, params), o in zip(order, outs)}
        assert [got[id(params)] for _, params in seeded] == alone
    reseeded = SamplingParams(temperature=0.8, seed=1235, max_tokens=16, ignore_eos=True)
    assert _gen(llm, [seeded[0][0]], reseeded)[0][0].token_ids != alone[0]
    unseeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    assert _gen(llm, [seeded[0][0]], unseeded)[0][0].token_ids != _gen(llm, [seeded[0][0]], unseeded)[0][0].token_ids


def _hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logits(hf, prompt: list[int], output: list[int]) -> np.ndarray:
    """HF logits [len(output), vocab] that predicted each output token (teacher-forced on `output`)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].double().numpy()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(output)]


def test_logprobs_match_transformers(llm, model_dir):
    """Greedy tokens' logprobs (and their top-5 alternatives) are HF's log-softmax of the same model's
    raw logits within 1e-3; the sampled token comes first in each entry; top ids match in order."""
    hf = _hf_model(model_dir)
    rng = random.Random(6)
    prompts = [_random_prompt(rng, 5, 60) for _ in range(3)]
    outs = _gen(llm, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5))
    for prompt, (out,) in zip(prompts, outs):
        assert len(out.logprobs) == len(out.token_ids) == 10
        reference = torch.log_softmax(torch.from_numpy(_hf_logits(hf, prompt, out.token_ids)), -1).numpy()
        for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            want = reference[step]
            assert next(iter(entry)) == token
            assert token == int(np.argmax(want)) or want.max() - want[token] < 1e-3
            np.testing.assert_allclose(entry[token], want[token], atol=1e-3)
            top = np.argsort(-want)[:5]
            assert len(entry) == 5  # the greedy token is among the top 5
            got_ids = sorted(entry, key=entry.get, reverse=True)
            gaps = np.diff(-want[top])
            if np.all(gaps > 1e-3):
                assert got_ids == top.tolist()
            else:
                assert set(got_ids) == set(top.tolist())
            np.testing.assert_allclose([entry[t] for t in top], want[top], atol=1e-3)


def test_penalized_greedy_matches_transformers_with_reference_penalties(llm, model_dir):
    """End to end, the engine penalizes with the right history: each greedy token under repetition,
    frequency and presence penalties is the argmax of HF logits penalized by the NumPy reference over
    prompt + the tokens generated so far."""
    hf = _hf_model(model_dir)
    rng = random.Random(7)
    cases = [(1.5, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 1.2), (1.3, 0.4, 0.3), (0.7, -0.5, -0.5)]
    prompts = [_random_prompt(rng, 5, 40) for _ in cases]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=r,
                             frequency_penalty=f, presence_penalty=p) for r, f, p in cases]
    outs = _gen(llm, prompts, params)
    plain = _gen(llm, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert any(o[0].token_ids != q[0].token_ids for o, q in zip(outs, plain)), "penalties changed nothing"
    for prompt, (rep, freq, pres), (out,) in zip(prompts, cases, outs):
        logits = _hf_logits(hf, prompt, out.token_ids)
        for step, token in enumerate(out.token_ids):
            history = prompt + out.token_ids[:step]
            want = _reference_penalties(logits[step], history, len(prompt), rep, freq, pres)
            assert want.max() - want[token] < 1e-3, (rep, freq, pres, step, token, int(np.argmax(want)))


def test_logit_bias_forces_tokens(llm):
    """A large logit_bias makes its token the greedy choice at every step, even a sampled one."""
    target = _ids(llm, "q")[0]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=6, ignore_eos=True,
                                logit_bias={target: 100.0})
        assert _gen(llm, [[1, 2, 3]], params)[0][0].token_ids == [target] * 6


def _letters_run(llm, prompt, **kwargs):
    """Sampled output restricted to lowercase ASCII by logit_bias: varied text, one token per char."""
    letters = {t: 40.0 for t in _ids(llm, "abcdefghijklmnopqrstuvwxyz")}
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True, logit_bias=letters, **kwargs)
    return _gen(llm, [prompt], params)[0][0]


def test_stop_strings_spanning_tokens_are_found_and_removed(llm):
    """A multi-character stop string (several byte tokens) ends generation with finish_reason 'stop'
    and stop_reason the string; the text ends right before it, or right after it with
    include_stop_str_in_output; of several stop strings the earliest match wins."""
    prompt = _ids(llm, "Once upon a time")
    full = _letters_run(llm, prompt)
    text = full.text
    assert len(text) == 40 and text.isalpha() and text.islower(), text
    start = next(i for i in range(8, 30) if text.find(text[i:i + 3]) == i)
    stop = text[start:start + 3]
    later = next(text[i:i + 4] for i in range(start + 6, 36) if text.find(text[i:i + 4]) == i)

    out = _letters_run(llm, prompt, stop=[later, stop])
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:start], "stop", stop)
    assert out.token_ids == full.token_ids[:start + len(stop)]
    kept = _letters_run(llm, prompt, stop=stop, include_stop_str_in_output=True)
    assert (kept.text, kept.finish_reason, kept.stop_reason) == (text[:start + len(stop)], "stop", stop)
    none = _letters_run(llm, prompt, stop="0123")
    assert (none.text, none.finish_reason, none.stop_reason) == (text, "length", None)


def test_min_tokens_suppresses_stop_ids_and_eos(llm):
    """Before min_tokens outputs exist, EOS and stop_token_ids cannot be sampled, even when a logit
    bias forces them; at min_tokens the forced id is sampled and stops the request."""
    forced = _ids(llm, "q")[0]
    eos = llm.engine.model_cfg.eos_token_ids[0]
    prompt = _ids(llm, "hello")
    base = dict(temperature=0.0, max_tokens=10)
    cases = [
        (dict(logit_bias={forced: 100.0}, stop_token_ids=[forced]), forced),
        (dict(logit_bias={eos: 100.0}), eos),
    ]
    for extra, stop_id in cases:
        (out,), = _gen(llm, [prompt], SamplingParams(**base, **extra))
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([stop_id], "stop", stop_id)
        (out,), = _gen(llm, [prompt], SamplingParams(**base, **extra, min_tokens=3))
        assert stop_id not in out.token_ids[:3]
        assert len(out.token_ids) == 4 and out.token_ids[3] == stop_id
        assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # sampled: a likely stop id never shows up in the first min_tokens tokens
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, min_tokens=12, logit_bias={forced: 4.0},
                            stop_token_ids=[forced])
    (out,), = _gen(llm, [prompt], params)
    assert len(out.token_ids) == 12 and forced not in out.token_ids and eos not in out.token_ids


def test_random_mixed_batch_compiles_nothing_after_warmup(llm):
    """Requests mixing every sampling parameter (greedy/random, truncation, penalties, biases, stops,
    min_tokens, logprobs, n) with ragged prompts run on the warm-up executables only, and their
    outputs are well-formed."""
    rng = random.Random(8)
    prompts = [_random_prompt(rng) for _ in range(24)]
    params = [_mixed_params(rng) for _ in prompts]
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.get_stats()["compilations_since_warmup"] == 0
    assert not llm.engine.has_unfinished
    for p, result in zip(params, results):
        assert len(result.outputs) == p.n
        for out in result.outputs:
            assert 1 <= len(out.token_ids) <= p.max_tokens and out.finish_reason in ("stop", "length")
            assert all(0 <= t < 320 for t in out.token_ids)
            if out.finish_reason == "stop" and isinstance(out.stop_reason, int):
                assert len(out.token_ids) >= p.min_tokens and out.token_ids[-1] == out.stop_reason
            if p.logprobs is None:
                assert out.logprobs is None
            else:
                assert len(out.logprobs) == len(out.token_ids)
                for token, entry in zip(out.token_ids, out.logprobs):
                    assert next(iter(entry)) == token and len(entry) in (p.logprobs, p.logprobs + 1)
                    assert all(v <= 0 for v in entry.values())


def test_n_samples_are_distinct_and_share_prompt_pages(llm):
    """n > 1 gives n distinct samples (reproducible with a seed) whose prompt is computed once: the
    children take the first sample's full prompt pages from the prefix cache (ref count n)."""
    rng = random.Random(9)
    prompt = _random_prompt(rng, 40, 40)  # 5 full pages of 8
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, ignore_eos=True, seed=42)
    before = llm.get_stats()
    (outs,) = _gen(llm, [prompt], params)
    after = llm.get_stats()
    assert [o.index for o in outs] == [0, 1, 2, 3]
    samples = [tuple(o.token_ids) for o in outs]
    assert len(set(samples)) == 4 and all(len(s) == 24 for s in samples)
    shared = (len(prompt) - 1) // 8 * 8  # one token is always left to compute
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == 3 * shared
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == 40 + 3 * (40 - shared)
    assert [tuple(o.token_ids) for o in _gen(llm, [prompt], params)[0]] == samples

    # Greedy children computed on shared pages equal the single greedy sample.
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    other = _random_prompt(rng, 43, 43)
    many = _gen(llm, [other], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True))[0]
    llm.engine.pool.reset_prefix_cache()
    single = _gen(llm, [other], greedy)[0][0].token_ids
    assert [o.token_ids for o in many] == [single] * 3

    # Driving the engine: after the first step every child's block table starts with the same pages.
    engine = llm.engine
    fresh = _random_prompt(rng, 40, 40)
    group = [engine.make_request(fresh, params, "n-test", sample_index=0)]
    group += [engine.make_request(fresh, params, f"n-test-{i}", sample_index=i) for i in range(1, 4)]
    assert len({r.seed for r in group}) == 4
    for request in group:
        engine.add_request(request)
    engine.step()
    first_pages = group[0].page_table[:shared // 8]
    assert len(first_pages) == 5 - 1
    for request in group:
        assert request.page_table[:len(first_pages)] == first_pages
    assert [engine.pool.ref_counts[p] for p in first_pages] == [4] * len(first_pages)
    assert len({r.page_table[-1] for r in group}) == 4  # each computes its last prompt page itself
    while engine.has_unfinished:
        engine.step()
    assert [engine.pool.ref_counts[p] for p in first_pages] == [0] * len(first_pages)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.01), "min_p"),
    (dict(presence_penalty=2.01), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(n=0), "n"),
    (dict(seed=-1), "seed"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_out_of_range_sampling_params_raise_naming_the_parameter(kwargs, name):
    """Each out-of-range value raises ValueError whose message names the parameter."""
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        SamplingParams(**kwargs)


def test_boundary_sampling_params_are_accepted():
    """The ends of each documented range are valid; top_k=-1 means off, like 0."""
    SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=-2, frequency_penalty=2,
                   logprobs=20, max_tokens=1, min_tokens=1)
    SamplingParams(top_p=1e-9, min_p=1.0, presence_penalty=2, frequency_penalty=-2, repetition_penalty=1e-3)
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("kwargs", [
    dict(stop_token_ids=[320]), dict(stop_token_ids=[5, -1]), dict(logit_bias={320: 1.0}),
    dict(logit_bias={-3: 1.0}),
], ids=["stop_id_too_big", "stop_id_negative", "bias_id_too_big", "bias_id_negative"])
def test_out_of_vocab_ids_raise_at_request_creation(llm, kwargs):
    """Out-of-vocabulary stop_token_ids / logit_bias ids raise at request creation; nothing is queued."""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.make_request([1, 2, 3], SamplingParams(**kwargs))
    free = llm.engine.pool.num_free_pages
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 4]}],
                     [SamplingParams(), SamplingParams(**kwargs)], use_tqdm=False)
    assert not llm.engine.has_unfinished and llm.engine.pool.num_free_pages == free
