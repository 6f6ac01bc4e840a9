"""Every engine setting, declared once: `EngineConfig`, and the command-line flags derived from it.

Each field of `EngineConfig` is one setting: its name (vLLM's where vLLM has one), type, default and
help text, its choices, and whether the command line takes it (as `--the-name`, so vLLM's flag name).
From that one declaration come the config itself (frozen, hashable, validated in `__post_init__`), the
flags of `jaxserve serve`, `generate`, `chat`, `check-lowering` and `bench throughput`
(`add_engine_flags`, `engine_config_from_args`) and the keyword arguments of the offline `LLM`
(`engine_config_from_kwargs`). Adding a setting is one field here, for example

    enable_prefix_caching: bool = setting(True, "reuse the KV pages of earlier prompts' common prefixes")

(plus a check in `__post_init__` if some values are wrong), and the code that uses it; what a
setting does lives there, not here.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable

from jaxserve.config.generation_config import check_generation_config, normalize_override, parse_override_flag
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.lora.request import LoRARequest, parse_lora_modules


@dataclasses.dataclass(frozen=True)
class KindDefaults:
    """What a kind of device gets for the settings left unset (`device_defaults.resolve` applies them)."""

    name: str  # "a CPU", for the start-up line
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_bytes: int | None  # None: sized from the device's memory
    max_model_len_cap: int | None  # the most a default max_model_len may be, besides the model's and the pool's
    why: str  # where the numbers come from, for the start-up line


# The engine's defaults from before they depended on the device, kept as they were; float32 activations (the
# C++ kernels'). Where the CPU has AVX512-BF16, dtype auto also holds the weights and KV pages in bfloat16
# (attention_backends.cpu_half_precision: the cpu-bf16 kernels).
CPU = KindDefaults("a CPU", "float32", 32, 512, 512 * 2**20, 2048, "a CPU's defaults")
# The engine measured on one H100 (docs/benchmarks.md, SmolLM2-1.7B's shape): bfloat16, which the Pallas
# kernels need (with float32, auto attention falls back to XLA's, several times slower there), and 128
# sequences in steps of 2048 tokens (16 executables to warm up).
GPU = KindDefaults("a GPU", "bfloat16", 128, 2048, None, None, "the engine measured on an H100")


# auto: the Pallas kernels on a Hopper GPU when the model fits them, the C++ kernel of cpu_ffi.py on a
# CPU for a float32 engine (float32 or bfloat16 pages), else XLA (attention_backends.py says why it chose).
# Under auto the C++ kernel multiplies its prompt tiles in bfloat16 where the matmuls are cpu-bf16, or int8 on
# a CPU with AVX512-BF16 (paired_attention_backend); an explicit cpu keeps float32 products.
ATTENTION_BACKENDS = ("auto", "xla", "cpu", "pallas", "pallas-interpret")
# auto: the C++ packed-weight matmul on a CPU (float32) when it builds, else XLA's dot. cpu-bf16: the same
# kernel with bfloat16 weights (x rounded to bfloat16, float32 sums; activations stay float32, the KV
# pages are bfloat16 unless kv_cache_dtype says otherwise).
MATMUL_BACKENDS = ("auto", "xla", "cpu", "cpu-bf16")
# auto: bfloat16 on a GPU (the Pallas kernels'; float16 is not supported); on a CPU bfloat16 weights and KV pages
# where it has AVX512-BF16 (the cpu-bf16 kernels, float32 activations), else float32. float32: the exact-parity
# mode (Hugging Face's float32 tokens); an explicit bfloat16 on a CPU runs XLA in bfloat16 throughout.
DTYPES = ("auto", "float32", "bfloat16")
# auto: dtype's, and bfloat16 under matmul_backend cpu-bf16 (device_defaults.py). bfloat16 pages under
# float32 activations are read by the C++ attention kernel (half the bytes) or XLA's. fp8 (vLLM's name;
# fp8_e4m3 its alias) resolves to JAX's float8_e4m3fn, the name the resolved config holds: a quarter of
# float32's bytes, scale 1.0, every reader widens the pages in its kernel.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "float8_e4m3fn")
# vLLM's names. int8: int8 weights with per-channel scales, activations quantized per token as each matmul
# runs (W8A8; in the C++ CPU matmul, per group of a token's values); fp8: float8 e4m3 weights with per-channel
# scales, on a GPU with fp8 activations (W8A8), in the C++ CPU matmul with bfloat16 ones (W8A16: a CPU has no
# fp8 arithmetic). Unset: the checkpoint's own (a quantization_config), else none. compressed-tensors and gguf
# name a checkpoint's own format, as vLLM's do (runner/resolve.py checks the checkpoint is one): the first is
# its 8-bit weights as stored, the second a GGUF file kept quantized, every tensor type requantized to int8.
QUANTIZATIONS = ("int8", "fp8", "compressed-tensors", "gguf")
# vLLM's: fcfs orders by arrival alone; priority lets a request's `priority` (lower first) order admission and
# choose preemption victims, so off by default: any client could otherwise jump the queue.
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's: auto reads the weights from the model's files; dummy draws random ones on the device in the shape
# of a Hugging Face directory's config.json, to benchmark a shape without its weight files.
LOAD_FORMATS = ("auto", "dummy")


def _per_device(setting: str) -> str:
    """The help's "(default: ...)" of a limit that device_defaults.py chooses when it is unset."""
    return f"(default: {getattr(CPU, setting)} on a CPU, {getattr(GPU, setting)} on a GPU)"


def parse_size(text: str) -> int:
    """A byte count: "536870912", "512MiB", "0.5GiB", "4G" (K, M, G and T are powers of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (for example 536870912, 512MiB or 4GiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


def _parse_speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's message (a ValueError's it drops)
        raise argparse.ArgumentTypeError(str(e)) from None


def setting(default: Any, help: str, *, flag: bool = True, choices: tuple | None = None,
            parse: Callable[[str], Any] | None = None, unit_alias: tuple[str, int, str] | None = None,
            short: str | None = None, nargs: str | None = None):
    """Declares one engine setting. flag: whether the command line takes it, as `--the-name` (the
    field names are vLLM's, so the flags are too); parse: how a flag's text becomes the value (default:
    the field's type); unit_alias: a second flag for the same setting in another unit (flag, how many of
    the setting's units one of it is, the unit's name), kept for the command lines written before;
    short: a short form of the flag (vLLM's, such as -tp); nargs: argparse's, for a flag taking a list."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "choices": choices,
                                                        "parse": parse, "unit_alias": unit_alias, "short": short,
                                                        "nargs": nargs})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: page pool, batch limits, buckets, backends."""

    # A setting left None (dtype "auto") is chosen for the device at start-up: device_defaults.py.
    max_model_len: int | None = setting(
        None, f"most tokens (prompt plus output) one sequence may hold (default: the model's context length, at "
              f"most what the KV pool holds and, on a CPU, {CPU.max_model_len_cap})")
    block_size: int = setting(16, "tokens per KV page")
    max_num_seqs: int | None = setting(None, "most sequences in one step " + _per_device("max_num_seqs"))
    max_num_batched_tokens: int | None = setting(
        None, "token budget of one step; longer prompts are prefilled in chunks "
              + _per_device("max_num_batched_tokens"))
    num_kv_pages: int | None = setting(None, "KV pages in the pool (fixes its size; else kv_cache_memory_bytes does)")
    kv_cache_memory_bytes: int | None = setting(
        None, f"memory for the KV page pool on each device, e.g. 512MiB or 4GiB (ignored with --num-kv-pages; "
              f"default: {CPU.kv_cache_memory_bytes // 2**20}MiB on a CPU, on a GPU what gpu_memory_utilization "
              f"leaves after the weights and a step's activations)",
        parse=parse_size, unit_alias=("--kv-cache-memory-gib", 2**30, "GiB"))
    gpu_memory_utilization: float = setting(
        0.9, "the share of each GPU's memory (what XLA may allocate) the engine may use, its KV cache included; "
             "sizes the KV cache when kv_cache_memory_bytes and num_kv_pages are unset")
    dtype: str = setting("auto", f"weights, activations and KV pages; auto: {GPU.dtype} on a GPU; on a CPU "
                                 f"bfloat16 weights and KV pages where it has AVX512-BF16, else {CPU.dtype}; "
                                 f"float32 keeps Hugging Face's float32 tokens", choices=DTYPES)
    kv_cache_dtype: str = setting("auto", "the KV pages' dtype; auto: dtype's, bfloat16 under matmul_backend "
                                          "cpu-bf16 or a quantization (half the bytes per token; a float32 engine widens them as it "
                                          "reads them); fp8 (or fp8_e4m3): float8 e4m3, a quarter of float32's "
                                          "bytes, scale 1.0, keys and values clipped to +-448 as they are written",
                                  choices=KV_CACHE_DTYPES)
    quantization: str | None = setting(
        None, "int8: the weight matrices in int8 with a scale per output channel, activations quantized per token "
              "as each matmul runs (the C++ CPU matmul's VNNI dot, or XLA's int8 dot); fp8: the same in float8 "
              "e4m3 (XLA's fp8 GEMM on a Hopper GPU; on a CPU the C++ matmul with bfloat16 activations, W8A16); "
              "compressed-tensors: the checkpoint's 8-bit weights as its quantization_config declares them (the "
              "default for such a checkpoint); gguf: a GGUF file kept quantized (its weights requantized to int8, "
              "as int8 serves them); default: none, or what the checkpoint declares",
        choices=QUANTIZATIONS)
    seed: int = setting(0, "seed of the seeds drawn for requests that bring none (and of dummy weights)")
    load_format: str = setting(
        "auto", "auto: the model's weight files; dummy: random weights made on the device, in the shape of a "
                "Hugging Face directory's config.json (no weight file needed; for benchmarking, the outputs are "
                "meaningless)", choices=LOAD_FORMATS)
    enable_prefix_caching: bool = setting(True, "reuse the KV pages of earlier prompts' common prefixes")
    long_prefill_token_threshold: int = setting(
        0, "a prompt with more tokens left to prefill than this is long: it takes at most this many tokens "
           "a step, and at most max_long_partial_prefills long prompts prefill at once, so shorter prompts go "
           "ahead of it (0: no prompt is long; unset with max_num_partial_prefills > 1: 4% of max_model_len)")
    max_num_partial_prefills: int | None = setting(
        None, "most prompts prefilling (partly) in one step (default: as many as the token budget takes)")
    max_long_partial_prefills: int = setting(
        1, "most long prompts (see long_prefill_token_threshold) prefilling in one step")
    mixed_batches: bool = setting(True, "let prompt chunks and decode rows share a step (off: prompts and "
                                        "decodes in separate steps, vLLM V0's policy, to measure what mixing buys)")
    scheduling_policy: str = setting(
        "fcfs", "fcfs: requests run in arrival order; priority: a request's priority (lower first, then arrival) "
                "orders admission and preemption, and without it a non-zero priority is refused",
        choices=SCHEDULING_POLICIES)
    attention_backend: str = setting("auto", "auto: the Pallas kernels on a Hopper GPU when the model fits them, "
                                             "the C++ kernel on a CPU (float32), else XLA", choices=ATTENTION_BACKENDS)
    tensor_parallel_size: int = setting(1, "devices the model is split over, by heads, MLP columns and "
                                           "vocabulary (tensor parallelism); KV memory is per device", short="-tp")
    nnodes: int = setting(1, "hosts serving one model together (jax.distributed); see --node-rank, --dist-init-addr")
    node_rank: int = setting(0, "this host's rank among --nnodes: 0 leads (HTTP server, scheduler), the others "
                                "follow its steps")
    dist_init_addr: str | None = setting(None, "HOST:PORT of rank 0's JAX coordinator (the step inputs go to "
                                               "PORT + 1); needed with --nnodes > 1")
    insecure_multihost: bool = setting(
        False, "let a multi-host group start without a shared secret (JAXSERVE_MULTIHOST_SECRET or "
               "JAXSERVE_MULTIHOST_SECRET_FILE, the same on every rank): then anyone who reaches the leader's "
               "PORT + 1 during start-up can join as a follower; only on a network nobody else reaches")
    async_scheduling: bool | None = setting(
        None, "schedule step N+1 and build its inputs while step N runs, feeding N's sampled tokens to N+1 on "
              "the device; the host reads each step's tokens one step late (default: on a GPU, off on a CPU)")
    matmul_backend: str = setting("auto", "auto: the C++ packed-weight matmul on a CPU (float32), else XLA's dot; cpu-bf16: that "
                                  "kernel with bfloat16 weights and matmul inputs, float32 sums (2x float32's rate "
                                  "on a CPU with AVX512-BF16; prompt attention's products in bfloat16 there too)",
                                  choices=MATMUL_BACKENDS)
    speculative_config: SpeculativeConfig | None = setting(
        None, "speculative decoding, as a JSON object: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} (prompt lookup) or {\"method\": \"draft_model\", "
              "\"model\": DIR, \"num_speculative_tokens\": 4}; \"disable_by_batch_size\": N turns it off in steps "
              "of more than N sequences (default: off)", parse=_parse_speculative_config)
    enable_lora: bool = setting(
        False, "serve LoRA adapters (PEFT directories) beside the base model, chosen per request (the server's "
               "model field, the offline lora_request); not with speculative decoding or several hosts")
    lora_modules: tuple[LoRARequest, ...] | None = setting(
        None, "LoRA adapters loaded at start, each name=path or a JSON object {\"name\": ..., \"path\": ..., "
              "\"base_model_name\": ...}; each is a model of the server (needs --enable-lora)",
        parse=str, nargs="+")
    max_loras: int = setting(1, "most LoRA adapters in one batch: the device holds this many adapters' weights "
                                "(requests for another adapter wait for a slot)")
    max_lora_rank: int = setting(16, "largest rank (r) a LoRA adapter may have: the width of the device slots")
    max_cpu_loras: int | None = setting(
        None, "LoRA adapters whose weights stay read in host memory; others are read again from their directory "
              "when they next need a slot (default: max_loras)")
    generation_config: str = setting(
        "auto", "where the sampling defaults of requests come from (for the fields a request leaves out): auto: the "
                "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, and "
                "max_new_tokens as max_tokens), for a GGUF file jaxserve's table of the models it ships; vllm: "
                "none (neutral defaults); a folder: its generation_config.json")
    override_generation_config: str | dict | None = setting(
        None, "sampling defaults over the generation config's, as a JSON object of its fields, e.g. "
              "'{\"temperature\": 0.5}'; its max_new_tokens also caps every request's max_tokens",
        parse=parse_override_flag)
    # Tests, debugging and tuning only: not on the command line.
    forbid_compilation_after_warmup: bool = setting(False, "any XLA compilation after warm-up raises", flag=False)
    min_prefill_bucket: int = setting(16, "the smallest token-count bucket of prompt steps", flag=False)
    min_decode_bucket: int = setting(1, "the smallest batch-size bucket of decode steps", flag=False)
    prefill_query_tile: int = setting(64, "query rows per tile of the XLA attention in prompt steps (the Pallas "
                                          "and C++ kernels choose their own tiles)", flag=False)
    kv_tile: int = setting(128, "keys per iteration of the XLA attention's loop over keys (the Pallas and C++ "
                                "kernels choose their own)", flag=False)

    def __post_init__(self):
        def check(ok: bool, message: str):
            if not ok:
                raise ValueError(message)

        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "override_generation_config", normalize_override(self.override_generation_config))
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules))
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        check_generation_config(self.generation_config)
        check(not (self.speculative_config and self.async_scheduling),
              "speculative decoding runs with synchronous scheduling: async_scheduling must be off (or unset) "
              "with speculative_config")
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            check(choices is None or getattr(self, f.name) in choices or getattr(self, f.name) is f.default is None,
                  f"{f.name}={getattr(self, f.name)!r} must be one of {choices}")
        check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
              f"{self.block_size=} must be a power of two")
        check(self.max_model_len is None or self.max_model_len > 0, f"{self.max_model_len=} must be positive")
        check(self.max_num_seqs is None or self.max_num_seqs > 0, f"{self.max_num_seqs=} must be positive")
        check(self.tensor_parallel_size >= 1, f"{self.tensor_parallel_size=} must be at least 1")
        check(self.load_format != "dummy" or self.tensor_parallel_size == 1,
              f"load_format='dummy' does not support tensor parallelism yet ({self.tensor_parallel_size=}); "
              f"use one device, or real weights")
        check(self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes,
              f"{self.node_rank=} must be in [0, {self.nnodes=})")
        check(self.tensor_parallel_size % self.nnodes == 0,
              f"{self.tensor_parallel_size=} must be a multiple of {self.nnodes=} (devices on each host)")
        check(self.nnodes == 1 or bool(re.fullmatch(r".+:[0-9]+", self.dist_init_addr or "")),
              f"{self.dist_init_addr=} must be HOST:PORT with {self.nnodes=}")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= self.min_prefill_bucket,
              f"{self.max_num_batched_tokens=} must be at least {self.min_prefill_bucket=}")
        check(None in (self.max_num_batched_tokens, self.max_num_seqs)
              or self.max_num_batched_tokens >= self.max_num_seqs,
              f"{self.max_num_batched_tokens=} must be at least {self.max_num_seqs=}")
        check(self.long_prefill_token_threshold >= 0, f"{self.long_prefill_token_threshold=} must be >= 0")
        check(self.max_num_partial_prefills is None or self.max_num_partial_prefills >= 1,
              f"{self.max_num_partial_prefills=} must be at least 1")
        check(self.max_long_partial_prefills >= 1 and (self.max_num_partial_prefills is None or
              self.max_long_partial_prefills <= self.max_num_partial_prefills),
              f"{self.max_long_partial_prefills=} must be in [1, {self.max_num_partial_prefills=}]")
        check(self.num_kv_pages is None or self.num_kv_pages >= 1, f"{self.num_kv_pages=} must be at least 1")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
              f"{self.kv_cache_memory_bytes=} must be positive")
        check(0 < self.gpu_memory_utilization <= 1, f"{self.gpu_memory_utilization=} must be in (0, 1]")
        check(self.max_loras >= 1, f"{self.max_loras=} must be at least 1")
        check(self.max_lora_rank >= 1, f"{self.max_lora_rank=} must be at least 1")
        check(self.max_cpu_loras >= self.max_loras, f"{self.max_cpu_loras=} must be at least {self.max_loras=}")
        check(self.enable_lora or not self.lora_modules,
              f"lora_modules {[lora.name for lora in self.lora_modules]} need enable_lora=True (--enable-lora)")
        check(not (self.enable_lora and self.speculative_config),
              "enable_lora does not run with speculative decoding yet: leave speculative_config unset")
        check(not (self.enable_lora and self.nnodes > 1),
              f"enable_lora does not run on several hosts yet ({self.nnodes=}); serve adapters from one host")
        check(not (self.attention_backend == "pallas-interpret" and self.forbid_compilation_after_warmup),
              "attention_backend='pallas-interpret' compiles the GPU interpreter's helpers while it runs: "
              "it cannot be combined with forbid_compilation_after_warmup=True")

    @property
    def page_size(self) -> int:
        """Tokens per KV page: vLLM's block_size."""
        return self.block_size

    @property
    def pages_per_seq(self) -> int:
        assert self.max_model_len is not None, "resolve the defaults first (device_defaults.resolve)"
        return -(-self.max_model_len // self.page_size)


def engine_config_from_kwargs(**kwargs) -> EngineConfig:
    """An EngineConfig from keyword arguments (`LLM(**kwargs)`); an unknown name is a TypeError that
    lists the known ones."""
    known = [f.name for f in dataclasses.fields(EngineConfig)]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise TypeError(f"unknown engine settings {unknown}; known: {known}")
    return EngineConfig(**kwargs)


def _flag_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata["flag"]]


def _unit_alias_dest(name: str) -> str:
    return f"{name}_in_alias_unit"


def add_engine_flags(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """The model argument and one flag per command-line setting of EngineConfig."""
    help_text = "model directory, GGUF file or jaxserve checkpoint (default: SmolLM2-135M-Instruct)"
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help=help_text)
    else:
        parser.add_argument("--model", default=None, help=help_text)
    group = parser.add_argument_group("engine settings")
    for f in _flag_fields():
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        meta = {**meta, "help": meta["help"].replace("%", "%%")}  # argparse formats help with %
        flags = (meta["short"], flag) if meta["short"] else (flag,)
        if f.type in ("bool", "bool | None"):
            default = "" if f.default is None else f" (default: {'on' if f.default else 'off'})"
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=meta["help"] + default)
            continue
        value_type = meta["parse"] or {"int": int, "int | None": int, "float": float, "str": str,
                                        "str | None": str}[f.type]
        help_text = meta["help"] if f.default is None else f"{meta['help']} (default: {f.default})"
        group.add_argument(*flags, dest=f.name, type=value_type, default=f.default, choices=meta["choices"],
                           nargs=meta["nargs"], help=help_text)
        if meta["unit_alias"] is not None:
            alias, _, unit_name = meta["unit_alias"]
            group.add_argument(alias, dest=_unit_alias_dest(f.name), type=float, default=None, metavar=unit_name,
                               help=f"the same as {flag}, in {unit_name}")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig that `add_engine_flags`' flags describe; a bad value is a ValueError naming it."""
    kwargs = {}
    for f in _flag_fields():
        kwargs[f.name] = getattr(args, f.name)
        alias = f.metadata["unit_alias"]
        if alias is not None and getattr(args, _unit_alias_dest(f.name)) is not None:
            kwargs[f.name] = int(getattr(args, _unit_alias_dest(f.name)) * alias[1])
    return EngineConfig(**kwargs)
