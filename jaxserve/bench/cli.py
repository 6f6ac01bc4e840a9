"""The `jaxserve bench serve|throughput|quality` subcommands."""

from __future__ import annotations

import argparse

from jaxserve.bench import quality, serve, throughput
from jaxserve.config.engine_config import add_engine_flags


def _serve(args: argparse.Namespace) -> None:
    serve.run(args)


def _throughput(args: argparse.Namespace) -> None:
    throughput.run(args)


def _quality(args: argparse.Namespace) -> None:
    quality.run(args)


def add_bench_parser(sub) -> None:

    bench = sub.add_parser("bench", help="benchmark a server (serve), the offline engine (throughput) or "
                                          "a setting's quality against float32 (quality)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    srv = kinds.add_parser("serve", help="load-test any OpenAI-compatible server (jaxserve, vLLM, ...)")
    serve.add_flags(srv)
    srv.set_defaults(func=_serve)
    tput = kinds.add_parser("throughput", help="offline LLM.generate throughput on this machine")
    add_engine_flags(tput)
    throughput.add_flags(tput)
    tput.set_defaults(func=_throughput)
    qual = kinds.add_parser("quality", help="perplexity and greedy agreement of engine settings against float32")
    add_engine_flags(qual)
    quality.add_flags(qual)
    qual.set_defaults(func=_quality)
