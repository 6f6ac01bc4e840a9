"""`jaxserve serve --data-parallel-size 2`: two tiny-model replicas behind sglang-router, on loopback.

Guards: the OpenAI client (streaming too) gets the same greedy text through the router as from a
replica; both replicas take requests, each pinned to its own cores; a replica killed mid-run fails
only its own in-flight streams, every request after the router has dropped it succeeds, and the
restarted replica serves again; SIGTERM and SIGINT (during start-up too) leave no process behind. Also
the launcher's pure parts, and the Kubernetes manifests in deploy/ against the API's schemas.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from server_helpers import API_KEY, AUTH, REPO_ROOT, TINY_FLAGS, free_port, metric, metric_samples

from jaxserve.data_parallel import replica_flags, split_cpus

pytest.importorskip("sglang_router")

REPLICA_LINE = re.compile(r"replica (\d+): pid (\d+) at (http://\S+)")


class Launcher:
    """`jaxserve serve --data-parallel-size 2` as a user starts it; its stderr is read for the replicas."""

    def __init__(self, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="jaxserve-dp-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *extra, "--data-parallel-size", "2",
               "--host", "127.0.0.1", "--port", str(self.port)]
        env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_API_KEY"}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self.log)

    def text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def replicas(self) -> dict[int, tuple[int, str]]:
        """rank -> (pid, url), the latest start of each."""
        return {int(r): (int(pid), url) for r, pid, url in REPLICA_LINE.findall(self.text())}

    def wait_for(self, pattern: str, timeout_s: float, count: int = 1) -> None:
        deadline = time.monotonic() + timeout_s
        while len(re.findall(pattern, self.text())) < count:
            assert self.proc.poll() is None, f"the launcher exited with {self.proc.returncode}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} after {timeout_s} s:\n{self.text()[-4000:]}"
            time.sleep(0.2)

    def descendants(self) -> set[int]:
        return descendants(self.proc.pid)


def descendants(root: int) -> set[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def launcher(tiny_model_dir):
    group = Launcher([str(tiny_model_dir("llama")), *TINY_FLAGS])
    try:
        group.wait_for(r"2 replicas behind sglang-router", timeout_s=300)
        yield group
    finally:
        if group.proc.poll() is None:
            group.proc.kill()  # a test failed before the stop test: the kernel SIGTERMs the children
            group.proc.wait()
        group.log.close()
        os.unlink(group.log.name)


def test_openai_client_through_the_router(launcher):
    """Completions, chat and streams through the router equal a replica's own greedy output; both
    replicas serve, each on its own cores."""
    from openai import OpenAI

    client = OpenAI(base_url=launcher.url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    replicas = launcher.replicas()
    direct = OpenAI(base_url=replicas[0][1] + "/v1", api_key=API_KEY, max_retries=0)
    for i in range(4):
        prompt = f"{i} conversation number {i * 7919}"
        routed = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert routed.choices[0].text == direct.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    messages = [{"role": "user", "content": "hello there"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    assert _served_by_all(launcher.url, [url for _, url in replicas.values()], "spread"), \
        f"a replica got no request:\n{launcher.text()[-3000:]}"
    cores = [Path(f"/proc/{pid}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
             for pid, _ in replicas.values()]
    if len(os.sched_getaffinity(0)) >= 2:
        assert cores[0] != cores[1], cores


def test_router_fields_accepted_only_at_values_that_change_nothing(launcher):
    """sglang-router adds SGLang's fields to every body; set to change the output they are still a 400."""
    url = launcher.replicas()[0][1]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "no_stop_trim": False, "return_hidden_states": False}
    assert httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
    refused = httpx.post(url + "/v1/completions", json={**body, "no_stop_trim": True}, headers=AUTH, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "no_stop_trim"
    info = httpx.get(url + "/server_info", timeout=30).json()
    assert info["served_model_name"] == "tiny"


def _served_by_all(router_url: str, replica_urls: list[str], tag: str, max_bursts: int = 6) -> bool:
    """Bursts of 8 concurrent requests (each of 8 sequences, a replica's whole batch, so that they overlap)
    until every replica has prompt tokens. sglang-router 0.3.2's cache-aware policy sends most prompts
    without a cached prefix to one replica until the in-flight gap passes the launcher's threshold."""
    statuses = []

    def post(i: int):
        statuses.append(httpx.post(router_url + "/v1/completions", headers=AUTH, timeout=60, json={
            "model": "tiny", "prompt": f"{tag} {i} {i * 7919}", "max_tokens": 50, "n": 8,
            "ignore_eos": True}).status_code)
    for burst in range(max_bursts):
        threads = [threading.Thread(target=post, args=(burst * 8 + i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert statuses == [200] * len(statuses), statuses
        if all(metric(metric_samples(url), "jaxserve:prompt_tokens_total") > 0 for url in replica_urls):
            return True
    return False


def _stream(url: str, prompt: str, max_tokens: int, started: threading.Barrier, results: dict, key) -> None:
    """One streamed completion of 8 sequences (a replica's whole batch: the streams queue, so they outlast
    the tiny model's speed); results[key] = completion tokens, or the error that ended it."""
    waited = False
    try:
        with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "n": 8, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            response.raise_for_status()
            usage = None
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    if not waited:
                        waited = True
                        started.wait()
                    event = json.loads(line[len("data: "):])
                    assert "error" not in event, event
                    usage = (event.get("usage") or {}).get("completion_tokens", usage)
            results[key] = usage
    except (httpx.HTTPError, AssertionError) as e:
        results[key] = e
    finally:
        if not waited:
            started.wait()


def test_killed_replica_fails_its_streams_only_and_rejoins(launcher):
    """SIGKILL a replica while 8 streams run or queue: its streams end in an error, the others finish; once the
    router has dropped it every request succeeds; the restarted replica is back in rotation."""
    replicas = launcher.replicas()
    results, started = {}, threading.Barrier(8)
    threads = [threading.Thread(target=_stream, args=(launcher.url, f"stream {i} {i * 104729}", 100, started,
                                                      results, i)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while True:  # kill a replica while it runs one of the streams and others wait
        running = {rank: metric(metric_samples(url), "jaxserve:num_requests_running") for rank, (_, url) in
                   replicas.items()}
        victim = max(running, key=running.get)
        if running[victim] >= 1 and len(results) <= 4:
            break
        assert time.monotonic() < deadline and len(results) < 4, f"the streams ended before a kill: {results}"
    victim_pid, victim_url = replicas[victim]
    os.kill(victim_pid, signal.SIGKILL)
    for t in threads:
        t.join()
    failed = [r for r in results.values() if isinstance(r, Exception)]
    assert failed, f"no stream was on the killed replica: {results}"
    assert all(r == 8 * 100 for r in results.values() if not isinstance(r, Exception)), results

    launcher.wait_for(rf"replica {victim} \(pid \d+\) exited", timeout_s=10)
    deadline = time.monotonic() + 10
    while any(w["url"] == victim_url for w in
              httpx.get(launcher.url + "/workers", headers=AUTH, timeout=10).json()["workers"]):
        assert time.monotonic() < deadline, "the router still lists the dead replica"
        time.sleep(0.1)
    for i in range(10):
        response = httpx.post(launcher.url + "/v1/completions", headers=AUTH, timeout=60,
                              json={"model": "tiny", "prompt": f"after {i} {i * 31}", "max_tokens": 4})
        assert response.status_code == 200, response.text

    launcher.wait_for(rf"replica {victim} is healthy again", timeout_s=120)
    new_pid, url = launcher.replicas()[victim]
    assert new_pid != victim_pid and url == victim_url
    assert _served_by_all(launcher.url, [url], "back"), \
        f"the restarted replica gets no requests:\n{launcher.text()[-3000:]}"


def test_sigterm_stops_router_and_replicas(launcher):
    children = launcher.descendants()
    assert len(children) >= 3, children  # the router and two replicas
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(timeout=60) == 0, launcher.text()[-4000:]
    assert not [pid for pid in children if alive(pid)], "orphaned processes after SIGTERM"


def test_sigint_during_start_up_leaves_nothing(tiny_model_dir):
    group = Launcher([str(tiny_model_dir("llama")), *TINY_FLAGS])
    try:
        group.wait_for(REPLICA_LINE.pattern, timeout_s=60, count=2)
        children = group.descendants()
        group.proc.send_signal(signal.SIGINT)
        assert group.proc.wait(timeout=60) == 0, group.text()[-4000:]
        assert not [pid for pid in children if alive(pid)], "orphaned processes after SIGINT"
    finally:
        if group.proc.poll() is None:
            group.proc.kill()
        os.unlink(group.log.name)


def test_split_cpus_gives_disjoint_contiguous_shares():
    assert split_cpus([3, 0, 1, 2, 4], 2) == [[0, 1], [2, 3, 4]]
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([5], 3) == [[5], [5], [5]]  # fewer cores than replicas: they share


def test_replica_flags_round_trip_without_the_launcher_flags():
    """A replica gets every serve flag given, none of the group's (port, host, -dp, router policy)."""
    from jaxserve.cli import build_parser
    from server.main import add_serve_flags

    argv = ["serve", "model_dir", "--max-num-seqs", "4", "--no-enable-prefix-caching", "--api-key", "k",
            "--no-chat-page", "-tp", "2", "--port", "9", "--host", "0.0.0.0", "-dp", "3", "--router-policy",
            "round_robin"]
    args = build_parser().parse_args(argv)
    flags = replica_flags(args, add_serve_flags)
    assert not {"--port", "--host", "-dp", "--data-parallel-size", "--router-policy"} & set(flags), flags
    again = build_parser().parse_args(["serve", *flags])
    for name in ("model", "max_num_seqs", "enable_prefix_caching", "api_key", "chat_page", "tensor_parallel_size"):
        assert getattr(again, name) == getattr(args, name), name
    assert again.data_parallel_size == 1 and again.port != args.port


# ---- deploy/: every Kubernetes object validates against the API's schema (shipped by kubernetes-validate)

MANIFESTS = sorted((REPO_ROOT / "deploy").rglob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_deploy_manifests_validate(path):
    import kubernetes_validate

    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no object"
    for doc in docs:
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_deploy_commands_are_jaxserve_flags():
    """The manifests' jaxserve commands parse with today's flags (a renamed flag fails here, not in a pod);
    shell expansions in `sh -c` commands stand in as 1."""
    from jaxserve.cli import build_parser

    commands = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            pod = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []):
                argv = container.get("command", []) + container.get("args", [])
                if argv[:2] == ["sh", "-c"]:
                    argv = shlex.split(re.sub(r"\$\(\(.*?\)\)|\$\(\w+\)|\$\{?\w+\}?", "1", argv[2]))
                    argv = argv[argv.index("jaxserve"):] if "jaxserve" in argv else []
                if argv[:2] == ["jaxserve", "serve"]:
                    commands.append(argv)
    assert len(commands) >= 3, commands  # replicas, a multi-host group's leader and its workers
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv[1:])
        assert args.func.__name__ == "serve"
