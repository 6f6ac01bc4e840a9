"""lm-evaluation-harness against `jaxserve serve`, and the response shapes it reads.

lm-eval's `local-completions` model scores a multiple-choice question by sending each (question, choice)
as one prompt with echo=true, logprobs=1, max_tokens=1 and summing the choice tokens' `token_logprobs`.
A small multiple-choice task from local files (no download) runs through it against a server on a tiny
float32 model, and through lm-eval's own `hf` backend on the same directory: every choice's
loglikelihood agrees to 1e-3 and so do the accuracies; `tokenizer_backend=remote` (the server's
/tokenizer_info, /tokenize and /detokenize as the tokenizer) gives the same. The shapes themselves: the
echoed logprobs are the prompt logprobs of the same prompt, max_tokens=0 echoes the prompt alone, a
stream echoes them in its first chunk, chat returns vLLM's top-level prompt_logprobs.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

import tiny_models
from server_helpers import parse_sse, run_server

lm_eval = pytest.importorskip("lm_eval")

TASK = "jaxserve_tiny_mc"
QUESTIONS = [  # (question, choices, answer)
    ("The capital of France is", ["Paris", "London", "a river"], 0),
    ("Two plus two equals", ["four", "five", "twenty-two", "none"], 0),
    ("The color of the sky is", ["blue", "loud"], 0),
    ("Water freezes at", ["zero degrees", "a hundred degrees", "noon"], 0),
    ("A cat says", ["meow", "moo", "tweet"], 0),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm_eval_model")
    tiny_models.make_tiny_model("llama_untied", path, attention_std=0.3, embedding_std=1.0)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    flags = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
             "--block-size", "16", "--num-kv-pages", "40", "--served-model-name", "tiny",
             "--enable-tokenizer-info-endpoint", "--no-chat-page"]
    with run_server([str(model_dir), *flags]) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The task's YAML and its jsonl data, written where lm-eval's TaskManager looks (include_path)."""
    path = tmp_path_factory.mktemp("lm_eval_task")
    data = path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (path / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    return path


def _evaluate(task_dir, monkeypatch, tmp_path, model: str, model_args: str) -> tuple[float, list[list[float]]]:
    """lm-eval's accuracy on the task, and each question's choice loglikelihoods."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=1, device="cpu",
                              log_samples=True, task_manager=TaskManager(include_path=str(task_dir)))
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return (results["results"][TASK]["acc,none"],
            [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples])


def test_lm_eval_scores_the_server_as_it_scores_hugging_face(server, model_dir, task_dir, monkeypatch, tmp_path):
    """local-completions against the server (its tokenizer from the model directory, then the server's own
    through /tokenizer_info) and lm-eval's hf backend: the same choice loglikelihoods and accuracy."""
    completions = f"model=tiny,base_url={server}/v1/completions,num_concurrent=1,max_retries=1"
    served = _evaluate(task_dir, monkeypatch, tmp_path, "local-completions",
                       f"{completions},tokenizer_backend=huggingface,tokenizer={model_dir}")
    remote = _evaluate(task_dir, monkeypatch, tmp_path, "local-completions", f"{completions},tokenizer_backend=remote")
    hf = _evaluate(task_dir, monkeypatch, tmp_path, "hf", f"pretrained={model_dir},dtype=float32")
    assert [len(choices) for choices in hf[1]] == [len(c) for _, c, _ in QUESTIONS]
    for name, (acc, loglikelihoods) in {"huggingface tokenizer": served, "remote tokenizer": remote}.items():
        for question, (ours, theirs) in enumerate(zip(loglikelihoods, hf[1])):
            np.testing.assert_allclose(ours, theirs, atol=1e-3, err_msg=f"{name}, question {question}")
        assert acc == hf[0], name
    assert len({round(ll, 3) for choices in hf[1] for ll in choices}) > len(QUESTIONS)  # not all alike


def test_tokenizer_info_holds_what_a_client_reads(server, model_dir):
    """vLLM's /tokenizer_info: the class, the special tokens as text, the chat template; no file paths."""
    info = httpx.get(f"{server}/tokenizer_info", timeout=30).json()
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
    assert info["chat_template"] == tokenizer.chat_template
    assert not any(key.endswith("_file") for key in info), info


def _complete(server: str, **body) -> httpx.Response:
    return httpx.post(f"{server}/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=120)


def test_echoed_logprobs_are_the_prompt_logprobs_then_the_completions(server):
    """echo + logprobs: tokens, token_logprobs (the first null), top_logprobs (the first null, then at most
    logprobs + 1 entries) and text_offset cover the prompt then the completion; the prompt part agrees
    with the same prompt's vLLM-style prompt_logprobs, the completion part with the logprobs without echo."""
    prompt = "The quick brown fox"
    echoed = _complete(server, prompt=prompt, max_tokens=3, logprobs=2, echo=True).json()["choices"][0]
    plain = _complete(server, prompt=prompt, max_tokens=3, logprobs=2, prompt_logprobs=2).json()["choices"][0]
    logprobs, n = echoed["logprobs"], len(prompt)
    assert echoed["text"] == prompt + plain["text"]
    assert "".join(logprobs["tokens"][:n]) == prompt  # (a random model's tokens may be bytes no text holds)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"][1:])
    entries = plain["prompt_logprobs"]
    assert len(entries) == n and entries[0] is None  # the byte tokenizer: one token per character
    for i, entry in enumerate(entries[1:], 1):
        token, first = next(iter(entry.items()))
        assert first["decoded_token"] == prompt[i] and first["rank"] >= 1
        assert abs(logprobs["token_logprobs"][i] - first["logprob"]) < 1e-6
    assert logprobs["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(server):
    body = _complete(server, prompt="Hello there", max_tokens=0, logprobs=1, echo=True).json()
    choice = body["choices"][0]
    assert choice["text"] == "Hello there" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len("Hello there")
    refused = _complete(server, prompt="Hello there", max_tokens=0)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_a_stream_echoes_the_prompt_and_its_logprobs_first(server):
    """The stream's first chunk carries the prompt's text and logprobs with the first token; the chunks
    add up to the whole response's."""
    body = dict(prompt="Stream me", max_tokens=4, logprobs=1, echo=True, ignore_eos=True)
    whole = _complete(server, **body).json()["choices"][0]
    with httpx.stream("POST", f"{server}/v1/completions", json={"model": "tiny", "temperature": 0, "stream": True,
                                                                 **body}, timeout=120) as response:
        events, done = parse_sse(response.iter_lines())
    assert done
    chunks = [event["choices"][0] for event in events]
    assert chunks[0]["text"].startswith("Stream me") and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert [x for c in chunks for x in c["logprobs"][field]] == whole["logprobs"][field], field
    refused = _complete(server, prompt="x", prompt_logprobs=1, stream=True)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_chat_returns_prompt_logprobs_beside_the_choices(server):
    """Chat: vLLM's top-level prompt_logprobs, one entry per prompt token of the rendered template."""
    response = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0})
    body = response.json()
    tokenizer = tiny_models.byte_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    rendered = tokenizer.encode(text, add_special_tokens=False)
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(rendered)
    assert [int(next(iter(entry))) for entry in body["prompt_logprobs"][1:]] == list(rendered[1:])
