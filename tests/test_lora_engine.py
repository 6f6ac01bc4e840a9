"""LoRA adapters in the engine (issue 39), against Hugging Face transformers + PEFT in float32.

What must hold: each adapter (rank 8 and 16, attention and MLP targets, rsLoRA, some layers only) gives
PEFT's greedy tokens; a batch mixing the base model and three adapters gives every row its own tokens;
adapters loaded, evicted from device slots and from the host cache, and reloaded never compile anything
after warm-up; a request whose adapter finds no free slot waits and completes; prefix-cache pages never
serve another adapter (nor the base model); and without enable_lora the step holds nothing of LoRA.
"""

from __future__ import annotations

import pytest

import lora_adapters
import tiny_models
from jaxserve import LLM, SamplingParams
from jaxserve.lora import LoRAError, LoRARequest

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Five adapters for three device slots and a host cache of three: running them all evicts and reloads
ADAPTERS = {
    "attn8": dict(rank=8, targets=("q_proj", "v_proj"), seed=1),
    "mlp16": dict(rank=16, targets=("gate_proj", "up_proj", "down_proj"), seed=2),
    "all8rs": dict(rank=8, alpha=32, targets=ALL, use_rslora=True, seed=3),
    "ko16": dict(rank=16, targets=("k_proj", "o_proj", "down_proj"), layers_to_transform=[1], seed=4),
    "qup8": dict(rank=8, targets=("q_proj", "up_proj"), seed=5),
}
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _prompt(seed: int, length: int = 12) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 3 for i in range(length)]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora_base")
    tiny_models.make_tiny_model("llama", directory, attention_std=0.3, embedding_std=1.0)
    return directory


@pytest.fixture(scope="module")
def loras(base_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    out = {}
    for lora_id, (name, kwargs) in enumerate(ADAPTERS.items(), 1):
        path = lora_adapters.make_peft_adapter(base_dir, tmp_path_factory.mktemp(name), **kwargs)
        out[name] = LoRARequest(name, lora_id, str(path))
    return out


@pytest.fixture(scope="module")
def reference(base_dir, loras):
    """HF + PEFT's greedy tokens of (adapter name or None, prompt), computed once each."""
    cache = {}

    def get(name: str | None, prompt: list[int]) -> list[int]:
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = lora_adapters.peft_greedy(base_dir, None if name is None else loras[name].lora_path,
                                                   prompt, MAX_TOKENS, eos_id=tiny_models.EOS_ID)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def llm(base_dir):
    return LLM(str(base_dir), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, max_cpu_loras=3,
               max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=48,
               forbid_compilation_after_warmup=True)


def _generate(llm, loras, prompts, names):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                           lora_request=[None if n is None else loras[n] for n in names])
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_alone_gives_peft_greedy_tokens_and_nothing_compiles(llm, loras, reference):
    """Five adapters through three slots and a host cache of three: every one is evicted and reloaded
    at least once (the second round), with no compilation and the same tokens."""
    writes = llm.engine.lora_stats()["num_slot_writes"]
    for _ in range(2):
        for i, name in enumerate([None, *ADAPTERS]):
            prompt = _prompt(i)
            assert _generate(llm, loras, [prompt], [name]) == [reference(name, prompt)], name
    assert llm.engine.lora_stats()["num_slot_writes"] - writes >= 2 * len(ADAPTERS) - 3  # evicted and reloaded
    assert len(llm.engine.lora_stats()["resident"]) == 3
    assert llm.engine.num_compilations_since_warmup == 0


def test_adapters_change_the_tokens(reference):
    """The parity above means something only if the adapters differ from the base model and each other."""
    prompt = _prompt(0)
    tokens = {name: tuple(reference(name, prompt)) for name in [None, *ADAPTERS]}
    assert len(set(tokens.values())) == len(tokens)


def test_one_batch_mixing_the_base_model_and_three_adapters(llm, loras, reference):
    names = [None, "attn8", "mlp16", "all8rs"]
    prompts = [_prompt(10 + i, 9 + 3 * i) for i in range(len(names))]
    engine = llm.engine
    requests = [engine.add_request(p, GREEDY, lora_request=None if n is None else loras[n])
                for p, n in zip(prompts, names)]
    engine.step()
    first = engine.last_schedule.scheduled
    assert {r.request_id for r, _ in first} == {r.request_id for r in requests}  # all four in one step
    assert sorted(r.lora_slot for r, _ in first) == [0, 1, 2, 3]
    while any(not r.status.is_finished for r in requests):
        engine.step()
    assert [r.output_token_ids for r in requests] == [reference(n, p) for n, p in zip(names, prompts)]
    assert engine.num_compilations_since_warmup == 0


def test_a_request_whose_adapter_has_no_free_slot_waits_and_completes(llm, loras, reference):
    """Four adapters for three slots, each pinned by a running request: the fourth waits (requests
    behind it still run), then takes the slot the first to finish leaves."""
    names = ["ko16", "qup8", "attn8", "mlp16", None]
    prompts = [_prompt(20 + i) for i in range(len(names))]
    engine = llm.engine
    requests = [engine.add_request(p, GREEDY, lora_request=None if n is None else loras[n])
                for p, n in zip(prompts, names)]
    engine.step()
    stats = engine.lora_stats()
    assert stats["waiting_lora_adapters"] == ["mlp16"]
    assert sorted(stats["running_lora_adapters"]) == ["attn8", "ko16", "qup8"]
    assert requests[4].is_running  # the base request behind the waiting one was admitted
    while any(not r.status.is_finished for r in requests):
        engine.step()
    assert [r.output_token_ids for r in requests] == [reference(n, p) for n, p in zip(names, prompts)]
    assert engine.lora_stats()["waiting_lora_adapters"] == []
    assert engine.num_compilations_since_warmup == 0


def test_prefix_cache_pages_are_never_shared_across_adapters(llm, loras, reference):
    """The same 40-token prompt (two full pages) under two adapters and the base model: no hits across
    them, hits on a second run under each."""
    prompt = _prompt(30, 40)
    pool = llm.engine.pool

    def hits(name):
        before = pool.num_hit_tokens
        assert _generate(llm, loras, [prompt], [name]) == [reference(name, prompt)], name
        return pool.num_hit_tokens - before

    assert [hits(name) for name in ("attn8", "all8rs", None)] == [0, 0, 0]
    assert [hits(name) for name in ("attn8", "all8rs", None)] == [32, 32, 32]


def test_adapter_api_and_refusals(llm, loras, tmp_path):
    engine = llm.engine
    assert {lora.lora_name for lora in engine.list_loras()} >= set(ADAPTERS)
    extra = LoRARequest("extra", 99, loras["attn8"].lora_path)
    engine.add_lora(extra)
    assert extra in engine.list_loras()
    assert engine.remove_lora("extra") and not engine.remove_lora("extra")
    with pytest.raises(LoRAError):  # a directory that holds no adapter, refused before anything is queued
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("empty", 100, str(tmp_path)))
    with pytest.raises(ValueError, match="attn8"):  # a known name with another path
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("attn8", 1, str(tmp_path)))
    assert not engine.has_unfinished


def test_without_enable_lora_the_step_holds_nothing_of_lora(base_dir, loras):
    """enable_lora off: no slot arrays in the params, no slot field in the device batch, and a request
    naming an adapter is refused by the setting's name."""
    plain = LLM(str(base_dir), dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                num_kv_pages=48, warmup=False)
    runner = plain.engine.runner
    assert "lora" not in runner.params and runner.lora is None
    assert runner.batch_state.lora_slots is None
    assert "lora" not in runner.lower("decode", 1).as_text().lower()
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("hi", GREEDY, use_tqdm=False, lora_request=loras["attn8"])


@pytest.mark.default_model
def test_default_model_with_an_adapter_gives_peft_greedy_tokens(tmp_path):
    """SmolLM2-135M (its GGUF, as HF reads it) with a rank-8 adapter on attention and MLP projections,
    beside the base model in one batch: both rows give HF + PEFT's float32 greedy tokens."""
    from jaxserve.weights import default_model_path

    base = default_model_path()
    adapter = lora_adapters.make_peft_adapter(base, tmp_path / "smol_lora", rank=8,
                                              targets=("q_proj", "v_proj", "down_proj"), seed=7)
    llm = LLM(None, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=16, forbid_compilation_after_warmup=True)  # 3 steps to compile
    prompt = llm.tokenizer.encode("The capital of Germany is")
    eos_id = llm.engine.model_cfg.eos_token_ids[0]
    lora = LoRARequest("smol", 1, str(adapter))
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 2, SamplingParams(temperature=0.0, max_tokens=8),
                           use_tqdm=False, lora_request=[None, lora])
    expected = [lora_adapters.peft_greedy(base, path, prompt, 8, eos_id=eos_id) for path in (None, adapter)]
    assert expected[0] != expected[1]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.num_compilations_since_warmup == 0


def test_xla_masked_deltas_give_peft_greedy_tokens(base_dir, loras, reference):
    """Off the C++ matmul (a GPU's path, here matmul_backend xla) the deltas are XLA's masked dots, not the
    C++ kernel: the same tokens, base model and two adapters in one batch."""
    llm = LLM(str(base_dir), dtype="float32", matmul_backend="xla", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=48)
    assert "jaxserve_lora_bgmv" not in llm.engine.runner.lower("decode", 4).as_text()
    names = [None, "attn8", "all8rs"]
    prompts = [_prompt(20 + i) for i in range(len(names))]
    assert _generate(llm, loras, prompts, names) == [reference(n, p) for n, p in zip(names, prompts)]
