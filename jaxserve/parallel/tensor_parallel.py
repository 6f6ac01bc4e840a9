"""Tensor parallelism: one model split over the devices of a `jax.sharding.Mesh` (Megatron style).

Each device holds a slice of every layer: some of the query heads with their KV heads (q/k/v columns,
o_proj rows, its heads of every KV page), a slice of the MLP's intermediate axis (gate/up columns,
down_proj rows), a slice of the vocabulary (embedding rows, LM head columns). The whole step runs under
one `shard_map`, so each device runs the single-device model on its slices (`models/transformer.py`
with `axis=MODEL_AXIS`), and the only communication is written out: one all-reduce after o_proj and one
after down_proj per layer, one after the embedding lookup, and in the sampler either a gather of
per-device maxima (a greedy batch) or of the logits (anything else).

Which heads each device holds, and how padding keeps the output unchanged, is `tp_layout.py`'s.

The scheduler, page pool and server do not know about any of this: pages are logical, and each device
holds its KV heads' part of every page.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config.model_config import ModelConfig
from jaxserve.ops.packed_matmul import PackedWeight
from jaxserve.ops.quantized import QuantizedWeight
from jaxserve.models.params import MODEL_AXIS, param_specs
from jaxserve.models.transformer import forward, init_kv_cache
from jaxserve.ops.sampling import SamplerOutput, SamplingTensors, argmax, choose, no_logprobs, sample
from jaxserve.parallel.tp_layout import HeadLayout, shard_params

KV_SPEC = P(None, None, None, MODEL_AXIS, None)  # [num_layers, num_pages, page_size, KVH, D]: by KV head
VOCAB_SPEC = P(None, MODEL_AXIS)  # logits [S, V]: by vocabulary


# serving_params' fused matrices take the spec of their parts; a packed matrix's data is
# [panels, K, PANEL_WIDTH]: split by panels where the matrix is split by columns, by K where by rows.
_FUSED_FROM = {"w_qkv": "wq", "b_qkv": "bq", "w_gate_up": "w_gate"}
_PACKED_SPECS = {P(None, MODEL_AXIS): P(MODEL_AXIS, None, None), P(MODEL_AXIS, None): P(None, MODEL_AXIS, None)}
# An 8-bit packed matrix's column scales [panels * PANEL_WIDTH] go with its columns where it is split by
# columns. Split by rows, each device packs its own rows (`place_params`), so its column scales are over
# those rows alone: device d's block of a [tp * N] array split the same way, not one [N] array replicated
# (whose gathered value would be device 0's scales for every device).
_PACKED_SCALE_SPECS = {P(None, MODEL_AXIS): P(MODEL_AXIS), P(MODEL_AXIS, None): P(MODEL_AXIS)}


def serving_specs(cfg: ModelConfig, serving: dict) -> dict:
    """PartitionSpecs for `serving_params`' pytree `serving` (packed or not, rope tables included)."""
    specs = param_specs(cfg)

    def leaf_spec(spec, value):
        if isinstance(value, PackedWeight):
            quantized = value.scale is not None
            return PackedWeight(_PACKED_SPECS[spec], value.n, _PACKED_SCALE_SPECS[spec] if quantized else None)
        if isinstance(value, QuantizedWeight):  # a scale per output column: split with the columns
            return QuantizedWeight(spec, P(spec[-1]))
        return spec

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

    def __init__(self, model_cfg: ModelConfig, tp: int, layout: HeadLayout | None = None):
        """layout: the heads' places if already decided (`resolve_config` does), else decided here."""
        self.model_cfg = model_cfg
        self.layout = layout or HeadLayout.for_model(model_cfg, tp)
        self.mesh = make_mesh(tp)
        self.device_cfg = self.layout.device_config(model_cfg)  # what forward runs with on each device
        self.padded_cfg = self.layout.padded_config(model_cfg)  # what the arrays hold, all devices together
        self.param_specs = None  # set by place_params

    def describe(self) -> str:
        return self.layout.describe(self.model_cfg)

    def place_params(self, params, to_serving: Callable, rope: Callable[[], dict]) -> dict:
        """The loaded params (arrays, LazyTensors or shapes) -> the padded model's in forward's layout
        (`to_serving`, a partial of `serving_params`) plus the rope tables, placed on the mesh by their
        PartitionSpecs. Each of this process's devices gets the serving params of its own part
        (`shard_params`), built on the host one device at a time: a LazyTensor is read only where this
        process's devices need it, and no process holds the whole model. Shapes in, shapes out."""
        to_serving = functools.partial(to_serving.func, self.device_cfg, **to_serving.keywords)

        def build(params, shard: int):
            return to_serving(shard_params(self.model_cfg, self.layout, params, shard))

        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        local = jax.eval_shape(functools.partial(build, shard=0), abstract)
        self.param_specs = serving_specs(self.device_cfg, local | jax.eval_shape(rope))
        specs = {name: spec for name, spec in self.param_specs.items() if name in local}
        whole = jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(_global_shape(x.shape, spec, self.layout.tp),
                                                                  x.dtype), local, specs)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            return whole | jax.eval_shape(rope)
        pieces = []  # per device of this process: its serving params' leaves, on it
        for shard, device in enumerate(self.mesh.devices.flat):
            if device.process_index == jax.process_index():
                pieces.append([jax.device_put(x, device) for x in jax.tree.leaves(build(params, shard))])
        placed = [jax.make_array_from_single_device_arrays(x.shape, sharding, list(on_devices))
                  for x, sharding, *on_devices in zip(jax.tree.leaves(whole),
                                                      jax.tree.leaves(shardings(self.mesh, specs)), *pieces)]
        tables = jax.tree.map(lambda x: self.replicated(np.asarray(x)), rope())
        return jax.tree.unflatten(jax.tree.structure(whole), placed) | tables

    def init_kv_cache(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype):
        """The padded model's KV page arrays, created on the mesh split by KV head."""
        assert cfg == self.model_cfg
        make = functools.partial(init_kv_cache, self.padded_cfg, num_pages, page_size, dtype)
        return jax.jit(make, out_shardings=shardings(self.mesh, (KV_SPEC, KV_SPEC)))()

    def forward(self, params, kv_cache, inputs, **forward_kwargs):
        """`models.transformer.forward` split over the mesh, for step inputs (model_runner.StepInputs):
        (logits [S, padded vocab] split by vocabulary, kv_cache), and with return_hidden the last layer's
        output [T, hidden] (the same on every device). Each device runs forward on its share."""

        def on_each_device(params, kv_cache, inputs):
            return forward(params, self.device_cfg, inputs.token_ids, inputs.positions, kv_cache, inputs.md,
                           inputs.logits_indices, axis=MODEL_AXIS, lora_mask=inputs.lora_mask, **forward_kwargs)

        kv_specs = (KV_SPEC, KV_SPEC)
        out_specs = (VOCAB_SPEC, kv_specs) + ((P(),) if forward_kwargs.get("return_hidden") else ())
        return jax.shard_map(on_each_device, mesh=self.mesh, in_specs=(self.param_specs, kv_specs, P()),
                             out_specs=out_specs, check_vma=False)(params, kv_cache, inputs)

    def step(self, params, kv_cache, inputs, *, sampler_branches: bool = True, sampler_kernel: bool = False,
             **forward_kwargs):
        """model_runner's step on the mesh: `forward`, then each device samples from its slice of the
        vocabulary (`vocab_sharded_sample`); the sampled tokens are the same on every device."""
        logits, kv_cache, *hidden = self.forward(params, kv_cache, inputs, lora_branches=sampler_branches,
                                                 **forward_kwargs)
        sample_on_each = functools.partial(vocab_sharded_sample, vocab_size=self.model_cfg.vocab_size,
                                           branches=sampler_branches, cpu_kernel=sampler_kernel)
        sampled = jax.shard_map(sample_on_each, mesh=self.mesh, in_specs=(VOCAB_SPEC, P()), out_specs=P(),
                                check_vma=False)(logits, inputs.sampling)
        return sampled, kv_cache, *hidden

    def jit(self, step, with_hidden: bool = False):
        """jax.jit for `step`, with the shardings serving uses (warm-up compiles exactly these, so a step
        never meets an input placed differently), the KV pages and the last sampled tokens donated.
        with_hidden: the step hands out the last layer's output too (replicated)."""
        kv, replicated = shardings(self.mesh, (KV_SPEC, KV_SPEC)), NamedSharding(self.mesh, P())
        outputs = (replicated, kv, replicated) + (replicated,) * with_hidden
        return jax.jit(step, donate_argnums=(1, 2), out_shardings=outputs,
                       in_shardings=(shardings(self.mesh, self.param_specs), kv, replicated, replicated))

    def jit_replicated(self, fn):
        """jax.jit for a function of replicated arrays (the device batch's row writer), its first argument
        donated."""
        replicated = NamedSharding(self.mesh, P())
        return jax.jit(fn, donate_argnums=0, in_shardings=replicated, out_shardings=replicated)

    def replicated(self, x: np.ndarray) -> jax.Array:
        """A host array copied to every device of the mesh (each process gives its own devices' copies)."""
        return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, P()), lambda index: x[index])


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


def _global_shape(shape: tuple[int, ...], spec: P, tp: int) -> tuple[int, ...]:
    """The whole array's shape from one device's part of it, split as `spec` says."""
    return tuple(n * tp if axis == MODEL_AXIS else n for n, axis in zip(shape, (*spec, *[None] * len(shape))))


def shardings(mesh: Mesh, specs):
    """NamedShardings for a pytree of PartitionSpecs."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def vocab_sharded_sample(logits, t: SamplingTensors, *, vocab_size: int, axis: str = MODEL_AXIS,
                         branches: bool = True, cpu_kernel: bool = False) -> SamplerOutput:
    """`sampling.sample` for logits [S, V / tp] split by vocabulary over `axis` (inside shard_map).

    A batch of plain greedy rows (the common case) takes each device's argmax and gathers only those;
    anything else (temperature, penalties, bias, a grammar's bitmask, logprobs) gathers the logits and runs `sample` itself,
    so every sampling parameter behaves exactly as on one device. Padded vocabulary columns are -inf.
    """
    num_seqs, local_vocab = logits.shape
    offset = jax.lax.axis_index(axis) * local_vocab
    logits = jnp.where(offset + jnp.arange(local_vocab) < vocab_size, logits, -jnp.inf)
    plain = ~jnp.any((t.temperature > 0) | (t.presence_penalty != 0) | (t.frequency_penalty != 0)
                     | (t.repetition_penalty != 1) | jnp.any(t.bias_values != 0, axis=-1) | t.want_logprobs
                     | jnp.any(t.token_bitmask != -1, axis=-1))

    def greedy():
        local = argmax(logits)  # [S]
        best = jnp.take_along_axis(logits, local[:, None], axis=-1)[:, 0]
        bests, ids = jax.lax.all_gather(best, axis), jax.lax.all_gather(local + offset, axis)  # [tp, S]
        shard = jnp.argmax(bests, axis=0)  # the first device holding the maximum: the lowest id, as argmax
        return SamplerOutput(jnp.take_along_axis(ids, shard[None], axis=0)[0].astype(jnp.int32),
                             *no_logprobs(num_seqs, logits.dtype))

    def gathered():
        full = jax.lax.all_gather(logits, axis, axis=1, tiled=True)[:, :vocab_size]
        return sample(full, t, branches, cpu_kernel)

    return choose(branches, plain, greedy, gathered)  # both, selected, on a GPU (sampling.choose)
