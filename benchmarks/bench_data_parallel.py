"""Two replicas behind sglang-router, cache-aware policy vs round-robin, in one run.

A multi-turn chat workload: each conversation opens with its own long user message and resends its
whole growing history every turn, so a replica that served the previous turn holds most of the next
prompt in its prefix cache. For each policy this starts `jaxserve serve MODEL --data-parallel-size 2
--router-policy P`, runs the same conversations (several at once, each turn after the last), and reads
every replica's /metrics before and after: prefix-cache hit rate (`jaxserve:prefix_cache_hits_total` /
`jaxserve:prefix_cache_queries_total`), its share of prompt tokens, and the run's throughput.

    python benchmarks/bench_data_parallel.py --out benchmarks/results/data_parallel_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parent.parent
WORDS = ("river stone lantern orbit meadow copper signal harbor violet engine quiet marble falcon ember "
         "canyon willow summit prism glacier thunder cedar velvet beacon").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def opening(rng: random.Random, num_words: int) -> str:
    return "Here are my notes: " + " ".join(rng.choice(WORDS) for _ in range(num_words)) + ". Summarize them."


def run_policy(policy: str, args) -> dict:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+b", prefix="bench-dp-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *([args.model] if args.model else []),
           "--data-parallel-size", "2", "--router-policy", policy, "--port", str(port),
           "--max-model-len", str(args.max_model_len), *args.serve_flag]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 900
        while "replicas behind sglang-router" not in Path(log.name).read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the group did not start:\n{Path(log.name).read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        replicas = sorted(set(re.findall(r"replica \d+: pid \d+ at (http://\S+)", Path(log.name).read_text())))
        before = [counters(url) for url in replicas]
        result = workload(f"http://127.0.0.1:{port}", args)
        after = [counters(url) for url in replicas]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        os.unlink(log.name)
    per_replica = []
    for b, a in zip(before, after):
        delta = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in ("jaxserve:prefix_cache_hits_total",
                                                             "jaxserve:prefix_cache_queries_total",
                                                             "jaxserve:prompt_tokens_total")}
        queries = delta["jaxserve:prefix_cache_queries_total"]
        per_replica.append({"prefix_cache_hits": delta["jaxserve:prefix_cache_hits_total"],
                            "prefix_cache_queries": queries,
                            "hit_rate": delta["jaxserve:prefix_cache_hits_total"] / queries if queries else 0.0,
                            "prompt_tokens": delta["jaxserve:prompt_tokens_total"]})
    hits = sum(r["prefix_cache_hits"] for r in per_replica)
    queries = sum(r["prefix_cache_queries"] for r in per_replica)
    return {"policy": policy, **result, "hit_rate": hits / queries if queries else 0.0, "replicas": per_replica}


def workload(url: str, args) -> dict:
    rng = random.Random(args.seed)
    openings = [opening(rng, args.opening_words) for _ in range(args.num_conversations)]
    totals = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "errors": 0}
    lock = threading.Lock()
    slots = threading.Semaphore(args.concurrency)

    def conversation(i: int):
        messages = [{"role": "user", "content": openings[i]}]
        with slots, httpx.Client(timeout=600) as client:
            for turn in range(args.num_turns):
                response = client.post(url + "/v1/chat/completions", json={
                    "model": args.served_model_name, "messages": messages, "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True})
                with lock:
                    totals["requests"] += 1
                    if response.status_code != 200:
                        totals["errors"] += 1
                        return
                    usage = response.json()["usage"]
                    totals["prompt_tokens"] += usage["prompt_tokens"]
                    totals["output_tokens"] += usage["completion_tokens"]
                messages += [response.json()["choices"][0]["message"],
                             {"role": "user", "content": f"Now turn {turn + 1}: say more about {rng.choice(WORDS)}."}]

    start = time.perf_counter()
    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(args.num_conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    return {**totals, "seconds": seconds, "output_tokens_per_s": totals["output_tokens"] / seconds,
            "requests_per_s": totals["requests"] / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    parser.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8, help="conversations running at once")
    parser.add_argument("--opening-words", type=int, default=150, help="words in each conversation's first message")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-flag", action="append", default=[], help="another flag for jaxserve serve")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.model and args.served_model_name == parser.get_default("served_model_name"):
        args.served_model_name = os.path.basename(args.model.rstrip("/"))
    runs = [run_policy(policy, args) for policy in args.policies]
    print("| policy | prefix-cache hit rate (replica 0 / 1) | prompt tokens (replica 0 / 1) | requests/s | "
          "output tokens/s | errors |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        r0, r1 = run["replicas"]
        print(f"| {run['policy']} | {run['hit_rate']:.1%} ({r0['hit_rate']:.1%} / {r1['hit_rate']:.1%}) | "
              f"{r0['prompt_tokens']:.0f} / {r1['prompt_tokens']:.0f} | {run['requests_per_s']:.2f} | "
              f"{run['output_tokens_per_s']:.1f} | {run['errors']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "args": vars(args), "runs": runs},
                                             indent=2) + "\n")


if __name__ == "__main__":
    main()
