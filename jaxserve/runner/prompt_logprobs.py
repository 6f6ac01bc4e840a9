"""Prompt logprobs on the device: each prompt token's logprob given the tokens before it, its rank and
the top alternatives, for the requests that ask (`SamplingParams.prompt_logprobs`).

A prefill step hands out its last layer's output of every token (`hidden` [T, hidden], before the final
norm). When a step holds prompt positions whose logprobs a request wants, the engine launches one more
executable on it right after the step, on the device, without waiting for either: the final norm and the
LM head over those rows only, in blocks of at most `BLOCK_ROWS` rows (its logits stay [BLOCK_ROWS, vocab]
whatever the bucket), then the log-softmax at each row's next prompt token (`sampling.target_logprobs`).
It is compiled per prefill bucket at warm-up. A step without such rows never launches it, and its only
cost to the prefill step itself is `hidden` as an output; decode steps do not produce it.

The job, one int32 array [2, W] (`job_width`): row 0 the token rows of `hidden` to read (the used ones
first, -1 after them), row 1 each row's target token (the prompt token that follows it).
Under tensor parallelism each device computes its slice of the vocabulary's logits and they are gathered,
as the sampler does for logprobs. What rows a step needs, and reading the results into requests, is the
engine's (`core/prompt_logprobs.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config.model_config import ModelConfig
from jaxserve.config.sampling_params import MAX_LOGPROBS
from jaxserve.models.params import MODEL_AXIS
from jaxserve.models.transformer import lm_head_logits
from jaxserve.ops.sampling import PromptLogprobs, target_logprobs
from jaxserve.parallel.tensor_parallel import TensorParallel, shardings

BLOCK_ROWS = 128


def job_width(bucket: int) -> int:
    """The job's width for a prefill bucket of `bucket` tokens: a whole number of blocks that holds them."""
    block = min(bucket, BLOCK_ROWS)
    return -(-bucket // block) * block


def compute(params, hidden, job, *, cfg: ModelConfig, vocab_size: int, axis: str | None = None
            ) -> PromptLogprobs:
    """The job's rows [W] (`PromptLogprobs`; rows past the used ones are zeros). hidden [T, hidden_size];
    job [2, W] int32. axis: inside shard_map, the LM head is this device's slice of the vocabulary."""
    rows, targets = job[0], job[1]
    width = rows.shape[0]
    block = min(width, BLOCK_ROWS)
    num_blocks = (jnp.sum(rows >= 0) + block - 1) // block  # blocks past the used rows are skipped

    def one_block(i, out: PromptLogprobs) -> PromptLogprobs:
        start = i * block
        logits = lm_head_logits(params, cfg, hidden[jnp.maximum(jax.lax.dynamic_slice_in_dim(rows, start, block), 0)])
        if axis is not None:
            logits = jax.lax.all_gather(logits, axis, axis=1, tiled=True)
        got = target_logprobs(logits[:, :vocab_size], jax.lax.dynamic_slice_in_dim(targets, start, block))
        return PromptLogprobs(*(jax.lax.dynamic_update_slice_in_dim(o, g, start, 0) for o, g in zip(out, got)))

    empty = PromptLogprobs(jnp.zeros(width, jnp.float32), jnp.zeros(width, jnp.int32),
                           jnp.zeros((width, MAX_LOGPROBS), jnp.int32), jnp.zeros((width, MAX_LOGPROBS), jnp.float32))
    return jax.lax.fori_loop(0, num_blocks, one_block, empty)


def make_fn(model_cfg: ModelConfig, parallel: TensorParallel | None):
    """`compute`, jitted for one device or split over the mesh of `parallel`."""
    if parallel is None:
        return jax.jit(functools.partial(compute, cfg=model_cfg, vocab_size=model_cfg.vocab_size))
    on_each = functools.partial(compute, cfg=parallel.device_cfg, vocab_size=model_cfg.vocab_size, axis=MODEL_AXIS)
    split = jax.shard_map(on_each, mesh=parallel.mesh, in_specs=(parallel.param_specs, P(), P()), out_specs=P(),
                          check_vma=False)
    replicated = NamedSharding(parallel.mesh, P())
    return jax.jit(split, in_shardings=(shardings(parallel.mesh, parallel.param_specs), replicated, replicated),
                   out_shardings=replicated)


def lower(fn, params, hidden, bucket: int, float32_on_gpu: bool):
    """`make_fn`'s function lowered for a prefill bucket: params as served, hidden the prefill step's output
    (its shape and dtype). float32_on_gpu: float32 dots at full precision, as the steps (model_runner.lower)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, hidden))
    job = jax.ShapeDtypeStruct((2, job_width(bucket)), jnp.int32)
    with jax.default_matmul_precision("highest" if float32_on_gpu else None):
        return fn.trace(*shapes, job).lower()
