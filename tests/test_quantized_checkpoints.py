"""Checkpoints that declare their 8-bit weights in a `quantization_config` load and serve as they are.

Each test writes a tiny random llama as the quantizer tools write it: compressed-tensors W8A8 (int8 with
a scale per channel; fp8 with a scale per tensor) and vLLM's fp8 (a scale per tensor), every q/k/v/o and
gate/up/down matrix quantized, the LM head left in float (compressed-tensors' `ignore: ["lm_head"]`),
scales in bfloat16 as llm-compressor saves them. Beside each goes its float reference: the same model
with the dequantized weights. What must hold: the engine takes the checkpoint's quantization without the
flag (and refuses a conflicting one); the quantized matrices never pass through float (they load as
`QuantizedWeight`s and the C++ matmul packs the int8 integers as they are); the logits are the float
reference's within the activations' quantization error and greedy tokens agree; other quantization
methods and block-wise scales are refused by name.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import tiny_models
from jaxserve import LLM, SamplingParams
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelLoadError
from jaxserve.models.transformer import forward
from jaxserve.ops.packed_matmul import PackedWeight
from jaxserve.ops.quantized import QuantizedWeight
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.resolve import resolve_config
from jaxserve.weights import hf, load_model
from paged_helpers import SeqChunk, assign_pages, make_batch

PAGE_SIZE = 16
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (quant_method, 8-bit type, scale strategy) of each checkpoint written
FORMATS = {
    "compressed-tensors int8": ("compressed-tensors", "int8", "channel"),
    "compressed-tensors fp8": ("compressed-tensors", "fp8", "tensor"),
    "fp8": ("fp8", "fp8", "tensor"),
}
TORCH_TYPES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def _scheme(kind: str, strategy: str) -> dict:
    weights = dict(num_bits=8, type="int" if kind == "int8" else "float", strategy=strategy, symmetric=True,
                   dynamic=False, group_size=None, block_structure=None, actorder=None, observer="minmax",
                   observer_kwargs={})
    activations = dict(weights, strategy="token", dynamic=True, observer=None)
    return {"targets": ["Linear"], "weights": weights, "input_activations": activations, "output_activations": None}


def quantization_config(method: str, kind: str, strategy: str) -> dict:
    """The quantization_config the tools write into config.json: llm-compressor's compressed-tensors, or
    vLLM's / Hugging Face's fp8."""
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    return {"quant_method": "compressed-tensors", "format": "int-quantized" if kind == "int8" else "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": _scheme(kind, strategy)}, "global_compression_ratio": None}


def write_quantized(model: torch.nn.Module, source: Path, out: Path, reference: Path, method: str, kind: str,
                    strategy: str) -> None:
    """`model` (saved in `source`) quantized into `out`, and the float model of its dequantized weights
    into `reference`, each with source's tokenizer and config files."""
    dtype, largest = TORCH_TYPES[kind]
    quantized, dequantized = {}, {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        tensor = tensor.detach().float().clone()
        if name.rsplit(".", 2)[-2] in MATRICES:
            absmax = tensor.abs().amax(dim=1, keepdim=True) if strategy == "channel" else tensor.abs().amax()
            scale = (absmax / largest).to(torch.bfloat16)  # llm-compressor saves the scales in the model's dtype
            q = (tensor / scale.float()).clamp(-largest, largest)
            q = (q.round() if kind == "int8" else q).to(dtype)
            quantized[name], quantized[f"{name}_scale"] = q, scale.reshape(-1, 1) if strategy == "channel" else scale
            dequantized[name] = q.float() * scale.float()
        else:
            quantized[name] = dequantized[name] = tensor
    for directory, tensors in ((out, quantized), (reference, dequantized)):
        directory.mkdir(parents=True)
        for file in source.iterdir():
            if file.name != "model.safetensors":
                (directory / file.name).write_bytes(file.read_bytes())
        save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, kind, strategy)
    (out / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (quantized checkpoint, its float reference), for every FORMATS entry on a tied llama and
    for compressed-tensors int8 on an untied one (a float LM head beside the quantized matrices)."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for family in ("llama", "llama_untied"):
        source = root / family
        model = tiny_models.make_tiny_model(family, source, attention_std=0.1, embedding_std=1.0)
        for name, (method, kind, strategy) in FORMATS.items():
            if family == "llama_untied" and name != "compressed-tensors int8":
                continue
            key = name if family == "llama" else f"{name} untied"
            directory = root / key.replace(" ", "_")
            write_quantized(model, source, directory, root / f"{directory.name}_reference", method, kind, strategy)
            out[key] = (directory, root / f"{directory.name}_reference")
    return out


def _runner(path, **settings) -> ModelRunner:
    model = load_model(path, "float32")
    cfg = EngineConfig(**{**dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=24),
                          **settings})
    return ModelRunner(model.config, resolve_config(cfg, model.config, source=model.source), model.params)


def _logits(runner: ModelRunner) -> np.ndarray:
    """Logits of every row of three prompts (40, 23 and 9 tokens) through the runner's params."""
    tables = assign_pages([40, 23, 9], PAGE_SIZE, 24, seed=1)
    rng = np.random.default_rng(0)
    chunks = [SeqChunk(rng.integers(0, 259, n).tolist(), 0, t) for n, t in zip((40, 23, 9), tables)]
    batch = make_batch(chunks, page_size=PAGE_SIZE, pages_per_seq=8, num_tokens=96, num_seqs=4)
    run = jax.jit(functools.partial(forward, cfg=runner.model_cfg, q_tile=16, kv_tile=32,
                                    attention_backend=runner.attention_backend))
    logits, _ = run(runner.params, token_ids=batch.token_ids, positions=batch.positions, kv_cache=runner.kv_cache,
                    md=batch.md, logits_indices=batch.logits_indices)
    return np.asarray(logits)[np.concatenate(batch.rows), :runner.model_cfg.vocab_size]


@pytest.mark.parametrize("name", [*FORMATS, "compressed-tensors int8 untied"])
def test_the_weights_are_the_checkpoints_numbers(checkpoints, name):
    """Each loaded matrix, data times its per-column scale (a per-tensor scale broadcast), is the float
    reference's matrix to float32 rounding; the float tensors load as before."""
    path, reference = checkpoints[name]
    got, want = load_model(path, "float32"), load_model(reference, "float32")
    assert got.config.quantization == FORMATS[name.removesuffix(" untied")][1]
    assert want.config.quantization is None
    for param, w in got.params["layers"].items():
        expected = np.asarray(want.params["layers"][param])
        if param.startswith("w"):
            assert isinstance(w, QuantizedWeight) and w.scale.shape == expected.shape[::2]
            np.testing.assert_allclose(np.asarray(w.dequantize()), expected, rtol=1e-6, atol=0, err_msg=param)
        else:
            np.testing.assert_array_equal(np.asarray(w), expected, err_msg=param)


@pytest.mark.parametrize("name", [*FORMATS, "compressed-tensors int8 untied"])
@pytest.mark.parametrize("matmul_backend", ["auto", "xla"])
def test_logits_match_the_dequantized_float_model(checkpoints, name, matmul_backend):
    """The checkpoint's logits are its float reference's within the per-token quantization of the
    activations (the weights are the same numbers on both sides), and their argmax agrees: the C++
    matmul (a CPU's default for int8 and fp8: fp8 as W8A16) and XLA's 8-bit dot (W8A8)."""
    path, reference = checkpoints[name]
    runner = _runner(path, matmul_backend=matmul_backend)
    kind = FORMATS[name.removesuffix(" untied")][1]
    assert runner.cfg.quantization == kind  # taken from the checkpoint: no flag given
    got, want = _logits(runner), _logits(_runner(reference))
    # int8 activations keep ~1/127 of each row's largest value, float8 e4m3 three mantissa bits (~1/16)
    rms, largest = (0.025, 0.1) if kind == "int8" else (0.08, 0.3)
    error = np.abs(got - want) / want.std()
    assert np.sqrt(np.mean(error**2)) < rms and error.max() < largest, (name, np.sqrt(np.mean(error**2)), error.max())
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95, name


@pytest.mark.parametrize("matmul_backend", ["auto", "xla"])
def test_an_int8_checkpoint_serves_what_the_flag_makes_of_its_float_model(checkpoints, matmul_backend):
    """Per-channel int8 scales are what quantization='int8' computes from the dequantized float weights, so
    the checkpoint and the flag on its float reference give the same logits, bit for bit: the loader
    and the packing keep the file's integers and scales exactly."""
    path, reference = checkpoints["compressed-tensors int8 untied"]
    got = _logits(_runner(path, matmul_backend=matmul_backend))
    want = _logits(_runner(reference, matmul_backend=matmul_backend, quantization="int8"))
    np.testing.assert_array_equal(got, want)


def test_the_quantized_matrices_never_pass_through_float(checkpoints, monkeypatch):
    """No float copy of a quantized matrix is made: the loader converts only the float tensors (norms,
    embeddings, the LM head) to float32, the matrices load as QuantizedWeights holding the file's int8,
    and the C++ matmul packs those integers and scales as they are (nothing quantized or rounded again);
    the runner then holds about one byte per matrix parameter."""
    path, _ = checkpoints["compressed-tensors int8 untied"]
    converted = []
    from_hf = hf.from_hf
    monkeypatch.setattr(hf, "from_hf", lambda cfg, name, array: converted.append(name) or from_hf(cfg, name, array))
    def refuse(*args, **kwargs):
        raise AssertionError("a quantized checkpoint's matrix quantized or dequantized again")

    monkeypatch.setattr(QuantizedWeight, "quantize", classmethod(refuse))
    monkeypatch.setattr(QuantizedWeight, "dequantize", refuse)
    model = load_model(path, "float32")
    assert sorted(set(converted)) == ["attn_norm", "embed", "final_norm", "lm_head", "mlp_norm"]
    matrices = {name: w for name, w in model.params["layers"].items() if name.startswith("w")}
    assert all(isinstance(w, QuantizedWeight) and w.data.dtype == np.int8 for w in matrices.values())
    # The lm_head is float (ignored by the quantizer): packing it in int8 is the one quantization at load.
    monkeypatch.setattr(PackedWeight, "pack", classmethod(
        lambda cls, w, *a, **k: _pack_only_the_lm_head(cls, w, model.config, *a, **k)))
    runner = ModelRunner(model.config, EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                                                     num_kv_pages=24), model.params)
    assert runner.resolved.packed_dtype == "int8"
    layer = runner.params["layers"][0]
    assert all(isinstance(layer[name], PackedWeight) and layer[name].data.dtype == np.uint8
               for name in ("w_qkv", "wo", "w_gate_up", "w_down"))
    # the packed integers are the file's own: w_down's first column
    file = hf.SafetensorsFiles(lambda name: path / "model.safetensors")
    down = np.asarray(file.get("model.layers.0.mlp.down_proj.weight"))  # [hidden, intermediate] int8
    packed = layer["w_down"].columns(np.arange(1)) / layer["w_down"].scale[:1, None]
    np.testing.assert_array_equal(np.round(np.asarray(packed)), down[:1].astype(np.float32))
    matrix_params = sum(int(np.prod(w.shape)) for w in matrices.values())
    float_bytes = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.params)) - 3 * matrix_params
    assert runner.device_weight_bytes < float_bytes, "the serving params hold more than the loaded ones"


_PACK = PackedWeight.pack.__func__


def _pack_only_the_lm_head(cls, w, model_cfg, *args, **kwargs):
    assert w.shape == (model_cfg.hidden_size, model_cfg.vocab_size), f"a {w.shape} matrix quantized at load"
    return _PACK(cls, w, *args, **kwargs)


@pytest.mark.parametrize("name", ["compressed-tensors int8", "compressed-tensors fp8"])
def test_the_engine_serves_the_checkpoint_without_the_flag(checkpoints, name):
    """LLM(path) serves a quantized checkpoint with its own quantization, gives the float reference's
    greedy tokens on a short prompt, and compiles nothing after warm-up."""
    path, reference = checkpoints[name]
    settings = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_pages=16,
                    forbid_compilation_after_warmup=True)
    prompt = [{"prompt_token_ids": list(b"The quick brown fox")}]
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(str(path), **settings)
    assert llm.config.quantization == FORMATS[name][1]
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    want = LLM(str(reference), **settings).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_a_conflicting_flag_is_refused(checkpoints):
    """quantization='fp8' on an int8 checkpoint is an error naming both; the matching flag is accepted."""
    path, _ = checkpoints["compressed-tensors int8"]
    with pytest.raises(ValueError, match=r"quantization='fp8'.*stored in int8"):
        _runner(path, quantization="fp8")
    assert _runner(path, quantization="int8").cfg.quantization == "int8"


def test_vllm_names_of_a_checkpoints_own_format_are_checked_against_it(checkpoints):
    """quantization='compressed-tensors' (vLLM's name for such a checkpoint) serves its weights as stored
    and is refused, by name, for a float checkpoint; 'gguf' is refused for anything but a .gguf file."""
    path, reference = checkpoints["compressed-tensors int8"]
    runner = _runner(path, quantization="compressed-tensors")
    assert runner.cfg.quantization == "int8" and runner.resolved.packed_dtype == "int8"
    with pytest.raises(ValueError, match=r"quantization='compressed-tensors'.*declares no quantization_config"):
        _runner(reference, quantization="compressed-tensors")
    with pytest.raises(ValueError, match=r"quantization='gguf'.*is not a \.gguf file"):
        _runner(path, quantization="gguf")


def _with_config(checkpoints, tmp_path, change) -> Path:
    """A copy of the compressed-tensors int8 checkpoint whose quantization_config `change` rewrites."""
    source, _ = checkpoints["compressed-tensors int8"]
    out = tmp_path / "changed"
    out.mkdir()
    for file in source.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = change(copy.deepcopy(config["quantization_config"]))
    (out / "config.json").write_text(json.dumps(config))
    return out


def _weights(group: str, **changes):
    def change(config):
        config["config_groups"][group]["weights"].update(changes)
        return config
    return change


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: {"quant_method": "awq", "bits": 4, "group_size": 128}, r"method 'awq'"),
    (lambda c: {"quant_method": "gptq", "bits": 4, "group_size": 128}, r"method 'gptq'"),
    (lambda c: {"quant_method": "bitsandbytes", "load_in_4bit": True}, r"method 'bitsandbytes'"),
    (lambda c: {"quant_method": "fp8", "weight_block_size": [128, 128]}, r"block-wise fp8"),
    (_weights("group_0", num_bits=4, strategy="group", group_size=128), r"group 'group_0' has weights"),
    (_weights("group_0", symmetric=False), r"symmetric 8-bit"),
    (lambda c: {**c, "format": "pack-quantized"}, r"format 'pack-quantized'"),
])
def test_other_quantizations_are_refused_by_name(checkpoints, tmp_path, change, message):
    """AWQ, GPTQ, bitsandbytes, block-wise fp8, group-wise, asymmetric or packed compressed-tensors: a
    ModelLoadError that names what the checkpoint declares."""
    with pytest.raises(ModelLoadError, match=message):
        load_model(_with_config(checkpoints, tmp_path, change), "float32")


def test_block_wise_scales_are_refused_by_name(checkpoints, tmp_path):
    """A weight_scale_inv tensor (DeepSeek-style 128x128 blocks) is refused even where the config does not
    say weight_block_size."""
    source, _ = checkpoints["fp8"]
    out = tmp_path / "blocks"
    out.mkdir()
    for file in source.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[f"{name}_scale_inv"] = tensors.pop(f"{name}_scale")
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ModelLoadError, match="block-wise scales"):
        load_model(out, "float32")


def test_a_q8_0_gguf_serves_from_int8_weights(tmp_path):
    """A Q8_0 GGUF loaded with quantization='int8' is served from int8 weights (on a CPU the C++ matmul's
    packed int8, the tied LM head the one copy of the embeddings) holding at most 1.1 bytes per parameter
    (scales, column sums, norms and rope tables included), and its logits are those of the same file
    dequantized to float32 within the int8 requantization (each column's scale in place of Q8_0's
    per-32 block scales) and the activations' quantization."""
    import gguf_files
    from gguf import GGMLQuantizationType

    # Widths that fill whole int8 panels (48 columns) and Q8_0 blocks (32): a tiny model's padding is not
    # what the bound is about (SmolLM2-135M's 576 and 1536 need none)
    model = tiny_models.make_tiny_model("llama", tmp_path / "hf", embedding_std=1.0, hidden_size=384,
                                        intermediate_size=768, num_attention_heads=8, num_key_value_heads=4,
                                        head_dim=48)
    path = gguf_files.write_gguf(tmp_path / "tiny.Q8_0.gguf", model, "llama", GGMLQuantizationType.Q8_0)
    runner = _runner(path, quantization="int8", max_model_len=64)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(load_model(path, "float32").params))
    assert runner.resolved.packed_dtype == "int8"
    assert all(isinstance(w, PackedWeight) and w.data.dtype == np.uint8
               for w in [*runner.params["layers"][0].values(), runner.params["lm_head"]] if isinstance(w, PackedWeight))
    assert runner.device_weight_bytes / num_params <= 1.1, runner.device_weight_bytes / num_params
    got, want = _logits(runner), _logits(_runner(path, max_model_len=64))
    error = np.abs(got - want) / want.std()
    assert np.sqrt(np.mean(error**2)) < 0.03 and np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95
    # vLLM's name for keeping a GGUF quantized: the same int8 weights and logits
    kept = _runner(path, quantization="gguf", max_model_len=64)
    assert kept.cfg.quantization == "int8" and kept.resolved.packed_dtype == "int8"
    np.testing.assert_array_equal(_logits(kept), got)


def test_tensor_parallelism_over_a_quantized_checkpoint_is_refused_by_name(checkpoints):
    """Its lazy load (what tensor parallelism reads) says so, instead of failing inside the sharding."""
    path, _ = checkpoints["compressed-tensors int8"]
    with pytest.raises(ModelLoadError, match="tensor parallelism over a quantized checkpoint"):
        load_model(path, "float32", lazy=True)
