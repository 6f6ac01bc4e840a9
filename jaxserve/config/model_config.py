"""What the model is: `ModelConfig` (and its `RopeConfig`), frozen and hashable, so it can be a
static argument of jitted functions.

This module owns the translation from a Hugging Face config to ours and its validation; it does not
load weights (`weights.py`). How the engine runs a model is `EngineConfig` (`engine_config.py`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# The 8-bit weights a checkpoint may be stored in (EngineConfig.quantization's names), and the
# quantization_config methods that declare them.
CHECKPOINT_QUANTIZATIONS = ("int8", "fp8")
QUANTIZATION_METHODS = ("fp8", "compressed-tensors")


class ModelLoadError(ValueError):
    """A model path, config or weight file that jaxserve cannot load, with the reason."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters of one kind of layer (Gemma 3 has a local and a global kind)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:  # [head_dim // 2]
        inv_freq = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "llama3":
            # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends in between.
            old_len = self.original_max_position_embeddings
            low_freq_wavelen = old_len / self.low_freq_factor
            high_freq_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            inv_freq = np.where(is_medium, smoothed, scaled)
        return inv_freq.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer; the flags cover Llama, Mistral, Qwen2, Qwen3 and Gemma 3 text."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: q/k/v projections have biases
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k
    sandwich_norm: bool = False  # Gemma 3: extra norms after attention and after the MLP
    hidden_act: str = "silu"  # "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # Gemma 3 multiplies embeddings by sqrt(hidden_size)
    query_scale: float = 0.0  # 0 means head_dim ** -0.5
    attn_logit_softcap: float = 0.0  # 0 means off
    final_logit_softcap: float = 0.0
    sliding_window: int = 0  # 0 means no sliding window
    # Per layer: True where the layer uses the sliding window and the local rope.
    sliding_layers: tuple[bool, ...] = ()
    local_rope: RopeConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # The checkpoint's weight matrices are stored quantized ("int8", "fp8": its quantization_config), with
    # a scale per output channel or per tensor; None: float. The engine serves them so unless told otherwise.
    quantization: str | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ModelLoadError(f"{self.architecture=} is not supported")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ModelLoadError(f"{self.hidden_act=} is not supported (silu or gelu_tanh)")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ModelLoadError(f"{len(self.sliding_layers)=} must equal {self.num_layers=}")
        if self.quantization not in (None, *CHECKPOINT_QUANTIZATIONS):
            raise ModelLoadError(f"{self.quantization=} must be None or one of {CHECKPOINT_QUANTIZATIONS}")

    @property
    def scale(self) -> float:
        return self.query_scale or self.head_dim**-0.5

    def kv_bytes_per_token(self, dtype) -> int:
        """Bytes of K and V one token takes in the pages, over all layers, in `dtype`."""
        import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy

        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(dtype).itemsize

    @property
    def layer_is_sliding(self) -> tuple[bool, ...]:
        return self.sliding_layers or (bool(self.sliding_window),) * self.num_layers

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Builds a ModelConfig from a transformers `PretrainedConfig` (config.json or GGUF metadata)."""
        architectures = getattr(hf, "architectures", None) or []
        model_type = getattr(hf, "model_type", "")
        family = next((SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if family is None and model_type in SUPPORTED_ARCHITECTURES.values():
            family = model_type
        if family is None and model_type == "gemma3_text":
            family = "gemma3"
        if family is None:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ModelLoadError(
                f"unsupported architecture {architectures or model_type!r}; jaxserve supports {supported}"
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        rope_params = _rope_parameters(hf)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        common = dict(
            architecture=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or family == "qwen2",
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
            quantization=checkpoint_quantization(getattr(hf, "quantization_config", None)),
        )
        layer_types = tuple(getattr(hf, "layer_types", None) or ())
        sliding_window = getattr(hf, "sliding_window", None) or 0
        if family == "gemma3":
            return cls(
                **common,
                rope=_rope_config(rope_params.get("full_attention", {}), 1_000_000.0, hf),
                local_rope=_rope_config(rope_params.get("sliding_attention", {}), 10_000.0, hf),
                qk_norm=True,
                sandwich_norm=True,
                hidden_act="gelu_tanh",
                embed_scale=float(hf.hidden_size) ** 0.5,
                query_scale=float(hf.query_pre_attn_scalar) ** -0.5,
                attn_logit_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
                final_logit_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
                sliding_window=sliding_window,
                sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            )
        sliding_layers = ()
        if sliding_window and layer_types:
            sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
        return cls(
            **common,
            rope=_rope_config(rope_params, 10_000.0, hf),
            qk_norm=family == "qwen3",
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
        )


def checkpoint_quantization(config: Any) -> str | None:
    """A checkpoint's `quantization_config` -> how its weight matrices are stored: "int8", "fp8" or None
    (no config). Read: vLLM's and Hugging Face's fp8 (a scale per tensor or per output channel) and
    compressed-tensors' W8A8 and W8A16 (symmetric 8-bit int or float weights, a scale per channel or per
    tensor). Activations are quantized per token as each matmul runs, whatever the config says of them (a
    static input_scale is not used). Any other method or scheme is a ModelLoadError naming it."""
    if not config:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if method == "fp8":
        if config.get("weight_block_size"):
            raise ModelLoadError(
                f"block-wise fp8 weights (weight_block_size={config['weight_block_size']}, scales in "
                f"weight_scale_inv) are not supported: jaxserve reads fp8 checkpoints with a scale per tensor "
                f"or per output channel")
        return "fp8"
    if method == "compressed-tensors":
        return _compressed_tensors_quantization(config)
    raise ModelLoadError(
        f"quantization method {method!r} (the checkpoint's quantization_config) is not supported: jaxserve "
        f"loads 8-bit weights declared by {', '.join(QUANTIZATION_METHODS)} (int8 or fp8, a scale per channel "
        f"or per tensor), or a float checkpoint with quantization='int8' or 'fp8'")


def _compressed_tensors_quantization(config: dict) -> str:
    """compressed-tensors' config_groups -> "int8" or "fp8": every group's weights must be symmetric 8-bit
    with a scale per channel or per tensor, all of one type, stored unpacked."""
    kinds = set()
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        scheme = {key: weights.get(key) for key in ("num_bits", "type", "strategy", "symmetric")}
        if (scheme["num_bits"] != 8 or scheme["type"] not in ("int", "float")
                or scheme["strategy"] not in ("channel", "tensor") or scheme["symmetric"] is False):
            raise ModelLoadError(
                f"compressed-tensors group {name!r} has weights {scheme}: jaxserve loads symmetric 8-bit int or "
                f"float weights with a scale per channel or per tensor (W8A8, W8A16), not group- or block-wise "
                f"or packed 4-bit ones")
        kinds.add("int8" if scheme["type"] == "int" else "fp8")
    fmt = config.get("format")
    if fmt not in (None, "int-quantized", "float-quantized", "naive-quantized"):
        raise ModelLoadError(f"compressed-tensors format {fmt!r} is not supported: jaxserve reads int-quantized, "
                             f"float-quantized and naive-quantized weights")
    if len(kinds) != 1:
        raise ModelLoadError(f"compressed-tensors config_groups declare {sorted(kinds) or 'no'} weight types: "
                             f"jaxserve loads one 8-bit type per checkpoint")
    return kinds.pop()


def _rope_parameters(hf: Any) -> dict:
    params = getattr(hf, "rope_parameters", None)
    if params is None:  # transformers 4.x style configs
        params = dict(getattr(hf, "rope_scaling", None) or {})
        if getattr(hf, "rope_theta", None) is not None:
            params.setdefault("rope_theta", hf.rope_theta)
    return params


def _rope_config(params: dict, default_theta: float, hf: Any) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported {rope_type=}; jaxserve supports {', '.join(SUPPORTED_ROPE_TYPES)}")
    if getattr(hf, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ModelLoadError(f"partial_rotary_factor={hf.partial_rotary_factor} is not supported")
    return RopeConfig(
        theta=float(params.get("rope_theta", getattr(hf, "rope_theta", None) or default_theta)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.max_position_embeddings)
        ),
    )
