"""`jaxserve serve`: load the model, compile every bucket, start the engine thread, serve HTTP.

The engine loop runs in a thread beside uvicorn's event loop rather than in another process: XLA
releases the GIL while a step runs, so request parsing and /health stay responsive, and a thread
shares the tokenizer and needs no IPC for token deltas.

SIGTERM or Ctrl-C drains the server: it stops admitting (503, /health too, so a router takes it
out), lets in-flight requests finish for up to `--shutdown-timeout` seconds, ends the rest with an
error event, then stops uvicorn and the engine thread and exits 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from server.tool_parsers import PARSERS as TOOL_CALL_PARSERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20  # prompts of a long context, as text or token ids, fit easily


def serve(args: argparse.Namespace) -> None:
    if args.data_parallel_size > 1 and args.allowed_hosts is not None:
        raise ValueError("--allowed-hosts is not supported with --data-parallel-size: the router in front of the "
                         "replicas does not check the Host header")
    if args.data_parallel_size > 1:  # replicas of this command behind a router (jaxserve/distributed/data_parallel.py)
        from jaxserve.distributed.data_parallel import serve_data_parallel

        return serve_data_parallel(args, add_serve_flags)
    import uvicorn

    from jaxserve.core.engine import LLMEngine
    from jaxserve.config.engine_config import engine_config_from_args
    from jaxserve.config.generation_config import resolve_sampling_defaults
    from jaxserve.core.engine_loop import EngineLoop
    from jaxserve.weights import default_model_path
    from server.app import check_allowed_hosts, create_app
    from server.draining import DrainingServer

    started = time.perf_counter() - _process_age()
    load_start = time.perf_counter()
    chat_template = _read_chat_template(args.chat_template) if args.chat_template else None  # fail before loading
    check_allowed_hosts(args.allowed_hosts or [])
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes calls in)")
    engine_cfg = engine_config_from_args(args)
    sampling_defaults = resolve_sampling_defaults(engine_cfg.generation_config, engine_cfg.override_generation_config,
                                                  args.model or default_model_path())  # a bad file fails here
    engine, warmup = LLMEngine.from_config(args.model, engine_cfg)
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    engine_loop = EngineLoop(engine, iteration_timeout_s=args.engine_iteration_timeout_s).start()
    if engine.leader is not None:  # a multi-host group's leader: a follower's end ends serving
        engine.leader.on_follower_lost = engine_loop.fail  # called at once for a follower already gone
    name = args.served_model_name or (os.path.basename(str(args.model).rstrip("/")) if args.model
                                      else "SmolLM2-135M-Instruct")
    api_key = args.api_key or os.environ.get("JAXSERVE_API_KEY")
    app = create_app(engine_loop, name, api_key=api_key, max_queued_requests=args.max_queued_requests,
                     max_request_body_bytes=args.max_request_body_bytes, chat_page=args.chat_page,
                     tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                     allowed_hosts=args.allowed_hosts, sampling_defaults=sampling_defaults,
                     enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        now = time.perf_counter()
        cache = "warm" if warmup["num_cache_hits"] == warmup["num_executables"] else (
            "cold" if warmup["num_cache_hits"] == 0 else "partly warm")
        print(f"jaxserve: ready {now - started:.1f} s after the process started (imports "
              f"{load_start - started:.1f} s, model and tokenizer loading {now - load_start - warmup['seconds']:.1f} s, "
              f"warm-up {warmup['seconds']:.1f} s with the compilation cache {cache}); serving {name!r} at "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        yield
        engine_loop.shutdown()
        if engine.leader is not None:  # the followers see the end and exit; then JAX's shutdown can meet
            engine.leader.close()
        app.state.jaxserve.shutdown_executor()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    DrainingServer(config, lambda: app.state.jaxserve.drain(args.shutdown_timeout)).run()


def _read_chat_template(value: str) -> str:
    """--chat-template: a file holding a Jinja template, or the template itself (as vLLM takes it)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _process_age() -> float:
    """Seconds since this process started (from /proc on Linux; 0 elsewhere), so that the ready time
    includes the Python start-up and imports a user waits through."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: from the path)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but "
                                                         "/health, /version and the chat page (or set "
                                                         "JAXSERVE_API_KEY)")
    parser.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                        help="answer only requests whose Host header names one of these (without the port; "
                             "*.example.com for subdomains), against DNS rebinding of a server without a key "
                             "(default: no check, any Host)")
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests waiting beyond max_num_seqs before the server answers 503")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies are refused with 413")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template itself) to use instead of the "
                             "model's own, for a model that ships none")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto", the default with tools), '
                             "read with --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                        help="the format the model writes tool calls in (vLLM's names)")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's class, settings and chat template "
                             "(lm-evaluation-harness's tokenizer_backend=remote reads it)")
    parser.add_argument("--no-chat-page", dest="chat_page", action="store_false",
                        help="do not serve the chat page on / (the API is unchanged)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="serve N replicas of the model, each on its own cores (or -tp GPUs), behind "
                             "sglang-router on --port (the 'router' extra)")
    parser.add_argument("--router-policy", default="cache_aware",
                        choices=["cache_aware", "round_robin", "power_of_two", "random"],
                        help="how the router spreads requests over the replicas (with --data-parallel-size)")
    parser.add_argument("--engine-iteration-timeout-s", type=float, default=None,
                        help="a step that runs longer declares the engine stuck: /health turns 503 and open "
                             "requests end with an error (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S; default: 20x "
                             "the slowest step seen, at least 60 s)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds to let in-flight requests finish before ending them "
                             "with an error")
