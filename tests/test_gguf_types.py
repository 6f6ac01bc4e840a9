"""Every GGUF tensor type the `gguf` package can dequantize loads through `load_model`, value for value,
and a type it cannot is refused with an error that names the tensor and the type.

Each file is a one-layer llama written as llama.cpp writes it (`gguf_files.py`), every matrix in one
type, with rows of 256 values so that every type's blocks fit. It is loaded the way a user's file is
(metadata, tokenizer, conversion), and every param is compared with what the file holds: the tensor's
bytes dequantized by the `gguf` package, its q/k rows put back in Hugging Face's order by this module's
own inverse of llama.cpp's permutation, in jaxserve's input-major layout. For the types
`gguf.quants.quantize` can write, the file holds the model's own weights, so the loaded params must
also follow the original float weights; for the others it holds random blocks of finite values.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType

import tiny_models
from gguf_files import gguf_tensor_name, llama_cpp_permute, write_gguf
from jaxserve.config.model_config import ModelLoadError
from jaxserve.weights import gguf_tensor_types, load_model

UNSUPPORTED_TYPES = [t.name for t in QType if t.name not in gguf_tensor_types()]
GLOBAL_PARAMS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
LAYER_PARAMS = {  # a llama layer's Hugging Face names (under model.layers.0.) -> jaxserve's
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
# How closely each type's loaded matrices follow the original weights (correlation), for the types
# gguf.quants.quantize can write; ternary TQ types keep only a sign and a zero per weight. Reading the
# wrong block, scale or row order gives a correlation near 0.
MIN_CORRELATION = {"F32": 0.999999, "F16": 0.999999, "BF16": 0.99999, "Q8_0": 0.9999, "Q5_0": 0.995, "Q5_1": 0.995,
                   "Q4_0": 0.99, "Q4_1": 0.99, "MXFP4": 0.98, "TQ2_0": 0.6, "TQ1_0": 0.6}


@pytest.fixture(autouse=True)
def _throwaway_caches(monkeypatch, tmp_path):
    """Each file is loaded once: no model cache, and its tokenizer cached under the test's own directory."""
    monkeypatch.setenv("JAXSERVE_MODEL_CACHE", "off")
    monkeypatch.setenv("JAXSERVE_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))


@pytest.fixture(scope="module")
def llama_1_layer() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tiny_models.VOCAB_SIZE, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def values_in_file(path, model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Hugging Face name -> the tensor `path` holds for it, dequantized, in torch's layout and row order."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    values = {}
    for hf_name, original in model.state_dict().items():
        tensor = tensors[gguf_tensor_name(hf_name)]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(original.shape)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = model.config.num_attention_heads if "q_proj" in hf_name else model.config.num_key_value_heads
            written_order = llama_cpp_permute(np.arange(len(array))[:, None], heads)[:, 0]
            unpermuted = np.empty_like(array)
            unpermuted[written_order] = array
            array = unpermuted
        values[hf_name] = array
    return values


def loaded_param(params: dict, hf_name: str) -> np.ndarray:
    """jaxserve's param for a Hugging Face name, back in torch's [out, in] layout for matrices."""
    if hf_name in GLOBAL_PARAMS:
        array = np.asarray(params[GLOBAL_PARAMS[hf_name]])
        return array.T if hf_name == "lm_head.weight" else array
    array = np.asarray(params["layers"][LAYER_PARAMS[hf_name.removeprefix("model.layers.0.")]][0])
    return array if array.ndim == 1 else array.T


@pytest.mark.parametrize("qtype", gguf_tensor_types())
def test_each_type_loads_the_values_its_file_holds(tmp_path, llama_1_layer, qtype):
    """Guards each type's dequantization and reshape (block and super-block layouts), the llama q/k
    un-permutation and the transposes, tensor by tensor, through the loader a user's file goes through."""
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", llama_1_layer, "llama", QType[qtype])
    matrix_types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
    assert matrix_types == {qtype}
    params = load_model(path).params
    expected = values_in_file(path, llama_1_layer)
    assert len(expected) == len(GLOBAL_PARAMS) + len(LAYER_PARAMS)
    for hf_name, values in expected.items():
        assert np.isfinite(values).all() and np.abs(values).max() > 0, hf_name  # a test that can tell
        np.testing.assert_array_equal(loaded_param(params, hf_name), values, err_msg=f"{qtype} {hf_name}")
    if qtype in MIN_CORRELATION:  # the file holds the model's own weights, quantized
        for hf_name, original in llama_1_layer.state_dict().items():
            if original.ndim == 1:
                continue  # norms are written in F32 whatever the type, and start as all ones
            correlation = np.corrcoef(loaded_param(params, hf_name).ravel(), original.numpy().ravel())[0, 1]
            assert correlation >= MIN_CORRELATION[qtype], (qtype, hf_name, correlation)


def test_the_types_that_load_include_llama_cpps_usual_quant_mixes():
    """Q4_K_M and Q5_K_M files hold Q5_0, Q5_1, Q8_0 and Q6_K tensors besides their K-quants; the
    smaller mixes Q2_K and Q3_K; imatrix and ternary quants the IQ and TQ types."""
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
            "IQ2_XXS", "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4", "F16", "BF16", "F32"} <= set(gguf_tensor_types())


@pytest.mark.parametrize("qtype", UNSUPPORTED_TYPES)
def test_a_type_the_gguf_package_cannot_dequantize_is_refused_by_name(tmp_path, llama_1_layer, qtype):
    """A tensor of a type `gguf.quants` cannot dequantize is refused before anything is converted, with
    a message naming the tensor, its type and the types that do load."""
    with pytest.raises(NotImplementedError):
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[QType[qtype]][1]), np.uint8), QType[qtype])
    # embed F32, then the first layer's q projection in the refused type
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", llama_1_layer, "llama", [QType.F32, QType[qtype]])
    pattern = (rf"tensor 'blk\.0\.attn_q\.weight' in .* has GGUF quantization type {qtype}, which the installed "
               rf"gguf package cannot dequantize \(it can: F32, F16, .*Q5_0")
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(path)
