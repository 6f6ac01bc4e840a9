"""What each device holds under tensor parallelism: which heads sit where (`HeadLayout`), and one
device's part of the loaded params (`shard_params`), cut from arrays or from LazyTensors, which then
read only that part of their file (`weights/lazy.py`). `tensor_parallel.py` places the parts on a mesh.

Heads must split evenly with each device's query heads next to their own KV head. `HeadLayout` decides
how, from the model's head counts (the JAX engines' two remedies):
  - KV heads divide by tp: each device takes num_kv_heads / tp of them and their query groups;
  - tp divides by the KV heads (fewer KV heads than devices): each KV head is replicated on
    tp / num_kv_heads devices, which share its query group, padded with zero query heads if needed;
  - otherwise the KV heads are padded with zero heads (and zero query groups) to a multiple of tp.
A zero query head attends to zero values, and its o_proj rows are zero, so padding never changes the
output. The MLP's intermediate size and the vocabulary are padded the same way, to multiples of tp
(the intermediate of PACKED_ROW_GROUP x tp; padded logits are -inf for the sampler).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.model_config import ModelConfig

PACKED_ROW_GROUP = 4  # the C++ matmul packs a weight's rows by fours (int8) or pairs (bfloat16, fp8)


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Which of the model's heads sit where once split over `tp` devices.

    q_heads[j] / kv_heads[j] is the model's head at position j of the padded head axis, None for a zero
    head; device d holds positions [d * n / tp, (d + 1) * n / tp) of each.
    """

    tp: int
    q_heads: tuple[int | None, ...]
    kv_heads: tuple[int | None, ...]
    intermediate_size: int  # padded to a multiple of tp
    vocab_size: int  # padded to a multiple of tp

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp: int) -> HeadLayout:
        num_kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        if num_kv % tp == 0:
            kv, q = list(range(num_kv)), list(range(cfg.num_heads))
        elif tp % num_kv == 0:  # each KV head on tp / num_kv devices, its query group split between them
            replicas = tp // num_kv
            per_device = -(-group // replicas)
            kv, q = [], []
            for device in range(tp):
                kv_head, part = divmod(device, replicas)
                kv.append(kv_head)
                q += [kv_head * group + i if i < group else None
                      for i in range(part * per_device, (part + 1) * per_device)]
        else:  # zero KV heads (with zero query groups) up to a multiple of tp
            padded = -(-num_kv // tp) * tp
            kv = list(range(num_kv)) + [None] * (padded - num_kv)
            q = list(range(cfg.num_heads)) + [None] * ((padded - num_kv) * group)
        round_up = lambda n, multiple=tp: -(-n // multiple) * multiple  # noqa: E731
        # down_proj is split by its rows, the intermediate: each device's share a whole number of row groups
        intermediate = round_up(cfg.intermediate_size, PACKED_ROW_GROUP * tp)
        return cls(tp, tuple(q), tuple(kv), intermediate, round_up(cfg.vocab_size))

    def device_config(self, cfg: ModelConfig) -> ModelConfig:
        """What one device's share of the model looks like: the config `forward` runs with under shard_map."""
        return dataclasses.replace(cfg, num_heads=len(self.q_heads) // self.tp,
                                   num_kv_heads=len(self.kv_heads) // self.tp,
                                   intermediate_size=self.intermediate_size // self.tp,
                                   vocab_size=self.vocab_size // self.tp)

    def padded_config(self, cfg: ModelConfig) -> ModelConfig:
        """The whole padded model (the shapes of every device's `shard_params` put together)."""
        return dataclasses.replace(cfg, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=self.intermediate_size, vocab_size=self.vocab_size)

    def describe(self, cfg: ModelConfig) -> str:
        """One line for the start-up log: what each device holds and what is padded or replicated."""
        zero_q, zero_kv = self.q_heads.count(None), self.kv_heads.count(None)
        replicated = len(self.kv_heads) - zero_kv - cfg.num_kv_heads
        notes = [f"{zero_q} zero query heads" if zero_q else "",
                 f"{zero_kv} zero KV heads" if zero_kv else "",
                 f"KV heads replicated x{len(self.kv_heads) // cfg.num_kv_heads}" if replicated > 0 else "",
                 f"intermediate padded by {self.intermediate_size - cfg.intermediate_size}"
                 if self.intermediate_size != cfg.intermediate_size else "",
                 f"vocabulary padded by {self.vocab_size - cfg.vocab_size}" if self.vocab_size != cfg.vocab_size else ""]
        device = self.device_config(cfg)
        held = f"{device.num_heads} query / {device.num_kv_heads} KV heads per device"
        return ", ".join([held] + [n for n in notes if n])


def _take_heads(x, heads: tuple[int | None, ...], axis: int, head_dim: int):
    """x with its head axis `axis` (heads * head_dim wide) rebuilt from `heads` (None: a zero head)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    x = xp.moveaxis(x, axis, -1)
    split = x.reshape(*x.shape[:-1], -1, head_dim)
    with_zero = xp.concatenate([split, xp.zeros((*split.shape[:-2], 1, head_dim), split.dtype)], axis=-2)
    zero = split.shape[-2]
    taken = with_zero[..., [zero if h is None else h for h in heads], :]
    return xp.moveaxis(taken.reshape(*x.shape[:-1], -1), -1, axis)


def _pad_axis(x, axis: int, size: int):
    xp = np if isinstance(x, np.ndarray) else jnp
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return xp.pad(x, widths)


def _read(x, axis: int, start: int, stop: int):
    """x[start:stop] along `axis`; a LazyTensor reads only that part (a tracer stays traced)."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    part = x[tuple(index)]
    return part if isinstance(part, jax.core.Tracer) else np.asarray(part)


def _read_heads(x, heads: tuple[int | None, ...], axis: int, head_dim: int):
    """The heads `heads` of x's head axis (None: a zero head), reading only the span they cover."""
    real = [h for h in heads if h is not None]
    lo, hi = (min(real), max(real) + 1) if real else (0, 0)
    span = _read(x, axis, lo * head_dim, hi * head_dim)
    return _take_heads(span, tuple(None if h is None else h - lo for h in heads), axis, head_dim)


def _read_block(x, axis: int, start: int, stop: int):
    """x[start:stop] along `axis` with zeros past x's end (the padding up to a multiple of tp)."""
    size = x.shape[axis]
    return _pad_axis(_read(x, axis, min(start, size), min(stop, size)), axis, stop - start)


# How the loaded params that models/params.py splits are cut: by the layout's heads, or in equal blocks
# of a padded axis; every other param is replicated.
_BY_HEADS = {"wq": ("q_heads", 2), "wk": ("kv_heads", 2), "wv": ("kv_heads", 2), "wo": ("q_heads", 1),
             "bq": ("q_heads", 1), "bk": ("kv_heads", 1), "bv": ("kv_heads", 1)}
_BY_BLOCKS = {"w_gate": ("intermediate_size", 2), "w_up": ("intermediate_size", 2),
              "w_down": ("intermediate_size", 1), "embed": ("vocab_size", 0), "lm_head": ("vocab_size", 1)}


def shard_params(cfg: ModelConfig, layout: HeadLayout, params: dict, shard: int) -> dict:
    """Device `shard`'s part of the padded model's params (models/params.py's layout, the shapes of
    `layout.device_config(cfg)`), taken from the loaded params of `cfg`: arrays, or LazyTensors, which
    then read only this part of their file."""

    def cut(name: str, x):
        if name in _BY_HEADS:
            attr, axis = _BY_HEADS[name]
            heads = getattr(layout, attr)
            n = len(heads) // layout.tp
            return _read_heads(x, heads[shard * n:(shard + 1) * n], axis, cfg.head_dim)
        if name in _BY_BLOCKS:
            attr, axis = _BY_BLOCKS[name]
            n = getattr(layout, attr) // layout.tp
            return _read_block(x, axis, shard * n, (shard + 1) * n)
        return _read(x, 0, 0, x.shape[0])

    layers = {name: cut(name, x) for name, x in params["layers"].items()}
    return {name: cut(name, x) for name, x in params.items() if name != "layers"} | {"layers": layers}


# An adapter's matrix that is split under tensor parallelism (models/params.py's lora_layout), cut as the
# loaded param of its projection: (0: A by rows, 1: B by columns, and the loaded param's name)
_LORA_CUT_AS = {"q_proj": (1, "wq"), "k_proj": (1, "wk"), "v_proj": (1, "wv"), "o_proj": (0, "wo"),
                "gate_proj": (1, "w_gate"), "up_proj": (1, "w_up"), "down_proj": (0, "w_down")}


def padded_lora(cfg: ModelConfig, layout: HeadLayout, target: str, a: np.ndarray, b: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """An adapter's stacked A [L, in, r] and B [L, r, out] for `target` in the padded model's layout: its
    split matrix cut for each device as its projection's loaded param is (heads reordered and padded, a
    padded intermediate axis), the parts put back together along the split axis."""
    which, name = _LORA_CUT_AS[target]
    split = (a, b)[which]
    parts = [shard_params(cfg, layout, {"layers": {name: split}}, shard)["layers"][name] for shard in range(layout.tp)]
    whole = np.concatenate(parts, axis=1 + which)
    return (whole, b) if which == 0 else (a, whole)
