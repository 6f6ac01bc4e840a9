"""`jaxserve bench serve`: a load generator for any OpenAI-compatible server (jaxserve, vLLM, ...).

It streams every request (so it can time the first token and the gaps between chunks), asks for
usage in the last chunk, keeps at most --max-concurrency requests in flight, and spaces arrivals
by a Poisson process of --request-rate (inf: all at once). `--sweep 1 8 32` repeats the run at each
concurrency and adds one table and, with --plot, a PNG of throughput and latency vs concurrency.
Against a jaxserve server it also reads the engine's busy time from /metrics around the timed part
and reports which fraction of the run the engine spent in steps, and in the model itself.
`--structured-output-ratio R` makes that share of the requests ask for JSON (`response_format` with a
schema whose output outlasts max_tokens, so constrained and free requests generate as many tokens); a
jaxserve server then also says how long its steps spent computing the grammars' token masks.
A server that speculates (jaxserve's or vLLM's spec_decode counters on /metrics) gets its acceptance
rate, mean acceptance length and per-position acceptance over the timed part reported too;
`--dataset-name grounded` sends prompts whose answers repeat them, the workload that prompt lookup
speeds up (datasets.py). `--lora-modules a b` sends each request to one of those LoRA adapters, picked
at random (seeded), as its `model` (vLLM bench serve's flag); the warm-ups go to each adapter in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time

import numpy as np
from tqdm.auto import tqdm

from jaxserve.bench.datasets import BenchRequest, add_dataset_flags, requests_from_flags
from jaxserve.bench.metrics import RequestResult, format_summary, format_sweep, plot_sweep, server_figures, summarize


def request_body(endpoint: str, model: str, request: BenchRequest, ignore_eos: bool,
                 sampling: dict | None = None) -> dict:
    """One request's JSON: greedy unless `sampling` ({"temperature": ..., "top_p": ..., "top_k": ...}, the
    fields given) says otherwise."""
    body = {"model": model, "max_tokens": request.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}} | (sampling or {})
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; jaxserve has it too
    if request.json_schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "bench", "schema": request.json_schema}}
    if endpoint == "chat":
        return body | {"messages": [{"role": "user", "content": request.prompt}]}
    return body | {"prompt": request.prompt}


async def send_request(client, url: str, body: dict, request: BenchRequest) -> RequestResult:
    """Streams one request; a non-200 answer, an error event or a broken stream makes it a failure."""
    result = RequestResult(prompt_len=request.prompt_len)
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error']}"
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    num_chunks += 1
                    last = now
                elif chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"].get("prompt_tokens", result.prompt_len)
    except Exception as e:  # noqa: BLE001 - a benchmark reports failures rather than dying on the first one
        result.error = f"{type(e).__name__}: {e}"
        return result
    if num_chunks == 0:
        result.error = "the stream ended without any content chunk"
        return result
    result.latency = last - start
    result.output_len = result.output_len or num_chunks
    result.success = True
    return result


def request_models(model: str, lora_modules: list[str] | None, num_requests: int, seed: int,
                   warmup: bool = False) -> list[str]:
    """Each request's `model`: `model`, or with `lora_modules` one of them at random (seeded), or for the
    warm-ups each in turn, so that every adapter is loaded before the timed part."""
    if not lora_modules:
        return [model] * num_requests
    if warmup:
        return [lora_modules[i % len(lora_modules)] for i in range(num_requests)]
    rng = np.random.default_rng([seed, 1])  # not the arrivals' stream: the same picks whatever the request rate
    return [lora_modules[i] for i in rng.integers(len(lora_modules), size=num_requests)]


def constrained(requests: list[BenchRequest], ratio: float) -> list[BenchRequest]:
    """`requests` with an even share `ratio` of them asking for JSON: an array of output_len integers,
    more tokens than max_tokens lets them write, so they run as long as the free ones."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"--structured-output-ratio must be in [0, 1], got {ratio}")
    out = []
    for i, request in enumerate(requests):
        if int((i + 1) * ratio) > int(i * ratio):
            schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                      "minItems": request.output_len, "maxItems": request.output_len}
            request = dataclasses.replace(request, json_schema=schema)
        out.append(request)
    return out


async def scrape_metrics(client, base_url: str) -> dict[tuple[str, tuple], float] | None:
    """Every sample of the server's /metrics, keyed by (sample name, sorted label items); None when it
    has no Prometheus /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(response.text) for sample in family.samples}
    except ValueError:  # not Prometheus' text format
        return None


async def run_once(base_url: str, endpoint: str, model: str, requests: list[BenchRequest], *,
                   max_concurrency: int | None, request_rate: float, ignore_eos: bool, seed: int,
                   warmups: list[BenchRequest] = (), api_key: str | None = None,
                   progress: bool = True, lora_modules: list[str] | None = None,
                   sampling: dict | None = None) -> tuple[list, float, dict]:
    """Sends every request (to `model`, or with `lora_modules` to those adapters: `request_models`); returns (results in dataset order, wall seconds from first send to last answer,
    what the server's /metrics says of those seconds: the engine's busy fractions if it is jaxserve, the
    speculative decoding figures if it speculates; empty otherwise)."""
    import httpx

    url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    semaphore = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, headers=headers) as client:
        async def limited(request: BenchRequest, request_model: str) -> RequestResult:
            async with semaphore:
                body = request_body(endpoint, request_model, request, ignore_eos, sampling)
                return await send_request(client, url, body, request)

        if warmups:
            warm = await asyncio.gather(*map(limited, warmups, request_models(model, lora_modules, len(warmups),
                                                                              seed, warmup=True)))
            if not any(r.success for r in warm):
                raise RuntimeError(f"every warm-up request failed; the first: {warm[0].error}")

        rng = np.random.default_rng(seed)
        bar = tqdm(total=len(requests), desc=f"benchmark (concurrency {max_concurrency or 'inf'})", unit="req",
                   disable=not progress)

        async def tracked(request: BenchRequest, request_model: str) -> RequestResult:
            result = await limited(request, request_model)
            bar.update(1)
            return result

        metrics_before = await scrape_metrics(client, base_url)
        start = time.perf_counter()
        tasks = []
        for request, request_model in zip(requests, request_models(model, lora_modules, len(requests), seed)):
            tasks.append(asyncio.create_task(tracked(request, request_model)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        metrics_after = await scrape_metrics(client, base_url) if metrics_before is not None else None
    if metrics_after is None:
        return results, duration, {}
    return results, duration, server_figures(metrics_before, metrics_after, duration)


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model id that /v1/models lists."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot read the served model from {base_url}/v1/models ({e}); pass --model") from None


def build_requests(args: argparse.Namespace) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(timed requests, warm-up requests). Generated warm-ups are other prompts than the timed ones, so a
    server's prefix cache cannot serve a timed prompt from the warm-up."""
    from jaxserve.weights import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset_path:
        requests = constrained(requests_from_flags(args, tokenizer, args.num_prompts), args.structured_output_ratio)
        return requests, [requests[i % len(requests)] for i in range(args.num_warmups)]
    requests = requests_from_flags(args, tokenizer, args.num_prompts + args.num_warmups)
    requests = constrained(requests, args.structured_output_ratio)
    return requests[:args.num_prompts], requests[args.num_prompts:]


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark (or the sweep) the flags describe; prints tables, writes --out and --plot."""
    if args.plot and not args.sweep:
        raise ValueError("--plot needs --sweep (it plots throughput and latency against concurrency)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'jaxserve[bench]'")
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model = args.model or served_model(base_url, api_key)
    requests, warmups = build_requests(args)
    concurrencies = args.sweep or [args.max_concurrency]
    summaries = []
    for concurrency in concurrencies:
        results, duration, engine = asyncio.run(run_once(
            base_url, args.endpoint, model, requests, max_concurrency=concurrency,
            request_rate=args.request_rate, ignore_eos=args.ignore_eos, seed=args.seed,
            warmups=warmups, api_key=api_key, progress=not args.no_progress, lora_modules=args.lora_modules,
            sampling=sampling_fields(args)))
        summary = summarize(results, duration) | engine | {"max_concurrency": concurrency,
                                                             "request_rate": args.request_rate}
        summaries.append(summary)
        print(format_summary(summary, f"{args.label} at concurrency {concurrency or 'inf'}"), flush=True)
    if args.sweep:
        print("\n" + format_sweep({args.label: summaries}))
    report = {"label": args.label, "base_url": base_url, "model": model, "endpoint": args.endpoint,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "range_ratio": args.range_ratio, "random_prefix_len": args.random_prefix_len, "dataset_name": args.dataset_name, "dataset_path": args.dataset_path,
              "structured_output_ratio": args.structured_output_ratio, "lora_modules": args.lora_modules,
              "sampling": {"temperature": 0.0} | sampling_fields(args), "runs": summaries}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot_sweep({args.label: summaries}, args.plot, f"{model}: {args.input_len} in / {args.output_len} out")
        print(f"wrote {args.plot}", file=sys.stderr)
    return report


def sampling_fields(args: argparse.Namespace) -> dict:
    """The sampling fields the flags put in every request: temperature, and top_p and top_k where given."""
    return {"temperature": args.temperature} | {name: value for name, value in
                                                (("top_p", args.top_p), ("top_k", args.top_k)) if value is not None}


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="the server's root URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="LoRA adapters the server serves: each request names one of them, at random, as its "
                             "model (vLLM bench serve's flag)")
    parser.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for the prompts: model dir, GGUF or checkpoint (default: SmolLM2's)")
    add_dataset_flags(parser)
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    parser.add_argument("--sweep", type=int, nargs="+", default=None, metavar="CONCURRENCY",
                        help="run once per concurrency and tabulate them")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="untimed requests sent first (generated datasets: prompts other than the timed ones)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sent with every request (default 0: greedy; vLLM bench serve's flag)")
    parser.add_argument("--top-p", type=float, default=None, help="sent with every request where given")
    parser.add_argument("--top-k", type=int, default=None, help="sent with every request where given")
    parser.add_argument("--structured-output-ratio", type=float, default=0.0,
                        help="share of the requests that ask for JSON with a schema (response_format)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated datasets and of the arrivals")
    parser.add_argument("--label", default="server", help="the engine's name in tables and plots")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="with --sweep: write a PNG plot here")
    parser.add_argument("--no-progress", action="store_true")
