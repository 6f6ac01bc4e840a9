"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers loading the same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.ops.packed_matmul import PackedWeight
from jaxserve.models.transformer import MATRICES
from jaxserve.weights import default_model_path
from hf_gguf import hf_model_of_gguf, logits

pytestmark = pytest.mark.default_model

PLAIN = [
    "The capital of Germany is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "List three fruits.",
]


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


@pytest.fixture(scope="module")
def hf_model():
    return hf_model_of_gguf(default_model_path())


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=eos_id)
    new = out[0, len(prompt_ids):].tolist()
    return new[: new.index(eos_id) + 1] if eos_id in new else new


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.tokenizer
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PLAIN]
    return prompts + [{"prompt_token_ids": tok.encode(
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)} for c in CHAT]


def _hf_argmaxes(model, prompt_ids: list[int], tokens: list[int]) -> list[int]:
    """The model's argmax after the prompt and after each of `tokens` but the last: one forward pass."""
    return logits(model, prompt_ids + tokens[:-1])[len(prompt_ids) - 1:].argmax(-1).tolist()


@pytest.fixture(scope="module")
def hf_tokens(llm, hf_model, prompts):
    """HF transformers' 32 greedy tokens for each prompt (to its EOS, if sooner).

    Greedy tokens are those each of which is the model's argmax given the prompt and the tokens before it. So
    HF's model scores the engine's greedy tokens in one forward pass a prompt (HF's `generate` loop takes about
    2.5 s a prompt here, most of this module's setup after the engine's): where its argmaxes are those tokens
    and they end as `generate` would (32 tokens, or its EOS), they are HF's greedy tokens. Where they are not,
    HF's `generate` gives HF's own tokens, which the tests then find different."""
    eos_id = llm.engine.model_cfg.eos_token_ids[0]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    tokens = []
    for prompt, out in zip(prompts, outs):
        prompt_ids, engine_tokens = prompt["prompt_token_ids"], list(out.outputs[0].token_ids)
        scored = _hf_argmaxes(hf_model, prompt_ids, engine_tokens)
        ends_as_generate = len(scored) == 32 or scored[-1] == eos_id
        tokens.append(scored if scored == engine_tokens and ends_as_generate
                      else _hf_greedy(hf_model, prompt_ids, 32, eos_id))
    return tokens


def test_greedy_matches_hf_for_chat_and_plain_prompts(llm, prompts, hf_tokens):
    """32 greedy tokens, identical to HF transformers, for 8 prompts (4 plain, 4 chat) run as one batch."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for prompt, out, expected in zip(prompts, outs, hf_tokens):
        assert out.outputs[0].token_ids == expected, llm.tokenizer.decode(prompt["prompt_token_ids"])
    assert "Paris" in outs[4].outputs[0].text


def test_the_reference_scoring_finds_a_token_that_is_not_hfs_argmax(hf_model, prompts, hf_tokens):
    """hf_tokens' one-pass scoring tells a wrong token: one of HF's greedy tokens replaced, the argmax after its
    prefix is still HF's token, not the replacement."""
    prompt_ids, expected = prompts[0]["prompt_token_ids"], hf_tokens[0]
    wrong = expected[:5] + [expected[5] + 1] + expected[6:]
    scored = _hf_argmaxes(hf_model, prompt_ids, wrong)
    assert scored[:6] == expected[:6] and scored != wrong


USERS_GREEDY = """
import json, sys
from jaxserve import LLM, SamplingParams
llm = LLM(None, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, dtype="float32",
          min_prefill_bucket=128, min_decode_bucket=8)
outs = llm.generate(json.load(sys.stdin), SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
print(json.dumps([list(out.outputs[0].token_ids) for out in outs]))
"""


def test_greedy_matches_hf_compiled_as_users_compile(prompts, hf_tokens):
    """The same 8 prompts' tokens in a process at the users' XLA flags: the suite compiles XLA's own code at
    LLVM level 0 to save time (tests/conftest.py), which moves results in their last bits. One bucket of each
    kind (128 tokens, 8 sequences): the executables at the users' flags are what take this test's time, and the
    tokens must be Hugging Face's whatever the padding."""
    env = dict(os.environ, XLA_FLAGS=os.environ["JAXSERVE_TEST_USERS_XLA_FLAGS"])
    result = subprocess.run([sys.executable, "-c", USERS_GREEDY], input=json.dumps(prompts), capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == hf_tokens


# -m slow: in CI the default model split over 2 devices is checked by the notebook (the same text as one device)
# and by test_multihost.py (two processes, the same text); 3 is an uneven split
@pytest.mark.parametrize("tp", [pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_split_over_devices_greedy_matches_hf(tp, llm, prompts, hf_tokens):
    """Split over 2 devices (a zero KV head pads SmolLM2's 3) or 3 (one KV head each), the same tokens,
    with about 1/tp of the weights on each device (a zero KV head and its query group pad tp=2's)."""
    split = LLM(None, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, tensor_parallel_size=tp, dtype="float32")
    outs = split.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == hf_tokens
    share = split.get_stats()["device_weight_bytes"] / llm.get_stats()["device_weight_bytes"]
    assert share < {2: 0.56, 3: 0.36}[tp], share


def test_cli_chat_answers_paris():
    """`jaxserve chat` reads a question on stdin and answers with Paris."""
    env = dict(os.environ, JAXSERVE_COMPILATION_CACHE=os.environ.get("JAXSERVE_COMPILATION_CACHE", "off"))
    result = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "chat", "--max-model-len", "512", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "128"],
        input="What is the capital of France?\n", capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout


def test_on_a_cpu_the_weights_are_packed_for_the_cpu_matmul_without_a_second_embedding_copy(llm):
    runner = llm.engine.runner
    if runner.matmul_backend != "cpu":
        pytest.skip(f"the CPU kernels are not used here ({runner.matmul_backend} matmuls)")
    assert all(isinstance(lp[name], PackedWeight) for lp in runner.params["layers"] for name in MATRICES)
    lm_head = runner.params["lm_head"]
    assert isinstance(lm_head, PackedWeight) and lm_head.n == runner.model_cfg.vocab_size
    assert "embed" not in runner.params  # the tied LM head serves the embedding lookup


def test_rope_is_looked_up_not_evaluated_in_every_layer(llm):
    """The compiled steps read cos and sin from the engine's per-position tables: no cosine is left in
    any executable. (Computed once per step instead, XLA fused cos and sin into each layer's rotation,
    60 cosines per executable, about 38 ms of a 512-token step.)"""
    runner = llm.engine.runner
    assert runner.params["rope"][0].shape == (runner.cfg.max_model_len, runner.model_cfg.head_dim // 2)
    for key, exe in runner._executables.items():
        assert exe.as_text().count(" cosine(") == 0, key


def test_compiled_decode_steps_read_the_weights_in_place(llm):
    """No decode step allocates room for a layer's weights: each layer's matmuls read that layer's own
    arrays. (A `lax.scan` over stacked layers made XLA:CPU copy every layer's weights out of the stack on
    every step, 40 ms of a 145 ms decode step at batch 32.) The count is XLA's own: the temporary bytes
    of the batch-1 decode executable, against the bytes of one layer's weights (14.2 MB; the scan's
    executable needed 14.2 MB of temporaries, the unrolled one 1.6 MB). Larger buckets add about
    1.6 MB per row, the sampler's vocabulary-sized rows, and no fixed cost."""
    runner = llm.engine.runner
    assert len(runner.params["layers"]) == runner.model_cfg.num_layers
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.params["layers"][0]))
    temp = {bucket: exe.memory_analysis().temp_size_in_bytes
            for (kind, bucket), exe in runner._executables.items() if kind == "decode"}
    assert sorted(temp) == runner.decode_buckets and temp[1] > 0
    assert temp[1] < layer_bytes / 4, (layer_bytes, temp)
    assert all(size <= bucket * temp[1] * 1.05 for bucket, size in temp.items()), temp


# -- speculative decoding (prompt lookup) --------------------------------------------------------------

GROUNDED = [  # answers that repeat their prompt: prompt lookup's drafts are accepted
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog beside the quiet river.",
    "Copy the list word for word: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew.",
    "Say again, unchanged: Meetings are held on the first Monday of every month in the town hall at noon.",
    "Repeat the following line twice: red green blue, red green blue, red green blue.",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


@pytest.fixture(scope="module")
def spec_llm():
    """The `llm` engine's shapes (its executables come from the compilation cache) with prompt lookup."""
    return LLM(None, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, speculative_config=NGRAM, dtype="float32")


def _chat(tok, content: str) -> dict:
    return {"prompt_token_ids": tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True), add_special_tokens=False)}


def test_prompt_lookup_gives_the_same_greedy_tokens(llm, spec_llm, prompts, hf_tokens):
    """12 prompts (4 plain, 8 chat of which 4 ask to repeat a text), in batches of 4 (speculation's
    default batch limit): the greedy tokens of the engine without speculation (the first 8: HF's)."""
    params = SamplingParams(temperature=0, max_tokens=32)
    grounded = [_chat(llm.tokenizer, text) for text in GROUNDED]
    expected = hf_tokens + [o.outputs[0].token_ids for o in llm.generate(grounded, params, use_tqdm=False)]
    every = prompts + grounded
    got = [o.outputs[0].token_ids for start in range(0, len(every), 4)
           for o in spec_llm.generate(every[start:start + 4], params, use_tqdm=False)]
    assert got == expected
    stats = spec_llm.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens_per_pos"][-1] > 0, stats  # whole runs of drafts accepted


def _serve_four_at_a_time(engine, work, abort_after: dict[int, int]) -> list:
    """Runs `work` [(prompt ids, params)] keeping 4 requests in flight; request i in abort_after is aborted
    once it has that many tokens. Returns the finished requests in work order."""
    waiting, running, done = list(enumerate(work)), {}, {}
    while waiting or running:
        while waiting and len(running) < 4:
            i, (prompt, params) = waiting.pop(0)
            running[i] = engine.add_request(prompt, params)
        engine.step()
        for i, request in list(running.items()):
            if i in abort_after and len(request.output_token_ids) >= abort_after[i] and not request.status.is_finished:
                engine.abort_request(request.request_id)
            if request.status.is_finished:
                done[i] = running.pop(i)
    assert engine.pool.num_used_pages == 0 and not engine.requests
    return [done[i] for i in range(len(work))]


def test_prompt_lookup_in_a_stream_of_32_requests_with_stops_and_aborts(llm, spec_llm, prompts):
    """32 greedy requests, 4 in flight: stop ids, stop strings (taken from a first run, so they fire
    mid-output), max_tokens from 1 to 40, EOS, and 4 aborts. The same tokens, text and reasons with and
    without speculation; an aborted request keeps a prefix of its tokens."""
    tok = llm.tokenizer
    every = [p["prompt_token_ids"] for p in prompts + [_chat(tok, text) for text in GROUNDED]]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    first = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in every], greedy, use_tqdm=False)]
    work = []
    for i in range(32):
        prompt, out = every[i % len(every)], first[i % len(every)]
        words = out.text.split()
        kind = i % 4
        params = [SamplingParams(temperature=0, max_tokens=1 + (i * 7) % 40),
                  SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[out.token_ids[min(9, len(out.token_ids) - 1)]]),
                  SamplingParams(temperature=0, max_tokens=40, stop=[words[len(words) // 2]] if words else None),
                  greedy][kind]
        work.append((prompt, params))
    abort_after = {3: 2, 11: 5, 19: 9, 27: 12}
    runs = [_serve_four_at_a_time(engine.engine, work, abort_after) for engine in (llm, spec_llm)]
    for i, (a, b) in enumerate(zip(*runs)):
        if i in abort_after and "abort" in (a.finish_reason, b.finish_reason):
            shorter, longer = sorted((a.output_token_ids, b.output_token_ids), key=len)
            assert longer[:len(shorter)] == shorter, i
            continue
        assert (a.output_token_ids, a.output_text, a.finish_reason, a.stop_reason) == (
            b.output_token_ids, b.output_text, b.finish_reason, b.stop_reason), i
    reasons = {(r.finish_reason, type(r.stop_reason).__name__) for r in runs[1]}
    assert {("length", "NoneType"), ("stop", "int"), ("stop", "str"), ("abort", "NoneType")} <= reasons
    assert spec_llm.get_stats()["compilations_since_warmup"] == 0
