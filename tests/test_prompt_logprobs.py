"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against Hugging Face's log-softmax of the prompt.

What must hold: each prompt token's logprob, rank and top alternatives are the float32 log-softmax of
Hugging Face's logits at the position before it (the first token: None), whether the prompt runs in one
step or is chunked at any token budget, whether its prefix is in the prefix cache (a request that asks
does not read the cache, as in vLLM V1), split over two devices or not; requests beside it that did not
ask get exactly the tokens they get alone; and nothing compiles after warm-up.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_models
from jaxserve import LLM, SamplingParams
from jaxserve.runner.compilation import num_compilations

ATOL = 1e-4
NUM_TOP = 5
SETTINGS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, block_size=16, num_kv_pages=40,
                forbid_compilation_after_warmup=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny llama whose every token depends on its context (tiny_models.make_tiny_model; its own LM head
    keeps the logits in the range of a trained model's), and its torch twin."""
    path = tmp_path_factory.mktemp("prompt_logprobs")
    torch_model = tiny_models.make_tiny_model("llama_untied", path, attention_std=0.3, embedding_std=1.0)
    return path, torch_model


@pytest.fixture(scope="module")
def llms(model):
    """Engines by token budget (16: every prompt here is chunked) and a tensor-parallel one."""
    path, _ = model
    return {"budget 64": LLM(str(path), max_num_batched_tokens=64, **SETTINGS),
            "budget 16": LLM(str(path), max_num_batched_tokens=16, **SETTINGS),
            "tp 2": LLM(str(path), max_num_batched_tokens=32, tensor_parallel_size=2, **SETTINGS)}


def _prompts(seed: int = 0, lengths=(1, 2, 17, 40, 90)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 259, n).tolist() for n in lengths]


def _hf_logprobs(torch_model, prompt: list[int]) -> np.ndarray:
    """[len(prompt), vocab]: row i the log-softmax of the logits after prompt[:i + 1]."""
    with torch.no_grad():
        logits = torch_model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


TOKENIZER = tiny_models.byte_tokenizer()


def _check(torch_model, prompt: list[int], entries) -> None:
    """entries (RequestOutput.prompt_logprobs) against Hugging Face: None first, then per token its
    logprob and rank and the top NUM_TOP, each with its decoded text. (A rank or top-k order may differ
    from Hugging Face's only between logprobs closer than ATOL.)"""
    assert len(entries) == len(prompt) and entries[0] is None
    expected = _hf_logprobs(torch_model, prompt)
    for i, entry in enumerate(entries[1:], 1):
        token, row = prompt[i], expected[i - 1]
        assert next(iter(entry)) == token  # the prompt's own token first, as vLLM's
        assert abs(entry[token].logprob - row[token]) < ATOL, (i, entry[token], row[token])
        assert abs(np.sort(row)[::-1][entry[token].rank - 1] - row[token]) < ATOL, (i, entry[token].rank)
        top = [t for t in entry if t != token or entry[t].rank <= NUM_TOP]
        assert len(top) == NUM_TOP and len(entry) in (NUM_TOP, NUM_TOP + 1), entry
        assert sorted(entry[t].rank for t in top) == list(range(1, NUM_TOP + 1)) or token in top
        np.testing.assert_allclose([entry[t].logprob for t in top], row[top], atol=ATOL)
        np.testing.assert_allclose(sorted((entry[t].logprob for t in top), reverse=True),
                                   np.sort(row)[::-1][:NUM_TOP], atol=ATOL)
        assert all(lp.decoded_token == TOKENIZER.decode([t]) for t, lp in entry.items())


@pytest.mark.parametrize("name", ["budget 64", "budget 16", "tp 2"])
def test_prompt_logprobs_are_hugging_faces_log_softmax(model, llms, name):
    """Prompts of 1, 2, 17, 40 and 90 tokens, in one step or chunked (budget 16 cuts each prompt past 16
    tokens into steps, and runs them beside each other's chunks), on one device or two."""
    _, torch_model = model
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=NUM_TOP)
    compiles = num_compilations()
    outputs = llms[name].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert num_compilations() == compiles  # (forbid_compilation_after_warmup would also have raised)
    for prompt, output in zip(prompts, outputs):
        _check(torch_model, prompt, output.prompt_logprobs)
        assert output.outputs[0].logprobs is None


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(model, llms):
    """A prompt whose first 48 tokens are in the prefix cache: a request with prompt logprobs computes
    them all (and gets every entry right); one without reads the cache as before."""
    _, torch_model = model
    llm = llms["budget 64"]
    shared = _prompts(seed=1, lengths=(48,))[0]
    first, second, third = (shared + tail for tail in _prompts(seed=2, lengths=(5, 7, 9)))
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)
    cached = llm.get_stats()["prompt_tokens_cached"]
    with_logprobs = llm.generate([{"prompt_token_ids": second}],
                                 SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=NUM_TOP), use_tqdm=False)
    assert llm.get_stats()["prompt_tokens_cached"] == cached  # read nothing from the cache
    _check(torch_model, second, with_logprobs[0].prompt_logprobs)
    llm.generate([{"prompt_token_ids": third}], greedy, use_tqdm=False)
    assert llm.get_stats()["prompt_tokens_cached"] == cached + 48  # the cache still serves the others


@pytest.mark.parametrize("name", ["budget 64", "budget 16"])
def test_requests_without_prompt_logprobs_get_the_tokens_they_get_alone(llms, name):
    """A batch mixing requests with and without prompt logprobs (greedy and seeded random): each one's
    tokens are those it gets alone, and the asking ones' tokens are those they get without asking."""
    llm = llms[name]
    prompts = [{"prompt_token_ids": p} for p in _prompts(seed=3, lengths=(30, 3, 45, 12))]
    plain = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)] * 2
    asking = [SamplingParams(**{**vars(p), "prompt_logprobs": 2}) for p in plain]
    mixed = [asking[0], plain[1], plain[2], asking[3]]
    compiles = num_compilations()
    together = llm.generate(prompts, mixed, use_tqdm=False)
    alone = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt, params in zip(prompts, plain)]
    for i, (both, single) in enumerate(zip(together, alone)):
        assert both.outputs[0].token_ids == single.outputs[0].token_ids, i
        assert (both.prompt_logprobs is None) == (mixed[i].prompt_logprobs is None)
    assert num_compilations() == compiles  # the counter is the process's: these engines' warm-ups are past


def test_prompt_logprobs_zero_gives_the_prompt_tokens_alone(llms):
    """prompt_logprobs=0: each entry holds only the prompt's token (with its rank), as vLLM's."""
    prompt = _prompts(seed=4, lengths=(20,))[0]
    [output] = llms["budget 64"].generate([{"prompt_token_ids": prompt}],
                                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert [list(entry) for entry in output.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    assert all(entry[t].rank >= 1 for entry, t in zip(output.prompt_logprobs[1:], prompt[1:]))
