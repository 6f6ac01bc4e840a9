"""The decoder-only transformer as a pure function: Llama, Mistral, Qwen2, Qwen3 and Gemma 3 text.

The families differ only by flags in `ModelConfig` (biases, q/k norms, sandwich norms, activation,
embedding scale, sliding-window layers, a second rope), so one forward pass serves them all; the
per-family differences in weight names live in `weights/`.

The params pytree as loaded (layers stacked, matrices input-major) is declared in `models/params.py`.
`forward` takes them as `serving_params` lays them out: one dict per layer, q/k/v and gate/up each
fused into one matrix. Slicing a layer out of a stacked array inside the compiled step copies it
(XLA:CPU copied every weight of every layer on every step: benchmarks/results/cpu_kernels_history.md),
and one wide matmul replaces two or three narrow ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.ops import cpu_ffi
from jaxserve.ops.attention import AttentionMetadata
from jaxserve.ops.attention_backends import paged_attention, rope_and_write_kv, rotates_in_writer, write_kv
from jaxserve.config.model_config import ModelConfig
from jaxserve.ops.linear import matmul, silu_gated_matmul
from jaxserve.ops.lora import GATE_UP, QKV, TokenSlots, delta, fused_delta, with_lora
from jaxserve.ops.packed_matmul import PackedWeight, kernel_input_dtype
from jaxserve.ops.quantized import QuantizedWeight

KVCache = tuple[jax.Array, jax.Array]  # (k_pages, v_pages), see attention.py for the layout


def rms_norm(x, weight, eps: float):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def _fused_norm_dtype(lp: dict, h, lora) -> jnp.dtype | None:
    """The dtype the fused add and norm (`_add_and_norm`) gives the layer's qkv and gate_up matmuls: bfloat16
    where both C++ kernels take bfloat16 rows, float32 where both are int8 (the kernel quantizes float32 rows
    itself), else None: XLA's add and norm (float32 weights, the parity mode; XLA's dots; LoRA, whose deltas
    read the norm unrounded)."""
    if lora is not None or h.dtype != jnp.float32:
        return None
    if kernel_input_dtype(lp["w_qkv"]) == jnp.bfloat16 and kernel_input_dtype(lp["w_gate_up"]) == jnp.bfloat16:
        return jnp.dtype(jnp.bfloat16)
    if all(isinstance(lp[name], PackedWeight) and lp[name].kind == "int8" for name in ("w_qkv", "w_gate_up")):
        return jnp.dtype(jnp.float32)
    return None


def _add_and_norm(h, add, weight, eps: float, fused: jnp.dtype | None):
    """(h + add, rms_norm of it). fused (a dtype): one C++ kernel call on XLA:CPU (cpu_ffi.add_rms_norm), the
    norm coming out in that dtype, as the next matmul takes it (XLA ran the add, the mean's reduction and the
    scaling with its conversion as three passes over [T, E])."""
    if fused is not None:
        return cpu_ffi.add_rms_norm(h, add, weight, eps, fused)
    h = h + add
    return h, rms_norm(h, weight, eps)


def rope_tables(inv_freq: np.ndarray, positions):
    """cos and sin [T, D/2] for the given positions [T]."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def rope_position_tables(cfg: ModelConfig, max_positions: int) -> dict:
    """cos and sin [max_positions, D/2] of every position, for the model's rope (and local rope), built
    once at engine start; `forward` looks its positions up in them. Computed per step instead, XLA
    fuses cos and sin into every layer's rotation and evaluates them there again for every head."""
    return _rope_tables_at(cfg, jnp.arange(max_positions))


def _rope_tables_at(cfg: ModelConfig, positions) -> dict:
    """{"rope": (cos, sin)} at `positions`, and "local_rope" for a model with a local rope."""
    tables = {"rope": rope_tables(cfg.rope.inv_freq(cfg.head_dim), positions)}
    if cfg.local_rope is not None:
        tables["local_rope"] = rope_tables(cfg.local_rope.inv_freq(cfg.head_dim), positions)
    return tables


def apply_rope(x, cos, sin):
    """Rotates halves (the Hugging Face convention, not interleaved pairs). x: [T, heads, D]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _fuse(parts: list, num_shards: int, xp):
    """Concatenates parts [..., n_i] on their last axis, shard by shard: [p0_0 | p1_0 | p2_0 | p0_1 | ...],
    so that cutting the result into num_shards equal blocks gives each shard its own slice of each part."""
    if isinstance(parts[0], QuantizedWeight):  # a quantized checkpoint's matrices, each column with its scale
        return QuantizedWeight.concatenate(parts, num_shards)
    split = [p.reshape(*p.shape[:-1], num_shards, p.shape[-1] // num_shards) for p in parts]
    fused = xp.concatenate(split, axis=-1)
    return fused.reshape(*fused.shape[:-2], -1)


def serving_params(cfg: ModelConfig, params, packed: bool = False, num_shards: int = 1,
                   packed_dtype: str = "float32", quantization: str | None = None,
                   unquantized_dtype: str | None = None) -> dict:
    """The loaded (stacked) params -> forward's layout: a list of per-layer dicts with
    w_qkv [hidden, (H + 2 KVH) D] (and b_qkv) and w_gate_up [hidden, 2 inter].

    packed: the weight matrices become `PackedWeight`s for the C++ CPU matmul, the LM head included;
    a tied LM head is then the only copy of the embeddings (forward looks tokens up in it). packed_dtype:
    the packed matrices' dtype, float32, bfloat16 (rounded), int8 or fp8 (per-column scales; fp8 keeps the
    LM head unquantized, packed in `unquantized_dtype`, the resolved config's: `_packed_lm_head_dtype`); the rest of the
    params stay as they are. quantization ("int8", "fp8"; unpacked only): the matrices become
    `QuantizedWeight`s for XLA's 8-bit dot, and the LM head too under int8 (QUANTIZED_LM_HEADS; a tied
    model keeps its float embeddings for the lookup).
    num_shards: the fused matrices (and packed column-split ones) are laid out shard by shard for a
    split over that many devices by output columns (tensor_parallel.py); 1 is the plain layout."""
    stacked = params["layers"]
    xp = np if isinstance(stacked["attn_norm"], np.ndarray) else jnp  # host arrays stay on the host
    assert not (packed and quantization), "the C++ matmul's int8 is packed_dtype int8"
    out = {k: v for k, v in params.items() if k != "layers"}
    fused = {"w_qkv": ("wq", "wk", "wv"), "b_qkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}
    parts = {name for names in fused.values() for name in names}
    layers = []
    for i in range(cfg.num_layers):
        lp = {name: stacked[name][i] for name in stacked if name not in parts}
        for name, names in fused.items():
            if names[0] in stacked:
                lp[name] = _fuse([stacked[n][i] for n in names], num_shards, xp)
        layers.append(lp)
    out["layers"] = layers
    if packed:
        for lp in layers:
            for name in MATRICES:
                by_columns = name in COLUMN_SPLIT
                pack = PackedWeight.from_quantized if isinstance(lp[name], QuantizedWeight) else PackedWeight.pack
                lp[name] = pack(lp[name], num_shards if by_columns else 1, packed_dtype,
                                k_shards=1 if by_columns else num_shards)
        lm_head = out.pop("embed").T if cfg.tie_word_embeddings else out["lm_head"]
        pack = PackedWeight.from_quantized if isinstance(lm_head, QuantizedWeight) else PackedWeight.pack
        out["lm_head"] = pack(lm_head, num_shards, _packed_lm_head_dtype(lm_head, packed_dtype, unquantized_dtype))
    elif quantization:
        for lp in layers:
            for name in MATRICES:
                lp[name] = _quantized(lp[name], quantization)
        lm_head = out["embed"].T if cfg.tie_word_embeddings else out["lm_head"]
        if quantization in QUANTIZED_LM_HEADS or isinstance(lm_head, QuantizedWeight):
            out["lm_head"] = _quantized(lm_head, quantization)
    return out


# Whose LM head is quantized at load. fp8 keeps it in the model's dtype, as vLLM's fp8 does: e4m3's three
# mantissa bits in the vocabulary projection cost the default model 1.4 points of its perplexity increase
# (+4.73% with an fp8 LM head, +3.36% without; `jaxserve bench quality`). int8 quantizes it: at batch 1
# the step is bound by the bytes it reads, and the LM head is a fifth of a small model's weights.
QUANTIZED_LM_HEADS = ("int8",)


def _packed_lm_head_dtype(lm_head, packed_dtype: str, unquantized_dtype: str | None) -> str:
    """The packed LM head's type: the matrices' own, but under fp8 (not in QUANTIZED_LM_HEADS) what the
    resolved config keeps unquantized (`attention_backends.unquantized_packed_dtype`). A checkpoint's
    quantized LM head stays as stored."""
    if packed_dtype != "fp8" or isinstance(lm_head, QuantizedWeight):
        return packed_dtype
    assert unquantized_dtype in ("bfloat16", "float32"), "fp8's LM head needs the resolved unquantized_dtype"
    return unquantized_dtype


def _quantized(w, kind: str) -> QuantizedWeight:
    """w as a QuantizedWeight of `kind` (a quantized checkpoint's own weights stay as they are)."""
    if isinstance(w, QuantizedWeight):
        assert w.kind == kind, f"the checkpoint's {w.kind} weights served as {kind}"
        return w
    return QuantizedWeight.quantize(w, kind)


MATRICES = ("w_qkv", "wo", "w_gate_up", "w_down")  # a layer's weight matrices, in serving_params' layout
COLUMN_SPLIT = ("w_qkv", "w_gate_up")  # split by output columns under tensor parallelism; wo and w_down by rows


def _mlp(cfg: ModelConfig, lp, x, rows, lora: dict | None = None, lora_mask=None):
    """With `lora` (the layer's adapter slots, ops/lora.py): the gate and up deltas added before the
    activation (inside the C++ gated kernel where it runs), and down_proj's to this device's partial sum."""
    add = None if lora is None else fused_delta(x, lora, GATE_UP, lora_mask)
    if cfg.hidden_act == "silu":
        # bfloat16 down_proj weights take the activations rounded: the gated kernel rounds them as it writes
        # them (LoRA's down_proj delta reads them unrounded)
        out_dtype = kernel_input_dtype(lp["w_down"]) if lora is None else None
        act_up = silu_gated_matmul(x, lp["w_gate_up"], rows, add, out_dtype=out_dtype)
    else:
        gate_up = matmul(x, lp["w_gate_up"], rows)
        gate, up = jnp.split(gate_up if add is None else gate_up + add.astype(gate_up.dtype), 2, axis=-1)
        act_up = jax.nn.gelu(gate, approximate=True) * up
    out = matmul(act_up, lp["w_down"], rows)
    return out if lora is None else out + delta(act_up, *lora["down_proj"], lora_mask).astype(out.dtype)


def _all_reduce(x, axis: str | None):
    """The sum of each device's partial x over the tensor-parallel `axis` (nothing on one device)."""
    return x if axis is None else jax.lax.psum(x, axis)


@functools.partial(jax.jit, static_argnames=("cfg", "sliding", "q_tile", "kv_tile", "attention_backend",
                                             "decode_only", "axis", "lora_branches", "lora_rank"))
def _layer(h, pending, k_pages, v_pages, lp, layer, cos, sin, md: AttentionMetadata, lora=None, *, cfg: ModelConfig,
           sliding: bool, q_tile: int, kv_tile: int, attention_backend: str, decode_only: bool, axis: str | None,
           lora_branches: bool = True, lora_rank: int | None = None):
    """One decoder layer: h + pending (the layer before's MLP output; zeros before the first) in, and (h,
    this layer's MLP output) out, the output not yet added, so that each residual add goes with the norm
    after it (`_add_and_norm`: one C++ call where the layer's matmuls are bfloat16 or int8 on XLA:CPU).
    Jitted on its own so that tracing and lowering happen once per step function, not once per layer; XLA still
    inlines it into each layer's place. Under tensor parallelism cfg is one device's share and the two
    all-reduces are the layer's only communication.
    lora: (the layer's adapter slots, mask [T, S * r], whether any token uses an adapter) or None
    (ops/lora.py); each delta is added to its projection's output (before the all-reduce). lora_rank: the
    mask is each token's slot [T], for the C++ kernel (ops/lora.TokenSlots) of slots of that rank."""
    weights, mask, active = lora if lora is not None else (None, None, None)
    if lora is not None and lora_rank is not None:
        mask = TokenSlots(mask, md.cu_q_lens[-1], lora_rank)

    def lora_added(y, add):  # add(y) where some token uses an adapter, else y
        return y if lora is None else with_lora(lambda: y, lambda: add(y), active, lora_branches)

    num_tokens = h.shape[0]
    rows = md.cu_q_lens[-1]  # the real tokens; the packed CPU matmul skips the padding below them
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = _fused_norm_dtype(lp, h, lora)
    h, x = _add_and_norm(h, pending, lp["attn_norm"], cfg.rms_norm_eps, fused)
    qkv = lora_added(matmul(x, lp["w_qkv"], rows),
                     lambda y: y + fused_delta(x, weights, QKV, mask).astype(y.dtype))
    if cfg.attention_bias:
        qkv = qkv + lp["b_qkv"]
    if not cfg.qk_norm and rotates_in_writer(attention_backend, k_pages.dtype):
        q, k_pages, v_pages = rope_and_write_kv(k_pages, v_pages, layer, qkv, cos, sin, md.slot_mapping,
                                                num_heads=cfg.num_heads)
        q = q.astype(qkv.dtype)
    else:
        q = qkv[:, :q_width].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, q_width:q_width + kv_width].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, q_width + kv_width:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_pages, v_pages = write_kv(k_pages, v_pages, layer, k, v, md.slot_mapping, backend=attention_backend)
    attn = paged_attention(
        q, k_pages, v_pages, layer, md,
        scale=cfg.scale,
        sliding_window=cfg.sliding_window if sliding else 0,
        soft_cap=cfg.attn_logit_softcap,
        q_tile=q_tile,
        kv_tile=kv_tile,
        backend=attention_backend,
        decode_only=decode_only,
        # a bfloat16 o_proj takes the attention rounded (the C++ kernel rounds it as it writes it); LoRA's delta
        # reads it unrounded
        out_dtype=kernel_input_dtype(lp["wo"]) if lora is None else None,
    )
    attn = attn.reshape(num_tokens, q_width)
    out = _all_reduce(lora_added(matmul(attn, lp["wo"], rows),
                                 lambda y: y + delta(attn, *weights["o_proj"], mask).astype(y.dtype)), axis)
    if cfg.sandwich_norm:
        out = rms_norm(out, lp["post_attn_norm"], cfg.rms_norm_eps)
    h, x = _add_and_norm(h, out, lp["mlp_norm"], cfg.rms_norm_eps, fused)
    mlp = functools.partial(_mlp, cfg, lp, x, rows)
    out = _all_reduce(mlp() if lora is None else with_lora(mlp, lambda: mlp(weights, mask), active, lora_branches),
                      axis)
    if cfg.sandwich_norm:
        out = rms_norm(out, lp["post_mlp_norm"], cfg.rms_norm_eps)
    return h, out, k_pages, v_pages


def forward(
    params,
    cfg: ModelConfig,
    token_ids,  # [T] int32
    positions,  # [T] int32
    kv_cache: KVCache,
    md: AttentionMetadata,
    logits_indices,  # [S] int32: rows whose next-token logits are wanted
    *,
    q_tile: int = 16,
    kv_tile: int = 128,
    attention_backend: str = "xla",
    decode_only: bool = False,
    axis: str | None = None,
    return_hidden: bool = False,
    lora_mask=None,  # [T, S * r]: each token's adapter slot's columns (ops/lora.py); None: no adapters
    lora_branches: bool = True,
    lora_rank: int | None = None,  # set: lora_mask is each token's slot [T], for the C++ kernel (ops/lora.py)
):
    """Runs the model over a ragged batch of tokens; returns (logits [S, vocab] f32, kv_cache), and with
    return_hidden the last layer's output of every token [T, hidden] too (before the final norm: what
    `lm_head_logits` takes; prompt logprobs read it).

    params are in `serving_params`' layout; the layers are unrolled (each reads its own weight
    arrays in place). attention_backend is a resolved one (see attention_backends.py); decode_only
    promises at most one query row per sequence, which lets the Pallas backends use their decode kernel.
    axis: inside shard_map over that mesh axis (tensor_parallel.py), params, kv_cache and cfg are one
    device's share and the logits its slice of the vocabulary.
    lora_mask: with params["lora"] (each layer's adapter slots, runner/lora_slots.py), every token gets
    its slot's deltas; lora_branches: skip them on the device where no token uses one (ops/lora.py).
    """
    h = _embed(params, token_ids, axis)
    if cfg.embed_scale != 1.0:
        h = h * jnp.asarray(cfg.embed_scale, h.dtype)

    if "rope" in params:  # the engine's tables (rope_position_tables)
        ropes = {name: tuple(table[positions] for table in params[name])
                 for name in ("rope", "local_rope") if name in params}
    else:
        ropes = _rope_tables_at(cfg, positions)
    global_rope = ropes["rope"]
    local_rope = ropes.get("local_rope", global_rope)
    k_pages, v_pages = kv_cache
    lora_active = None if lora_mask is None else jnp.any(lora_mask != 0)
    # The layer before's MLP output, added by the next layer with its norm; zeros before the first layer (XLA
    # drops that add where it runs it), so that every layer traces to one function.
    pending = jnp.zeros_like(h)
    for layer_id, lp in enumerate(params["layers"]):
        sliding = bool(cfg.layer_is_sliding[layer_id])
        lora = None if lora_mask is None else (params["lora"][layer_id], lora_mask, lora_active)
        h, pending, k_pages, v_pages = _layer(
            h, pending, k_pages, v_pages, lp, jnp.int32(layer_id), *(local_rope if sliding else global_rope), md, lora,
            cfg=cfg, sliding=sliding, q_tile=q_tile, kv_tile=kv_tile, attention_backend=attention_backend,
            decode_only=decode_only, axis=axis, lora_branches=lora_branches, lora_rank=lora_rank,
        )
    h = h + pending

    logits = lm_head_logits(params, cfg, h[logits_indices])
    if return_hidden:
        return logits, (k_pages, v_pages), h
    return logits, (k_pages, v_pages)


def lm_head_logits(params, cfg: ModelConfig, h):
    """The final norm and the LM head of last-layer outputs h [N, hidden]: logits [N, vocab] f32 (under
    tensor parallelism, this device's slice of the vocabulary)."""
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    if isinstance(params.get("lm_head"), (PackedWeight, QuantizedWeight)):
        logits = matmul(h, params["lm_head"])
    else:
        lm_head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
        logits = jnp.dot(h, lm_head, preferred_element_type=jnp.float32)
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def _embed(params, token_ids, axis: str | None):
    """Embedding rows [T, hidden] of token_ids; with a vocabulary split over `axis`, each device looks up
    the ids in its slice and the rows are summed across devices."""
    if "embed" in params:
        table_rows, lookup = params["embed"].shape[0], lambda ids: params["embed"][ids]
    else:  # packed and tied: the LM head holds the embeddings
        table_rows, lookup = params["lm_head"].n, params["lm_head"].columns
    if axis is None:
        return lookup(token_ids)
    local = token_ids - jax.lax.axis_index(axis) * table_rows
    inside = (local >= 0) & (local < table_rows)
    return _all_reduce(jnp.where(inside[:, None], lookup(jnp.where(inside, local, 0)), 0), axis)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> KVCache:
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


