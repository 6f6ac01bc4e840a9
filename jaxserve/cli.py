"""The `jaxserve` command: generate, chat, convert, check-lowering (the server and benchmarks add their own).

Engine flags use vLLM's names (`--max-model-len`, `--max-num-seqs`, ...); each maps onto a field of
`EngineConfig`. Bad input ends with a one-line error and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxserve.config import ATTENTION_BACKENDS, MATMUL_BACKENDS, EngineConfig, ModelLoadError


def _add_engine_flags(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    defaults = EngineConfig()
    help_text = "model directory, GGUF file or jaxserve checkpoint (default: SmolLM2-135M-Instruct)"
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help=help_text)
    else:
        parser.add_argument("--model", default=None, help=help_text)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-model-len", type=int, default=None, help="default: min(2048, the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV page")
    parser.add_argument("--num-kv-pages", type=int, default=None, help="fixes the KV pool size")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=defaults.kv_cache_memory_bytes / 2**30,
                        help="memory for the KV page pool (ignored with --num-kv-pages)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--no-mixed-batches", dest="mixed_batches", action="store_false",
                        help="never put prompt chunks and decode rows in one step (to measure what mixing buys)")
    parser.add_argument("--attention-backend", default=defaults.attention_backend, choices=ATTENTION_BACKENDS,
                        help="auto: Pallas kernels on a Hopper GPU when the model fits them, the C++ attention kernel "
                             "on a CPU (float32), else XLA")
    parser.add_argument("--matmul-backend", default=defaults.matmul_backend, choices=MATMUL_BACKENDS,
                        help="auto: the C++ packed-weight matmul on a CPU (float32), else XLA's dot")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_pages=args.num_kv_pages,
        kv_cache_memory_bytes=int(args.kv_cache_memory_gib * 2**30),
        seed=args.seed,
        attention_backend=args.attention_backend,
        matmul_backend=args.matmul_backend,
        mixed_batches=args.mixed_batches,
    )
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    return kwargs


def _add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int | None) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    parser.add_argument("--sampling-seed", type=int, default=None)


def _sampling_params(args: argparse.Namespace):
    from jaxserve.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)


def _make_llm(args: argparse.Namespace):
    from jaxserve.llm import LLM

    return LLM(args.model, dtype=args.dtype, **_engine_kwargs(args))


def cmd_generate(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    llm = _make_llm(args)
    for output in llm.generate(args.prompt, params, use_tqdm=False):
        print(output.outputs[0].text)


def cmd_chat(args: argparse.Namespace) -> None:
    """A chat REPL; reads one user turn per line (so it also answers piped input), EOF ends it."""
    params = _sampling_params(args)
    llm = _make_llm(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        answer = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": answer})
        print(f"assistant> {answer}" if interactive else answer, flush=True)


def cmd_convert(args: argparse.Namespace) -> None:
    from jaxserve.weights import load_hf_config, load_model, save_checkpoint

    hf_config = load_hf_config(args.src) if args.to == "hf" else None  # fail before the slow load
    loaded = load_model(args.src, args.dtype)
    if args.to == "hf":
        from jaxserve.export import save_hf_dir

        dst = save_hf_dir(loaded, hf_config, args.dst, args.dtype)
    else:
        dst = save_checkpoint(loaded, args.dst)
    print(f"wrote {dst} ({loaded.config.architecture}, {args.dtype}, {args.to} format)")


def cmd_check_lowering(args: argparse.Namespace) -> None:
    """Lowers every bucket's step functions for --platform; exit code 1 if any failed."""
    import jax

    from jaxserve.check_lowering import check_lowering, format_results
    from jaxserve.weights import load_model

    loaded = load_model(args.model, args.dtype)  # for its config; only the params' shapes are used
    model_cfg = loaded.config
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), loaded.params)
    del loaded
    engine_kwargs = _engine_kwargs(args)
    engine_kwargs.setdefault("max_model_len", min(2048, model_cfg.max_position_embeddings))
    results = check_lowering(model_cfg, EngineConfig(dtype=args.dtype, **engine_kwargs), params,
                             platform=args.platform)
    print(format_results(results, args.platform))
    if not all(r.ok for r in results):
        sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    _add_engine_flags(gen)
    _add_sampling_flags(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (one user turn per input line)")
    _add_engine_flags(chat)
    _add_sampling_flags(chat, max_tokens=256)
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.set_defaults(func=cmd_chat)

    from server.main import add_serve_flags, serve

    srv = sub.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API")
    _add_engine_flags(srv, positional_model=True)
    add_serve_flags(srv)
    srv.set_defaults(func=serve)

    convert = sub.add_parser("convert", help="convert a model to a jaxserve (orbax) checkpoint or a HF directory")
    convert.add_argument("src", nargs="?", default=None, help="model to convert (default: SmolLM2-135M-Instruct)")
    convert.add_argument("dst")
    convert.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    convert.add_argument("--to", default="jaxserve", choices=["jaxserve", "hf"],
                         help="jaxserve: orbax checkpoint (fastest to load); hf: config.json + safetensors "
                              "(for transformers, vLLM, ...)")
    convert.set_defaults(func=cmd_convert)

    from jaxserve.bench.cli import add_bench_parser

    add_bench_parser(sub)

    lower = sub.add_parser("check-lowering", help="lower every bucket's step functions for a platform (no GPU needed)")
    _add_engine_flags(lower, positional_model=True)
    lower.add_argument("--platform", default="cuda", choices=["cuda", "cpu"], help="the platform to lower for")
    lower.set_defaults(func=cmd_check_lowering)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (ModelLoadError, ValueError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
