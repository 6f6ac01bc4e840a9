"""Writing GGUF files the way llama.cpp's `convert_hf_to_gguf.py` does, for the loader's tests: its tensor
names, metadata keys, q/k row permutation for the llama architecture and a gpt2-style byte-level BPE
tokenizer, from a transformers model, with tensors of any type the `gguf` package knows.

`gguf.quants.quantize` cannot quantize to the K-quants, the IQ types and several others; tensors of
those types are random blocks instead of the model's weights (with sane fp16 super-block scales for
Q4_K, Q5_K and Q6_K; redrawn until their values are finite and small for the rest).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

import tiny_models
from jaxserve.weights import gguf_tensor_types

MAX_RANDOM_WEIGHT = 0.1  # random blocks: about the magnitude of the models' own weights

_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# Byte offsets of each K-quant block's fp16 super-block scales, with values that give weights of
# roughly the magnitude of the models' own (std ~0.03) from otherwise random blocks.
_K_QUANT_SCALES = {
    QType.Q4_K: {0: 1e-4, 2: 7.5e-4},  # d, dmin
    QType.Q5_K: {0: 5e-5, 2: 7.75e-4},  # d, dmin
    QType.Q6_K: {208: 3e-5},  # d
}


def gguf_tensor_name(hf_name: str) -> str:
    base, kind = hf_name.rsplit(".", 1)
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}.{kind}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's `permute`: llama.cpp's rope pairs adjacent rows, HF's pairs halves."""
    rows = weights.shape[0]
    return (weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def random_blocks(shape: tuple[int, int], qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """Random quantized blocks of a type `gguf.quants` cannot quantize to, for a [rows, cols] tensor."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    if qtype.name not in gguf_tensor_types():  # for the refusal tests: any bytes will do
        return blocks.reshape(rows, -1)
    if qtype in _K_QUANT_SCALES:
        for offset, scale in _K_QUANT_SCALES[qtype].items():
            scales = (scale * rng.uniform(0.5, 1.5, blocks.shape[:1])).astype(np.float16)
            blocks[:, offset:offset + 2] = scales[:, None].view(np.uint8)
        return blocks.reshape(rows, -1)
    # Random bytes can hold any scale: draw a pool, keep the blocks whose values are finite and small
    # (at least the 16 smallest, for types where few are), and build the tensor from those.
    pool = rng.integers(0, 256, (20_000, type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        values = gguf.quants.dequantize(pool, qtype).reshape(len(pool), block_size)
    peak = np.where(np.isfinite(values).all(axis=1), np.abs(values).max(axis=1), np.inf)
    peak[peak == 0] = np.inf
    order = np.argsort(peak)
    keep = order[: max(16, int((peak <= MAX_RANDOM_WEIGHT).sum()))]
    assert np.isfinite(peak[keep]).all(), qtype
    return pool[rng.choice(keep, len(blocks))].reshape(rows, -1)


def add_quantized_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: QType, rng):
    if array.ndim == 1 or qtype == QType.F32:  # llama.cpp keeps norms and biases in F32
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == QType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        try:
            data = gguf.quants.quantize(array, qtype)
        except NotImplementedError:
            data = random_blocks(array.shape, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)


def add_byte_tokenizer(writer: gguf.GGUFWriter, vocab_size: int):
    """tiny_models' byte tokenizer as llama.cpp stores a gpt2-style BPE vocabulary."""
    tok = tiny_models.byte_tokenizer()
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * (len(tok) - 256)
    # llama.cpp refuses a BPE vocabulary without merges: merge bytes 0x00 0x01, which no test text has.
    tokens.append("Āā")
    types.append(gguf.TokenType.NORMAL)
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ā ā"])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tiny_models.CHATML)


def hf_head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def write_gguf(path, model: torch.nn.Module, arch: str, qtype: QType | list[QType] = QType.F32, *,
               tokenizer: bool = True):
    """Writes `model` (a transformers llama/qwen2/qwen3) as llama.cpp would, tensors in `qtype` (a
    list: the matrices take its types in turn)."""
    qtypes = qtype if isinstance(qtype, list) else [qtype]
    num_matrices = 0
    cfg = model.config
    head_dim = hf_head_dim(cfg)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")  # transformers reads a llama file named "...mistral..." as mistral
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        add_byte_tokenizer(writer, cfg.vocab_size)
    rng = np.random.default_rng(0)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        add_quantized_tensor(writer, gguf_tensor_name(hf_name), array, qtypes[num_matrices % len(qtypes)], rng)
        num_matrices += array.ndim == 2
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
