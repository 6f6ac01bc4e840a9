"""The params layout: the name and shape of every weight the transformer reads, declared once.

`weights/` builds this pytree from each source and checks every tensor against it, `export.py` writes
it back out as Hugging Face tensors, `check_lowering.py` lowers the model from these shapes alone, and
`models/transformer.py` reads it (after `serving_params` fuses q/k/v and gate/up within each layer).

Per-layer weights are stacked on a leading `num_layers` axis. Matrices are stored input-major
(`x @ w`), and heads are contiguous blocks of the output axis, so the projections shard by heads.
Norm weights are the multiplier itself: Gemma's `1 + w` is folded in at load time. The names of these
weights in Hugging Face and GGUF files live in `weights/hf.py` and `weights/gguf.py`.
"""

from __future__ import annotations

from jaxserve.config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict:
    """The params pytree of `cfg` with a shape tuple at each leaf; per-layer weights under "layers"."""
    num_layers, hidden, inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {
        "attn_norm": (num_layers, hidden),
        "wq": (num_layers, hidden, q_dim),  # [L, hidden, H*D]
        "wk": (num_layers, hidden, kv_dim),  # [L, hidden, KVH*D]
        "wv": (num_layers, hidden, kv_dim),  # [L, hidden, KVH*D]
        "wo": (num_layers, q_dim, hidden),  # [L, H*D, hidden]
        "mlp_norm": (num_layers, hidden),  # before the MLP (Gemma's pre_feedforward_layernorm)
        "w_gate": (num_layers, hidden, inter),
        "w_up": (num_layers, hidden, inter),
        "w_down": (num_layers, inter, hidden),
    }
    if cfg.attention_bias:
        layers |= {"bq": (num_layers, q_dim), "bk": (num_layers, kv_dim), "bv": (num_layers, kv_dim)}
    if cfg.qk_norm:  # one weight per head dimension, shared by all heads
        layers |= {"q_norm": (num_layers, cfg.head_dim), "k_norm": (num_layers, cfg.head_dim)}
    if cfg.sandwich_norm:  # Gemma also normalizes each block's output before adding it to the residual
        layers |= {"post_attn_norm": (num_layers, hidden), "post_mlp_norm": (num_layers, hidden)}
    params = {
        "embed": (cfg.vocab_size, hidden),
        "final_norm": (hidden,),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:  # tied: the LM head is embed.T
        params["lm_head"] = (hidden, cfg.vocab_size)
    return params
