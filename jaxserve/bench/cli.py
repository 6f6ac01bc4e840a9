"""The `jaxserve bench serve|throughput` subcommands."""

from __future__ import annotations

import argparse


def _serve(args: argparse.Namespace) -> None:
    from jaxserve.bench.serve import run

    run(args)


def _throughput(args: argparse.Namespace) -> None:
    from jaxserve.bench.throughput import run

    run(args)


def add_bench_parser(sub) -> None:
    from jaxserve.bench import serve, throughput
    from jaxserve.cli import _add_engine_flags

    bench = sub.add_parser("bench", help="benchmark a server (serve) or the offline engine (throughput)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    srv = kinds.add_parser("serve", help="load-test any OpenAI-compatible server (jaxserve, vLLM, ...)")
    serve.add_flags(srv)
    srv.set_defaults(func=_serve)
    tput = kinds.add_parser("throughput", help="offline LLM.generate throughput on this machine")
    _add_engine_flags(tput)
    throughput.add_flags(tput)
    tput.set_defaults(func=_throughput)
