"""Tensor parallelism over forced host devices (conftest asks JAX for 8 CPU devices before it starts).

What must hold whatever the split: a model split over tp devices computes the logits of the model on
one device (to float32 summation order), whether its heads divide tp, must be padded with zero heads,
or are fewer KV heads than devices (replicated); the engine gives the same tokens under every sampling
parameter; nothing compiles after warm-up; each device holds about 1/tp of the weights; and the only
communication inside a layer is its two all-reduces.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

import tiny_models
from jaxserve import LLM, SamplingParams
from jaxserve.runner.compilation import num_compilations
from jaxserve.config.engine_config import EngineConfig
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.models.params import param_specs
from jaxserve.models.transformer import forward
from jaxserve.runner.step_inputs import StepInputs
from jaxserve.parallel.tp_layout import HeadLayout
from jaxserve.weights import load_model
from paged_helpers import SeqChunk, assign_pages, make_batch

PAGE_SIZE = 16
ATOL = 2e-4  # |Δlogit|: the same float32 math summed in another order across devices
# family -> head counts and sizes: heads that divide tp, that need zero heads, fewer KV heads than devices
SHAPES = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2),  # tp 2 divides, 3 pads, 4 and 8 replicate
    "mistral": dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=132),  # SmolLM2's heads: 3 divides, 2/4/8 pad
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=1),  # one KV head (biases): replicated everywhere
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=8),  # 2, 4, 8 divide, 3 pads
    "gemma3": dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=100),  # intermediate pads too
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = tmp_path_factory.mktemp(f"tp_{family}")
            tiny_models.make_tiny_model(family, cache[family], attention_std=0.3, embedding_std=1.0,
                                        **SHAPES[family])
        return cache[family]

    return get


def _runner(path, tp: int, **settings) -> ModelRunner:
    model = load_model(path, "float32")
    cfg = EngineConfig(**{**dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=24,
                              tensor_parallel_size=tp, dtype="float32"), **settings})
    return ModelRunner(model.config, cfg, model.params)


def _logits(runner: ModelRunner) -> np.ndarray:
    """Logits of every row of two calls (three prompts, then their continuations reading the cached
    keys), through the runner's params and KV pages, on one device or split over the mesh."""
    tables = assign_pages([40, 23, 9], PAGE_SIZE, 24, seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 259, n).tolist() for n in (40, 23, 9)]
    split = [(30, 10), (20, 3), (5, 4)]
    kwargs = dict(q_tile=16, kv_tile=32, attention_backend=runner.attention_backend)
    if runner.parallel is None:
        run = jax.jit(functools.partial(forward, cfg=runner.model_cfg, **kwargs))
    else:
        run = jax.jit(functools.partial(runner.parallel.forward, **kwargs))
    kv_cache, out = runner.kv_cache, []
    for call in range(2):
        chunks = [SeqChunk(p[:a] if call == 0 else p[a:a + b], 0 if call == 0 else a, t)
                  for p, (a, b), t in zip(prompts, split, tables)]
        batch = make_batch(chunks, page_size=PAGE_SIZE, pages_per_seq=8, num_tokens=64, num_seqs=4)
        if runner.parallel is None:
            logits, kv_cache = run(runner.params, token_ids=batch.token_ids, positions=batch.positions,
                                   kv_cache=kv_cache, md=batch.md, logits_indices=batch.logits_indices)
        else:
            logits, kv_cache = run(runner.params, kv_cache, StepInputs(*batch[:4], sampling=None, prev_rows=None))
        rows = np.concatenate(batch.rows)
        out.append(np.asarray(logits)[rows, :runner.model_cfg.vocab_size])
    return np.concatenate(out)


@functools.cache
def _reference(path) -> np.ndarray:
    return _logits(_runner(path, 1))


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
@pytest.mark.parametrize("family", list(SHAPES))
def test_logits_match_one_device(model_dir, family, tp):
    """Split over tp devices (padded, replicated or neither), the model computes one device's logits."""
    path = model_dir(family)
    runner = _runner(path, tp)
    layout = runner.parallel.layout
    got, want = _logits(runner), _reference(path)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"{family} at {tp=}: {layout}")
    # the argmax agrees, or (a near-tie broken by summation order) each side's token is in the other's top 5
    for g, w in zip(got, want):
        if g.argmax() != w.argmax():
            assert g.argmax() in np.argsort(w)[-5:] and w.argmax() in np.argsort(g)[-5:]


def test_the_xla_paths_split_too(model_dir):
    """XLA's attention and dot (not the C++ kernels) under shard_map."""
    path = model_dir("llama")
    runner = _runner(path, 2, attention_backend="xla", matmul_backend="xla")
    np.testing.assert_allclose(_logits(runner), _reference(path), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tp", [2, 3])
def test_fp8_packed_weights_split_too(model_dir, tp):
    """fp8 weights in the C++ matmul (W8A16) split by columns and by rows. Each device packs its own share
    (`place_params`), so a matrix split by rows gets column scales over that device's rows: a finer
    quantization than one device's, not the same numbers. The logits are then the float model's within
    e4m3's rounding, as one device's fp8 logits are, and as often on its next token."""
    from jaxserve.ops.packed_matmul import PackedWeight

    path = model_dir("llama")
    split, one = _runner(path, tp, quantization="fp8"), _runner(path, 1, quantization="fp8")
    assert split.resolved.packed_dtype == one.resolved.packed_dtype == "fp8"
    assert isinstance(split.params["layers"][0]["w_down"], PackedWeight)
    assert split.params["layers"][0]["w_down"].kind == "fp8"
    # the scales of a matrix split by rows are each device's own, and the array says so: split over the
    # devices, device d's block its share's scales (not one array declared replicated holding different values)
    for name, by_rows in (("w_down", True), ("wo", True), ("w_qkv", False)):
        scale = split.params["layers"][0][name].scale
        blocks = [np.asarray(shard.data) for shard in sorted(scale.addressable_shards, key=lambda s: s.index)]
        assert not scale.sharding.is_fully_replicated and len(blocks) == tp, name
        np.testing.assert_array_equal(np.concatenate(blocks), np.asarray(scale))
        if by_rows:  # per device, the column scales of different rows
            assert not all(np.array_equal(blocks[0], b) for b in blocks[1:]), name
    got, single, want = _logits(split), _logits(one), _reference(path)
    # e4m3's three mantissa bits cost this tiny random model (large weights, no training) about a fifth of
    # its logits' spread on one device; split, the same (a wrong scale or panel would cost all of it)
    split_error, single_error = (np.sqrt(np.mean((fp8 - want) ** 2)) / want.std() for fp8 in (got, single))
    assert split_error < 1.2 * single_error and single_error < 0.3, (split_error, single_error)
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= np.mean(single.argmax(-1) == want.argmax(-1)) - 0.1


def test_int8_packed_weights_split_too(model_dir):
    """int8 weights in the C++ matmul (W8A8) split by columns and by rows over 2 devices, each device's share
    packed on its own as fp8's are: the row-split matrices' column scales are each device's block of one array
    split over the mesh, and the logits are the float model's within int8's rounding, as one device's are."""
    path = model_dir("llama")
    split, one = _runner(path, 2, quantization="int8"), _runner(path, 1, quantization="int8")
    assert split.resolved.packed_dtype == one.resolved.packed_dtype == "int8"
    scale = split.params["layers"][0]["w_down"].scale
    assert split.params["layers"][0]["w_down"].kind == "int8" and not scale.sharding.is_fully_replicated
    assert scale.shape[0] == 2 * one.params["layers"][0]["w_down"].scale.shape[0]
    got, single, want = _logits(split), _logits(one), _reference(path)
    split_error, single_error = (np.sqrt(np.mean((q - want) ** 2)) / want.std() for q in (got, single))
    # about 0.07 both ways on a 2-core Zen 4 (a wrong scale or panel would cost all of the spread)
    assert split_error < 1.2 * single_error and single_error < 0.15, (split_error, single_error)


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "q_per_device", "kv_per_device", "zero_q"), [
    (9, 3, 3, 3, 1, 0),  # divides
    (9, 3, 2, 6, 2, 3),  # one zero KV head and its query group
    (4, 2, 4, 1, 1, 0),  # each KV head on two devices, its two query heads split between them
    (4, 1, 8, 1, 1, 4),  # one KV head on eight devices: four of them hold a zero query head
])
def test_head_layout(heads, kv_heads, tp, q_per_device, kv_per_device, zero_q):
    model_cfg = _tiny_config(heads, kv_heads)
    layout = HeadLayout.for_model(model_cfg, tp)
    device = layout.device_config(model_cfg)
    assert (device.num_heads, device.num_kv_heads, layout.q_heads.count(None)) == (q_per_device, kv_per_device, zero_q)
    # every real query head appears once, on a device that holds its own KV head, in its group there
    group, device_group = heads // kv_heads, device.num_heads // device.num_kv_heads
    assert sorted(h for h in layout.q_heads if h is not None) == list(range(heads))
    for position, head in enumerate(layout.q_heads):
        if head is not None:
            on_device, local = divmod(position, device.num_heads)
            assert layout.kv_heads[on_device * device.num_kv_heads + local // device_group] == head // group


def _tiny_config(heads: int, kv_heads: int):
    from jaxserve.config.model_config import ModelConfig

    return ModelConfig.from_hf(tiny_models.hf_config("llama", num_attention_heads=heads, num_key_value_heads=kv_heads))


SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=12),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=12),
    "penalties and bias": SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.3,
                                         repetition_penalty=1.2, logit_bias={65: 3.0}, min_tokens=4, max_tokens=12),
    "logprobs": SamplingParams(temperature=0, logprobs=5, max_tokens=12),
}


@pytest.fixture(scope="module")
def llms(model_dir):
    """The same engine on one device and split over 2 and 3, every compile after warm-up forbidden, with a
    pool small enough to preempt, prefix caching on and prompts longer than the token budget (chunked)."""
    path = model_dir("mistral")
    settings = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_kv_pages=8,
                    forbid_compilation_after_warmup=True)
    return {tp: LLM(str(path), tensor_parallel_size=tp, **settings) for tp in (1, 2, 3)}


def _prompts() -> list[dict]:
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 259, 40).tolist()  # a common prefix: prefix caching
    return [{"prompt_token_ids": shared + rng.integers(0, 259, n).tolist()} for n in (3, 30, 17, 9, 50)]


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_the_engine_gives_the_same_tokens_split_or_not(llms, name):
    """Every sampling parameter behaves across vocabulary shards as on one device: tokens and logprobs,
    with preemption, prefix caching and chunked prefill active, and not one compile after warm-up."""
    params = SAMPLINGS[name]
    compiles = num_compilations()
    results = {tp: llm.generate(_prompts(), params, use_tqdm=False) for tp, llm in llms.items()}
    assert num_compilations() == compiles  # (forbid_compilation_after_warmup would also have raised)
    for tp in (2, 3):
        for one, split in zip(results[1], results[tp]):
            assert split.outputs[0].token_ids == one.outputs[0].token_ids, (name, tp)
            if params.logprobs:
                for a, b in zip(one.outputs[0].logprobs, split.outputs[0].logprobs):
                    assert a.keys() == b.keys()
                    np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)
    for tp, llm in llms.items():
        assert llm.get_stats()["tensor_parallel_size"] == tp


def test_the_run_preempted_cached_and_chunked(llms):
    """The engines above really exercised preemption, the prefix cache and chunked prefill."""
    for llm in llms.values():
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0, stats
        assert stats["prefix_cache_hits"] > 0, stats
        assert stats["prompt_tokens_computed"] > 32  # some prompt took more than one step's budget


def test_each_device_holds_its_share_of_the_weights(model_dir):
    """Per-device weight bytes at tp = N are 1/N of the split weights plus the replicated ones (norms,
    rope tables), exactly, when no head needs padding (9 query, 3 KV heads at tp 3; the embedding's
    vocabulary is padded by one row in the embedding and the LM head, counted)."""
    path = model_dir("mistral")
    one, three = _runner(path, 1, matmul_backend="xla"), _runner(path, 3, matmul_backend="xla", num_kv_pages=24)
    specs = three.parallel.param_specs
    replicated = sum(x.nbytes for x, spec in zip(jax.tree.leaves(three.params), jax.tree.leaves(
        specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))) if not any(spec))
    padded_rows = three.parallel.layout.vocab_size - one.model_cfg.vocab_size
    vocab_padding = padded_rows * one.model_cfg.hidden_size * 4 * (1 if one.model_cfg.tie_word_embeddings else 2)
    assert replicated > 0 and three.parallel.layout.intermediate_size == one.model_cfg.intermediate_size
    assert 3 * (three.device_weight_bytes - replicated) == one.device_weight_bytes - replicated + vocab_padding
    assert three.device_kv_cache_bytes * 3 == one.device_kv_cache_bytes


def test_a_layer_holds_exactly_two_all_reduces(model_dir):
    """The compiled step of a split model: two all-reduces per layer (after o_proj, after down_proj) and
    one for the embedding lookup; the sampler gathers (per-device maxima or the logits), it does not
    all-reduce."""
    runner = _runner(model_dir("llama"), 2)
    num_layers = runner.model_cfg.num_layers
    for kind, bucket in (("decode", runner.decode_buckets[-1]), ("prefill", runner.prefill_buckets[0])):
        hlo = runner.lower(kind, bucket).compile().as_text()
        assert len(re.findall(r" all-reduce(?:-start)?\(", hlo)) == 2 * num_layers + 1, kind
        assert len(re.findall(r" all-gather(?:-start)?\(", hlo)) > 0, kind


def test_too_few_devices_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=16 needs 16 devices; JAX sees 8"):
        _runner(model_dir("llama"), 16)


def test_param_specs_cover_every_param():
    cfg = _tiny_config(4, 2)
    from jaxserve.models.params import param_shapes

    shapes, specs = param_shapes(cfg), param_specs(cfg)
    flat_shapes = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert len(flat_shapes) == len(flat_specs)
    for shape, spec in zip(flat_shapes, flat_specs):
        assert len(spec) <= len(shape)
