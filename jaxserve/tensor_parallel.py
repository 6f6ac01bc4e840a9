"""Tensor parallelism: one model split over the devices of a `jax.sharding.Mesh` (Megatron style).

Each device holds a slice of every layer: some of the query heads with their KV heads (q/k/v columns,
o_proj rows, its heads of every KV page), a slice of the MLP's intermediate axis (gate/up columns,
down_proj rows), a slice of the vocabulary (embedding rows, LM head columns). The whole step runs under
one `shard_map`, so each device runs the single-device model on its slices (`models/transformer.py`
with `axis=MODEL_AXIS`), and the only communication is written out: one all-reduce after o_proj and one
after down_proj per layer, one after the embedding lookup, and in the sampler either a gather of
per-device maxima (a greedy batch) or of the logits (anything else).

Heads must split evenly with each device's query heads next to their own KV head. `HeadLayout` decides
how, from the model's head counts (the JAX engines' two remedies):
  - KV heads divide by tp: each device takes num_kv_heads / tp of them and their query groups;
  - tp divides by the KV heads (fewer KV heads than devices): each KV head is replicated on
    tp / num_kv_heads devices, which share its query group, padded with zero query heads if needed;
  - otherwise the KV heads are padded with zero heads (and zero query groups) to a multiple of tp.
A zero query head attends to zero values, and its o_proj rows are zero, so padding never changes the
output. The MLP's intermediate size and the vocabulary are padded to multiples of tp the same way
(padded logits are -inf for the sampler).

The scheduler, page pool and server do not know about any of this: pages are logical, and each device
holds its KV heads' part of every page.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.cpu_ffi import PackedWeight
from jaxserve.models.params import MODEL_AXIS, param_specs
from jaxserve.models.transformer import forward, init_kv_cache
from jaxserve.sampling import SamplerOutput, SamplingTensors, argmax, no_logprobs, sample

KV_SPEC = P(None, None, None, MODEL_AXIS, None)  # [num_layers, num_pages, page_size, KVH, D]: by KV head
VOCAB_SPEC = P(None, MODEL_AXIS)  # logits [S, V]: by vocabulary


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
        round_up = lambda n: -(-n // tp) * tp  # noqa: E731
        return cls(tp, tuple(q), tuple(kv), round_up(cfg.intermediate_size), round_up(cfg.vocab_size))

    def device_config(self, cfg: ModelConfig) -> ModelConfig:
        """What one device's share of the model looks like: the config `forward` runs with under shard_map."""
        return dataclasses.replace(cfg, num_heads=len(self.q_heads) // self.tp,
                                   num_kv_heads=len(self.kv_heads) // self.tp,
                                   intermediate_size=self.intermediate_size // self.tp,
                                   vocab_size=self.vocab_size // self.tp)

    def padded_config(self, cfg: ModelConfig) -> ModelConfig:
        """The whole padded model (what `pad_params` returns the weights of)."""
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
    with_zero = xp.concatenate([split, xp.zeros_like(split[..., :1, :])], axis=-2)
    zero = split.shape[-2]
    taken = with_zero[..., [zero if h is None else h for h in heads], :]
    return xp.moveaxis(taken.reshape(*x.shape[:-1], -1), -1, axis)


def _pad_axis(x, axis: int, size: int):
    xp = np if isinstance(x, np.ndarray) else jnp
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return xp.pad(x, widths)


def pad_params(cfg: ModelConfig, layout: HeadLayout, params: dict) -> dict:
    """The loaded params (models/params.py's layout) of `cfg` -> those of `layout.padded_config(cfg)`."""
    layers, d = dict(params["layers"]), cfg.head_dim
    for name, heads, axis in (("wq", layout.q_heads, 2), ("wk", layout.kv_heads, 2), ("wv", layout.kv_heads, 2),
                              ("bq", layout.q_heads, 1), ("bk", layout.kv_heads, 1), ("bv", layout.kv_heads, 1),
                              ("wo", layout.q_heads, 1)):
        if name in layers:
            layers[name] = _take_heads(layers[name], heads, axis, d)
    for name, axis in (("w_gate", 2), ("w_up", 2), ("w_down", 1)):
        layers[name] = _pad_axis(layers[name], axis, layout.intermediate_size)
    out = dict(params, layers=layers, embed=_pad_axis(params["embed"], 0, layout.vocab_size))
    if "lm_head" in params:
        out["lm_head"] = _pad_axis(params["lm_head"], 1, layout.vocab_size)
    return out


# serving_params' fused matrices take the spec of their parts; a packed matrix's data is
# [panels, K, PANEL_WIDTH]: split by panels where the matrix is split by columns, by K where by rows.
_FUSED_FROM = {"w_qkv": "wq", "b_qkv": "bq", "w_gate_up": "w_gate"}
_PACKED_SPECS = {P(None, MODEL_AXIS): P(MODEL_AXIS, None, None), P(MODEL_AXIS, None): P(None, MODEL_AXIS, None)}


def serving_specs(cfg: ModelConfig, serving: dict) -> dict:
    """PartitionSpecs for `serving_params`' pytree `serving` (packed or not, rope tables included)."""
    specs = param_specs(cfg)

    def leaf_spec(spec, value):
        return PackedWeight(_PACKED_SPECS[spec], value.n) if isinstance(value, PackedWeight) else spec

    layer_specs = {name: P(*specs["layers"][_FUSED_FROM.get(name, name)][1:]) for name in serving["layers"][0]}
    out = {"layers": [{name: leaf_spec(layer_specs[name], value) for name, value in layer.items()}
                      for layer in serving["layers"]]}
    lm_head_spec = P(None, MODEL_AXIS)
    for name, value in serving.items():
        if name == "layers":
            continue
        if name in ("rope", "local_rope"):
            out[name] = jax.tree.map(lambda _: P(), value)
        else:
            out[name] = leaf_spec(lm_head_spec if name == "lm_head" else specs[name], value)
    return out


class TensorParallel:
    """One model split over a mesh of `tp` devices: its head layout, the mesh, where each param lives,
    and the step function and jit that run on it (what `ModelRunner` uses instead of the one-device ones)."""

    def __init__(self, model_cfg: ModelConfig, tp: int):
        self.model_cfg = model_cfg
        self.layout = HeadLayout.for_model(model_cfg, tp)
        self.mesh = make_mesh(tp)
        self.device_cfg = self.layout.device_config(model_cfg)  # what forward runs with on each device
        self.padded_cfg = self.layout.padded_config(model_cfg)  # what the arrays hold, all devices together
        self.param_specs = None  # set by place_params

    def describe(self) -> str:
        return self.layout.describe(self.model_cfg)

    def place_params(self, params, to_serving: Callable, rope: Callable[[], dict]) -> dict:
        """The loaded params -> the padded model's in forward's layout (`to_serving`, a partial of
        `serving_params`, laid out shard by shard) plus the rope tables, placed on the mesh by their
        PartitionSpecs. Shapes in, shapes out (check-lowering)."""
        to_serving = functools.partial(to_serving.func, self.padded_cfg, **to_serving.keywords,
                                       num_shards=self.layout.tp)

        def build(params):
            return to_serving(pad_params(self.model_cfg, self.layout, params)) | rope()

        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            serving = jax.eval_shape(build, params)
            self.param_specs = serving_specs(self.padded_cfg, serving)
            return serving
        serving = build(jax.tree.map(np.asarray, params))
        self.param_specs = serving_specs(self.padded_cfg, serving)

        def place(x: np.ndarray, sharding: NamedSharding):  # each device gets only its slice; over several
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])  # hosts, only ours

        return jax.tree.map(place, serving, shardings(self.mesh, self.param_specs))

    def init_kv_cache(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype):
        """The padded model's KV page arrays, created on the mesh split by KV head."""
        assert cfg == self.model_cfg
        make = functools.partial(init_kv_cache, self.padded_cfg, num_pages, page_size, dtype)
        return jax.jit(make, out_shardings=shardings(self.mesh, (KV_SPEC, KV_SPEC)))()

    def forward(self, params, kv_cache, inputs, **forward_kwargs):
        """`models.transformer.forward` split over the mesh, for step inputs (model_runner.StepInputs):
        (logits [S, padded vocab] split by vocabulary, kv_cache). Each device runs forward on its share."""

        def on_each_device(params, kv_cache, inputs):
            return forward(params, self.device_cfg, inputs.token_ids, inputs.positions, kv_cache, inputs.md,
                           inputs.logits_indices, axis=MODEL_AXIS, **forward_kwargs)

        kv_specs = (KV_SPEC, KV_SPEC)
        return jax.shard_map(on_each_device, mesh=self.mesh, in_specs=(self.param_specs, kv_specs, P()),
                             out_specs=(VOCAB_SPEC, kv_specs), check_vma=False)(params, kv_cache, inputs)

    def step(self, params, kv_cache, inputs, **forward_kwargs):
        """model_runner's step on the mesh: `forward`, then each device samples from its slice of the
        vocabulary (`vocab_sharded_sample`); the sampled tokens are the same on every device."""
        logits, kv_cache = self.forward(params, kv_cache, inputs, **forward_kwargs)
        sample_on_each = functools.partial(vocab_sharded_sample, vocab_size=self.model_cfg.vocab_size)
        sampled = jax.shard_map(sample_on_each, mesh=self.mesh, in_specs=(VOCAB_SPEC, P()), out_specs=P(),
                                check_vma=False)(logits, inputs.sampling)
        return sampled, kv_cache

    def jit(self, step):
        """jax.jit for `step`, with the shardings serving uses (warm-up compiles exactly these, so a step
        never meets an input placed differently) and the KV pages donated."""
        kv, replicated = shardings(self.mesh, (KV_SPEC, KV_SPEC)), NamedSharding(self.mesh, P())
        return jax.jit(step, donate_argnums=1, in_shardings=(shardings(self.mesh, self.param_specs), kv, replicated),
                       out_shardings=(replicated, kv))


def request_cpu_devices(n: int) -> None:
    """Asks JAX for n CPU devices, which it only gives if asked before it starts (a no-op then, and for
    n = 1); on a GPU machine the extra CPU devices are unused."""
    if n > 1 and jax.config.jax_num_cpu_devices < n:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # JAX already started: make_mesh says what is missing
            pass


def make_mesh(tp: int) -> Mesh:
    """A one-axis mesh over this process's first `tp` devices; a clear error when there are fewer."""
    devices = jax.devices()
    if len(devices) < tp:
        hint = (" (on a CPU, JAX makes several devices only if asked before it starts: "
                "XLA_FLAGS=--xla_force_host_platform_device_count=N, or LLM(tensor_parallel_size=N) and the "
                "jaxserve commands before any other JAX work)") if devices[0].platform == "cpu" else ""
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; JAX sees {len(devices)} "
                         f"{devices[0].platform} device(s){hint}")
    return Mesh(np.asarray(devices[:tp]), (MODEL_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def shardings(mesh: Mesh, specs):
    """NamedShardings for a pytree of PartitionSpecs."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def vocab_sharded_sample(logits, t: SamplingTensors, *, vocab_size: int, axis: str = MODEL_AXIS) -> SamplerOutput:
    """`sampling.sample` for logits [S, V / tp] split by vocabulary over `axis` (inside shard_map).

    A batch of plain greedy rows (the common case) takes each device's argmax and gathers only those;
    anything else (temperature, penalties, bias, logprobs) gathers the logits and runs `sample` itself,
    so every sampling parameter behaves exactly as on one device. Padded vocabulary columns are -inf.
    """
    num_seqs, local_vocab = logits.shape
    offset = jax.lax.axis_index(axis) * local_vocab
    logits = jnp.where(offset + jnp.arange(local_vocab) < vocab_size, logits, -jnp.inf)
    plain = ~jnp.any((t.temperature > 0) | (t.presence_penalty != 0) | (t.frequency_penalty != 0)
                     | (t.repetition_penalty != 1) | jnp.any(t.bias_values != 0, axis=-1) | t.want_logprobs)

    def greedy():
        local = argmax(logits)  # [S]
        best = jnp.take_along_axis(logits, local[:, None], axis=-1)[:, 0]
        bests, ids = jax.lax.all_gather(best, axis), jax.lax.all_gather(local + offset, axis)  # [tp, S]
        shard = jnp.argmax(bests, axis=0)  # the first device holding the maximum: the lowest id, as argmax
        return SamplerOutput(jnp.take_along_axis(ids, shard[None], axis=0)[0].astype(jnp.int32),
                             *no_logprobs(num_seqs, logits.dtype))

    def gathered():
        full = jax.lax.all_gather(logits, axis, axis=1, tiled=True)[:, :vocab_size]
        return sample(full, t)

    return jax.lax.cond(plain, greedy, gathered)
