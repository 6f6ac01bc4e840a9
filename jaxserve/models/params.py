"""The params layout: the name, shape and sharding of every weight the transformer reads, declared once.

`weights/` builds this pytree from each source and checks every tensor against it, `export.py` writes
it back out as Hugging Face tensors, `check_lowering.py` lowers the model from these shapes alone,
`tensor_parallel.py` places each weight on a mesh by its PartitionSpec, and `models/transformer.py`
reads it (after `serving_params` fuses q/k/v and gate/up within each layer).

Per-layer weights are stacked on a leading `num_layers` axis. Matrices are stored input-major
(`x @ w`), and heads are contiguous blocks of the output axis, so the projections shard by heads.
Norm weights are the multiplier itself: Gemma's `1 + w` is folded in at load time. The names of these
weights in Hugging Face and GGUF files live in `weights/hf.py` and `weights/gguf.py`.

Shardings are Megatron's over the mesh axis `MODEL_AXIS`: q/k/v and gate/up split by output columns
(heads, intermediate), o_proj and down_proj by input rows (one all-reduce after each), the embedding
and the LM head by vocabulary. `tensor_parallel.py` pads and reorders heads so that these splits fall
on whole heads before the specs are applied.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxserve.config.model_config import ModelConfig

MODEL_AXIS = "model"  # the tensor-parallel axis of the mesh
_COLUMNS = P(None, None, MODEL_AXIS)  # a stacked [L, in, out] matrix split by output columns
_ROWS = P(None, MODEL_AXIS, None)  # ... by input rows
_HEADS = P(None, MODEL_AXIS)  # a stacked [L, out] bias, split like its matrix's columns
_REPLICATED = P()


def param_layout(cfg: ModelConfig) -> dict:
    """The params pytree of `cfg` with (shape, PartitionSpec) at each leaf; per-layer weights under "layers"."""
    num_layers, hidden, inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {
        "attn_norm": ((num_layers, hidden), _REPLICATED),
        "wq": ((num_layers, hidden, q_dim), _COLUMNS),  # [L, hidden, H*D]
        "wk": ((num_layers, hidden, kv_dim), _COLUMNS),  # [L, hidden, KVH*D]
        "wv": ((num_layers, hidden, kv_dim), _COLUMNS),  # [L, hidden, KVH*D]
        "wo": ((num_layers, q_dim, hidden), _ROWS),  # [L, H*D, hidden]
        "mlp_norm": ((num_layers, hidden), _REPLICATED),  # before the MLP (Gemma's pre_feedforward_layernorm)
        "w_gate": ((num_layers, hidden, inter), _COLUMNS),  # [L, hidden, I]
        "w_up": ((num_layers, hidden, inter), _COLUMNS),  # [L, hidden, I]
        "w_down": ((num_layers, inter, hidden), _ROWS),  # [L, I, hidden]
    }
    if cfg.attention_bias:
        layers |= {"bq": ((num_layers, q_dim), _HEADS), "bk": ((num_layers, kv_dim), _HEADS),
                   "bv": ((num_layers, kv_dim), _HEADS)}
    if cfg.qk_norm:  # one weight per head dimension, shared by all heads
        layers |= {"q_norm": ((num_layers, cfg.head_dim), _REPLICATED),
                   "k_norm": ((num_layers, cfg.head_dim), _REPLICATED)}
    if cfg.sandwich_norm:  # Gemma also normalizes each block's output before adding it to the residual
        layers |= {"post_attn_norm": ((num_layers, hidden), _REPLICATED),
                   "post_mlp_norm": ((num_layers, hidden), _REPLICATED)}
    params = {
        "embed": ((cfg.vocab_size, hidden), P(MODEL_AXIS, None)),  # [V, hidden]
        "final_norm": ((hidden,), _REPLICATED),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:  # tied: the LM head is embed.T
        params["lm_head"] = ((hidden, cfg.vocab_size), P(None, MODEL_AXIS))  # [hidden, V]
    return params


def _leaves(layout: dict, index: int) -> dict:
    return {name: _leaves(entry, index) if isinstance(entry, dict) else entry[index] for name, entry in layout.items()}


def param_shapes(cfg: ModelConfig) -> dict:
    """The params pytree of `cfg` with a shape tuple at each leaf."""
    return _leaves(param_layout(cfg), 0)


def param_specs(cfg: ModelConfig) -> dict:
    """The params pytree of `cfg` with a PartitionSpec at each leaf (over a mesh with `MODEL_AXIS`)."""
    return _leaves(param_layout(cfg), 1)


def lora_layout(cfg: ModelConfig, max_loras: int, max_lora_rank: int) -> dict:
    """One layer's LoRA adapter slots (ops/lora.py): per target module, A [in, S * r] and B [S * r, out]
    (S = max_loras slots of rank r) with (shape, PartitionSpec). Under tensor parallelism each is split as
    its projection is: B by output columns where the projection is (q/k/v, gate/up; A replicated), A by
    input rows where it is (o_proj, down_proj; B replicated), so each delta is this device's share of its
    projection's output (o/down: a partial sum, which the layer's all-reduce adds up)."""
    width, hidden, inter = max_loras * max_lora_rank, cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def by_columns(out: int):
        return ((hidden, width), _REPLICATED), ((width, out), P(None, MODEL_AXIS))

    def by_rows(into: int):
        return ((into, width), P(MODEL_AXIS, None)), ((width, hidden), _REPLICATED)

    return {"q_proj": by_columns(q_dim), "k_proj": by_columns(kv_dim), "v_proj": by_columns(kv_dim),
            "o_proj": by_rows(q_dim), "gate_proj": by_columns(inter), "up_proj": by_columns(inter),
            "down_proj": by_rows(inter)}
