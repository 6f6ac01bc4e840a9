"""The `jaxserve bench serve|throughput` subcommands."""

from __future__ import annotations

import argparse

from jaxserve.bench import serve, throughput
from jaxserve.config.engine_config import add_engine_flags


def _serve(args: argparse.Namespace) -> None:
    serve.run(args)


def _throughput(args: argparse.Namespace) -> None:
    throughput.run(args)


def add_bench_parser(sub) -> None:

    bench = sub.add_parser("bench", help="benchmark a server (serve) or the offline engine (throughput)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    srv = kinds.add_parser("serve", help="load-test any OpenAI-compatible server (jaxserve, vLLM, ...)")
    serve.add_flags(srv)
    srv.set_defaults(func=_serve)
    tput = kinds.add_parser("throughput", help="offline LLM.generate throughput on this machine")
    add_engine_flags(tput)
    throughput.add_flags(tput)
    tput.set_defaults(func=_throughput)
