"""Starting a real `jaxserve serve` subprocess for HTTP tests, and small helpers to read its replies.

The server runs as its own process on a free 127.0.0.1 port, exactly as a user would start it, so the
tests cover argument parsing, warm-up, uvicorn and the shutdown path too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parent.parent
API_KEY = "testkey"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Flags shared by the servers of several test modules, so their executables come from one compile cache.
TINY_FLAGS = ["--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "8",
              "--num-kv-pages", "96", "--served-model-name", "tiny", "--api-key", API_KEY]
# Two running + two queued requests, and room for long generations.
SMALL_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--block-size", "8",
               "--num-kv-pages", "160", "--served-model-name", "tiny", "--api-key", API_KEY,
               "--max-queued-requests", "2"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, num_chars: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-num_chars:]
    except OSError as e:
        return f"<cannot read the server's stderr: {e}>"


class ServerProcess:
    """A running server: `url` (http://127.0.0.1:PORT), `proc` (the Popen) and `stderr_tail()`."""

    def __init__(self, url: str, proc: subprocess.Popen, stderr_path: str):
        self.url, self.proc, self.stderr_path = url, proc, stderr_path

    def stderr_tail(self, num_chars: int = 4000) -> str:
        return _tail(self.stderr_path, num_chars)


@contextlib.contextmanager
def run_server(args: list[str], *, startup_timeout_s: float = 300.0) -> Iterator[ServerProcess]:
    """Starts `jaxserve serve ARGS --port <free>`, waits for /health == 200, yields; SIGINT (then kill) on exit."""
    port = free_port()
    env = dict(os.environ)
    if "JAXSERVE_COMPILATION_CACHE" in os.environ:
        env["JAXSERVE_COMPILATION_CACHE"] = os.environ["JAXSERVE_COMPILATION_CACHE"]
    env.pop("JAXSERVE_API_KEY", None)  # only --api-key decides, so the tests know which key is in force
    stderr_file = tempfile.NamedTemporaryFile("w+b", prefix="jaxserve-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr_file)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"`jaxserve serve` exited with {proc.returncode} before it was healthy:\n"
                                     f"{' '.join(cmd)}\n{_tail(stderr_file.name)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"`jaxserve serve` not healthy after {startup_timeout_s:.0f} s:\n"
                                     f"{' '.join(cmd)}\n{_tail(stderr_file.name)}")
            time.sleep(0.5)
        yield ServerProcess(url, proc, stderr_file.name)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        stderr_file.close()
        with contextlib.suppress(OSError):
            os.unlink(stderr_file.name)


def parse_sse(lines: Iterator[str]) -> tuple[list[dict], bool]:
    """SSE `data:` payloads of a stream as JSON, and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            break
        events.append(json.loads(payload))
    return events, done


def metric_samples(url: str, client: httpx.Client | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of GET /metrics (with the tests' API key, which a server without one ignores), keyed by
    (sample name, sorted label items)."""
    response = (client.get(url + "/metrics", headers=AUTH) if client is not None
                else httpx.get(url + "/metrics", headers=AUTH, timeout=30.0))
    assert response.status_code == 200, response.text
    text = response.text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    """One sample's value (0 when absent, as a counter that has not been touched yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
