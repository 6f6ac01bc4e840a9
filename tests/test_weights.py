"""Loading models: GGUF files of every supported quantization, the errors a user can cause, jaxserve
checkpoints, and the default model.

GGUF files are written by `gguf_files.py` the way llama.cpp's converter writes them, from tiny random
models. The reference for each file is Hugging Face transformers loading that same file
(`from_pretrained(..., gguf_file=...)`): both sides dequantize with the `gguf` package, so logits must
agree tightly for every type, and the metadata must be good enough for transformers to build a config
and a tokenizer from it. Tensors of the types `gguf.quants.quantize` cannot write are random blocks
rather than the model's weights; the same-file comparison with transformers still holds for them.
The common types get a file each; every other type the `gguf` package can dequantize is covered by
files that mix several types, tensor by tensor, as llama.cpp's own quant mixes (Q4_K_M: Q4_K, Q5_0,
Q6_K, ...) do. `test_gguf_types.py` checks each type's values param by param.
"""

from __future__ import annotations

import shutil
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType

import hf_gguf
import tiny_models
from jaxserve.config.model_config import ModelLoadError
from jaxserve.models.transformer import forward, serving_params
from jaxserve.weights import LoadedModel, default_model_path, gguf_tensor_types, load_model, save_checkpoint
from gguf_files import hf_head_dim, write_gguf
from paged_helpers import SeqChunk, assign_pages, make_batch

ATOL = 1e-4  # max |Δlogit| where both sides compute with the same float32 weights
# One file per type for these; every other type the gguf package dequantizes goes into mixed files.
COMMON_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
OTHER_TYPES = [t for t in gguf_tensor_types() if t not in COMMON_TYPES]
PAGE_SIZE = 16
forward_jit = jax.jit(forward, static_argnames=("cfg", "q_tile", "kv_tile"))


@pytest.fixture(autouse=True)
def _private_tokenizer_cache(request, monkeypatch, tmp_path_factory):
    """GGUF tokenizers and converted GGUF models are cached on disk; keep this module's
    throwaway files out of the user's caches (the default model keeps using it, as it does outside tests)."""
    if "default_model" not in request.keywords:
        monkeypatch.setenv("JAXSERVE_TOKENIZER_CACHE", str(tmp_path_factory.getbasetemp() / "tokenizer_cache"))
        monkeypatch.setenv("JAXSERVE_MODEL_CACHE", str(tmp_path_factory.getbasetemp() / "model_cache"))


def jax_logits(loaded: LoadedModel, token_ids) -> np.ndarray:
    """Logits at every position of one prompt [len, vocab], through the paged forward pass."""
    cfg = loaded.config
    num_pages = -(-len(token_ids) // PAGE_SIZE) + 1
    (pages,) = assign_pages([len(token_ids)], PAGE_SIZE, num_pages)
    batch = make_batch([SeqChunk(token_ids, 0, pages)], page_size=PAGE_SIZE, pages_per_seq=len(pages),
                       num_tokens=len(token_ids), num_seqs=1)
    shape = (cfg.num_layers, num_pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    kv_cache = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    logits, _ = forward_jit(serving_params(cfg, loaded.params), cfg, batch.token_ids, batch.positions, kv_cache, batch.md,
                            batch.logits_indices)
    return np.asarray(logits)


def torch_logits(model: torch.nn.Module, token_ids) -> np.ndarray:
    return hf_gguf.logits(model, list(token_ids)).float().numpy()


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float(np.abs(a - b).max())


PROMPT = np.random.default_rng(0).integers(0, 259, 24).tolist()

def make_llama_256(seed: int = 0) -> torch.nn.Module:
    """A tiny llama whose rows (hidden and intermediate 256) fit K-quant super-blocks of 256."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=tiny_models.VOCAB_SIZE, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.5)
    return model


@pytest.fixture(scope="module")
def llama_256():
    return make_llama_256()


@pytest.fixture(scope="module")
def llama_gguf_files(tmp_path_factory, llama_256):
    """qtype name -> path of the llama_256 GGUF in that type, each in its own directory."""
    return {name: write_gguf(tmp_path_factory.mktemp(f"gguf_{name}") / f"tiny-{name}.gguf", llama_256, "llama",
                             QType[name])
            for name in COMMON_TYPES}


@pytest.fixture(scope="module")
def tiny_hf_dirs(tmp_path_factory):
    """family -> (Hugging Face directory, torch model), built once."""
    dirs = {}

    def get(family: str):
        if family not in dirs:
            directory = tmp_path_factory.mktemp(f"hf_{family}")
            dirs[family] = directory, tiny_models.make_tiny_model(family, directory)
        return dirs[family]

    return get


# ----------------------------------------------------------------------------------------------
# GGUF parity


@pytest.mark.parametrize("qtype", COMMON_TYPES)
def test_gguf_logits_match_transformers_loading_the_same_file(llama_gguf_files, qtype):
    """Every supported tensor type dequantizes, un-permutes q/k and maps names like transformers'
    GGUF loader: guards each type's reshape (K-quant super-blocks included) and the llama rope
    row order."""
    path = llama_gguf_files[qtype]
    loaded = load_model(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    expected = torch_logits(reference, PROMPT)
    assert np.abs(expected).max() > 0.1  # not a degenerate model that any loader would match
    assert max_abs_diff(jax_logits(loaded, PROMPT), expected) <= ATOL


def test_every_type_the_gguf_package_dequantizes_loads(tmp_path, llama_256):
    """Beyond the common types, every other type `gguf.quants` can dequantize (Q5_0, Q5_1, Q2_K, Q3_K,
    the IQ and TQ types, MXFP4, ...) loads and gives the logits transformers gets from the same file.
    Each file mixes types tensor by tensor, as real quant mixes do (Q4_K_M holds Q5_0 tensors)."""
    assert {"Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ2_XXS", "TQ1_0", "MXFP4"} <= set(OTHER_TYPES)
    num_matrices = 2 * 7 + 2  # llama_256: seven per layer, the embedding and the LM head
    groups = [OTHER_TYPES[i:i + num_matrices] for i in range(0, len(OTHER_TYPES), num_matrices)]
    for i, group in enumerate(groups):
        (tmp_path / f"mixed{i}").mkdir()
        path = write_gguf(tmp_path / f"mixed{i}" / "tiny-mixed.gguf", llama_256, "llama", [QType[t] for t in group])
        assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors} >= set(group)
        loaded = load_model(path)
        reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                      dtype=torch.float32).eval()
        expected = torch_logits(reference, PROMPT)
        assert np.isfinite(expected).all() and np.abs(expected).max() > 0.1
        assert max_abs_diff(jax_logits(loaded, PROMPT), expected) <= ATOL * max(1.0, np.abs(expected).max()), group


# What each lossy type keeps of the float32 model's logits on llama_256: (minimum correlation,
# minimum share of positions where the greedy token agrees). Measured: F16 1.0 / 100%, BF16 0.99999
# / 100%, Q8_0 0.9999 / 100%, Q4_0 0.974 / 62%, Q4_1 0.978 / 88% (random weights give flat logits,
# so 4-bit noise flips many greedy tokens). A misread scale or block gives correlation near 0.
QUANTIZATION_BUDGET = {"F16": (0.99999, 1.0), "BF16": (0.9999, 0.95), "Q8_0": (0.999, 0.9),
                       "Q4_0": (0.95, 0.4), "Q4_1": (0.95, 0.4)}


def test_f32_gguf_matches_the_original_model_exactly(llama_gguf_files, llama_256):
    """A float32 GGUF gives back the model's own weights: guards the llama q/k un-permutation against
    the original model itself, not against transformers' GGUF loader, which could share a mistake."""
    loaded = load_model(llama_gguf_files["F32"])
    assert max_abs_diff(jax_logits(loaded, PROMPT), torch_logits(llama_256, PROMPT)) <= ATOL


@pytest.mark.parametrize("qtype", QUANTIZATION_BUDGET)
def test_quantized_gguf_stays_close_to_the_original_model(llama_gguf_files, llama_256, qtype):
    """The weights that come back are the model's own up to quantization noise: guards scales or
    blocks read from the wrong place, which a same-file comparison with transformers would share."""
    loaded = load_model(llama_gguf_files[qtype])
    expected = torch_logits(llama_256, PROMPT)
    actual = jax_logits(loaded, PROMPT)
    min_correlation, min_agreement = QUANTIZATION_BUDGET[qtype]
    assert np.corrcoef(actual.ravel(), expected.ravel())[0, 1] >= min_correlation
    assert np.mean(actual.argmax(-1) == expected.argmax(-1)) >= min_agreement


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_of_each_family_matches_the_original_model(tmp_path, tiny_hf_dirs, family):
    """A float32 GGUF of each GGUF family gives the original model's logits: guards the llama q/k
    un-permutation (against HF itself, not HF's GGUF loader), qwen2's biases, qwen3's q/k norms and
    its head_dim (from `attention.key_length`, which is not hidden_size / num_heads here)."""
    _, model = tiny_hf_dirs(family)
    loaded = load_model(write_gguf(tmp_path / f"tiny-{family}.gguf", model, family))
    assert loaded.config.head_dim == hf_head_dim(model.config)
    assert max_abs_diff(jax_logits(loaded, PROMPT), torch_logits(model, PROMPT)) <= ATOL


def test_gguf_metadata_gives_the_models_config_and_tokenizer(llama_gguf_files, llama_256):
    """llama.cpp metadata keys become the right config (layers, heads, tied embeddings, eos/bos),
    and the gpt2-style vocabulary becomes a tokenizer that encodes like the original byte tokenizer."""
    loaded = load_model(llama_gguf_files["F32"])
    cfg, hf = loaded.config, llama_256.config
    byte_tokenizer = tiny_models.byte_tokenizer()
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 2, 256, 256)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 64, tiny_models.VOCAB_SIZE)
    assert cfg.tie_word_embeddings is False and "lm_head" in loaded.params
    assert cfg.rope.theta == 10000.0 and cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.eos_token_ids == (byte_tokenizer.eos_token_id,) and cfg.bos_token_id == byte_tokenizer.bos_token_id
    text = "Hello, wörld! 你好<|im_end|>"
    assert loaded.tokenizer.encode(text) == byte_tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert (loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == byte_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_a_gguf_is_converted_once_and_then_loaded_from_the_model_cache(tmp_path, monkeypatch, llama_256):
    """The second load of a GGUF reads the cached conversion (no GGUF parsing), gives the same config,
    params and tokenizer, and a damaged cache entry is converted again rather than failing the load."""
    monkeypatch.setenv("JAXSERVE_MODEL_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", llama_256, "llama", QType.Q8_0)
    first = load_model(path)
    (entry,) = (p for p in (tmp_path / "cache").iterdir() if p.is_dir())  # beside it: its lock file
    assert sorted(p.name for p in entry.iterdir()) == ["jaxserve_model.json", "params.safetensors"]

    with monkeypatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", None)  # a cache hit must not touch the GGUF metadata
        second = load_model(path)
    assert second.config == first.config and second.source == first.source
    assert jax.tree.structure(second.params) == jax.tree.structure(first.params)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert second.tokenizer.encode("Hello") == first.tokenizer.encode("Hello")

    (entry / "params.safetensors").write_bytes(b"damaged")
    third = load_model(path)
    np.testing.assert_array_equal(np.asarray(third.params["embed"]), np.asarray(first.params["embed"]))
    assert (entry / "params.safetensors").stat().st_size > 1000  # rewritten

    monkeypatch.setenv("JAXSERVE_MODEL_CACHE", "off")
    other = write_gguf(tmp_path / "other.gguf", llama_256, "llama")
    load_model(other)
    assert [p for p in (tmp_path / "cache").iterdir() if p.is_dir()] == [entry]  # nothing written with the cache off


def test_a_gguf_first_load_without_torch_names_the_extra_and_a_cached_one_needs_none(tmp_path, monkeypatch,
                                                                                    llama_256):
    """transformers' GGUF reader imports torch: without it, a GGUF's first load says which extra to install;
    once converted, the model and tokenizer caches load it with no torch at all."""
    monkeypatch.setenv("JAXSERVE_MODEL_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", llama_256, "llama")
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "torch", None)  # what `import torch` and find_spec see with no torch
        with pytest.raises(ModelLoadError, match=r"needs torch .*jaxserve\[gguf\]"):
            load_model(path)
    first = load_model(path)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "torch", None)
        again = load_model(path)
    assert again.config == first.config
    assert again.tokenizer.encode("Hello") == first.tokenizer.encode("Hello")


# ----------------------------------------------------------------------------------------------
# Errors a user can cause: each is a ModelLoadError that names the problem


def test_nonexistent_path_is_a_load_error(tmp_path):
    """A typo in the model path says so instead of a FileNotFoundError from deep inside."""
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "no-such-model")


def test_directory_without_config_is_a_load_error(tmp_path):
    """A directory that is not a Hugging Face model (no config.json, no GGUF) is named as such."""
    (tmp_path / "README.md").write_text("not a model")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(tmp_path)


def test_non_gguf_file_is_a_load_error(tmp_path):
    """Passing a single file that is not a GGUF (e.g. model.safetensors itself) is named as such."""
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        load_model(path)


def test_unsupported_architecture_is_a_load_error(tmp_path):
    """A model family jaxserve has no forward pass for (GPT-2) is refused, naming it."""
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"])
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model(tmp_path)


def test_truncated_safetensors_is_a_load_error(tmp_path, tiny_hf_dirs):
    """A half-downloaded model.safetensors is reported as truncated, not as a safetensors panic."""
    source, _ = tiny_hf_dirs("llama")
    shutil.copytree(source, tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*truncated or corrupt"):
        load_model(tmp_path / "model")


def test_missing_tokenizer_is_a_load_error(tmp_path, tiny_hf_dirs):
    """A model directory without tokenizer files fails at load time, not at the first request."""
    source, _ = tiny_hf_dirs("llama")
    shutil.copytree(source, tmp_path / "model", ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer"):
        load_model(tmp_path / "model")


@pytest.mark.parametrize("fraction", [0.5, 0.99])
def test_truncated_gguf_is_a_load_error(tmp_path, llama_gguf_files, fraction):
    """A GGUF cut short (in the tensor data, or just its last bytes) is reported as truncated."""
    data = llama_gguf_files["Q8_0"].read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(path)


@pytest.mark.parametrize("qtype", ["Q8_K", "Q8_1"])
def test_a_type_the_gguf_package_cannot_dequantize_is_a_load_error(tmp_path, llama_256, qtype):
    """A GGUF holding a tensor type that `gguf.quants` cannot dequantize is refused, naming the type."""
    assert qtype not in gguf_tensor_types()
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", llama_256, "llama", [QType.F32, QType[qtype]])
    with pytest.raises(ModelLoadError, match=f"type {qtype}, which the installed gguf package cannot dequantize"):
        load_model(path)


def test_gguf_without_tokenizer_is_a_load_error(tmp_path, llama_256):
    """A GGUF without tokenizer metadata fails at load time with a message naming the tokenizer."""
    path = write_gguf(tmp_path / "no-tokenizer.gguf", llama_256, "llama", tokenizer=False)
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer"):
        load_model(path)


def test_unsupported_gguf_architecture_is_a_load_error(tmp_path, tiny_hf_dirs):
    """A GGUF of an architecture jaxserve does not run (here a llama written as 'gpt2') is refused."""
    _, model = tiny_hf_dirs("llama")
    path = write_gguf(tmp_path / "gpt2.gguf", model, "gpt2")
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2'"):
        load_model(path)


# ----------------------------------------------------------------------------------------------
# jaxserve checkpoints


@pytest.mark.parametrize("family", ["gemma3", "llama_untied"])
def test_checkpoint_round_trip_gives_identical_params_and_logits(tmp_path, tiny_hf_dirs, family):
    """save_checkpoint then load_model restores the config (local rope, per-layer sliding flags,
    eos ids), every param bit for bit, and a tokenizer that encodes the same."""
    source, _ = tiny_hf_dirs(family)
    original = load_model(source)
    restored = load_model(save_checkpoint(original, tmp_path / "ckpt"))
    assert restored.config == original.config
    flat_original = jax.tree_util.tree_leaves_with_path(original.params)
    flat_restored = dict(jax.tree_util.tree_leaves_with_path(restored.params))
    assert len(flat_restored) == len(flat_original)
    for key, value in flat_original:
        np.testing.assert_array_equal(np.asarray(flat_restored[key]), np.asarray(value), err_msg=str(key))
    np.testing.assert_array_equal(jax_logits(restored, PROMPT), jax_logits(original, PROMPT))
    assert restored.tokenizer.encode("héllo<|im_end|>") == original.tokenizer.encode("héllo<|im_end|>")


def test_checkpoint_into_non_empty_directory_is_a_load_error(tmp_path, tiny_hf_dirs):
    """Converting into a directory that already holds files refuses rather than mixing two models."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("user data")
    with pytest.raises(ModelLoadError, match="not empty"):
        save_checkpoint(load_model(tiny_hf_dirs("llama")[0]), tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "keep.txt").read_text() == "user data"


# ----------------------------------------------------------------------------------------------
# The default model


@pytest.fixture(scope="module")
def default_model():
    return load_model(None)


@pytest.mark.default_model
def test_default_model_config(default_model):
    """load_model(None) finds SmolLM2-135M-Instruct (Q4_1 GGUF) and reads its shape right."""
    cfg = default_model.config
    assert default_model.source == str(default_model_path())
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 9, 3)
    assert (cfg.head_dim, cfg.hidden_size, cfg.vocab_size) == (64, 576, 49152)
    assert cfg.tie_word_embeddings and "lm_head" not in default_model.params
    assert cfg.eos_token_ids and default_model.tokenizer.eos_token_id in cfg.eos_token_ids


@pytest.mark.default_model
def test_default_model_logits_match_transformers(default_model):
    """The real 30-layer model agrees with transformers loading the same GGUF (same dequantized
    weights): guards the llama.cpp q/k un-permutation with 9 query and 3 kv heads, and tied embeddings.
    The reference is the suite's shared one (tests/hf_gguf.py): transformers' read of the GGUF, or the float32
    copy that the process which read it stored after checking that it gives the read's logits bit for bit."""
    reference = hf_gguf.hf_model_of_gguf(default_model_path())
    assert sorted(p.name for p in hf_gguf.stored_copy(default_model_path()).iterdir()) == \
        ["config.json", "generation_config.json", "model.safetensors"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = default_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    token_ids = default_model.tokenizer.encode(prompt, add_special_tokens=False)
    assert max_abs_diff(jax_logits(default_model, token_ids), torch_logits(reference, token_ids)) <= 1e-3
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()  # tied


def test_a_stored_float32_copy_is_checked_against_the_model_it_came_from(tiny_model_dir, tmp_path):
    """hf_gguf's check of the copy it stores: it passes for a faithful copy and fails when one weight differs."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    hf_gguf.save_copy(model, tmp_path)
    hf_gguf.check_stored_copy(model, tmp_path)
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    with pytest.raises(AssertionError, match="does not give the logits"):
        hf_gguf.check_stored_copy(model, tmp_path)
