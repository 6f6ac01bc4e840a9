"""Logits parity with Hugging Face transformers (PyTorch, float32) for every tiny model family.

Each family's random-weight model is saved as a Hugging Face directory, loaded through
`jaxserve.weights.load_model`, and run through `jaxserve.models.transformer.forward` over a paged KV
cache: one-shot prefill, token-by-token decode, chunked prefill, a ragged batch mixing prefill and
decode rows, and several attention tile sizes. Every call uses shuffled pages (never page 0) in a
cache pre-filled with garbage, so reading a wrong slot shows up as a logits error.

The tolerance is 1e-4 rather than 1e-3: on these tiny models float32 parity is ~5e-7, while some
real bugs move logits by only ~2e-3 (rope theta off by 2x on tiny llama), and
`test_parity_check_catches_rope_and_window_bugs` keeps that margin honest. Compiling dominates the
runtime, so every call but decode uses one shape (64 token rows, 6 sequences) and decode uses
(1 row, 1 sequence): two compiles per family, plus one per tile size and per mutation tested.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tiny_models
from jaxserve.ops import cpu_ffi
from jaxserve.config.model_config import ModelConfig
from jaxserve.models.transformer import forward, serving_params
from jaxserve.weights import LoadedModel, load_model
from paged_helpers import SeqChunk, assign_pages, make_batch

ATOL = 1e-4  # max |Δlogit| against Hugging Face
TILE_ATOL = 1e-5  # max |Δlogit| between tile sizes (only the summation order differs)
PAGE_SIZE = 8
NUM_PAGES = 32
PAGES_PER_SEQ = 8  # 64 tokens per sequence at most
PROMPT_LEN = 40  # longer than both sliding windows (mistral 24, gemma3 20) and 5 pages
BATCH_TOKENS, BATCH_SEQS = 64, 6  # the shape of every call but decode

forward_jit = jax.jit(forward, static_argnames=("cfg", "q_tile", "kv_tile", "attention_backend"))
max_errors: dict[str, float] = {}


@dataclasses.dataclass
class TinyModel:
    family: str
    loaded: LoadedModel
    torch_model: torch.nn.Module

    @property
    def cfg(self) -> ModelConfig:
        return self.loaded.config

    def hf_logits(self, token_ids) -> np.ndarray:  # [len(token_ids), vocab]
        with torch.no_grad():
            return self.torch_model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> TinyModel, each built, saved and loaded once per module."""
    models = {}

    def get(family: str) -> TinyModel:
        if family not in models:
            directory = tmp_path_factory.mktemp(family)
            torch_model = tiny_models.make_tiny_model(family, directory)
            models[family] = TinyModel(family, load_model(directory), torch_model)
        return models[family]

    yield get
    print("\nmax |Δlogit| vs Hugging Face:", {k: f"{v:.1e}" for k, v in sorted(max_errors.items())})


def random_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 259, n).tolist()


def garbage_cache(cfg: ModelConfig, seed: int = 0):
    """A KV cache full of large finite values: any read of a slot nobody wrote changes the logits."""
    shape = (cfg.num_layers, NUM_PAGES, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    k, v = 5.0 * np.random.default_rng(seed).standard_normal((2, *shape), np.float32)
    return jnp.asarray(k), jnp.asarray(v)


def run(model: TinyModel, kv_cache, chunks, *, num_tokens, num_seqs, cfg=None, q_tile=16, kv_tile=128,
        packed=False):
    """One forward call; returns each real sequence's logits rows [q_len, vocab] and the cache.
    packed: the weights packed for the C++ CPU matmul (True: in float32; "bfloat16", with the C++ attention's
    prompt tiles in bfloat16 as the engine pairs them, backend "cpu-bf16")."""
    batch = make_batch(chunks, page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ, num_tokens=num_tokens,
                       num_seqs=num_seqs)
    cfg = cfg or model.cfg
    logits, kv_cache = forward_jit(
        serving_params(cfg, model.loaded.params, packed=bool(packed),
                       packed_dtype=packed if isinstance(packed, str) else "float32"), cfg, batch.token_ids, batch.positions, kv_cache, batch.md,
        batch.logits_indices, q_tile=q_tile, kv_tile=kv_tile,
        attention_backend="cpu-bf16" if packed == "bfloat16" else "xla",
    )
    logits = np.asarray(logits)
    return [logits[rows] for rows in batch.rows], kv_cache


def assert_matches_hf(model: TinyModel, actual: np.ndarray, expected: np.ndarray, what: str):
    assert actual.shape == expected.shape, what
    err = float(np.abs(actual - expected).max())
    max_errors[model.family] = max(max_errors.get(model.family, 0.0), err)
    assert err <= ATOL, f"{model.family} {what}: max |Δlogit| = {err:.2e} > {ATOL}"


def prefill(model: TinyModel, token_ids, *, cfg=None, seed=0) -> np.ndarray:
    (pages,) = assign_pages([len(token_ids)], PAGE_SIZE, NUM_PAGES, seed=seed)
    (logits,), _ = run(model, garbage_cache(model.cfg), [SeqChunk(token_ids, 0, pages)],
                       num_tokens=BATCH_TOKENS, num_seqs=BATCH_SEQS, cfg=cfg)
    return logits


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_prefill_matches_hf(tiny, family):
    """A 40-token prompt over 5 shuffled pages gives HF's logits at every position: guards the
    weight mapping, rope, norms, sliding windows, slot mapping and the page walk in attention."""
    model = tiny(family)
    prompt = random_tokens(PROMPT_LEN, seed=1)
    assert_matches_hf(model, prefill(model, prompt), model.hf_logits(prompt), "one-shot prefill")


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_decode_one_token_at_a_time_matches_hf(tiny, family):
    """Prefill 5 tokens, then decode one token per call (q_len 1) across page boundaries and past the
    sliding window: each step must read back exactly what earlier calls wrote to the cache."""
    model = tiny(family)
    prompt = random_tokens(PROMPT_LEN, seed=2)
    expected = model.hf_logits(prompt)
    (pages,) = assign_pages([PROMPT_LEN], PAGE_SIZE, NUM_PAGES, seed=2)
    num_prefill = 5
    (logits,), kv_cache = run(model, garbage_cache(model.cfg), [SeqChunk(prompt[:num_prefill], 0, pages)],
                              num_tokens=BATCH_TOKENS, num_seqs=BATCH_SEQS)
    assert_matches_hf(model, logits, expected[:num_prefill], "prefill before decode")
    for position in range(num_prefill, PROMPT_LEN):
        (logits,), kv_cache = run(model, kv_cache, [SeqChunk([prompt[position]], position, pages)],
                                  num_tokens=1, num_seqs=1)
        assert_matches_hf(model, logits[0], expected[position], f"decode step at position {position}")


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_chunked_prefill_matches_one_shot_prefill(tiny, family):
    """A prompt fed as chunks of 13 + 13 + 14 tokens (each attending to the cached prefix, chunk
    starts not page aligned) gives the one-shot prefill's logits and HF's."""
    model = tiny(family)
    prompt = random_tokens(PROMPT_LEN, seed=3)
    (pages,) = assign_pages([PROMPT_LEN], PAGE_SIZE, NUM_PAGES, seed=3)
    kv_cache = garbage_cache(model.cfg)
    chunk_logits = []
    for start, end in [(0, 13), (13, 26), (26, PROMPT_LEN)]:
        (logits,), kv_cache = run(model, kv_cache, [SeqChunk(prompt[start:end], start, pages)],
                                  num_tokens=BATCH_TOKENS, num_seqs=BATCH_SEQS)
        chunk_logits.append(logits)
    chunked = np.concatenate(chunk_logits)
    np.testing.assert_allclose(chunked, prefill(model, prompt, seed=3), atol=TILE_ATOL, rtol=0)
    assert_matches_hf(model, chunked, model.hf_logits(prompt), "chunked prefill")


def run_ragged_batches(model: TinyModel, *, cfg=None, q_tile=16, kv_tile=128, packed=False):
    """Two calls over 5 sequences: first fresh prompts of 1, 7, 8, 9 and 30 tokens in one batch, then
    a mix of decode rows and prefill chunks on top of those caches, the longest ending at position 32
    (a key tile boundary for kv_tile 8 and 16). Returns per sequence its logits rows from both
    calls [len, vocab], the sequences, their block tables, and the initial and final caches."""
    first_lens, second_lens = [1, 7, 8, 9, 30], [1, 1, 3, 9, 3]
    seqs = [random_tokens(a + b, seed=10 + i) for i, (a, b) in enumerate(zip(first_lens, second_lens))]
    tables = assign_pages([len(s) for s in seqs], PAGE_SIZE, NUM_PAGES, seed=4)
    initial = garbage_cache(model.cfg)
    first = [SeqChunk(s[:n], 0, t) for s, n, t in zip(seqs, first_lens, tables)]
    logits1, kv_cache = run(model, initial, first, num_tokens=BATCH_TOKENS, num_seqs=BATCH_SEQS,
                            cfg=cfg, q_tile=q_tile, kv_tile=kv_tile, packed=packed)
    second = [SeqChunk(s[n:], n, t) for s, n, t in zip(seqs, first_lens, tables)]
    logits2, kv_cache = run(model, kv_cache, second, num_tokens=BATCH_TOKENS, num_seqs=BATCH_SEQS,
                            cfg=cfg, q_tile=q_tile, kv_tile=kv_tile, packed=packed)
    logits = [np.concatenate([a, b]) for a, b in zip(logits1, logits2)]
    return logits, seqs, tables, initial, kv_cache


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_ragged_batch_matches_hf_per_sequence(tiny, family):
    """Sequences of different lengths in one call (flattened token axis, padding rows writing to page
    0, a padded sequence with q_len 0 and kv_len 0), then mixed decode/prefill rows, give each
    sequence's HF logits as if run alone: guards cu_q_lens/kv_lens handling and tiles spanning
    sequences. Pages no sequence owns must be left untouched."""
    model = tiny(family)
    logits, seqs, tables, initial, final = run_ragged_batches(model)
    for i, (seq_logits, seq) in enumerate(zip(logits, seqs)):
        assert_matches_hf(model, seq_logits, model.hf_logits(seq), f"ragged sequence {i} (len {len(seq)})")
    unowned = sorted(set(range(1, NUM_PAGES)) - {p for t in tables for p in t})
    for before, after in zip(initial, final):
        np.testing.assert_array_equal(np.asarray(after)[:, unowned], np.asarray(before)[:, unowned])


@pytest.mark.skipif(cpu_ffi.kernel_error() is not None, reason=f"no CPU kernels: {cpu_ffi.kernel_error()}")
@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_weights_packed_for_the_cpu_matmul_match_hf(tiny, family):
    """The ragged batches with every weight matrix packed for the C++ matmul (its widths, 64 to 320,
    are not multiples of its 48-column panels, so the padded last panel is exercised; tied LM heads
    also serve the embedding lookup) give each sequence's HF logits."""
    model = tiny(family)
    logits, seqs, _, _, _ = run_ragged_batches(model, packed=True)
    for i, (seq_logits, seq) in enumerate(zip(logits, seqs)):
        assert_matches_hf(model, seq_logits, model.hf_logits(seq), f"packed, ragged sequence {i}")


@pytest.mark.skipif(cpu_ffi.kernel_error() is not None, reason=f"no CPU kernels: {cpu_ffi.kernel_error()}")
@pytest.mark.parametrize("family", ["llama", "llama_untied", "gemma3"])
def test_bfloat16_packed_weights_stay_within_bfloat16_rounding_of_hf(tiny, family):
    """With every matrix packed in bfloat16 (matmul_backend "cpu-bf16": tied LM heads serve the embedding
    lookup in bfloat16 too), each sequence's logits stay within bfloat16's rounding of HF's float32
    ones: a hundredth of the logits' spread; the float32 packing stays within ATOL."""
    model = tiny(family)
    logits, seqs, _, _, _ = run_ragged_batches(model, packed="bfloat16")
    for i, (seq_logits, seq) in enumerate(zip(logits, seqs)):
        expected = model.hf_logits(seq)
        err = float(np.abs(seq_logits - expected).max())
        assert err <= 0.01 * float(expected.max() - expected.min()), f"{family} sequence {i}: {err:.2e}"
        assert (seq_logits.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("q_tile, kv_tile", [(1, 8), (4, 16)])
@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma3"])
def test_query_and_key_block_sizes_do_not_change_results(tiny, family, q_tile, kv_tile):
    """The ragged batches give the same logits for every query tile / key tile size (against the
    default 16 / 128): guards the tiling, the online softmax across key tiles, and the first key
    tile of a sliding window. The families cover what attention sees: sliding windows (mistral,
    gemma3's mixed layers), head_dim 32 (qwen3) and 16, a non-default query scale (gemma3)."""
    model = tiny(family)
    reference, seqs, _, _, _ = run_ragged_batches(model)
    logits, _, _, _, _ = run_ragged_batches(model, q_tile=q_tile, kv_tile=kv_tile)
    for i, (actual, expected, seq) in enumerate(zip(logits, reference, seqs)):
        np.testing.assert_allclose(actual, expected, atol=TILE_ATOL, rtol=0, err_msg=f"sequence {i}")
        assert_matches_hf(model, actual, model.hf_logits(seq), f"{q_tile=} {kv_tile=} sequence {i}")


def _mutations():
    replace = dataclasses.replace

    def double_theta(rope):
        return replace(rope, theta=2 * rope.theta)

    # name -> (family, wrong config); the comment is the max |Δlogit| it causes on the prompt
    return {
        "llama rope theta x2": ("llama", lambda c: replace(c, rope=double_theta(c.rope))),  # 2.2e-3
        "llama3 scaling ignored": (
            "llama3", lambda c: replace(c, rope=replace(c.rope, rope_type="default"))),  # 6.5e-3
        "mistral window - 1": ("mistral", lambda c: replace(c, sliding_window=c.sliding_window - 1)),  # 7.5e-2
        "gemma3 local rope theta x2": (
            "gemma3", lambda c: replace(c, local_rope=double_theta(c.local_rope))),  # 1.7e-1
    }


MUTATIONS = _mutations()


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_parity_check_catches_rope_and_window_bugs(tiny, mutation):
    """The parity tests above can fail: a slightly wrong rope or sliding window moves the logits of
    the 40-token prompt well past ATOL. Guards against a tolerance too loose, or a prompt too short."""
    family, mutate = MUTATIONS[mutation]
    model = tiny(family)
    prompt = random_tokens(PROMPT_LEN, seed=1)
    wrong = prefill(model, prompt, cfg=mutate(model.cfg))
    assert np.abs(wrong - model.hf_logits(prompt)).max() > 10 * ATOL
