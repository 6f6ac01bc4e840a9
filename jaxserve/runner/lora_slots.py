"""LoRA adapter slots on the device: each layer's stacked A and B arrays (`models/params.py`'s
`lora_layout`, zeros at start, served as params["lora"]), and writing one adapter into one slot.

The write is one jitted executable, its slot index an argument and the arrays donated (updated in
place), compiled at warm-up: loading, evicting and reloading adapters never compiles. An adapter's
weights arrive as `lora/peft_loader.py` reads them (float32, stacked over layers, scaling folded into
B) and are laid out here on the host: every target module (zeros for those it leaves alone, so nothing
of a slot's previous adapter survives), its rank padded with zeros to max_lora_rank, the model's dtype,
and under tensor parallelism the padded model's head and intermediate layout (`tp_layout.padded_lora`).

Which adapter sits in which slot is the host's (`lora/residency.py`, driven by the scheduler); the
slot each row of the batch uses is a field of the persistent device batch (`device_batch.py`); the math
is `ops/lora.py`'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.models.params import lora_layout
from jaxserve.ops.lora import TARGETS, slot_mask, token_slots
from jaxserve.parallel.tensor_parallel import TensorParallel, shardings
from jaxserve.parallel.tp_layout import padded_lora


def write_slot(lora: list[dict], slot, weights: dict, *, rank: int) -> list[dict]:
    """`lora` (per layer {target: (A [in, S r], B [S r, out])}) with `weights` ({target: (A [L, in, r],
    B [L, r, out])}) in slot `slot`'s columns of A and rows of B (slot >= 1)."""
    start = (slot - 1) * rank
    return [{target: (jax.lax.dynamic_update_slice(a, weights[target][0][i].astype(a.dtype), (0, start)),
                      jax.lax.dynamic_update_slice(b, weights[target][1][i].astype(b.dtype), (start, 0)))
             for target, (a, b) in layer.items()} for i, layer in enumerate(lora)]


class LoRASlots:
    """The slot arrays' shapes and shardings, and their writer, for a model served with `cfg`."""

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, parallel: TensorParallel | None,
                 matmul_backend: str = "xla"):
        """matmul_backend: the engine's resolved one. With the C++ matmul in bfloat16 (cpu-bf16) the slots are
        bfloat16 too, as the weights are (the C++ LoRA kernel widens them as it reads them: half the bytes a
        decode step reads for its deltas); else the engine's dtype."""
        self.model_cfg, self.parallel = model_cfg, parallel
        self.max_loras, self.rank = cfg.max_loras, cfg.max_lora_rank
        self.dtype = jnp.dtype(jnp.bfloat16 if matmul_backend == "cpu-bf16" else cfg.dtype)
        layer = lora_layout(parallel.padded_cfg if parallel else model_cfg, self.max_loras, self.rank)
        self.shapes = [{t: tuple(jax.ShapeDtypeStruct(shape, self.dtype) for shape, _ in layer[t]) for t in TARGETS}
                       for _ in range(model_cfg.num_layers)]
        self.specs = [{t: tuple(spec for _, spec in layer[t]) for t in TARGETS} for _ in range(model_cfg.num_layers)]
        # One adapter's stacked matrices, as `host_weights` lays them out: [L, in, r] and [L, r, out]
        self.weight_shapes = {t: (jax.ShapeDtypeStruct((model_cfg.num_layers, a.shape[0], self.rank), np.float32),
                                  jax.ShapeDtypeStruct((model_cfg.num_layers, self.rank, b.shape[1]), np.float32))
                              for t, (a, b) in self.shapes[0].items()}
        write = functools.partial(write_slot, rank=self.rank)
        if parallel:
            placed, replicated = shardings(parallel.mesh, self.specs), jax.sharding.NamedSharding(
                parallel.mesh, jax.sharding.PartitionSpec())
            self._write = jax.jit(write, donate_argnums=0, in_shardings=(placed, replicated, replicated),
                                  out_shardings=placed)
        else:
            self._write = jax.jit(write, donate_argnums=0)
        self._writer = None  # compiled by `compile` (at warm-up)

    @property
    def nbytes(self) -> int:
        """The slot arrays' bytes, all devices' parts together."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.shapes))

    def attach(self, params: dict) -> dict:
        """The served params with every slot empty as params["lora"]: on the device (split over the mesh
        under tensor parallelism, their specs added to the mesh's), or shapes where the params are shapes
        (check-lowering)."""
        if self.parallel:
            self.parallel.param_specs["lora"] = self.specs
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            return params | {"lora": self.shapes}
        return params | {"lora": self._zeros()}

    def _zeros(self) -> list[dict]:
        make = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes)  # noqa: E731
        if self.parallel:
            return jax.jit(make, out_shardings=shardings(self.parallel.mesh, self.specs))()
        return jax.jit(make)()

    def compile(self) -> None:
        if self._writer is None:
            slot = jax.ShapeDtypeStruct((), jnp.int32)
            self._writer = self._write.trace(self.shapes, slot, self.weight_shapes).lower().compile()

    def host_weights(self, targets: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
        """An adapter's matrices ({target: (A [L, in, rank], B [L, rank, out])}, float32) as the writer
        takes them: every target, rank padded to max_lora_rank, the padded model's layout."""
        out = {}
        for target, (a_shape, b_shape) in self.weight_shapes.items():
            if target not in targets:
                out[target] = (np.zeros(a_shape.shape, np.float32), np.zeros(b_shape.shape, np.float32))
                continue
            a, b = (np.asarray(m, np.float32) for m in targets[target])
            assert a.shape[2] == b.shape[1] <= self.rank, (target, a.shape, b.shape, self.rank)
            a = np.pad(a, ((0, 0), (0, 0), (0, self.rank - a.shape[2])))
            b = np.pad(b, ((0, 0), (0, self.rank - b.shape[1]), (0, 0)))
            if self.parallel:
                a, b = padded_lora(self.model_cfg, self.parallel.layout, target, a, b)
            assert (a.shape, b.shape) == (a_shape.shape, b_shape.shape), (target, a.shape, b.shape)
            out[target] = (a, b)
        return out

    def write(self, lora: list[dict], slot: int, targets: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[dict]:
        """`lora` (donated) with the adapter `targets` in slot `slot` (1..max_loras)."""
        assert 1 <= slot <= self.max_loras, slot
        self.compile()
        return self._writer(lora, np.int32(slot), self.host_weights(targets))


def step_mask(seq_slots, cu_q_lens, num_tokens: int, max_loras: int, rank: int, kernel: bool = False):
    """A step's LoRA mask [T, S * r] (ops/lora.py) from each sequence's slot seq_slots [S]; for the C++
    kernel (kernel), each token's slot [T] instead."""
    slots = token_slots(seq_slots, cu_q_lens, num_tokens)
    return slots if kernel else slot_mask(slots, max_loras, rank, jnp.float32)
