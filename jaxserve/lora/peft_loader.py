"""Reads a PEFT LoRA adapter directory into the stacked float32 A and B matrices the model adds.

PEFT stores, per adapted projection of each layer, lora_A.weight [r, in] and lora_B.weight [out, r], and
adds scaling * x @ lora_A.T @ lora_B.T to the projection's output (scaling lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora). `load_adapter` returns A = lora_A.T and B = scaling * lora_B.T in the
model's input-major convention, stacked over layers, so x @ A @ B is the whole delta. Everything jaxserve
cannot serve exactly is refused with a LoRAError naming the adapter and the field or tensor. Writing the
matrices into device slots is the model runner's; choosing the slots is `residency.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxserve.config.model_config import ModelConfig
from jaxserve.lora.errors import LoRAError

# The projections an adapter may adapt: every attention and MLP matrix of the supported families.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
# PEFT's key of one matrix: "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" (older
# versions keep the adapter name: "...q_proj.lora_A.default.weight").
_KEY = re.compile(r".*\blayers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight")
# Config fields whose presence changes the math into something else than x @ A @ B added to a projection.
_UNSUPPORTED_IF_SET = ("modules_to_save", "layer_replication", "trainable_token_indices", "target_parameters",
                       "alora_invocation_tokens")
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclasses.dataclass
class AdapterWeights:
    """One adapter's matrices. targets: for each projection it adapts, (A [num_layers, in, rank],
    B [num_layers, rank, out]) float32, the scaling folded into B; layers it leaves alone hold zeros."""

    rank: int
    targets: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.targets.values())


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of one layer of `cfg`."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def load_adapter(path: str | Path, model_cfg: ModelConfig, max_lora_rank: int, *,
                 name: str | None = None) -> AdapterWeights:
    """The adapter in PEFT directory `path` for a model of `model_cfg`; name: the adapter's name in
    errors (default: the path). Raises LoRAError for anything it cannot serve."""
    label = f"LoRA adapter {name or str(path)!r}"
    path = Path(path).expanduser()
    if not path.is_dir():
        raise LoRAError(f"{label}: {str(path)!r} is not a directory")
    config = _read_config(path, label)
    rank, scaling = _check_config(config, label, max_lora_rank)
    tensors = _read_tensors(path, label)
    shapes = target_shapes(model_cfg)
    pairs: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise LoRAError(f"{label}: tensor {key!r} is not a LoRA matrix of a layer's projection (only "
                            f"{', '.join(TARGETS)} can be adapted; not embed_tokens or lm_head)")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGETS:
            raise LoRAError(f"{label}: tensor {key!r} adapts {module!r}; only {', '.join(TARGETS)} can be adapted")
        if layer >= model_cfg.num_layers:
            raise LoRAError(f"{label}: tensor {key!r} is for layer {layer}, but the model has "
                            f"{model_cfg.num_layers} layers (an adapter made for another base model?)")
        d_in, d_out = shapes[module]
        expected = (rank, d_in) if which == "A" else (d_out, rank)
        if tensor.shape != expected:
            raise LoRAError(f"{label}: tensor {key!r} has shape {list(tensor.shape)}, the model needs "
                            f"{list(expected)} (r={rank}; an adapter made for another base model?)")
        pairs.setdefault((module, layer), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"{label}: the adapter holds no LoRA matrices")
    targets = {}
    for module in TARGETS:
        layers = {layer: pair for (m, layer), pair in pairs.items() if m == module}
        if not layers:
            continue
        d_in, d_out = shapes[module]
        a = np.zeros((model_cfg.num_layers, d_in, rank), np.float32)  # [num_layers, in, rank]
        b = np.zeros((model_cfg.num_layers, rank, d_out), np.float32)  # [num_layers, rank, out]
        for layer, pair in layers.items():
            if set(pair) != {"A", "B"}:
                missing = "lora_B" if "A" in pair else "lora_A"
                raise LoRAError(f"{label}: layer {layer}'s {module} has no {missing} matrix")
            a[layer] = pair["A"].astype(np.float32).T
            b[layer] = pair["B"].astype(np.float32).T * np.float32(scaling)
        targets[module] = (a, b)
    return AdapterWeights(rank=rank, targets=targets)


def _read_config(path: Path, label: str) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRAError(f"{label}: {str(path)!r} has no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"{label}: cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{label}: {CONFIG_FILE} is not a JSON object")
    return config


def _check_config(config: dict, label: str, max_lora_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling, after refusing what jaxserve does not serve."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{label}: peft_type={peft_type!r} is not supported (only LORA)")
    if config.get("use_dora"):
        raise LoRAError(f"{label}: use_dora=true (DoRA) is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoRAError(f"{label}: bias={config.get('bias')!r}, lora_bias={config.get('lora_bias')!r}: "
                        f"LoRA biases are not supported (bias must be 'none')")
    for field in _UNSUPPORTED_IF_SET:
        if config.get(field):
            raise LoRAError(f"{label}: {field}={config[field]!r} is not supported")
    if config.get("use_qalora"):
        raise LoRAError(f"{label}: use_qalora=true is not supported")
    target_modules = config.get("target_modules")
    if isinstance(target_modules, (list, tuple)):
        outside = [m for m in target_modules if m.rsplit(".", 1)[-1] not in TARGETS]
        if outside:
            raise LoRAError(f"{label}: target_modules {outside} cannot be adapted; only {', '.join(TARGETS)}")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{label}: r={rank!r} must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"{label}: lora_alpha={alpha!r} must be a number")
    if rank > max_lora_rank:
        raise LoRAError(f"{label}: r={rank} is above max_lora_rank={max_lora_rank} (raise --max-lora-rank)")
    # A per-module rank or alpha would need one scaling per module: refused unless it repeats the default.
    for field, default in (("rank_pattern", rank), ("alpha_pattern", alpha)):
        pattern = config.get(field) or {}
        if any(value != default for value in pattern.values()):
            raise LoRAError(f"{label}: {field}={pattern!r} (per-module ranks or alphas) is not supported")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def _read_tensors(path: Path, label: str) -> dict[str, np.ndarray]:
    if (path / SAFETENSORS_FILE).is_file():
        return _read_safetensors(path / SAFETENSORS_FILE, label)
    if (path / BIN_FILE).is_file():
        try:
            import torch
        except ImportError:
            raise LoRAError(f"{label}: {BIN_FILE} needs torch to read; save the adapter as safetensors") from None
        try:
            state = torch.load(path / BIN_FILE, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
            raise LoRAError(f"{label}: cannot read {BIN_FILE}: {e}") from None
        return {key: value.float().numpy() for key, value in state.items()}
    raise LoRAError(f"{label}: {str(path)!r} has no {SAFETENSORS_FILE} (or {BIN_FILE})")


def _read_safetensors(file: Path, label: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as float numpy arrays. Read here rather than through
    safetensors' numpy reader, which has no bfloat16. The format: an 8-byte little-endian header size,
    the JSON header (name -> dtype, shape, data_offsets), the tensors' bytes."""
    import ml_dtypes

    try:
        data = file.read_bytes()
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + size])
        tensors = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise LoRAError(f"{label}: tensor {key!r} has dtype {info['dtype']}; LoRA matrices must be "
                                f"float ({', '.join(_SAFETENSORS_DTYPES)})")
            name = _SAFETENSORS_DTYPES[info["dtype"]]
            dtype = np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
            start, end = info["data_offsets"]
            array = np.frombuffer(data, dtype, count=(end - start) // dtype.itemsize, offset=8 + size + start)
            tensors[key] = array.reshape(info["shape"])
        return tensors
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, LoRAError):
            raise
        raise LoRAError(f"{label}: cannot read {file.name} (truncated or corrupt?): {e}") from None
