"""The `jaxserve` command: serve, generate, chat, convert, bench, check-lowering.

Engine flags come from `EngineConfig`'s declaration (`engine_config.py`), with vLLM's names
(`--max-model-len`, `--max-num-seqs`, ...); the server (`server/main.py`) and the benchmarks
(`jaxserve/bench/cli.py`) add their own. Bad input ends with a one-line error and exit code 2, never a
traceback. Heavy imports (JAX, the engine) happen inside the commands, so `--help` stays quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from jaxserve.bench.cli import add_bench_parser
from jaxserve.config.model_config import ModelLoadError
from jaxserve.config.engine_config import add_engine_flags, engine_config_from_args
from server.main import add_serve_flags, serve


def _add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int | None) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    parser.add_argument("--sampling-seed", type=int, default=None)


def _sampling_params(args: argparse.Namespace):
    from jaxserve.config.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)


def _make_llm(args: argparse.Namespace):
    from jaxserve.llm import LLM

    return LLM(args.model, **dataclasses.asdict(engine_config_from_args(args)))


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
        from jaxserve.tools.export import save_hf_dir

        dst = save_hf_dir(loaded, hf_config, args.dst, args.dtype)
    else:
        dst = save_checkpoint(loaded, args.dst)
    print(f"wrote {dst} ({loaded.config.architecture}, {args.dtype}, {args.to} format)")


def cmd_check_lowering(args: argparse.Namespace) -> None:
    """Lowers every bucket's step functions for --platform; exit code 1 if any failed."""
    import jax

    from jaxserve.tools.check_lowering import PLATFORMS, check_lowering, format_results
    from jaxserve.config.device_defaults import DeviceInfo, resolve_dtype
    from jaxserve.parallel.tensor_parallel import request_cpu_devices
    from jaxserve.weights import load_model

    engine_cfg = engine_config_from_args(args)
    request_cpu_devices(engine_cfg.tensor_parallel_size)  # the mesh's devices, before JAX starts
    # "auto" decided once, for the target: the weights load in it and check_lowering resolves the rest
    engine_cfg = dataclasses.replace(engine_cfg, dtype=resolve_dtype(engine_cfg.dtype,
                                                                     DeviceInfo.target(PLATFORMS[args.platform])))
    loaded = load_model(args.model, engine_cfg.dtype)  # for its config; only the params' shapes are used
    model_cfg = loaded.config
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), loaded.params)
    del loaded
    results = check_lowering(model_cfg, engine_cfg, params, platform=args.platform, dump_dir=args.dump)
    print(format_results(results, args.platform))
    if not all(r.ok for r in results):
        sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    add_engine_flags(gen)
    _add_sampling_flags(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (one user turn per input line)")
    add_engine_flags(chat)
    _add_sampling_flags(chat, max_tokens=256)
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.set_defaults(func=cmd_chat)

    srv = sub.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API")
    add_engine_flags(srv, positional_model=True)
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

    add_bench_parser(sub)

    lower = sub.add_parser("check-lowering", help="lower every bucket's step functions for a platform (no GPU needed)")
    add_engine_flags(lower, positional_model=True)
    lower.add_argument("--platform", default="cuda", choices=["cuda", "cpu"], help="the platform to lower for")
    lower.add_argument("--dump", default=None, metavar="DIR", help="write each step's lowered module to DIR")
    lower.set_defaults(func=cmd_check_lowering)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:  # the engine's own details (start-up lines are INFO and show without -v)
        logging.getLogger("jaxserve").setLevel(logging.DEBUG)
    try:
        args.func(args)
    except (ModelLoadError, ValueError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
