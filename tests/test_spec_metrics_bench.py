"""Speculative decoding's Prometheus counters, `jaxserve bench serve`'s acceptance figures, and the grounded dataset.

The server's counters come from a stats snapshot built here (the engine loop publishes the same dict),
and the benchmark runs against a stand-in OpenAI server on 127.0.0.1 whose /metrics is rendered by
the real collector (or by vLLM's names, or is missing), so no model is loaded and nothing leaves
the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import byte_tokenizer

from jaxserve.bench import serve, throughput
from jaxserve.bench.datasets import GROUNDED_TEMPLATES, grounded_requests, requests_from_flags
from jaxserve.bench.metrics import format_summary, format_sweep, spec_decode_counters, spec_decode_summary, summarize
from jaxserve.spec_decode.speculative import SpecDecodeStats
from server.metrics import Metrics


def engine_stats(spec_decode: dict | None) -> dict:
    """What `LLMEngine.get_stats()` gives the collector, idle."""
    return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "tensor_parallel_size": 1,
            "device_weight_bytes": 0, "device_kv_cache_bytes": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
            "num_preemptions": 0, "num_steps": 7, "step_seconds": 0.5, "model_seconds": 0.25,
            "phase_seconds": {"grammar": 0.0}, "spec_decode": spec_decode}


def samples_of(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def spec_stats(*observations: tuple[int, int], num_speculative_tokens: int = 4) -> SpecDecodeStats:
    stats = SpecDecodeStats(num_speculative_tokens)
    for num_draft, num_accepted in observations:
        stats.observe(num_draft, num_accepted)
    return stats


# -- the server's counters -----------------------------------------------------------------------------


def test_spec_decode_counters_carry_the_engines_numbers_with_vllms_names():
    """Each counter is the snapshot's value; per position is one labelled series per draft position, from 0."""
    spec = spec_stats((4, 4), (4, 2), (3, 0), (4, 1)).as_dict()
    assert spec["num_accepted_tokens_per_pos"] == [3, 2, 1, 1]
    samples = samples_of(Metrics(SimpleNamespace(stats=engine_stats(spec))).render().decode())
    assert samples[("jaxserve:spec_decode_num_drafts_total", ())] == 4
    assert samples[("jaxserve:spec_decode_num_draft_tokens_total", ())] == 15
    assert samples[("jaxserve:spec_decode_num_accepted_tokens_total", ())] == 7
    per_pos = {dict(labels)["position"]: value for (name, labels), value in samples.items()
               if name == "jaxserve:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 3, "1": 2, "2": 1, "3": 1}
    assert samples[("jaxserve:engine_steps_total", ())] == 7  # the other engine counters are still there


@pytest.mark.parametrize("stats", [engine_stats(None), {k: v for k, v in engine_stats(None).items()
                                                        if k != "spec_decode"}], ids=["off", "absent"])
def test_no_spec_decode_series_when_the_engine_does_not_speculate(stats):
    text = Metrics(SimpleNamespace(stats=stats)).render().decode()
    assert "spec_decode" not in text and "jaxserve:engine_steps_total 7.0" in text


# -- the benchmark's figures ---------------------------------------------------------------------------


def test_acceptance_figures_follow_vllms_definitions_over_the_run_only():
    """Rate = accepted / draft tokens; mean length = 1 + accepted / drafts; per position = accepted there /
    drafts; what was counted before the run is subtracted."""
    before = spec_stats((4, 4), (4, 4)).as_dict()
    after = spec_stats((4, 4), (4, 4), (4, 3), (4, 1), (2, 2), (4, 0)).as_dict()
    spec = spec_decode_summary(before, after)
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (4, 14, 6)
    assert spec["acceptance_rate"] == pytest.approx(6 / 14)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert spec["num_accepted_tokens_per_pos"] == [3, 2, 1, 0]
    assert spec["acceptance_rate_per_pos"] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    table = format_summary(summarize([], 1.0) | {"spec_decode": spec})
    assert "| speculative decoding: acceptance rate | 42.9% |" in table
    assert "| speculative decoding: mean acceptance length | 2.50 |" in table
    assert "| speculative decoding: acceptance rate per position | 75.0% / 50.0% / 25.0% / 0.0% |" in table
    assert "| speculative decoding: drafts / draft tokens / accepted tokens | 4 / 14 / 6 |" in table


def test_a_run_without_drafts_reports_no_rate_instead_of_dividing_by_zero():
    spec = spec_decode_summary(spec_stats((4, 2)).as_dict(), spec_stats((4, 2)).as_dict())
    assert spec["num_drafts"] == 0
    assert math.isnan(spec["acceptance_rate"]) and math.isnan(spec["mean_acceptance_length"])
    table = format_summary(summarize([], 1.0) | {"spec_decode": spec})
    assert "| speculative decoding: acceptance rate | n/a |" in table


def test_the_benchmark_reads_back_what_the_server_renders():
    """The server's exposition parsed by the benchmark gives the engine's own dict back."""
    spec = spec_stats((4, 4), (4, 2), (1, 1)).as_dict()
    text = Metrics(SimpleNamespace(stats=engine_stats(spec))).render().decode()
    assert spec_decode_counters(samples_of(text)) == spec
    assert spec_decode_counters(samples_of(Metrics(SimpleNamespace(stats=engine_stats(None))).render()
                                                 .decode())) is None


def vllm_metrics_text(spec_by_engine: list[dict]) -> str:
    """vLLM's exposition: the same counters under `vllm:`, labelled by model and engine, with `_created` samples."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    counters = {name: Counter(f"vllm:spec_decode_{name}", name, labels, registry=registry)
                for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos", labels + ["position"],
                      registry=registry)
    for engine, spec in enumerate(spec_by_engine):
        for name, counter in counters.items():
            counter.labels("m", str(engine)).inc(spec[name])
        for position, value in enumerate(spec["num_accepted_tokens_per_pos"]):
            per_pos.labels("m", str(engine), str(position)).inc(value)
    return generate_latest(registry).decode()


def test_vllm_counters_are_read_and_summed_over_its_engines():
    a, b = spec_stats((4, 4), (4, 1)).as_dict(), spec_stats((4, 2)).as_dict()
    assert spec_decode_counters(samples_of(vllm_metrics_text([a, b]))) == {
        "num_drafts": 3, "num_draft_tokens": 12, "num_accepted_tokens": 7,
        "num_accepted_tokens_per_pos": [3, 2, 1, 1]}


def test_sweep_table_gains_acceptance_columns_only_with_speculation():
    row = summarize([], 1.0) | {"max_concurrency": 1}
    spec = spec_decode_summary(spec_stats().as_dict(), spec_stats((4, 2)).as_dict())
    assert "acceptance" not in format_sweep({"a": [row]})
    table = format_sweep({"a": [row | {"spec_decode": spec}], "b": [row]}).splitlines()
    assert table[0].endswith("| acceptance rate | mean acceptance length |")
    assert table[2].endswith("| 50.0% | 3.00 |") and table[3].endswith("| - | - |")


# -- the grounded dataset --------------------------------------------------------------------------------


def test_grounded_prompts_include_the_text_they_ask_for_and_differ():
    """Every prompt is an instruction around a text (so the answer repeats the prompt), about input_len tokens,
    different from every other prompt (a prefix cache cannot serve one from another), and the seed fixes them."""
    tokenizer = byte_tokenizer()
    requests = grounded_requests(tokenizer, 60, input_len=400, output_len=32, seed=5)
    assert requests == grounded_requests(tokenizer, 60, input_len=400, output_len=32, seed=5)
    assert requests != grounded_requests(tokenizer, 60, input_len=400, output_len=32, seed=6)
    assert len({r.prompt for r in requests}) == 60
    texts = set()
    for r in requests:
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert 300 <= r.prompt_len <= 500 and r.output_len == 32
        template = next(t for t in GROUNDED_TEMPLATES if r.prompt.startswith(t.split("{text}")[0]))
        head, tail = template.split("{text}")
        assert r.prompt.endswith(tail)
        text = r.prompt[len(head):-len(tail)]
        assert text.endswith(".") and text.count(". ") >= 2
        texts.add(text)
    assert len(texts) == 60
    assert len({r.prompt.split("\n")[0] for r in requests}) == len(GROUNDED_TEMPLATES)  # every instruction is used
    long = grounded_requests(tokenizer, 3, input_len=4000, output_len=8, range_ratio=0.1, seed=0)
    assert all(3500 <= r.prompt_len <= 4500 for r in long)  # longer than the sentence list: it cycles


def test_grounded_dataset_refuses_more_prompts_than_it_has_different_ones():
    with pytest.raises(ValueError, match="different prompts"):
        grounded_requests(byte_tokenizer(), 500, input_len=1, output_len=4)


def dataset_args(parser_flags, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser_flags(parser)
    args = parser.parse_args(list(argv))
    args.seed = getattr(args, "seed", 0)
    return args


@pytest.mark.parametrize("add_flags", [serve.add_flags, throughput.add_flags], ids=["serve", "throughput"])
def test_both_benchmarks_take_the_dataset_flags(add_flags, tmp_path):
    tokenizer = byte_tokenizer()
    args = dataset_args(add_flags, "--dataset-name", "grounded", "--input-len", "200", "--output-len", "9")
    requests = requests_from_flags(args, tokenizer, 4)
    assert requests == grounded_requests(tokenizer, 4, 200, 9, seed=0)
    assert dataset_args(add_flags).dataset_name == "random"
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    assert [r.prompt for r in requests_from_flags(dataset_args(add_flags, "--dataset-path", str(path)), tokenizer, 2)
            ] == ["hi", "hi"]
    with pytest.raises(ValueError, match="exclude each other"):
        requests_from_flags(dataset_args(add_flags, "--dataset-path", str(path), "--dataset-name", "grounded"),
                            tokenizer, 2)


# -- `jaxserve bench serve` against a stand-in server ------------------------------------------------------


class FakeServer:
    """An OpenAI server that streams two chunks per request and, per request, counts two drafts of 4 tokens
    (3 and 1 accepted) into its /metrics, rendered as `kind` says."""

    def __init__(self, kind: str):
        self.kind = kind
        self.spec = SpecDecodeStats(4)
        self.bodies = []
        self.lock = threading.Lock()

    def metrics_text(self) -> str | None:
        if self.kind == "vllm":
            return vllm_metrics_text([self.spec.as_dict()])
        if self.kind == "no-metrics":
            return None
        spec = self.spec.as_dict() if self.kind == "jaxserve" else None
        return Metrics(SimpleNamespace(stats=engine_stats(spec))).render().decode()

    def handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, body: bytes, content_type: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                text = fake.metrics_text() if self.path == "/metrics" else None
                if text is None:
                    self.reply(404, b'{"detail": "Not Found"}')
                else:
                    self.reply(200, text.encode(), "text/plain; version=0.0.4")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append((self.path, body))
                    fake.spec.observe(4, 3)
                    fake.spec.observe(4, 1)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                delta = {"delta": {"content": "x"}} if self.path.endswith("chat/completions") else {"text": "x"}
                for chunk in ({"choices": [delta]}, {"choices": [delta]},
                              {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2}}):
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        return Handler


@contextlib.contextmanager
def fake_server(kind: str):
    fake = FakeServer(kind)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        fake.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        yield fake
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("byte_tokenizer")
    byte_tokenizer().save_pretrained(directory)
    return directory


def bench_serve(url: str, tokenizer_dir, out, *flags: str) -> dict:
    parser = argparse.ArgumentParser()
    serve.add_flags(parser)
    return serve.run(parser.parse_args(["--base-url", url, "--model", "m", "--tokenizer", str(tokenizer_dir),
                                        "--num-prompts", "5", "--num-warmups", "2", "--input-len", "200",
                                        "--output-len", "2", "--out", str(out), "--no-progress", *flags]))


@pytest.mark.parametrize("kind", ["jaxserve", "vllm"])
def test_bench_serve_reports_the_acceptance_of_the_timed_requests(kind, tokenizer_dir, tmp_path, capsys):
    """Counted over the 5 timed requests only (the 2 warm-ups' drafts are left out), printed and in --out."""
    out = tmp_path / "spec.json"
    with fake_server(kind) as fake:
        bench_serve(fake.url, tokenizer_dir, out, "--dataset-name", "grounded", "--max-concurrency", "2")
    assert len(fake.bodies) == 7
    (run,) = json.loads(out.read_text())["runs"]
    assert run["completed"] == 5
    assert run["spec_decode"] == {
        "num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 20,
        "num_accepted_tokens_per_pos": [10, 5, 5, 0],
        "acceptance_rate": 0.5, "mean_acceptance_length": 3.0, "acceptance_rate_per_pos": [1.0, 0.5, 0.5, 0.0]}
    printed = capsys.readouterr().out
    assert "| speculative decoding: acceptance rate | 50.0% |" in printed
    assert "| speculative decoding: mean acceptance length | 3.00 |" in printed
    assert "| speculative decoding: acceptance rate per position | 100.0% / 50.0% / 50.0% / 0.0% |" in printed
    assert "| speculative decoding: drafts / draft tokens / accepted tokens | 10 / 40 / 20 |" in printed


@pytest.mark.parametrize("kind", ["jaxserve-off", "no-metrics"])
def test_bench_serve_says_nothing_of_speculation_when_the_server_has_no_counters(kind, tokenizer_dir, tmp_path,
                                                                                capsys):
    out = tmp_path / "plain.json"
    with fake_server(kind) as fake:
        bench_serve(fake.url, tokenizer_dir, out)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["completed"] == 5 and "spec_decode" not in run
    printed = capsys.readouterr().out
    assert "speculative" not in printed
    assert ("jaxserve engine busy" in printed) == (kind == "jaxserve-off")  # the other /metrics figures still work


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_sends_the_grounded_prompts_on_either_endpoint(endpoint, tokenizer_dir, tmp_path):
    """Seven different prompts (warm-ups included) arrive as the prompt or as the user message."""
    out = tmp_path / "grounded.json"
    with fake_server("no-metrics") as fake:
        bench_serve(fake.url, tokenizer_dir, out, "--dataset-name", "grounded", "--endpoint", endpoint)
    prompts = [body["messages"][0]["content"] if endpoint == "chat" else body["prompt"] for _, body in fake.bodies]
    want = [r.prompt for r in grounded_requests(byte_tokenizer(), 7, 200, 2, seed=0)]
    assert sorted(prompts) == sorted(want) and len(set(prompts)) == 7
    assert {path for path, _ in fake.bodies} == {"/v1/chat/completions" if endpoint == "chat" else "/v1/completions"}
    report = json.loads(out.read_text())
    assert report["dataset_name"] == "grounded"
