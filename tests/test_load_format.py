"""`load_format="dummy"` (`--load-format dummy`): a Hugging Face directory with only config.json and a
tokenizer serves with random weights made on the device; "auto" still needs the weight files."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.cli import build_parser
from jaxserve.config.model_config import ModelLoadError
from jaxserve.config.engine_config import EngineConfig, engine_config_from_args
from jaxserve.models.params import param_shapes
from jaxserve.weights import load_model
from tiny_models import byte_tokenizer, hf_config


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory):
    """A tiny Llama's config.json and tokenizer files, and no safetensors."""
    directory = tmp_path_factory.mktemp("config_only")
    hf_config("llama_untied").save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def test_dummy_params_have_the_layout_and_are_finite(config_only_dir):
    """The loaded model holds shapes and a draw function; drawn, the params are the layout's, finite."""
    loaded = load_model(config_only_dir, "bfloat16", load_format="dummy")
    layout = jax.tree.map(tuple, param_shapes(loaded.config), is_leaf=lambda x: isinstance(x, tuple))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(loaded.params))
    params = jax.jit(loaded.draw)()
    assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(lambda x: x.shape, loaded.params) == layout
    assert "lm_head" in params  # untied: every kind of leaf is drawn
    for leaf in jax.tree.leaves(params):
        assert isinstance(leaf, jax.Array) and leaf.dtype == jnp.bfloat16 and bool(jnp.isfinite(leaf).all())
    assert bool((params["final_norm"] == 1).all())
    assert 0.01 < float(jnp.std(params["layers"]["wq"].astype(jnp.float32))) < 0.03
    assert "random weights" in loaded.source


def test_the_same_seed_gives_the_same_params(config_only_dir):
    """Benchmarks must be repeatable: the seed alone decides the weights."""
    first, again, other = (jax.jit(load_model(config_only_dir, "float32", load_format="dummy", seed=seed).draw)()
                           for seed in (3, 3, 4))
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)))
    assert not bool((first["layers"]["wq"] == other["layers"]["wq"]).all())


def test_auto_still_needs_the_weight_files(config_only_dir):
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(config_only_dir, "float32")


def test_dummy_needs_a_hugging_face_directory(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="needs a Hugging Face model directory with config.json"):
        load_model(gguf, "float32", load_format="dummy")


def test_llm_generates_from_a_config_only_directory(config_only_dir, capsys):
    """The start-up line says the weights are random, so nobody mistakes the outputs for the model's."""
    llm = LLM(config_only_dir, load_format="dummy", attention_backend="xla", matmul_backend="xla",
              max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, num_kv_pages=10)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4
    assert "with random weights (load_format='dummy')" in capsys.readouterr().err


def test_a_bad_load_format_is_refused_by_name():
    with pytest.raises(ValueError, match=r"load_format='safetensors' must be one of \('auto', 'dummy'\)"):
        EngineConfig(load_format="safetensors")
    with pytest.raises(ValueError, match="load_format='dummy' does not support tensor parallelism"):
        EngineConfig(load_format="dummy", tensor_parallel_size=2)


def test_the_flag_parses():
    args = build_parser().parse_args(["serve", "some/dir", "--load-format", "dummy"])
    assert engine_config_from_args(args).load_format == "dummy"
    assert engine_config_from_args(build_parser().parse_args(["serve"])).load_format == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--load-format", "pt"])


def test_the_runner_draws_the_weights_in_its_own_layout(config_only_dir):
    """No copy of the weights but the runner's ever exists: on an H100 a freed loader copy of the 8B shape
    left a hole that split the memory the KV pool needs whole. The runner's weights are the drawn ones,
    converted: the engine's greedy tokens equal those of the same draw loaded as plain arrays."""
    from jaxserve.core.engine import LLMEngine
    from jaxserve.weights import LoadedModel

    settings = dict(attention_backend="xla", matmul_backend="xla", max_model_len=32, max_num_seqs=2,
                    max_num_batched_tokens=16, block_size=8, num_kv_pages=10)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def tokens(engine) -> list[int]:
        request = engine.add_request([1, 2, 3], params)
        while engine.has_unfinished:
            engine.step()
        return request.output_token_ids

    loaded = load_model(config_only_dir, "float32", load_format="dummy", seed=5)
    drawn = jax.jit(loaded.draw)()
    plain = LoadedModel(loaded.config, drawn, loaded.tokenizer, "the same draw, as arrays")
    engine = LLMEngine(loaded, EngineConfig(**settings))
    assert engine.model.params is None and engine.model.draw is None  # nothing kept beside the runner's
    assert tokens(engine) == tokens(LLMEngine(plain, EngineConfig(**settings)))
