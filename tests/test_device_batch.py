"""The persistent device batch (`jaxserve/runner/device_batch.py`): each running sequence's sampling settings,
block table and penalty history live on the device in a slot, and a step carries only the rows that
changed. Guards: what a step sends is small and counts only changed rows; slots are taken back and
reused; a preempted request's history is rewritten when it comes back (penalties see the same tokens);
a failing row runs in the inert slot without touching another request's row.
"""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.device_batch import ReqIndices
from tiny_models import make_tiny_model

MAX_MODEL_LEN, PAGE_SIZE = 256, 8
BASE = dict(max_model_len=MAX_MODEL_LEN, block_size=PAGE_SIZE, forbid_compilation_after_warmup=True,
            max_num_seqs=8, max_num_batched_tokens=64, min_decode_bucket=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_device_batch")
    make_tiny_model("llama", directory, attention_std=0.3, embedding_std=1.0)
    return directory


@pytest.fixture(scope="module")
def ample(model_dir):
    return LLM(model_dir, **BASE, num_kv_pages=260)


@pytest.fixture(scope="module")
def small(model_dir):
    return LLM(model_dir, **BASE, num_kv_pages=MAX_MODEL_LEN // PAGE_SIZE + 1)


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(3, 40))]} for _ in range(n)]


def _record_steps(llm: LLM):
    """Wraps the runner's launch: returns the list that collects each step's (scheduled requests with
    their admissions, block table lengths, banned ids and output tokens so far, inputs)."""
    engine, steps = llm.engine, []
    launch = engine.runner.launch

    def recording(kind, bucket, inputs):
        rows = [(r, r.num_admissions, len(r.page_table), r.suppressed_token_ids, len(r.output_token_ids))
                for r, _ in engine.last_schedule.scheduled]
        steps.append((rows, inputs))
        return launch(kind, bucket, inputs)

    engine.runner.launch = recording
    return steps


def test_a_step_writes_only_the_rows_that_changed(ample):
    """12 requests (8 slots) decoding 40 tokens: a row is written when its request takes a slot and when
    min_tokens unbans EOS (a block table that gains a page is the step's own to record: `record_pages`);
    otherwise a step carries no row at all, and never a block table or sampling row of its own."""
    steps = _record_steps(ample)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, min_tokens=10 * (i % 2),
                                 presence_penalty=0.5 * (i % 3 == 0)) for i in range(12)]
        ample.generate(_prompts(12, seed=0), params, use_tqdm=False)
    finally:
        del ample.engine.runner.launch
    num_rows = ample.engine.runner.inputs.num_rows
    seen, expected, written, rows_run, quiet_steps = {}, 0, 0, 0, 0
    for rows, inputs in steps:
        assert inputs.sampling is None and inputs.md.block_tables is None
        changed = 0
        for request, admission, table_len, banned, _ in rows:
            version = (admission, banned)
            changed += seen.get(request) != version
            seen[request] = version
        updates = inputs.row_updates
        num_written = 0 if updates is None else int((updates.req_indices < num_rows).sum())
        assert num_written == changed
        written, expected, rows_run = written + num_written, expected + changed, rows_run + len(rows)
        quiet_steps += updates is None
    assert written == expected and rows_run > 400
    assert written < rows_run / 4 and quiet_steps > len(steps) / 4, (written, rows_run, quiet_steps, len(steps))


def test_a_decode_step_sends_a_fraction_of_the_per_row_state(ample):
    """Bytes the host hands a steady decode step of 8 rows, against what the same rows' settings, bias
    rows, histories and block tables (what every step carried before the device batch) weigh: a step
    that writes no row sends only its tokens and row indices, and once every row has its slot no row is
    written again: a grown block table is recorded by the step from its tokens' slots."""
    steps = _record_steps(ample)
    try:
        ample.generate(_prompts(8, seed=1), SamplingParams(temperature=0.7, seed=1, max_tokens=30, ignore_eos=True,
                                                          repetition_penalty=1.2), use_tqdm=False)
    finally:
        del ample.engine.runner.launch
    builder = ample.engine.runner.inputs
    per_row_state = (sum(x.nbytes for x in jax.tree.leaves(builder.empty_sampling(8)))
                     + 8 * builder.cfg.pages_per_seq * 4)
    steady = [(rows, inputs) for rows, inputs in steps if len(rows) == 8 and all(row[-1] > 2 for row in rows)]
    decode = [inputs for _, inputs in steady]
    assert len(decode) > 10
    num_rows = ample.engine.runner.inputs.num_rows
    for inputs in decode:  # its tokens and row indices, and only the rows written (padded to a bucket)
        assert sum(x.nbytes for x in jax.tree.leaves(inputs._replace(row_updates=None))) < per_row_state / 50
        updates = inputs.row_updates
        if updates is not None:
            bucket = len(updates.req_indices)
            assert sum(x.nbytes for x in jax.tree.leaves(updates)) == sum(
                x.size * x.dtype.itemsize for x in jax.tree.leaves(builder.update_shapes(bucket)))
            assert bucket < 2 * int((updates.req_indices < num_rows).sum())
    rows_written = sum(int((inputs.row_updates.req_indices < num_rows).sum()) for inputs in decode if inputs.row_updates)
    assert rows_written == 0, (rows_written, len(decode))
    # ... though the 8 block tables gained pages over those steps (about 3 each)
    table_pages = [sum(table_len for _, _, table_len, _, _ in rows) for rows, _ in steady]
    assert table_pages[-1] - table_pages[0] > 8, table_pages


@pytest.mark.parametrize("pool", ["ample", "small"])
def test_the_device_block_tables_follow_the_host_page_tables(pool, request):
    """After every step each scheduled row's device block table equals its request's page table (the
    pages the step's tokens landed in recorded by the step, rows written only when taken), through page
    boundaries, slots reused and, in the smallest pool, preemption; the padding row keeps the dummy page."""
    llm = request.getfixturevalue(pool)
    runner, engine, checked = llm.engine.runner, llm.engine, []
    launch = runner.launch

    def checking(kind, bucket, inputs):
        output = launch(kind, bucket, inputs)
        tables = np.asarray(runner.batch_state.block_tables)
        for i, (req, _) in enumerate(engine.last_schedule.scheduled):
            row = int(inputs.req_indices[i])
            np.testing.assert_array_equal(tables[row, :len(req.page_table)], req.page_table, err_msg=req.request_id)
            checked.append(len(req.page_table))
        assert not tables[-1].any(), "the padding row's block table changed"
        return output

    runner.launch = checking
    before = llm.get_stats()["num_preemptions"]
    try:
        llm.generate(_prompts(12, seed=3), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    finally:
        del runner.launch
    assert len(checked) > 300 and max(checked) >= 8, (len(checked), max(checked))
    assert (llm.get_stats()["num_preemptions"] > before) == (pool == "small")


def test_penalties_see_the_same_tokens_after_preemption(ample, small):
    """In the smallest pool the 8 penalized requests are preempted and recomputed: each comes back in a
    fresh slot whose history is written whole, so its tokens equal the ample pool's."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.3)
    prompts = _prompts(8, seed=2)
    before = small.get_stats()["num_preemptions"]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.get_stats()["num_preemptions"] > before
    want = [o.outputs[0].token_ids for o in ample.generate(prompts, params, use_tqdm=False)]
    assert got == want
    plain = [o.outputs[0].token_ids for o in ample.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)]
    assert got != plain, "the penalties changed nothing: the comparison would prove nothing"


def test_slots_are_taken_back_from_gone_sequences_only():
    slots, live = ReqIndices(4), {"a", "b", "c"}  # 3 slots to give, the 4th is padding's
    placed = {key: slots.place(key, 0, live.__contains__) for key in ("a", "b", "c")}
    assert sorted(slot for slot, _, _ in placed.values()) == [0, 1, 2] and slots.padding_index == 3
    assert all(write and history for _, write, history in placed.values())
    assert slots.place("a", 0, live.__contains__) == (placed["a"][0], False, False)  # unchanged: no write
    assert slots.place("a", 1, live.__contains__) == (placed["a"][0], True, False)  # changed: its row only
    live.discard("b")
    live.add("d")
    assert slots.place("d", 0, live.__contains__) == (placed["b"][0], True, True)  # b's slot, b gone
    with pytest.raises(AssertionError):
        slots.place("e", 0, live.__contains__)  # a, c and d still run


def test_a_step_hands_its_executable_two_host_arrays(ample):
    """On a GPU each host array an executable takes is its own host-to-device copy (on an H100 a step's
    nine cost about 3 ms): the step's tokens, positions, slots, previous rows, sequence bounds, lengths,
    logits rows, slots and sample flags go as two arrays, and come out on the device as they went in."""
    from jaxserve.runner import step_inputs

    runner, calls = ample.engine.runner, []
    executables = dict(runner._executables)

    def recording(key):
        def call(params, kv_cache, state, packed):
            calls.append((key, packed))
            return executables[key](params, kv_cache, state, packed)
        return call

    runner._executables = {key: recording(key) for key in executables}
    steps = _record_steps(ample)
    try:
        ample.generate(_prompts(5, seed=2), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    finally:
        runner._executables = executables
        del ample.engine.runner.launch
    assert len(calls) == len(steps) > 5
    for ((kind, bucket), packed), (_, inputs) in zip(calls, steps):
        tokens, seqs = packed
        assert isinstance(tokens, np.ndarray) and isinstance(seqs, np.ndarray)
        assert tokens.dtype == seqs.dtype == np.int32 and tokens.shape == (bucket, 4)
        assert seqs.shape == (len(inputs.md.kv_lens) + 1, 5)
        back = jax.jit(step_inputs.unpack)(tokens, seqs)
        for name in ("token_ids", "positions", "prev_rows", "logits_indices", "req_indices", "samples"):
            np.testing.assert_array_equal(np.asarray(getattr(back, name)), getattr(inputs, name), err_msg=name)
        for name in ("slot_mapping", "cu_q_lens", "kv_lens"):
            np.testing.assert_array_equal(np.asarray(getattr(back.md, name)), getattr(inputs.md, name), err_msg=name)
