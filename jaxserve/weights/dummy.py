"""`load_format="dummy"` (vLLM's `--load-format dummy`): a model's shape with random weights, no weight file.

For benchmarking a shape (an 8B model on a GPU) from a directory holding only its config.json and
tokenizer, without writing or reading gigabytes of weights. The loaded model holds the params' shapes
and a `draw` function: the model runner draws them inside the jitted conversion to its serving layout,
so they are made on the device directly, the host never holds the model, and the device never holds a
second copy (on an H100 the 8B shape's freed loader copy left a hole that split the memory the KV pool
needs whole: out of memory with 60 GiB free). The outputs are meaningless; the engine's start-up line
says the weights are random.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config.model_config import ModelConfig, ModelLoadError
from jaxserve.models.params import param_shapes
from jaxserve.weights.hf import hf_dir_config, load_tokenizer_dir
from jaxserve.weights.loaded import LoadedModel

# vLLM's dummy init is uniform in [-1e-3, 1e-3]; a normal with the usual 0.02 std keeps logits varied
# enough that sampling does not collapse onto one token, and 32 bfloat16 layers finite.
INIT_STD = 0.02


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def dummy_params(key: jax.Array, cfg: ModelConfig, dtype: str) -> dict:
    """The params pytree of `cfg`: matrices normal * INIT_STD, norm weights (the multiplier itself) one,
    biases zero; each leaf from its own fold of `key`, so the same key gives the same params."""
    counter = iter(range(1 << 30))

    def draw(name: str, shape: tuple[int, ...]) -> jax.Array:
        leaf_key = jax.random.fold_in(key, next(counter))
        if "norm" in name:
            return jnp.ones(shape, dtype)
        if name.startswith("b"):
            return jnp.zeros(shape, dtype)
        return (jax.random.normal(leaf_key, shape, jnp.float32) * INIT_STD).astype(dtype)

    def build(shapes: dict) -> dict:
        return {name: build(entry) if isinstance(entry, dict) else draw(name, entry) for name, entry in shapes.items()}

    return build(param_shapes(cfg))


def load_dummy(path: Path, dtype: str, seed: int = 0) -> LoadedModel:
    """A Hugging Face directory's config and tokenizer, with random params (`dummy_params`) from `seed`."""
    if not (path.is_dir() and (path / "config.json").exists()):
        raise ModelLoadError(f"--load-format dummy needs a Hugging Face model directory with config.json; "
                             f"{str(path)!r} is not one")
    cfg = hf_dir_config(path)
    draw = functools.partial(dummy_params, jax.random.key(seed), cfg, dtype)
    return LoadedModel(cfg, jax.eval_shape(draw), load_tokenizer_dir(path),
                       f"{path} with random weights (load_format='dummy')", draw=draw)
