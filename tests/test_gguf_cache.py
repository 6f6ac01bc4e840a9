"""The converted-GGUF and tokenizer caches (`jaxserve/weights/cache.py`) under the conditions a start
meets outside a test's clean directory: a file replaced in place, several processes or threads loading
one file for the first time at once, a writer killed mid-entry, a write that fails, and a home directory
where no cache can be created."""

from __future__ import annotations

import logging
import os
import pathlib
import threading
import time

import numpy as np
import pytest
import torch
import transformers

import tiny_models
from gguf_files import write_gguf
from jaxserve.weights import cache, gguf, load_model

DEADLINE_S = 120  # generous: only a broken lock or a hang gets near it


def make_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=tiny_models.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _private_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.setenv("JAXSERVE_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))


def leftovers(directory) -> list[str]:
    """The temporary directories in a cache directory: its entries' writers' (`<entry>.tmp*`)."""
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


def lock_file(entry: pathlib.Path) -> pathlib.Path:
    return entry.with_name(f"{entry.name}.lock")


def test_a_gguf_replaced_in_place_with_its_size_and_mtime_put_back_loads_the_new_weights(tmp_path):
    """A cache keyed by path, size and mtime served the old weights for a file rewritten in place with its
    modification time restored (a copy tool, a checkout, `touch -r`): the key is the content."""
    path = write_gguf(tmp_path / "model.gguf", make_llama(seed=0), "llama")
    before = path.stat()
    old_embed = np.array(load_model(path).params["embed"])  # a copy: float32 params may view the file's pages
    replacement = make_llama(seed=1)
    write_gguf(path, replacement, "llama")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)

    new = load_model(path)
    assert not np.array_equal(np.asarray(new.params["embed"]), old_embed)
    np.testing.assert_array_equal(np.asarray(new.params["embed"]),
                                  replacement.model.embed_tokens.weight.detach().numpy())


def flock_waiters(path: pathlib.Path) -> int:
    """How many flock() calls wait on the file `path` (Linux's /proc/locks marks a waiter with '->')."""
    if not path.exists():
        return 0
    inode = str(path.stat().st_ino)
    with open("/proc/locks") as f:
        return sum("->" in line and any(field.count(":") == 2 and field.rsplit(":", 1)[1] == inode
                                        for field in line.split()) for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="watches the lock's waiters in /proc/locks (Linux)")
def test_concurrent_first_loads_of_a_gguf_convert_it_once_and_leave_no_temporary_directory(tmp_path, monkeypatch):
    """Two engines starting at once on a new file both converted it, and wrote over each other's entry:
    the second waits on the entry's lock while the first converts, then reads its copy. The first
    conversion holds on until the second load either converts too (the bug) or waits on the lock."""
    path = write_gguf(tmp_path / "model.gguf", make_llama(seed=0), "llama")
    lock = lock_file(cache.converted_model_dir(path, cache.file_digest(path), "float32"))
    conversions = []  # one per params build from the GGUF's tensors
    build = gguf.params_from_hf

    def counted(*args, **kwargs):
        conversions.append(threading.get_ident())
        deadline = time.monotonic() + DEADLINE_S
        while not (len(conversions) > 1 or flock_waiters(lock) or second_done()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return build(*args, **kwargs)

    monkeypatch.setattr(gguf, "params_from_hf", counted)
    results, errors = [None, None], []

    def load(i: int) -> None:
        try:
            results[i] = load_model(path)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    second_started = threading.Event()
    second_done = lambda: second_started.is_set() and not threads[1].is_alive()  # noqa: E731
    threads[0].start()
    deadline = time.monotonic() + DEADLINE_S
    while not conversions and time.monotonic() < deadline:  # the first holds the lock, converting
        time.sleep(0.05)
    threads[1].start()
    second_started.set()
    for thread in threads:
        thread.join(DEADLINE_S)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(conversions) == 1
    np.testing.assert_array_equal(np.asarray(results[0].params["embed"]), np.asarray(results[1].params["embed"]))
    for directory in (tmp_path / "models", tmp_path / "tokenizers"):
        assert leftovers(directory) == []


def test_a_writer_killed_mid_entry_leaves_nothing_behind_after_the_next_load(tmp_path):
    """A temporary directory of a process killed while writing an entry is removed by the next load of
    that file, which holds the entry's lock (so no live writer can own it)."""
    path = write_gguf(tmp_path / "model.gguf", make_llama(seed=0), "llama")
    entry = cache.converted_model_dir(path, cache.file_digest(path), "float32")
    stale = entry.with_name(f"{entry.name}.tmp_killed")
    stale.mkdir()
    (stale / "params.safetensors").write_bytes(b"half")
    load_model(path)
    assert leftovers(tmp_path / "models") == [] and entry.is_dir()


def test_a_failed_cache_write_leaves_no_temporary_directory_and_says_so(tmp_path, monkeypatch, caplog):
    """A full disk while writing the converted copy: the load still succeeds, the half-written temporary
    directory is gone, and a warning names the entry."""
    import safetensors.flax

    path = write_gguf(tmp_path / "model.gguf", make_llama(seed=0), "llama")

    def disk_full(flat, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.flax, "save_file", disk_full)
    with caplog.at_level(logging.WARNING, logger="jaxserve.config.cache_dirs"):
        loaded = load_model(path)
    assert loaded.params["embed"].shape[0] == tiny_models.VOCAB_SIZE
    assert leftovers(tmp_path / "models") == []
    assert not [p for p in (tmp_path / "models").iterdir() if p.is_dir()]
    assert any("No space left on device" in r.getMessage() and "models" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("home", ["under_a_file", "missing"])
def test_without_a_usable_home_a_gguf_loads_without_caches_and_says_so(tmp_path, monkeypatch, caplog, home):
    """HOME under a regular file (nothing can be created there, even by root, for whom a read-only mode
    bit stops nothing), or no HOME at all and no password entry: the load works, with a warning naming
    each cache it goes without."""
    monkeypatch.delenv("JAXSERVE_MODEL_CACHE")
    monkeypatch.delenv("JAXSERVE_TOKENIZER_CACHE")
    if home == "under_a_file":
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))
    else:
        def no_home(cls):
            raise RuntimeError("Could not determine home directory.")

        monkeypatch.delenv("HOME")
        monkeypatch.setattr(pathlib.Path, "home", classmethod(no_home))
    path = write_gguf(tmp_path / "model.gguf", make_llama(seed=0), "llama")
    with caplog.at_level(logging.WARNING, logger="jaxserve.config.cache_dirs"):
        first = load_model(path)
        second = load_model(path)
    np.testing.assert_array_equal(np.asarray(first.params["embed"]), np.asarray(second.params["embed"]))
    messages = [r.getMessage() for r in caplog.records]
    for name in ("models", "tokenizers"):
        assert any(f"running without its {name} cache" in m for m in messages), messages
    assert not (tmp_path / "file").is_dir()


def test_the_tokenizer_cache_turned_off_writes_nothing(tmp_path, monkeypatch):
    """JAXSERVE_TOKENIZER_CACHE=off, as for the other caches (it made a directory named `off`)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JAXSERVE_TOKENIZER_CACHE", "off")
    path = write_gguf(tmp_path / "model.gguf", make_llama(seed=0), "llama")
    assert load_model(path).tokenizer.encode("Hi") == load_model(path).tokenizer.encode("Hi")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "models"]
