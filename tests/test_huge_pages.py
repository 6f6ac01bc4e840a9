"""The KV page arrays in 2 MiB pages on a Linux CPU (jaxserve/runner/huge_pages.py): their whole 2 MiB pages
marked MADV_HUGEPAGE, still zeros, and mapped as 2 MiB pages once written where the system allows them."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner import huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")


def mapping_of(address: int) -> dict:
    """/proc/self/smaps' entry for the mapping holding `address`: its fields, VmFlags split."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                entry = {} if low <= address < high else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.split() if key == "VmFlags" else value.strip()
                if key == "VmFlags":
                    return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def interior(array: jax.Array) -> tuple[int, int]:
    address = array.unsafe_buffer_pointer()
    return (-(-address // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE,
            (address + array.nbytes) // huge_pages.HUGE_PAGE * huge_pages.HUGE_PAGE)


@pytest.mark.skipif(huge_pages.thp_setting() is None, reason="this kernel has no transparent huge pages")
def test_a_zeroed_arrays_whole_2mib_pages_are_marked_and_still_read_as_zeros():
    array = jnp.zeros((6, 1 << 20), jnp.float32)  # 24 MiB: at least 10 whole 2 MiB pages wherever it lies
    start, end = interior(array)
    advice = huge_pages.advise_zeroed_arrays([array])
    assert advice.skipped is None, advice.skipped
    assert advice.marked_bytes == end - start >= 10 * huge_pages.HUGE_PAGE
    assert "hg" in mapping_of(start)["VmFlags"]  # MADV_HUGEPAGE
    assert not np.asarray(array).any()
    assert "2 MiB pages" in advice.describe()


@pytest.mark.skipif(huge_pages.thp_setting() not in ("madvise", "always"),
                    reason="this system gives no transparent huge pages to memory that asks for them")
def test_the_marked_pages_are_2mib_pages_once_written():
    array = jnp.zeros((6, 1 << 20), jnp.float32)
    start, _ = interior(array)
    assert huge_pages.advise_zeroed_arrays([array]).skipped is None
    address = array.unsafe_buffer_pointer()
    written = jax.jit(lambda a: a.at[:, ::1024].set(1.0), donate_argnums=0)(array)
    assert written.unsafe_buffer_pointer() == address, "XLA wrote elsewhere: nothing to check"
    assert int(mapping_of(start)["AnonHugePages"].split()[0]) > 0
    assert float(written.sum()) == 6 * 1024


@pytest.mark.skipif(huge_pages.thp_setting() is None, reason="this kernel has no transparent huge pages")
def test_the_engine_asks_for_its_kv_pages_in_2mib_pages(tiny_model_dir):
    from jaxserve import LLM

    llm = LLM(tiny_model_dir("llama"), max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64,
              kv_cache_memory_bytes=32 << 20)
    runner = llm.engine.runner
    assert runner.huge_pages.skipped is None, runner.huge_pages.skipped
    pages = jax.tree.leaves(runner.kv_cache)
    assert runner.huge_pages.marked_bytes == sum(end - start for start, end in map(interior, pages)) > 0
    for array in pages:
        assert "hg" in mapping_of(interior(array)[0])["VmFlags"]
