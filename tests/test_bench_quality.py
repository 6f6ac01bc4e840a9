"""`jaxserve bench quality` (jaxserve/bench/quality.py) on tiny random models: the chunked, paged perplexity
against Hugging Face's, the greedy comparison, the command end to end, and the shipped text."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny_models
from jaxserve.bench import quality
from jaxserve.config.engine_config import EngineConfig
from jaxserve.cli import main
from jaxserve.llm import LLM

# Small limits keep warm-up to three executables: one prompt bucket, two decode buckets.
# float32 by name: the losses are compared with Hugging Face's float32 ones
LIMITS = dict(max_num_seqs=2, max_num_batched_tokens=16, block_size=16, dtype="float32")
NUM_TOKENS = 200


def make_model(directory: Path, seed: int):
    # Larger attention and embedding weights than the default init: each token's loss then depends on
    # the whole context (perplexity over 64-token windows is ~20% off), so a chunk that failed to read
    # the earlier chunks' pages would show.
    return tiny_models.make_tiny_model("llama", directory, seed, attention_std=0.3, embedding_std=0.3)


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    directory = tmp_path_factory.mktemp("quality_a")
    return directory, make_model(directory, seed=0)


@pytest.fixture(scope="module")
def llm_a(model_a):
    return LLM(str(model_a[0]), **LIMITS)


def hf_nlls(torch_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logprobs = torch.log_softmax(torch_model(torch.tensor([ids])).logits[0].float(), dim=-1).numpy()
    return -logprobs[np.arange(len(ids) - 1), ids[1:]]


@pytest.mark.parametrize("chunk_size", [24, 64])
def test_chunked_perplexity_matches_hugging_face(model_a, llm_a, chunk_size):
    """The engine's forward fed the text in chunks (24: chunks start inside a page; 64: on page boundaries),
    each reading the earlier ones back through reversed pages, gives HF's per-token losses and perplexity
    at float32: guards the chunk layout, the slot mapping, kv_lens and the targets' offset by one."""
    ids = llm_a.tokenizer.encode(quality.load_text(), add_special_tokens=False)[:NUM_TOKENS]
    expected = hf_nlls(model_a[1], ids)
    actual = quality.token_nlls(llm_a, ids, chunk_size)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=2e-4)
    ppl, hf_ppl = np.exp(actual.mean()), np.exp(expected.mean())
    assert abs(ppl / hf_ppl - 1) < 1e-4, (ppl, hf_ppl)


def test_compare_greedy_reports_the_first_differing_token():
    """A planted difference is found at its position, an output that stops early at the shorter one's end,
    and equal outputs are not reported."""
    tokenizer = tiny_models.byte_tokenizer()
    a, b, c = ([tokenizer.encode(text, add_special_tokens=False)] for text in ("Hi!", "Hi?", "H"))
    assert quality.compare_greedy(a, a, tokenizer) == []
    (d,) = quality.compare_greedy(a, b, tokenizer)
    assert (d.prompt, d.position, d.common_text, d.reference_text, d.text) == (0, 2, "Hi", "!", "?")
    (d,) = quality.compare_greedy(a, c, tokenizer)
    assert (d.position, d.common_text, d.reference_text, d.text) == (1, "H", "i!", "")


def test_greedy_of_another_model_is_reported_with_positions(tmp_path, llm_a):
    """Twelve prompts of one model against themselves agree; against a model of other weights, every
    reported difference is at the first token where the outputs part."""
    make_model(tmp_path, seed=1)
    prompts = quality.greedy_prompts(llm_a.tokenizer)
    assert len(prompts) == 12
    tokens_a = quality.greedy_tokens(llm_a, prompts)
    assert quality.compare_greedy(tokens_a, quality.greedy_tokens(llm_a, prompts), llm_a.tokenizer) == []
    llm_b = LLM(str(tmp_path), **LIMITS)
    tokens_b = quality.greedy_tokens(llm_b, prompts)
    differences = quality.compare_greedy(tokens_a, tokens_b, llm_a.tokenizer)
    assert differences
    for d in differences:
        a, b = tokens_a[d.prompt], tokens_b[d.prompt]
        assert a[:d.position] == b[:d.position]
        assert d.position == min(len(a), len(b)) or a[d.position] != b[d.position]


def test_label_names_only_the_settings_given():
    """Settings __post_init__ fills in (max_cpu_loras from max_loras, lora_modules as a tuple) are not
    named as if given."""
    assert quality.settings_label(EngineConfig()) == "defaults"
    assert quality.settings_label(EngineConfig(quantization="int8", max_loras=2, enable_lora=True)) == (
        "quantization=int8 enable_lora=True max_loras=2 max_cpu_loras=2")


def test_reference_keeps_only_the_weights_and_limits():
    """The float32 reference takes the weights' settings and the engine's limits, never a numeric setting of
    the one measured (quantization, KV pages, backends), whatever its name."""
    settings = {"load_format": "dummy", "seed": 3, "max_num_seqs": 2, "kv_cache_dtype": "bfloat16",
                "matmul_backend": "cpu-bf16", "quantization": "int8", "dtype": "bfloat16"}
    assert quality.reference_settings(settings) == {"load_format": "dummy", "seed": 3, "max_num_seqs": 2,
                                                    "dtype": "float32", "kv_cache_dtype": "float32"}


def test_command_runs_end_to_end(model_a, tmp_path, capsys):
    """`jaxserve bench quality` at --dtype float32 against the float32 reference: the table, 12/12 greedy
    agreement, equal perplexities, and the JSON."""
    output = tmp_path / "quality.json"
    main(["bench", "quality", "--model", str(model_a[0]), "--max-tokens", "100", "--chunk-size", "32",
          "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--dtype", "float32", "--output", str(output)])
    printed = capsys.readouterr().out
    assert "| float32 (reference) |" in printed and "12/12" in printed
    result = json.loads(output.read_text())
    assert result["num_tokens"] == 100
    assert result["greedy"] == {"num_prompts": 12, "num_equal": 12, "differences": []}
    assert result["perplexity_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert result["setting"]["label"] == "max_num_seqs=2 max_num_batched_tokens=16 dtype=float32"


def test_the_text_ships_with_the_package():
    """The text is package data (the command runs from an installed package)."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["jaxserve"]
    assert "bench/data/*.txt" in patterns
    assert quality.TEXT_PATH.match("jaxserve/bench/data/*.txt")


@pytest.mark.default_model
def test_the_text_holds_4000_tokens_of_the_default_model():
    """The issue asks for at least 4,000 tokens of the default model's tokenizer."""
    from jaxserve.weights import load_tokenizer

    assert len(load_tokenizer(None).encode(quality.load_text(), add_special_tokens=False)) >= 4000


def _benchmark(name: str):
    """benchmarks/<name>.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quality_split():
    return _benchmark("quality_split")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_weight_only_product_is_the_dequantized_weights_dot_with_the_input_as_it_is(kind):
    """benchmarks/quality_split.py's weight-only matmul: x times the weights' dequantization, x not
    quantized; the served W8A8 product (x rounded to 8 bits too) differs from it."""
    import jax.numpy as jnp

    from jaxserve.ops import quantized

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    w = quantized.QuantizedWeight.quantize(rng.standard_normal((64, 24)).astype(np.float32), kind)
    weight_only = np.asarray(_quality_split().weight_only_matmul(x, w))
    np.testing.assert_allclose(weight_only, np.asarray(x) @ np.asarray(w.dequantize()), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(quantized.matmul(x, w)) - weight_only).max() > 1e-3


def test_the_quality_split_measures_three_engines_and_the_weight_only_one_is_neither_other(model_a):
    """The split's three engines on a tiny model: float32, fp8 as served and fp8 weights only. The
    weight-only engine runs XLA's dot with the weights widened (its perplexity is neither float32's nor
    the served W8A8's), and the served one is back in place afterwards."""
    from jaxserve.ops import quantized

    served_matmul = quantized.matmul
    reference, served, weights = _quality_split().split(str(model_a[0]), "fp8", max_tokens=64, base=LIMITS)
    assert quantized.matmul is served_matmul
    assert "fp8 weights" in served.resolved and "xla matmul" in weights.resolved
    assert len({reference.perplexity, served.perplexity, weights.perplexity}) == 3


def _quality_rounding():
    return _benchmark("quality_rounding")


def test_int8_rounding_by_groups_puts_each_group_on_its_own_grid_of_255_steps():
    """benchmarks/quality_rounding.py's int8/G: each group of G along the contraction axis lands on
    multiples of its own max |a| / 127, within half a step of a, its largest value kept exactly; int8 (no
    G) is one group; bf16 is bfloat16's rounding; a scheme it cannot read is refused by name."""
    module = _quality_rounding()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 6)).astype(np.float32) * np.linspace(0.1, 10, 64, dtype=np.float32)[:, None]
    for group in (16, 32, 0):
        q = module.rounded(a, module.parse_rounding(f"int8/{group}" if group else "int8"), axis=0)
        size = group or 64
        for g in range(64 // size):
            block, qblock = a[g * size:(g + 1) * size], q[g * size:(g + 1) * size]
            step = np.abs(block).max(axis=0) / 127
            np.testing.assert_allclose(qblock / step, np.round(qblock / step), atol=1e-3)
            assert (np.abs(qblock - block) <= step / 2 + 1e-6).all()
            np.testing.assert_allclose(np.abs(qblock).max(axis=0), np.abs(block).max(axis=0), rtol=1e-6)
    # the groups follow the contraction axis: rows of 16 rounded as a whole differ from columns of 16
    by_rows = module.rounded(a.T, module.parse_rounding("int8/16"), axis=1)
    np.testing.assert_allclose(by_rows, module.rounded(a, module.parse_rounding("int8/16"), axis=0).T)
    assert np.abs(module.rounded(a, module.parse_rounding("int8/16"), axis=0) - a).max() < \
        np.abs(module.rounded(a, module.parse_rounding("int8"), axis=0) - a).max()
    bf16 = module.rounded(a, module.parse_rounding("bf16"), axis=0)
    np.testing.assert_array_equal(bf16, np.asarray(torch.from_numpy(a).to(torch.bfloat16).float()))
    assert module.rounded(a, None, axis=0) is not None and module.parse_rounding("none") is None
    for bad in ("int4", "int8/0", "int8/x", "fp8"):
        with pytest.raises(ValueError, match="rounding"):
            module.parse_rounding(bad)
    with pytest.raises(ValueError, match="not a multiple"):
        module.rounded(a, ("int8", 48), axis=0)


def test_the_rounding_schemes_run_on_the_quantized_path_and_leave_it_as_it_was(model_a):
    """none:none through the patched quantized path is float32 itself (same perplexity, same greedy
    tokens), each rounding moves the perplexity, and the served quantize and matmul are back afterwards."""
    from jaxserve.ops import quantized

    module = _quality_rounding()
    served = quantized.QuantizedWeight.__dict__["quantize"], quantized.matmul
    reference, plain, bf16, int8 = module.evaluate_schemes(str(model_a[0]), ["none:none", "bf16:bf16", "int8:int8/16"],
                                                           max_tokens=64, base=LIMITS)
    assert (quantized.QuantizedWeight.__dict__["quantize"], quantized.matmul) == served
    assert "int8 weights" in plain.resolved and "xla matmul" in plain.resolved
    np.testing.assert_allclose(plain.perplexity, reference.perplexity, rtol=1e-5)
    assert plain.greedy == reference.greedy
    assert len({reference.perplexity, bf16.perplexity, int8.perplexity}) == 3


def test_the_rounding_touches_only_the_matrices_named(monkeypatch):
    """--matrices: each scheme's engine is built with the layer matrices it names on the patched path and the
    LM head there only if named (the engine's own lists are back afterwards), and an unknown name is refused.
    Checked where the engines are built (quality.evaluate stands in), not through a tiny model's perplexity,
    which rounding one small matrix moves by about 4e-6."""
    import types

    from jaxserve.models import transformer
    from jaxserve.ops import quantized

    module = _quality_rounding()
    lists = transformer.MATRICES, transformer.QUANTIZED_LM_HEADS
    seen = []
    w = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)

    def evaluate(model, settings, label, max_tokens):
        rounded = quantized.QuantizedWeight.quantize(w, "int8").data if "quantization" in settings else None
        seen.append((label, settings.get("quantization"), transformer.MATRICES, transformer.QUANTIZED_LM_HEADS,
                     rounded))
        return types.SimpleNamespace(num_tokens=max_tokens)

    monkeypatch.setattr(quality, "evaluate", evaluate)
    module.evaluate_schemes("m", ["int8/16:none"], max_tokens=64, matrices=("w_down",))
    module.evaluate_schemes("m", ["int8:none"], max_tokens=64, matrices=("w_qkv", "lm_head"))
    assert [row[:4] for row in seen] == [
        ("float32", None, lists[0], lists[1]), ("int8/16:none", "int8", ("w_down",), ()),
        ("float32", None, lists[0], lists[1]), ("int8:none", "int8", ("w_qkv",), ("int8",))]
    np.testing.assert_array_equal(seen[1][4], module.rounded(w, ("int8", 16), axis=-2))
    np.testing.assert_array_equal(seen[3][4], module.rounded(w, ("int8", 0), axis=-2))
    assert (transformer.MATRICES, transformer.QUANTIZED_LM_HEADS) == lists
    with pytest.raises(ValueError, match="unknown matrices"):
        module.evaluate_schemes("m", ["int8:none"], matrices=("w_up",))
