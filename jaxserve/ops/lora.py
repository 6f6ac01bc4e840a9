"""LoRA adapters inside the step: the delta of a batch that mixes the base model and several adapters,
computed in one pass (Punica's batched gathered matmul, written as a masked matmul XLA runs anywhere).

Every projection an adapter may target holds the adapters of all `max_loras` device slots side by side:
A [in, S * r] and B [S * r, out] (S slots of rank r = max_lora_rank; slot s in columns / rows
(s - 1) * r .. s * r; zeros where a slot is empty, an adapter leaves a projection alone or has a lower
rank). Each token carries its sequence's slot (0: the base model). The batch's delta is then

    ((x @ A) * mask) @ B,    mask [T, S * r] = 1 where the column belongs to the token's own slot,

so each row gets its own adapter's x @ A_s @ B_s (scaling folded into B at load) and base rows get
zero. The shapes depend only on the settings, never on which adapters a batch holds: no compilation
when adapters load, leave or mix. The x @ A product computes every slot's r columns for every token,
S * r columns in all: small next to the projection itself at the ranks adapters use.

On a CPU whose C++ kernels are built (matmul_backend cpu or cpu-bf16) the same delta is the kernel of
`cpu_kernels/lora_bgmv.cc` instead (Punica's BGMV): each token multiplies only its own slot's r columns
and rows, one call per projection. XLA's masked form needs four small dots and passes for each, which
run far below the machine's rate at a decode step's few rows: with two rank-16 adapters on all seven
projections of the default model it cost a batch of 8 about 30% of its decode throughput. There the
step hands the model each token's slot ([T] int32, `TokenSlots`) instead of the mask.

Which slot holds what, and writing an adapter into a slot, is `runner/lora_slots.py`'s; the weights
come from `lora/peft_loader.py`. This module is the math only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The projections an adapter may target (PEFT's module names), by the fused matrix each one feeds
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
TARGETS = QKV + ("o_proj",) + GATE_UP + ("down_proj",)


def token_slots(seq_slots, cu_q_lens, num_tokens: int):
    """Each token's slot [T] from its sequence's slot seq_slots [S] and the step's cu_q_lens [S + 1]
    (padding tokens past cu_q_lens[-1]: slot 0)."""
    # [T, S] comparisons, no loop: a GPU step holds no control flow outside its kernels
    seq_of_token = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=cu_q_lens.dtype), side="right",
                                    method="compare_all")
    inside = seq_of_token < seq_slots.shape[0]
    return jnp.where(inside, seq_slots[jnp.minimum(seq_of_token, seq_slots.shape[0] - 1)], 0)


def slot_mask(slots, max_loras: int, max_lora_rank: int, dtype):
    """[T, S * r]: 1 in the r columns of each token's slot, 0 elsewhere (everywhere for slot 0)."""
    column_slot = jnp.arange(max_loras * max_lora_rank, dtype=slots.dtype) // max_lora_rank + 1
    return (column_slot[None, :] == slots[:, None]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class TokenSlots:
    """What the C++ kernel takes in place of the mask: each token's slot [T] int32 (0: the base model), the
    step's real tokens (those past it get zeros) and the slots' rank r."""

    slots: jax.Array
    rows: jax.Array
    rank: int


def bgmv(x, a, b, token_slots: TokenSlots):
    """The C++ kernel's delta (cpu_kernels/lora_bgmv.cc): [T, out] float32, token t through its own slot;
    a and b float32 or bfloat16 (widened in the kernel)."""
    assert a.dtype == b.dtype and a.dtype in (jnp.float32, jnp.bfloat16), (a.dtype, b.dtype)
    out = jax.ShapeDtypeStruct((x.shape[0], b.shape[1]), jnp.float32)
    target = "jaxserve_lora_bgmv" + ("_bf16" if a.dtype == jnp.bfloat16 else "")
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    return jax.ffi.ffi_call(target, out)(x.astype(jnp.float32), a, b, i32(token_slots.slots), i32(token_slots.rows),
                                         rank=token_slots.rank)


def delta(x, a, b, mask):
    """((x @ a) * mask) @ b: x [T, in], a [in, S * r], b [S * r, out], mask [T, S * r] -> [T, out] float32;
    the C++ kernel where mask is a `TokenSlots`."""
    if isinstance(mask, TokenSlots):
        return bgmv(x, a, b, mask)
    u = jnp.dot(x.astype(a.dtype), a, preferred_element_type=jnp.float32) * mask
    return jnp.dot(u.astype(b.dtype), b, preferred_element_type=jnp.float32)


def fused_delta(x, lora: dict, targets: tuple[str, ...], mask):
    """The deltas of `targets`, side by side as their fused matrix's columns ([q | k | v], [gate | up]):
    one device's share of each under tensor parallelism, as the fused matrix's own columns are."""
    return jnp.concatenate([delta(x, *lora[t], mask) for t in targets], axis=-1)


def with_lora(base, with_delta, active, branches: bool):
    """with_delta() where some token of the step uses an adapter (`active`), else base(). branches:
    decided on the device (a CPU: a step without adapters skips the deltas and keeps the fused kernels);
    without (a GPU, where a branch waits for the host), the deltas always run, adding zeros for base rows."""
    if branches:
        return jax.lax.cond(active, with_delta, base)
    return with_delta()
