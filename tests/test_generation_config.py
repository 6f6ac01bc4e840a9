"""The model's sampling defaults (issue 38): `--generation-config` auto | vllm | a folder, and
`--override-generation-config`, applied to the sampling fields a request leaves out (a field it sets
always wins), by the server's /v1/completions and /v1/chat/completions and by the offline `LLM`.

Without them, the chat page's requests (which set no temperature) sampled the default model at
temperature 1 and it rambled in French; vLLM takes these defaults from generation_config.json, and a
GGUF file, which has none, gets them from jaxserve's table of the models it ships.
"""

from __future__ import annotations

import json
import struct

import gguf
import httpx
import pytest

from jaxserve.config.engine_config import EngineConfig, engine_config_from_args
from jaxserve.config.generation_config import (GGUF_DEFAULTS, SamplingDefaults, gguf_general_fields,
                                               resolve_sampling_defaults)
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.errors import InvalidParameter
from server.errors import APIError
from server.prompts import sampling_params
from server.protocol import ChatCompletionRequest, CompletionRequest
from server_helpers import AUTH, TINY_FLAGS, run_server
from tiny_models import make_tiny_model

# Every field vLLM reads, and some it does not (do_sample is ignored; token ids are not sampling defaults)
MODEL_CONFIG = {"temperature": 1.5, "top_p": 0.8, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
                "max_new_tokens": 6, "do_sample": False, "bos_token_id": 256, "eos_token_id": 257}
MODEL_DEFAULTS = {"temperature": 1.5, "top_p": 0.8, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
                  "max_tokens": 6}
PROMPT = "The quick brown fox"


def write_generation_config(directory, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny llama whose generation_config.json sets every sampling field (written over the one
    save_pretrained leaves, which holds only token ids)."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("llama", directory)
    return write_generation_config(directory, MODEL_CONFIG)


# -------------------------------------------------------------------------------------------------
# resolving the defaults (no model run)


def test_auto_reads_the_models_generation_config_and_ignores_do_sample(tiny_model):
    defaults = resolve_sampling_defaults("auto", None, tiny_model)
    assert defaults.values == MODEL_DEFAULTS
    assert defaults.max_tokens_cap is None  # under auto the model's max_new_tokens is a default, not a cap
    assert str(tiny_model / "generation_config.json") in defaults.source


def test_auto_without_a_generation_config_and_vllm_mean_neutral_defaults(tiny_model, tmp_path):
    make_tiny_model("qwen2", tmp_path)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    assert resolve_sampling_defaults("auto", None, tmp_path).values == {}
    assert resolve_sampling_defaults("vllm", None, tiny_model).values == {}
    neutral = SamplingDefaults()
    assert [neutral.get(name, None) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")] \
        == [1.0, 1.0, 0, 0.0, 1.0] and neutral.max_tokens(None) is None


def test_a_folder_is_read_instead_of_the_models_and_its_max_new_tokens_caps(tiny_model, tmp_path):
    folder = write_generation_config(tmp_path / "elsewhere", {"temperature": 0.3, "max_new_tokens": 4,
                                                              "top_p": None})
    defaults = resolve_sampling_defaults(str(folder), None, tiny_model)
    assert defaults.values == {"temperature": 0.3, "max_tokens": 4}  # a null field is not a default
    assert defaults.max_tokens_cap == 4  # vLLM: a folder's max_new_tokens caps every request
    assert [defaults.max_tokens(None), defaults.max_tokens(2), defaults.max_tokens(100)] == [4, 2, 4]


def test_the_override_is_laid_over_the_models_defaults_and_its_max_new_tokens_caps(tiny_model):
    defaults = resolve_sampling_defaults("auto", '{"temperature": 0, "max_new_tokens": 3}', tiny_model)
    assert defaults.values == {**MODEL_DEFAULTS, "temperature": 0, "max_tokens": 3}
    assert defaults.max_tokens_cap == 3
    only = resolve_sampling_defaults("vllm", {"top_k": 5}, tiny_model)
    assert only.values == {"top_k": 5} and only.max_tokens_cap is None


@pytest.mark.default_model
def test_the_default_models_gguf_gets_its_cards_defaults_from_the_table():
    """The default model ships as a GGUF (no generation_config.json): its general.* metadata finds the
    defaults its model card recommends, temperature 0.2 and top_p 0.9 (the header alone is read)."""
    from jaxserve.weights import default_model_path

    defaults = resolve_sampling_defaults("auto", None, default_model_path())
    assert defaults.values == {"temperature": 0.2, "top_p": 0.9}
    assert "HuggingFaceTB smollm2 135M" in defaults.source
    assert resolve_sampling_defaults("vllm", None, default_model_path()).values == {}


def test_a_gguf_is_known_by_its_metadata_not_its_name(tmp_path):
    """The table's key is the file's general.* identity: a renamed copy keeps its defaults, another
    model's file (the same name) gets none; a file that is not GGUF gets none rather than an error."""
    identity = next(iter(GGUF_DEFAULTS))

    def write(path, finetune: str):
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_organization(identity[0])
        writer.add_basename(identity[1])
        writer.add_size_label(identity[2])
        writer.add_finetune(finetune)
        writer.add_token_list([b"a", b"b"])  # a string array before nothing else: skipped
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return path

    known = write(tmp_path / "renamed.gguf", identity[3])
    assert tuple(gguf_general_fields(known)[key] for key in ("general.organization", "general.basename",
                                                                "general.size_label", "general.finetune")) == identity
    assert resolve_sampling_defaults("auto", None, known).values == GGUF_DEFAULTS[identity]
    other = write(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", "base")
    assert resolve_sampling_defaults("auto", None, other).values == {}
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + b"\xff" * 7)
    assert gguf_general_fields(garbage) == {}


@pytest.mark.parametrize("text, words", [
    ("{temperature: 0.5}", ["not JSON"]),
    ("[0.5]", ["JSON object", "list"]),
    ('{"temprature": 0.5}', ["unknown fields", "temprature"]),
    ('{"temperature": -1}', ["temperature must be >= 0"]),
    ('{"top_k": 2.5}', ["top_k must be an integer"]),
    ('{"max_new_tokens": 0}', ["max_new_tokens must be >= 1"]),
])
def test_a_bad_override_is_refused_naming_the_flag(text, words, capsys):
    from jaxserve.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--override-generation-config", text])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--override-generation-config" in error and all(word in error for word in words), error
    with pytest.raises(InvalidParameter) as e:  # the offline LLM's keyword: the same check
        EngineConfig(override_generation_config=text)
    assert e.value.param == "override_generation_config"


def test_the_override_round_trips_the_command_line_and_the_config_stays_hashable():
    from jaxserve.cli import build_parser

    cfg = engine_config_from_args(build_parser().parse_args(
        ["serve", "--override-generation-config", '{"top_p": 0.5, "temperature": 0}']))
    assert json.loads(cfg.override_generation_config) == {"temperature": 0, "top_p": 0.5}
    assert hash(cfg) == hash(EngineConfig(override_generation_config={"temperature": 0, "top_p": 0.5}))


def test_a_missing_folder_or_a_bad_file_is_refused_naming_it(tiny_model, tmp_path):
    from jaxserve.cli import build_parser, main

    missing = tmp_path / "no-such-folder"
    with pytest.raises(ValueError, match=f"generation_config='{missing}'"):
        engine_config_from_args(build_parser().parse_args(["serve", "--generation-config", str(missing)]))
    with pytest.raises(SystemExit) as exit_info:  # before the model loads: one line, exit code 2
        main(["generate", "hi", "--model", str(tiny_model), "--generation-config", str(missing)])
    assert exit_info.value.code == 2
    bad = write_generation_config(tmp_path / "bad", {"temperature": "hot"})
    with pytest.raises(ValueError, match="generation_config.json: temperature must be a number"):
        resolve_sampling_defaults(str(bad), None, tiny_model)
    (bad / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        resolve_sampling_defaults(str(bad), None, tiny_model)


# -------------------------------------------------------------------------------------------------
# a request's sampling fields (server/prompts.py)


def test_absent_fields_take_the_defaults_and_set_fields_win():
    defaults = SamplingDefaults(MODEL_DEFAULTS)
    messages = [{"role": "user", "content": "hi"}]
    absent = sampling_params(ChatCompletionRequest(messages=messages), None, None, defaults=defaults)
    assert (absent.temperature, absent.top_p, absent.top_k, absent.min_p, absent.repetition_penalty,
            absent.max_tokens) == (1.5, 0.8, 40, 0.05, 1.1, 6)
    body = ChatCompletionRequest(messages=messages, temperature=0, top_p=1, top_k=-1, min_p=0, repetition_penalty=1,
                                 max_tokens=9)
    given = sampling_params(body, body.max_tokens, None, defaults=defaults)
    assert (given.temperature, given.top_p, given.top_k, given.min_p, given.repetition_penalty,
            given.max_tokens) == (0, 1, 0, 0, 1, 9)
    neutral = sampling_params(ChatCompletionRequest(messages=messages), None, None)
    assert (neutral.temperature, neutral.top_p, neutral.max_tokens) == (1.0, 1.0, None)


def test_a_cap_bounds_the_requests_max_tokens():
    capped = SamplingDefaults({"max_tokens": 4}, max_tokens_cap=4)
    body = CompletionRequest(prompt="hi", max_tokens=100)
    assert sampling_params(body, body.max_tokens, None, defaults=capped).max_tokens == 4
    body = CompletionRequest(prompt="hi", max_tokens=100, min_tokens=10)
    with pytest.raises(APIError, match="min_tokens"):  # a min_tokens above the cap is the request's error
        sampling_params(body, body.max_tokens, None, defaults=capped)


# -------------------------------------------------------------------------------------------------
# end to end


@pytest.fixture(scope="module")
def server(tiny_model):
    """The tiny model's defaults (temperature 1.5, top_k 40, max_new_tokens 6, ...) with temperature 0
    laid over them."""
    with run_server([str(tiny_model), *TINY_FLAGS, "--override-generation-config", '{"temperature": 0}']) as srv:
        yield srv


def _completion(server, **body) -> dict:
    response = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": PROMPT, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_server_shows_and_applies_the_defaults_in_force(server):
    """/server_info and the start-up line show them; a request without temperature is greedy (the
    override's 0, not the model's 1.5, whatever its seed); one that sets temperature samples; the
    model's max_new_tokens is the default max_tokens, and a request's own max_tokens wins."""
    info = httpx.get(server.url + "/server_info", headers=AUTH, timeout=30).json()
    assert info["default_sampling_params"] == {**MODEL_DEFAULTS, "temperature": 0}
    assert "max_tokens_cap" not in info
    assert "sampling defaults of requests: repetition_penalty=1.1, temperature=0" in server.stderr_tail(20_000)

    greedy = _completion(server, temperature=0, max_tokens=8)["choices"][0]["text"]
    for seed in (1, 2):
        assert _completion(server, seed=seed, max_tokens=8)["choices"][0]["text"] == greedy
    sampled = {_completion(server, temperature=1.0, top_k=0, top_p=1.0, seed=seed, max_tokens=8)["choices"][0]["text"]
               for seed in (1, 2)}
    assert len(sampled) == 2 and greedy not in sampled

    assert _completion(server, max_tokens=None)["usage"]["completion_tokens"] == 6
    assert _completion(server, max_tokens=9)["usage"]["completion_tokens"] == 9
    chat = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 6


def test_the_offline_llm_uses_the_defaults_when_given_no_sampling_params(tiny_model, tmp_path):
    """vLLM's `LLM.get_default_sampling_params`: generate() without sampling params is greedy here,
    max_new_tokens long, because the folder says so."""
    from jaxserve.llm import LLM

    folder = write_generation_config(tmp_path / "greedy", {"temperature": 0, "max_new_tokens": 3})
    llm = LLM(tiny_model, generation_config=str(folder), warmup=False, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64, block_size=8, num_kv_pages=96)  # compiles only the two steps it runs
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0, 3)
    default_tokens = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    assert len(default_tokens) == 3 and default_tokens == greedy
