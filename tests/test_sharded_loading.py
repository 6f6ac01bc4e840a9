"""Loading under tensor parallelism: a process reads only its own devices' slices of the weights.

`load_model(..., lazy=True)` gives LazyTensors, and `shard_params` cuts one device's part out of them,
reading only that part. For each source (a Hugging Face directory's safetensors, jaxserve's orbax
checkpoint, a GGUF file, and the converted copy of it in the model cache), every device's part equals
the one cut from the eagerly loaded arrays, and one device's part reads exactly its share of the split
params plus the replicated ones. A runner built from a lazy load reads every byte of the model once
(plus the replicated params once more per extra device) and computes what one device computes.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import tiny_models
from gguf_files import write_gguf
from jaxserve.config.engine_config import EngineConfig
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.parallel.tp_layout import HeadLayout, shard_params
from jaxserve.weights import LazyTensor, load_model, save_checkpoint
from jaxserve.weights.lazy import bytes_read, total_bytes

SPLIT = {"wq", "wk", "wv", "wo", "bq", "bk", "bv", "w_gate", "w_up", "w_down", "embed", "lm_head"}
SOURCES = ("hf", "orbax", "gguf", "gguf_cached")


@pytest.fixture(autouse=True)
def _private_caches(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("JAXSERVE_TOKENIZER_CACHE", str(tmp_path_factory.getbasetemp() / "tokenizer_cache"))
    monkeypatch.setenv("JAXSERVE_MODEL_CACHE", str(tmp_path_factory.getbasetemp() / "model_cache"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """source -> a path holding the same tiny llama (4 query / 2 KV heads, so tp 2 splits every
    head evenly): its Hugging Face directory, a jaxserve checkpoint of it, and an F32 GGUF of it."""
    hf_dir = tmp_path_factory.mktemp("hf")
    model = tiny_models.make_tiny_model("llama", hf_dir, num_attention_heads=4, num_key_value_heads=2)
    checkpoint = save_checkpoint(load_model(hf_dir), tmp_path_factory.mktemp("ckpt") / "llama")
    gguf_path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", model, "llama")
    return {"hf": hf_dir, "orbax": checkpoint, "gguf": gguf_path, "gguf_cached": gguf_path}


def _load_both(source: str, path, monkeypatch):
    if source == "gguf":  # the GGUF itself, dequantized tensor by tensor and sliced
        monkeypatch.setenv("JAXSERVE_MODEL_CACHE", "off")
    eager = load_model(path)  # for gguf_cached: this load writes the converted copy the lazy one reads
    return eager, load_model(path, lazy=True)


def _nbytes(params: dict, names) -> int:
    total = 0
    for name, x in {**params["layers"], **{k: v for k, v in params.items() if k != "layers"}}.items():
        if name in names:
            total += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    return total


@pytest.mark.parametrize("source", SOURCES)
def test_each_device_part_reads_only_its_share_and_equals_the_eager_one(source, sources, monkeypatch):
    eager, lazy = _load_both(source, sources[source], monkeypatch)
    assert all(isinstance(x, LazyTensor) for x in jax.tree.leaves(lazy.params))
    assert bytes_read(lazy.params) == 0, "loading lazily must read no weights"
    cfg, tp = eager.config, 2
    layout = HeadLayout.for_model(cfg, tp)
    split = _nbytes(lazy.params, SPLIT)
    replicated = total_bytes(lazy.params) - split
    assert replicated > 0 and split > 10 * replicated
    before = 0
    for shard in range(tp):
        part = shard_params(cfg, layout, lazy.params, shard)
        jax.tree.map(lambda want, got: np.testing.assert_array_equal(got, np.asarray(want)),
                     shard_params(cfg, layout, eager.params, shard), part)
        read = bytes_read(lazy.params) - before
        before += read
        assert read == split // tp + replicated, f"device {shard} read {read} bytes"


def test_a_runner_built_from_a_lazy_load_reads_the_model_once_and_matches_one_device(sources):
    lazy = load_model(sources["hf"], lazy=True)
    cfg = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_pages=8)
    runner = ModelRunner(lazy.config, EngineConfig(**cfg, tensor_parallel_size=2), lazy.params)
    replicated = total_bytes(lazy.params) - _nbytes(lazy.params, SPLIT)
    assert runner.weight_bytes_total == total_bytes(lazy.params)
    assert runner.weight_bytes_read == runner.weight_bytes_total + replicated
    assert "read" in runner.describe_weights_read()
    one = ModelRunner(lazy.config, EngineConfig(**cfg), load_model(sources["hf"]).params)
    assert one.weight_bytes_read == 0  # arrays, not LazyTensors: nothing is read from a file
    # Row-split matrices put back together are the one-device ones (the column-split are laid out
    # shard by shard; test_tensor_parallel checks what they compute).
    for name in ("wo", "w_down"):
        np.testing.assert_array_equal(*(np.asarray(jax.tree.leaves(r.params["layers"][1][name])[0])
                                        for r in (runner, one)))


def test_reading_outside_a_lazy_tensor_or_with_steps_is_refused(sources):
    wq = load_model(sources["hf"], lazy=True).params["layers"]["wq"]
    with pytest.raises(TypeError, match="step-1"):
        wq[:, :, ::2]
    with pytest.raises(TypeError, match="slices"):
        wq[0]
    assert wq[:, :, 8:4].shape == (wq.shape[0], wq.shape[1], 0)
    np.testing.assert_array_equal(np.asarray(wq)[:, 1:3], wq[:, 1:3])
