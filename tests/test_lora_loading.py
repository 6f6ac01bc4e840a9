"""LoRA on the host: PEFT adapter directories read into A and B that give PEFT's own deltas, the adapters
refused (each with a LoRAError naming the problem), LoRARequest, the adapters lora_adapters.py makes, the
device-slot and host-cache bookkeeping (LoRAResidency) and the LoRA engine settings and flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading

import numpy as np
import pytest
import torch
from lora_adapters import load_base, make_peft_adapter, peft_greedy
from tiny_models import make_tiny_model

from jaxserve import LoRARequest
from jaxserve.core.lora import EngineLoRA
from jaxserve.config.engine_config import EngineConfig, add_engine_flags, engine_config_from_args, engine_config_from_kwargs
from jaxserve.lora import LoRAError
from jaxserve.lora.peft_loader import TARGETS, AdapterWeights, load_adapter
from jaxserve.lora.residency import LoRAResidency
from jaxserve.weights.hf import hf_dir_config

ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


def _peft_deltas(base_dir, adapter_dir, x_by_target: dict[str, torch.Tensor]) -> dict[tuple[str, int], np.ndarray]:
    """PEFT's own delta (the LoRA layer's output minus its base layer's) for each adapted projection."""
    import peft  # here, not at the top: 3.5 s of every test process's collection

    model = peft.PeftModel.from_pretrained(load_base(base_dir), str(adapter_dir)).eval()
    deltas = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, peft.tuners.lora.Linear):
                target, layer = name.rsplit(".", 1)[-1], int(name.split("layers.")[1].split(".")[0])
                x = x_by_target[target]
                deltas[target, layer] = (module(x) - module.base_layer(x)).numpy()
    return deltas


@pytest.mark.parametrize("family, rank, alpha, targets, use_rslora, layers", [
    ("llama", 8, 16, ("q_proj", "v_proj"), False, None),
    ("llama", 16, 32, TARGETS, True, None),
    ("qwen3", 8, 8, MLP + ("o_proj",), False, None),  # head_dim * heads != hidden: q and o are not square
    ("qwen3", 16, 4, ("k_proj", "gate_proj"), True, [1]),  # layer 0 is left alone
])
def test_loaded_matrices_give_peft_deltas(tiny_model_dir, tmp_path, family, rank, alpha, targets, use_rslora, layers):
    """x @ A @ B equals PEFT's LoRA layer output minus its base layer's for every adapted projection and
    layer (A, B transposed and the alpha / r or alpha / sqrt(r) scaling folded in), and zeros elsewhere."""
    base = tiny_model_dir(family)
    adapter_dir = make_peft_adapter(base, tmp_path / "adapter", rank=rank, alpha=alpha, targets=targets,
                                    use_rslora=use_rslora, layers_to_transform=layers, seed=rank)
    cfg = hf_dir_config(base)
    weights = load_adapter(adapter_dir, cfg, max_lora_rank=16)
    assert weights.rank == rank and set(weights.targets) == set(targets)
    generator = torch.Generator().manual_seed(0)
    inputs = {t: torch.randn(3, weights.targets[t][0].shape[1], generator=generator) for t in targets}
    deltas = _peft_deltas(base, adapter_dir, inputs)
    for target, (a, b) in weights.targets.items():
        assert a.dtype == b.dtype == np.float32
        assert a.shape[::2] == b.shape[:2] == (cfg.num_layers, rank)
        for layer in range(cfg.num_layers):
            ours = inputs[target].numpy() @ a[layer] @ b[layer]
            if layers is not None and layer not in layers:
                assert (target, layer) not in deltas and not a[layer].any() and not b[layer].any()
                continue
            np.testing.assert_allclose(ours, deltas[target, layer], rtol=1e-4, atol=1e-5)
            assert np.abs(ours).max() > 1e-2  # a delta that could be told from none
    assert weights.nbytes == sum(a.nbytes + b.nbytes for a, b in weights.targets.values())


def test_bfloat16_adapter_reads_as_its_float32_values(tiny_model_dir, tmp_path):
    """A bfloat16 adapter file (safetensors' numpy reader has no bfloat16) loads as the same numbers; so
    does an adapter_model.bin."""
    from safetensors.torch import load_file, save_file

    adapter_dir = make_peft_adapter(tiny_model_dir("llama"), tmp_path / "adapter")
    cfg = hf_dir_config(tiny_model_dir("llama"))
    file = adapter_dir / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, file)
    rounded = load_adapter(adapter_dir, cfg, 16)
    save_file({k: v.float() for k, v in load_file(file).items()}, file)
    exact = load_adapter(adapter_dir, cfg, 16)
    torch.save(load_file(file), adapter_dir / "adapter_model.bin")  # PEFT's older format, read through torch
    file.unlink()
    from_bin = load_adapter(adapter_dir, cfg, 16)
    for target in ("q_proj", "v_proj"):
        for ours, theirs, bin_ in zip(rounded.targets[target], exact.targets[target], from_bin.targets[target]):
            np.testing.assert_array_equal(ours, theirs)
            np.testing.assert_array_equal(bin_, theirs)


def _edit_config(adapter_dir, **changes):
    config_file = adapter_dir / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))


@pytest.fixture
def llama_cfg(tiny_model_dir):
    return hf_dir_config(tiny_model_dir("llama"))


def _refusal(tmp_path, cfg, make, *, max_lora_rank=16, name="my-adapter") -> str:
    """The message of the LoRAError that loading the adapter `make(directory)` writes raises."""
    adapter_dir = tmp_path / "adapter"
    make(adapter_dir)
    with pytest.raises(LoRAError) as refused:
        load_adapter(adapter_dir, cfg, max_lora_rank, name=name)
    assert f"LoRA adapter {name!r}" in str(refused.value)
    return str(refused.value)


def _without_weights(adapter_dir):
    (adapter_dir / "adapter_model.safetensors").unlink()


@pytest.mark.parametrize("make, max_lora_rank, expected", [
    (lambda base, d: d.mkdir(), 16, "has no adapter_config.json"),
    (lambda base, d: _without_weights(make_peft_adapter(base, d)), 16, "has no adapter_model.safetensors"),
    (lambda base, d: make_peft_adapter(base, d, targets=("q_proj", "lm_head")), 16, "target_modules ['lm_head']"),
    (lambda base, d: make_peft_adapter(base, d, rank=16), 8, "r=16 is above max_lora_rank=8"),
    (lambda base, d: _edit_config(make_peft_adapter(base, d), use_dora=True), 16, "use_dora=true (DoRA)"),
    (lambda base, d: _edit_config(make_peft_adapter(base, d), bias="all"), 16, "bias='all'"),
    (lambda base, d: _edit_config(make_peft_adapter(base, d), modules_to_save=["lm_head"]), 16,
     "modules_to_save=['lm_head']"),
    (lambda base, d: _edit_config(make_peft_adapter(base, d), rank_pattern={"q_proj": 4}), 16, "rank_pattern"),
], ids=["no-config", "no-weights", "lm_head", "rank", "dora", "bias", "modules_to_save", "rank_pattern"])
def test_refusals_name_the_adapter_and_the_problem(tiny_model_dir, tmp_path, llama_cfg, make, max_lora_rank,
                                                   expected):
    """Each adapter jaxserve cannot serve is a LoRAError (a ValueError: the server's 400) that says why."""
    assert expected in _refusal(tmp_path, llama_cfg, lambda d: make(tiny_model_dir("llama"), d),
                                max_lora_rank=max_lora_rank)


def test_a_missing_directory_is_refused(tmp_path, llama_cfg):
    assert issubclass(LoRAError, ValueError)
    with pytest.raises(LoRAError, match=r"LoRA adapter 'gone': .*nowhere' is not a directory"):
        load_adapter(tmp_path / "nowhere", llama_cfg, 16, name="gone")


def test_embedding_and_head_matrices_are_refused_by_tensor_name(tiny_model_dir, tmp_path, llama_cfg):
    """A target_modules regex (not a list) that also caught embed_tokens or lm_head: refused at its tensor."""
    base = tiny_model_dir("llama")
    message = _refusal(tmp_path, llama_cfg, lambda d: _edit_config(
        make_peft_adapter(base, d, targets=("q_proj", "embed_tokens")), target_modules=".*(q_proj|embed_tokens)"))
    assert "embed_tokens" in message and "is not a LoRA matrix of a layer's projection" in message


def test_an_adapter_made_for_another_base_is_refused_by_its_shapes(tmp_path, llama_cfg):
    """Wider hidden size, or more layers, than the served model: the message names the tensor and both shapes."""
    wider, deeper = tmp_path / "wider", tmp_path / "deeper"
    make_tiny_model("llama", wider, hidden_size=96)
    make_tiny_model("llama", deeper, num_hidden_layers=3)
    message = _refusal(tmp_path / "1", llama_cfg, lambda d: make_peft_adapter(wider, d))
    assert "has shape [8, 96], the model needs [8, 64]" in message and "another base model" in message
    message = _refusal(tmp_path / "2", llama_cfg, lambda d: make_peft_adapter(deeper, d))
    assert "is for layer 2, but the model has 2 layers" in message


def test_lora_request_is_vllms():
    lora = LoRARequest("sql", 3, "/adapters/sql")
    assert (lora.name, lora.id, lora.adapter_id, lora.path) == ("sql", 3, 3, "/adapters/sql")
    assert lora == LoRARequest(lora_name="sql", lora_int_id=3, lora_path="/adapters/sql") and hash(lora)
    for bad in (0, -1, True, "1"):
        with pytest.raises(ValueError, match="lora_int_id"):
            LoRARequest("sql", bad, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/adapters/sql")


def test_made_adapters_change_greedy_tokens(tiny_model_dir, tmp_path):
    """The parity tests would prove nothing if an adapter left the tokens as they were."""
    base = tiny_model_dir("llama")
    adapter_dir = make_peft_adapter(base, tmp_path / "adapter")
    prompts = [[256, 72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6, 7, 8], [100, 50, 60]]
    assert any(peft_greedy(base, None, p, 8) != peft_greedy(base, adapter_dir, p, 8) for p in prompts)


class _Loads:
    """A `load` for LoRAResidency that counts its calls and refuses paths named "bad"."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, lora: LoRARequest) -> AdapterWeights:
        self.calls.append(lora.name)
        if lora.path == "bad":
            raise LoRAError(f"LoRA adapter {lora.name!r}: bad")
        return AdapterWeights(rank=1, targets={"q_proj": (np.zeros((1, 1, 1)), np.full((1, 1, 1), lora.id))})


def _loras(count: int) -> list[LoRARequest]:
    return [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, count + 1)]


def test_slots_are_given_to_free_slots_then_the_least_recently_used_unpinned_adapter():
    a1, a2, a3, a4 = _loras(4)
    residency = LoRAResidency(max_loras=2, max_cpu_loras=4, load=_Loads())
    slot1, weights1 = residency.acquire(a1)
    assert slot1 == 1 and weights1.targets["q_proj"][1].item() == 1
    assert residency.acquire(a2)[0] == 2
    assert residency.acquire(a1) == (1, None)  # resident: nothing to write; a1 is now the most recently used
    assert residency.pinned("a1") == 2
    assert residency.acquire(a3) is None  # both slots pinned: a3 waits (registered, not resident, not pinned)
    assert residency.known("a3") == a3 and residency.pinned("a3") == 0
    residency.release("a2")
    assert residency.acquire(a3)[0] == 2 and residency.resident() == {"a1": 1, "a3": 2}
    for _ in range(2):
        residency.release("a1")
    residency.release("a3")
    residency.acquire(a3)
    residency.release("a3")  # a1 is now least recently used, though its slot number is lower
    assert residency.acquire(a4)[0] == 1 and residency.resident() == {"a3": 2, "a4": 1}
    assert residency.pinned("a1") == 0 and residency.names() == ["a1", "a2", "a3", "a4"]


def test_pinned_slots_are_never_evicted():
    residency = LoRAResidency(max_loras=1, max_cpu_loras=3, load=_Loads())
    a1, a2, a3 = _loras(3)
    assert residency.acquire(a1)[0] == 1
    assert residency.acquire(a2) is None and residency.acquire(a3) is None
    assert residency.resident() == {"a1": 1} and residency.pinned("a2") == residency.pinned("a3") == 0
    residency.release("a1")
    assert residency.acquire(a2)[0] == 1 and residency.resident() == {"a2": 1}
    with pytest.raises(AssertionError):
        residency.release("a1")


def test_the_host_cache_is_bounded_and_reloads_through_load():
    loads = _Loads()
    residency = LoRAResidency(max_loras=1, max_cpu_loras=2, load=loads)
    a1, a2, a3 = _loras(3)
    for lora in (a1, a2, a3):
        residency.add(lora)
        residency.add(lora)  # the same request again: nothing read
    assert loads.calls == ["a1", "a2", "a3"] and residency.cached() == ["a2", "a3"]
    assert residency.acquire(a2)[1] is not None and loads.calls == ["a1", "a2", "a3"]  # from the cache
    residency.release("a2")
    slot, weights = residency.acquire(a1)  # fell out of the cache: read again, a2's slot reused
    assert slot == 1 and weights.targets["q_proj"][1].item() == 1 and loads.calls[-1] == "a1"
    assert residency.cached() == ["a2", "a1"]


def test_add_validates_and_refuses_a_second_adapter_under_a_name_or_id():
    residency = LoRAResidency(max_loras=1, max_cpu_loras=1, load=_Loads())
    with pytest.raises(LoRAError, match="'broken': bad"):
        residency.add(LoRARequest("broken", 9, "bad"))
    assert residency.known("broken") is None and residency.names() == []
    residency.add(LoRARequest("a1", 1, "/one"))
    with pytest.raises(ValueError, match="named 'a1' is already loaded"):
        residency.add(LoRARequest("a1", 1, "/other"))
    with pytest.raises(ValueError, match="lora_int_id=1 .* already the id of 'a1'"):
        residency.acquire(LoRARequest("a2", 1, "/two"))
    assert residency.known("a1") == LoRARequest("a1", 1, "/one")


def test_an_adapter_removed_while_pinned_keeps_its_slot_until_released():
    residency = LoRAResidency(max_loras=1, max_cpu_loras=1, load=_Loads())
    a1, a2 = _loras(2)
    residency.acquire(a1)
    residency.acquire(a1)
    assert residency.remove("a1") and not residency.remove("a1") and residency.names() == []
    assert residency.acquire(a2) is None and residency.resident() == {"a1": 1}
    with pytest.raises(ValueError, match="'a1' was unloaded but requests still run"):
        residency.add(LoRARequest("a1", 1, "/new-path"))
    residency.release("a1")
    assert residency.resident() == {"a1": 1}  # one request still runs with it
    residency.release("a1")
    assert residency.resident() == {} and residency.acquire(a2)[0] == 1
    residency.release("a2")
    assert residency.remove("a2") and residency.resident() == {} and residency.cached() == []


def _flags(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_lora_flags_take_vllms_two_forms_and_number_the_adapters():
    cfg = _flags("--enable-lora", "--lora-modules", "sql=/adapters/sql",
                 '{"name": "chat", "path": "/adapters/chat", "base_model_name": "base"}',
                 "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3")
    assert cfg.lora_modules == (LoRARequest("sql", 1, "/adapters/sql"),
                                LoRARequest("chat", 2, "/adapters/chat", base_model_name="base"))
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (True, 2, 8, 3)
    default = _flags()
    assert (default.enable_lora, default.lora_modules, default.max_loras, default.max_lora_rank,
            default.max_cpu_loras) == (False, (), 1, 16, 1)
    assert _flags("--max-loras", "4").max_cpu_loras == 4  # max_cpu_loras follows max_loras when unset
    # `jaxserve generate`/`chat` hand the offline LLM the flags' config as a dict (dataclasses.asdict)
    assert engine_config_from_kwargs(**dataclasses.asdict(cfg)) == cfg and hash(cfg)


def test_lora_settings_as_llm_keyword_arguments():
    cfg = engine_config_from_kwargs(enable_lora=True, max_loras=3, lora_modules=[
        "a=/adapters/a", {"name": "b", "path": "/adapters/b"}, LoRARequest("c", 7, "/adapters/c")])
    assert [(lora.name, lora.id, lora.path) for lora in cfg.lora_modules] == [
        ("a", 1, "/adapters/a"), ("b", 2, "/adapters/b"), ("c", 7, "/adapters/c")]
    assert engine_config_from_kwargs(enable_lora=True, lora_modules="a=/adapters/a").lora_modules == (
        LoRARequest("a", 1, "/adapters/a"),)


@pytest.mark.parametrize("settings, message", [
    (dict(lora_modules=["a=/adapters/a"]), r"lora_modules \['a'\] need enable_lora=True"),
    (dict(enable_lora=True, max_loras=2, max_cpu_loras=1), "self.max_cpu_loras=1 must be at least self.max_loras=2"),
    (dict(enable_lora=True, max_loras=0), "self.max_loras=0 must be at least 1"),
    (dict(enable_lora=True, max_lora_rank=0), "self.max_lora_rank=0 must be at least 1"),
    (dict(enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "enable_lora does not run with speculative decoding"),
    (dict(enable_lora=True, nnodes=2, tensor_parallel_size=2, dist_init_addr="leader:5000"),
     "enable_lora does not run on several hosts"),
    (dict(enable_lora=True, lora_modules=["a"]), "lora_modules entry 'a' must be name=path or a JSON object"),
    (dict(enable_lora=True, lora_modules=['{"name": "a"']), "lora_modules entry .* is not valid JSON"),
    (dict(enable_lora=True, lora_modules=[{"name": "a", "path": "/p", "rank": 8}]), r"unknown fields \['rank'\]"),
    (dict(enable_lora=True, lora_modules=["a=/one", "a=/two"]), "two adapters have the name 'a'"),
    (dict(enable_lora=True, lora_modules=["a=/one", LoRARequest("b", 1, "/two")]), "two adapters have the lora_int_id 1"),
])
def test_lora_settings_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        engine_config_from_kwargs(**settings)


def test_a_bad_lora_modules_flag_is_an_error_naming_it():
    with pytest.raises(ValueError, match="lora_modules entry 'sql' must be name=path"):
        _flags("--enable-lora", "--lora-modules", "sql")


def test_the_engine_reads_an_adapter_without_holding_its_lock():
    """The scheduler takes EngineLoRA's lock every step: an adapter being read (a server's load, a request
    naming a new adapter) must not hold it, or every running request would wait for the files."""
    reading, finish = threading.Event(), threading.Event()

    def slow_load(lora):
        reading.set()
        assert finish.wait(60)
        return AdapterWeights(rank=8, targets={})

    lora = EngineLoRA(EngineConfig(enable_lora=True), model_cfg=None)
    lora._load = slow_load
    adding = threading.Thread(target=lora.add, args=(LoRARequest("slow", 1, "/adapters/slow"),))
    adding.start()
    assert reading.wait(60)
    listing = threading.Thread(target=lora.list)  # takes the lock, as the scheduler's acquire does
    listing.start()
    listing.join(60)
    stuck = listing.is_alive()
    finish.set()
    adding.join(60)
    assert not stuck, "the lock was held while the adapter's files were read"
    assert [r.lora_name for r in lora.list()] == ["slow"]
