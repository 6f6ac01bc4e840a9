"""Engine settings are declared once (`engine_config.py`): the flags of every command, `EngineConfig`
and `LLM(**kwargs)` come from that declaration, keep today's names and defaults, and refuse bad values
by name."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.lora import LoRARequest

from jaxserve import LLM
from jaxserve.cli import build_parser
from jaxserve.config.engine_config import EngineConfig, engine_config_from_args, engine_config_from_kwargs, parse_size

REPO_ROOT = Path(__file__).resolve().parent.parent
COMMANDS = (["serve"], ["generate", "a prompt"], ["chat"], ["check-lowering"], ["bench", "throughput"])
# The flags the command line took before the declaration existed, spelled exactly so: scripts use them.
FLAGS_IN_USE = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                "--block-size", "8", "--num-kv-pages", "40", "--kv-cache-memory-gib", "0.25", "--seed", "7",
                "--no-mixed-batches", "--attention-backend", "xla", "--matmul-backend", "xla", "--dtype", "bfloat16",
                "--no-enable-prefix-caching"]
FLAG_FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.metadata["flag"]]


def _config(*argv: str) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_no_flags_give_the_declared_defaults(command):
    assert _config(*command) == EngineConfig()


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_the_flags_in_use_keep_their_names_and_meaning(command):
    assert _config(*command, *FLAGS_IN_USE) == EngineConfig(
        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=8, num_kv_pages=40,
        kv_cache_memory_bytes=2**28, seed=7, mixed_batches=False, attention_backend="xla", matmul_backend="xla",
        dtype="bfloat16", enable_prefix_caching=False)


SPECIAL_VALUES = {"kv_cache_memory_bytes": "1GiB", "gpu_memory_utilization": "0.5", "tensor_parallel_size": "2",
                  "nnodes": "2", "node_rank": "1", "dist_init_addr": "leader:1234",
                  "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
                  "generation_config": "vllm", "override_generation_config": '{"temperature": 0.5}',
                  "lora_modules": "sql=/adapters/sql"}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("field", FLAG_FIELDS, ids=lambda f: f.name)
def test_every_command_line_setting_is_a_flag_of_every_command(command, field):
    """A setting declared with flag=True reaches EngineConfig through `--its-name` in every command."""
    flag = "--" + field.name.replace("_", "-")
    if field.type in ("bool", "bool | None"):
        assert getattr(_config(*command, f"--no-{flag[2:]}"), field.name) is False
        assert getattr(_config(*command, flag), field.name) is True
        return
    choices = field.metadata["choices"]
    value = choices[-1] if choices else SPECIAL_VALUES.get(field.name, "64")
    expected = {"kv_cache_memory_bytes": parse_size, "dist_init_addr": str,
                "speculative_config": SpeculativeConfig.parse, "override_generation_config": str,
                "lora_modules": lambda v: (LoRARequest("sql", 1, "/adapters/sql"),)}.get(
        field.name, str if choices else type(field.default or 0))(value)
    group = ["-tp", "2", "--nnodes", "2", "--dist-init-addr", "leader:1234"]  # what the multi-host flags need
    others = group if field.name in ("nnodes", "node_rank", "dist_init_addr") else []
    if field.name == "lora_modules":  # adapters need --enable-lora
        others = ["--enable-lora"]
    assert getattr(_config(*command, *others, flag, value), field.name) == expected


def test_debug_settings_are_declared_but_not_flags():
    for name in ("forbid_compilation_after_warmup", "min_prefill_bucket", "prefill_query_tile", "kv_tile"):
        field = {f.name: f for f in dataclasses.fields(EngineConfig)}[name]
        assert field.metadata["help"] and not field.metadata["flag"]
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--" + name.replace("_", "-"), "1"])


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["chat"], ["bench", "throughput"], ["bench", "serve"],
                                     ["check-lowering"], ["convert"]])
def test_every_command_prints_its_help(command, capsys):
    """--help formats every setting's text (argparse reads % in it as a format: a bare one crashed it)."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_every_setting_has_help():
    for field in dataclasses.fields(EngineConfig):
        assert field.metadata.get("help"), f"{field.name} is not declared with setting()"


def test_kv_cache_memory_in_bytes_or_gib():
    assert _config("serve", "--kv-cache-memory-bytes", "268435456").kv_cache_memory_bytes == 2**28
    assert _config("serve", "--kv-cache-memory-bytes", "0.5GiB").kv_cache_memory_bytes == 2**29
    assert _config("serve", "--kv-cache-memory-bytes", "4G").kv_cache_memory_bytes == 4 * 2**30
    assert _config("serve", "--kv-cache-memory-gib", "1.5").kv_cache_memory_bytes == 3 * 2**29
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-memory-bytes", "lots"])


def test_choices_are_checked_by_the_config_too():
    """LLM(**kwargs) never passes through argparse: the declared choices are enforced by EngineConfig."""
    with pytest.raises(ValueError, match="dtype='float16' must be one of"):
        EngineConfig(dtype="float16")
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        EngineConfig(attention_backend="triton")


def test_unknown_keyword_settings_are_named_before_any_loading():
    with pytest.raises(TypeError, match=r"unknown engine settings \['max_seqs'\]; known: .*'max_num_seqs'"):
        engine_config_from_kwargs(max_seqs=4)
    with pytest.raises(TypeError, match="max_seqs"):
        LLM("/nonexistent", max_seqs=4)  # the name is checked before the path is


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "3"], "block_size=3 must be a power of two"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "max_num_batched_tokens=32 must be at least"),
    (["--dtype", "float16"], "invalid choice: 'float16'"),
])
def test_a_bad_setting_is_a_one_line_error_with_exit_code_2(argv, message):
    run = subprocess.run([sys.executable, "-m", "jaxserve.cli", "generate", "hi", *argv], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("jaxserve")
