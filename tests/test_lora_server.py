"""LoRA adapters through the server (issue 39), driven by the `openai` client as vLLM's are.

One module-scoped `jaxserve serve --enable-lora` on the tiny random llama at --dtype float32 serves two
adapters from --lora-modules (`a`: rank 8 on q/v, `b`: rank 16 on all seven projections) beside the base
model, with two device slots; a third (`c`) is loaded and unloaded at run time, so slots and the host
cache evict and reload. Every answer is checked against Hugging Face transformers + PEFT's greedy tokens
for its adapter. The tiny model's free greedy text is arbitrary bytes, so requests carry a logit_bias that
leaves only the letters a-z (and the reference restricts its argmax to them the same way): the texts are
then plain ASCII and compare exactly.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from server_helpers import API_KEY, AUTH, TINY_FLAGS, metric_samples, run_server
from tiny_models import VOCAB_SIZE

peft = pytest.importorskip("peft")
import torch  # noqa: E402 - after the skip: peft brings torch
import transformers  # noqa: E402

from lora_adapters import load_base, make_peft_adapter  # noqa: E402

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {"a": dict(rank=8, seed=1), "b": dict(rank=16, targets=ALL_TARGETS, seed=2)}
RUNTIME_ADAPTER = dict(rank=4, targets=("gate_proj", "up_proj", "down_proj"), seed=3)
PROMPT = "Tell me a story."
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict:
    base, root = tiny_model_dir("llama"), tmp_path_factory.mktemp("lora_server")
    dirs = {name: make_peft_adapter(base, root / name, **kwargs) for name, kwargs in ADAPTERS.items()}
    dirs["c"] = make_peft_adapter(base, root / "c", **RUNTIME_ADAPTER)
    dirs["too_big"] = make_peft_adapter(base, root / "too_big", rank=32, seed=4)  # over --max-lora-rank 16
    return dirs


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter_dirs):
    args = [str(tiny_model_dir("llama")), *TINY_FLAGS, "--dtype", "float32", "--enable-lora",
            "--lora-modules", f"a={adapter_dirs['a']}", f"b={adapter_dirs['b']}", "--max-loras", "2",
            "--max-lora-rank", "16"]
    with run_server(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def letters(tokenizer) -> list[int]:
    ids = sorted(set(tokenizer("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)["input_ids"]))
    assert len(ids) == 26
    return ids


@pytest.fixture(scope="module")
def letters_only(letters) -> dict[str, float]:
    """A logit_bias that leaves only the tokens of a-z."""
    return {str(t): -100.0 for t in range(VOCAB_SIZE) if t not in letters}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapter_dirs, letters, tokenizer):
    """reference(adapter name or None, prompt ids) -> HF + PEFT's float32 greedy text of MAX_TOKENS letters."""
    base = tiny_model_dir("llama")

    class LettersOnly(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            mask = torch.full_like(scores, float("-inf"))
            mask[:, letters] = 0.0
            return scores + mask

    def greedy(name: str | None, prompt_ids: list[int]) -> str:
        model = load_base(base)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, str(adapter_dirs[name])).eval()
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt_ids]),
                                 attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, logits_processor=[LettersOnly()],
                                 pad_token_id=0)
        return tokenizer.decode(out[0, len(prompt_ids):])

    return greedy


def _completion(client, model: str, bias: dict, stream: bool) -> tuple[str, set[str]]:
    """(text, the `model` every response or chunk named)."""
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logit_bias=bias,
                  extra_body={"ignore_eos": True})
    if not stream:
        response = client.completions.create(**kwargs)
        return response.choices[0].text, {response.model}
    chunks = list(client.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), {c.model for c in chunks}


def _chat(client, model: str, bias: dict, stream: bool) -> tuple[str, set[str]]:
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logit_bias=bias,
                  extra_body={"ignore_eos": True})
    if not stream:
        response = client.chat.completions.create(**kwargs)
        return response.choices[0].message.content, {response.model}
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), {c.model for c in chunks}


def test_models_lists_each_adapter_with_its_parent(client, adapter_dirs):
    """/v1/models: the base model, then each --lora-modules adapter (id its name, parent the base, root its
    directory), as vLLM's model cards."""
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["tiny", "a", "b"]
    assert models["tiny"].model_extra["parent"] is None
    for name in ("a", "b"):
        assert models[name].model_extra["parent"] == "tiny"
        assert models[name].model_extra["root"] == str(adapter_dirs[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_model_name_serves_its_adapter(client, http, reference, letters_only, stream):
    """/v1/completions and /v1/chat/completions with `model` naming the base or an adapter: greedy text equal
    to HF + PEFT's for that adapter, each adapter's different from the base's, and the response names it."""
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    chat_ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    texts = {}
    for model, name in (("tiny", None), ("a", "a"), ("b", "b")):
        text, named = _completion(client, model, letters_only, stream)
        assert (text, named) == (reference(name, prompt_ids), {model}), model
        chat_text, chat_named = _chat(client, model, letters_only, stream)
        assert (chat_text, chat_named) == (reference(name, chat_ids), {model}), model
        texts[model] = (text, chat_text)
    assert texts["a"] != texts["tiny"] and texts["b"] != texts["tiny"] and texts["a"] != texts["b"], texts


def test_responses_api_serves_an_adapter(client):
    """/v1/responses with an adapter's name answers as chat does with it (greedy), and names it."""
    response = client.responses.create(model="b", input=MESSAGES[0]["content"], max_output_tokens=MAX_TOKENS,
                                       temperature=0)
    chat = client.chat.completions.create(model="b", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    base = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert response.model == "b"
    assert response.output_text == (chat.choices[0].message.content or "") != base.choices[0].message.content


def test_load_and_unload_at_run_time(client, http, adapter_dirs, reference, letters_only):
    """POST /v1/load_lora_adapter adds a third adapter (two device slots: one is evicted for it), which then
    serves as HF + PEFT do; loading its name again is a 400; /v1/unload_lora_adapter removes it (vLLM's
    plain-text replies), after which its name is a 404 and unloading it again a 404."""
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapter_dirs["c"])})
    assert (response.status_code, response.text) == (200, "Success: LoRA adapter 'c' added successfully.")
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b", "c"]
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for model in ("c", "a", "b", "c"):  # three adapters through two slots: evicted and loaded again
        assert _completion(client, model, letters_only, False)[0] == reference(model, prompt_ids), model

    again = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapter_dirs["c"])})
    assert again.status_code == 400 and "'c' has already been loaded" in again.json()["error"]["message"]

    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert (response.status_code, response.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
    with pytest.raises(openai.NotFoundError, match="'c'"):
        _completion(client, "c", letters_only, False)
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert gone.status_code == 404 and "'c'" in gone.json()["error"]["message"]
    assert _completion(client, "a", letters_only, False)[0] == reference("a", prompt_ids)  # the others serve on


def test_an_unknown_adapter_is_a_404_naming_it(client):
    for call in (lambda: client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2),
                 lambda: client.chat.completions.create(model="no-such-adapter", messages=MESSAGES, max_tokens=2,
                                                        stream=True)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        error = e.value.body
        assert "'no-such-adapter' does not exist" in error["message"] and error["param"] == "model", error
        assert "'a', 'b'" in error["message"], error  # and it says what the server does serve


def test_a_bad_adapter_directory_is_a_400(http, tmp_path, adapter_dirs):
    """A directory that is missing, or holds an adapter above --max-lora-rank, is a 400 with the loader's
    reason, and nothing is added."""
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert missing.status_code == 400, missing.text
    assert "'x'" in missing.json()["error"]["message"] or "none" in missing.json()["error"]["message"]
    too_big = http.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": str(adapter_dirs["too_big"])})
    assert too_big.status_code == 400, too_big.text
    assert "32" in too_big.json()["error"]["message"] and "rank" in too_big.json()["error"]["message"]
    no_path = http.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": ""})
    assert no_path.status_code == 400 and "must be provided" in no_path.json()["error"]["message"]
    base_name = http.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(adapter_dirs["c"])})
    assert base_name.status_code == 400, base_name.text
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "a", "b"]


def test_the_adapter_routes_need_the_api_key(server, adapter_dirs):
    body = {"lora_name": "c", "lora_path": str(adapter_dirs["c"])}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=30).status_code == 401
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=30).status_code == 401


def test_lora_requests_info_names_the_running_adapter(server, http, letters_only):
    """/metrics' lora_requests_info (vLLM's gauge) names the adapter of a request while it runs, and max_lora."""
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    seen = None
    with http.stream("POST", "/v1/completions", json=body) as response:
        num_chunks = 0
        for line in response.iter_lines():
            num_chunks += line.startswith("data: {")
            if num_chunks == 2 and seen is None:  # a step after the first token: the stats have it running
                seen = metric_samples(server.url, http)
    infos = [dict(labels) for (name, labels), _ in seen.items() if name == "jaxserve:lora_requests_info"]
    assert {"running_lora_adapters": "a", "waiting_lora_adapters": "", "max_lora": "2"} in infos, infos


def test_bench_serve_sends_each_request_to_an_adapter(server):
    """`jaxserve bench serve --lora-modules a b`: the requests name the adapters as their model (seeded
    picks: both used, nothing else), and every one succeeds; an adapter the server lacks fails its requests."""
    from jaxserve.bench.datasets import BenchRequest
    from jaxserve.bench.serve import request_models, run_once

    picks = request_models("tiny", ["a", "b"], 16, seed=0)
    assert set(picks) == {"a", "b"} and picks == request_models("tiny", ["a", "b"], 16, seed=0)
    assert request_models("tiny", ["a", "b"], 3, seed=0, warmup=True) == ["a", "b", "a"]
    assert request_models("tiny", None, 2, seed=0) == ["tiny", "tiny"]
    requests = [BenchRequest(PROMPT, 5, 4)] * 4
    results, _, _ = asyncio.run(run_once(server.url, "completions", "tiny", requests, max_concurrency=4,
                                         request_rate=float("inf"), ignore_eos=True, seed=0, api_key=API_KEY,
                                         progress=False, lora_modules=["a", "b"]))
    assert all(r.success and r.output_len == 4 for r in results), [r.error for r in results]
    results, _, _ = asyncio.run(run_once(server.url, "completions", "tiny", requests, max_concurrency=4,
                                         request_rate=float("inf"), ignore_eos=True, seed=0, api_key=API_KEY,
                                         progress=False, lora_modules=["missing"]))
    assert all(not r.success and "404" in r.error and "missing" in r.error for r in results)


def test_without_enable_lora_the_adapter_routes_do_not_exist():
    """As vLLM's (which adds them only with runtime LoRA updating on): 404, and /v1/models lists the base alone."""
    from server.app import create_app

    engine = SimpleNamespace(tokenizer=None, model=SimpleNamespace(source="tiny-dir"),
                             cfg=SimpleNamespace(max_model_len=64, max_num_seqs=1, enable_lora=False),
                             model_cfg=SimpleNamespace(vocab_size=16))
    app = create_app(SimpleNamespace(engine=engine, is_alive=True), "tiny", max_request_body_bytes=2**20)
    with TestClient(app) as c:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert c.post(route, json={"lora_name": "a", "lora_path": "x"}).status_code == 404
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]
        assert c.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 404
