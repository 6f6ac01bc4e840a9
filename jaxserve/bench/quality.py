"""`jaxserve bench quality`: what an engine setting (quantized weights, KV pages, a matmul backend) costs in
quality, measured against the same model run in float32.

Two measures, each taken on an engine of the setting and on a float32 reference of the same model:

  perplexity: over a fixed English text (`data/shakespeare.txt`, Shakespeare, public domain; its first
      `max_tokens` tokens). The model's own `forward` runs on the engine's serving params, so quantized or
      packed weights are what is measured, over a KV cache of the engine's page dtype, the text fed as one
      sequence in chunks: later chunks read the earlier ones back through the pages, so the pages' dtype
      is measured too.
  greedy agreement: 12 fixed prompts (6 plain, 6 chat), 32 tokens each at temperature 0 through
      `LLM.generate`, the whole engine; a prompt agrees when its tokens are the reference's, and every
      difference is shown from the first token that differs.

The two engines are built one after the other, each freed before the next, so two copies of a model never
share the memory. This module measures and reports; it sets no pass/fail thresholds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine_config import EngineConfig, engine_config_from_args

TEXT_PATH = Path(__file__).parent / "data" / "shakespeare.txt"
NUM_GREEDY_TOKENS = 32
PLAIN_PROMPTS = (
    "The capital of Germany is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at 100 degrees Celsius because",
    "In 1492, Christopher Columbus",
)
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "List three fruits and their colors.",
    "How do I reverse a list in Python?",
    "Give me two tips for sleeping better.",
)
PROMPTS = PLAIN_PROMPTS + CHAT_PROMPTS  # in greedy_prompts' order
# What the float32 reference shares with the setting measured: the weights (a dummy model's draw) and the
# engine's limits. Every other setting, quantization and backends included, is left at its default: the
# reference is the model as its float32 engine runs it, whatever settings are added later.
SHARED_SETTINGS = ("load_format", "seed", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                   "num_kv_pages", "kv_cache_memory_bytes", "gpu_memory_utilization")
REFERENCE_SETTINGS = {"dtype": "float32", "kv_cache_dtype": "float32"}


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One engine's measurements."""

    label: str  # the settings measured, as given
    resolved: str  # what they resolved to: dtypes and backends
    num_tokens: int  # tokens of the text scored (the first is only context)
    perplexity: float
    greedy: tuple[tuple[int, ...], ...]  # per prompt, its greedy output tokens
    seconds: dict[str, float]  # load (and warm-up), perplexity, greedy
    tokenizer: Any = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class GreedyDifference:
    """A prompt whose greedy tokens differ from the reference's."""

    prompt: int  # its index in greedy_prompts
    position: int  # the first output token that differs (or where the shorter output ended)
    common_text: str  # the output tokens before it, which both share
    reference_text: str  # the reference's output from that token on
    text: str  # the setting's output from that token on


def load_text() -> str:
    return TEXT_PATH.read_text(encoding="utf-8")


def reference_settings(settings: dict) -> dict:
    """The float32 reference's engine settings for a setting's `settings` (see SHARED_SETTINGS)."""
    return {name: settings[name] for name in SHARED_SETTINGS if name in settings} | REFERENCE_SETTINGS


def settings_label(cfg: EngineConfig) -> str:
    """The settings of `cfg` that differ from the defaults, as `name=value`; "defaults" when none do. Compared
    with a default EngineConfig, not the fields' declared defaults: __post_init__ fills some in (lora_modules
    None becomes (), max_cpu_loras None becomes max_loras)."""
    defaults = EngineConfig()
    changed = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != getattr(defaults, f.name)]
    return " ".join(changed) or "defaults"


@functools.partial(jax.jit, static_argnames=("cfg", "q_tile", "kv_tile", "attention_backend"),
                   donate_argnames=("kv_cache",))
def _chunk_nll(params, kv_cache, token_ids, positions, md, targets, *, cfg, q_tile: int, kv_tile: int,
               attention_backend: str):
    """-log p(targets[t] | the tokens up to token_ids[t]) [T] for one chunk of one sequence, and the cache."""
    from jaxserve.models.transformer import forward

    logits, kv_cache = forward(params, cfg, token_ids, positions, kv_cache, md, jnp.arange(token_ids.shape[0]),
                               q_tile=q_tile, kv_tile=kv_tile, attention_backend=attention_backend)
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # [T, vocab]
    return -jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0], kv_cache


def token_nlls(llm, token_ids: Sequence[int], chunk_size: int = 512) -> np.ndarray:
    """-log p(token_ids[i + 1] | token_ids[:i + 1]) [N - 1] under `llm`'s engine: its serving params,
    attention backend and KV page dtype, the tokens fed as one sequence `chunk_size` at a time."""
    from jaxserve.models.transformer import init_kv_cache
    from jaxserve.ops.attention import AttentionMetadata

    runner = llm.engine.runner
    if runner.parallel is not None:
        raise ValueError("bench quality runs on one device: leave tensor_parallel_size at 1")
    if chunk_size < 1:
        raise ValueError(f"{chunk_size=} must be positive")
    ids = np.asarray(token_ids, np.int32)
    if len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    page_size = runner.cfg.page_size
    num_pages = -(-len(ids) // page_size)
    # Reversed, so that pages out of position order are what attention walks; page 0 is the dummy page.
    block_table = np.arange(num_pages, 0, -1, dtype=np.int32)  # [pages_per_seq]
    kv_cache = init_kv_cache(runner.model_cfg, num_pages + 1, page_size, runner.cfg.kv_cache_dtype)
    assert [x.dtype for x in jax.tree.leaves(kv_cache)] == [x.dtype for x in jax.tree.leaves(runner.kv_cache)], \
        "the cache measured must hold what the engine's does"
    # Without the engine's rope tables (which cover max_model_len positions) forward computes each
    # position's rope itself, so the text may be longer than the engine's max_model_len.
    params = {name: value for name, value in runner.params.items() if name not in ("rope", "local_rope")}
    # As the runner compiles its steps: a GPU's default float32 dot is TF32.
    precision = "highest" if runner.platform == "gpu" and runner.cfg.dtype == "float32" else None
    nlls = []
    for start in range(0, len(ids) - 1, chunk_size):
        end = min(start + chunk_size, len(ids) - 1)  # the last token has no next token to score
        num_new = end - start
        tokens, targets, positions = (np.zeros(chunk_size, np.int32) for _ in range(3))
        tokens[:num_new], targets[:num_new] = ids[start:end], ids[start + 1:end + 1]
        positions[:num_new] = np.arange(start, end)
        slot_mapping = np.arange(chunk_size, dtype=np.int32) % page_size  # padding rows write the dummy page
        slot_mapping[:num_new] = block_table[positions[:num_new] // page_size] * page_size + \
            positions[:num_new] % page_size
        md = AttentionMetadata(slot_mapping, np.array([0, num_new], np.int32), np.array([end], np.int32),
                               block_table[None, :])
        with jax.default_matmul_precision(precision):
            nll, kv_cache = _chunk_nll(params, kv_cache, tokens, positions, md, targets, cfg=runner.model_cfg,
                                       q_tile=runner.cfg.prefill_query_tile, kv_tile=runner.resolved.kv_tile,
                                       attention_backend=runner.attention_backend)
        nlls.append(np.asarray(nll)[:num_new])
    return np.concatenate(nlls)


def greedy_prompts(tokenizer) -> list[list[int]]:
    """The 12 prompts' token ids: the plain ones as text, the chat ones in the model's chat template (as
    text where it has none)."""
    prompts = [tokenizer.encode(p) for p in PLAIN_PROMPTS]
    for content in CHAT_PROMPTS:
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(content))
    return prompts


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int = NUM_GREEDY_TOKENS) -> list[list[int]]:
    from jaxserve.config.sampling_params import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def compare_greedy(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]],
                   tokenizer) -> list[GreedyDifference]:
    """Every prompt whose tokens in `other` are not those of `reference`, from its first differing token."""
    assert len(reference) == len(other), (len(reference), len(other))
    differences = []
    for i, (ref, out) in enumerate(zip(reference, other)):
        if list(ref) == list(out):
            continue
        position = next((t for t, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        differences.append(GreedyDifference(i, position, tokenizer.decode(ref[:position]),
                                            tokenizer.decode(ref[position:]), tokenizer.decode(out[position:])))
    return differences


def evaluate(model, settings: dict, *, max_tokens: int = 4096, chunk_size: int = 512, label: str = "") -> Evaluation:
    """Builds an engine of `model` with `settings` (`LLM`'s keyword arguments), measures it, frees it."""
    from jaxserve.llm import LLM

    start = time.perf_counter()
    llm = LLM(model, **settings)
    loaded = time.perf_counter()
    runner = llm.engine.runner
    ids = llm.tokenizer.encode(load_text(), add_special_tokens=False)
    ids = ids[:min(max_tokens, runner.model_cfg.max_position_embeddings)]
    nlls = token_nlls(llm, ids, chunk_size)
    scored = time.perf_counter()
    greedy = greedy_tokens(llm, greedy_prompts(llm.tokenizer))
    done = time.perf_counter()
    cfg = runner.cfg
    weights = f"{cfg.quantization} weights, " if cfg.quantization else ""
    resolved = (f"{cfg.dtype}, {weights}KV {cfg.kv_cache_dtype}, {runner.matmul_backend} matmul, "
                f"{runner.attention_backend} attention")
    evaluation = Evaluation(label, resolved, len(ids), float(np.exp(nlls.mean())), tuple(map(tuple, greedy)),
                            {"load": loaded - start, "perplexity": scored - loaded, "greedy": done - scored},
                            llm.tokenizer)
    del llm, runner
    gc.collect()  # the engine's weights and pages go before the next engine loads its own
    return evaluation


def report(reference: Evaluation, evaluation: Evaluation) -> tuple[str, dict]:
    """The Markdown table and differences, and the same as a JSON-able dict."""
    differences = compare_greedy(reference.greedy, evaluation.greedy, reference.tokenizer)
    num_prompts = len(reference.greedy)
    rows = [(reference, num_prompts), (evaluation, num_prompts - len(differences))]
    lines = [f"Perplexity over the first {reference.num_tokens} tokens of {TEXT_PATH.name}; greedy: "
             f"{NUM_GREEDY_TOKENS} tokens at temperature 0 on {num_prompts} prompts, equal to float32's.", "",
             "| setting | resolved | perplexity | vs float32 | greedy = float32 | seconds (load / ppl / greedy) |",
             "|---|---|---|---|---|---|"]
    for e, num_equal in rows:
        seconds = " / ".join(f"{s:.1f}" for s in e.seconds.values())
        ratio = e.perplexity / reference.perplexity
        lines.append(f"| {e.label} | {e.resolved} | {e.perplexity:.4f} | {ratio:.4f} ({100 * (ratio - 1):+.2f}%) | "
                     f"{num_equal}/{num_prompts} | {seconds} |")
    for d in differences:
        lines += ["", f"prompt {d.prompt} ({PROMPTS[d.prompt]!r}) differs from output token {d.position}:",
                  f"  both:    {d.common_text!r}", f"  float32: {d.reference_text!r}", f"  setting: {d.text!r}"]
    as_dict = lambda e: {k: v for k, v in dataclasses.asdict(e).items() if k != "tokenizer"}  # noqa: E731
    result = {"text": TEXT_PATH.name, "num_tokens": reference.num_tokens, "reference": as_dict(reference),
              "setting": as_dict(evaluation), "perplexity_ratio": evaluation.perplexity / reference.perplexity,
              "greedy": {"num_prompts": num_prompts, "num_equal": num_prompts - len(differences),
                         "differences": [dataclasses.asdict(d) for d in differences]}}
    return "\n".join(lines), result


def run(args: argparse.Namespace) -> dict:
    cfg = engine_config_from_args(args)
    settings = dataclasses.asdict(cfg)
    kwargs = dict(max_tokens=args.max_tokens, chunk_size=args.chunk_size)
    reference = evaluate(args.model, reference_settings(settings), label="float32 (reference)", **kwargs)
    evaluation = evaluate(args.model, settings, label=settings_label(cfg), **kwargs)
    text, result = report(reference, evaluation)
    print("\n" + text)
    result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=4096,
                        help="tokens of the text to score (at most the model's context; the text holds ~5,400 of "
                             "SmolLM2's)")
    parser.add_argument("--chunk-size", type=int, default=512, help="tokens per forward call while scoring")
    parser.add_argument("--output", default=None, metavar="PATH", help="write the results as JSON here")
