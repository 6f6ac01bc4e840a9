"""`jaxserve serve --data-parallel-size 2`: two tiny-model replicas behind sglang-router, on loopback.

Guards: the OpenAI client (streaming too) gets the same greedy text through the router as from a
replica; both replicas take requests, each pinned to its own cores; a replica killed mid-run fails
only its own in-flight streams, every request after the router has dropped it succeeds, and the
restarted replica serves again; a replica whose engine is stuck (a step blocked by the fault-injection
hook) turns /health 503, is killed and restarted while the router serves on; the API key is on no
child's command line, and the router's worker management needs a key even when the user gave none;
the start-up wait ends when a replica is lost meanwhile; SIGTERM and SIGINT (during start-up too)
leave no process behind. Also the launcher's pure parts, and the Kubernetes manifests in deploy/
against the API's schemas.
"""

from __future__ import annotations

import contextlib
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
from types import SimpleNamespace

import httpx
import pytest
import yaml
from server_helpers import API_KEY, AUTH, REPO_ROOT, TINY_FLAGS, free_port, metric, metric_samples

from jaxserve.distributed import data_parallel
from jaxserve.distributed.data_parallel import Replica, Router, replica_flags, split_cpus
from jaxserve.core.engine_loop import FAULT_HANG_DIR_ENV

pytest.importorskip("sglang_router")

REPLICA_LINE = re.compile(r"replica (\d+): pid (\d+) at (http://\S+)")


class Launcher:
    """`jaxserve serve --data-parallel-size 2` as a user starts it; its stderr is read for the replicas."""

    def __init__(self, extra: list[str], env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="jaxserve-dp-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *extra, "--data-parallel-size", "2",
               "--host", "127.0.0.1", "--port", str(self.port)]
        env = {**{k: v for k, v in os.environ.items() if k != "JAXSERVE_API_KEY"}, **(env or {})}
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
def launcher(tiny_model_dir, tmp_path_factory):
    """The group every test below shares. Its replicas' engines can be made to hang (a file
    hang-<pid> in `launcher.hang_dir`), and their watchdog declares a step stuck after 10 s."""
    hang_dir = tmp_path_factory.mktemp("hang")
    group = Launcher([str(tiny_model_dir("llama")), *TINY_FLAGS, "--engine-iteration-timeout-s", "10"],
                     env={FAULT_HANG_DIR_ENV: str(hang_dir)})
    group.hang_dir = hang_dir
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
    info = httpx.get(url + "/server_info", headers=AUTH, timeout=30).json()
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
    # Kill a replica while one of its streams still waits in its queue: that stream has not begun, so it cannot
    # finish in the moment between reading the metrics and the kill (a running one could, and did once: the
    # replica then held nothing when killed). 8 streams of a whole batch each on 2 replicas: some replica queues.
    while True:
        waiting = {rank: metric(metric_samples(url), "jaxserve:num_requests_waiting") for rank, (_, url) in
                   replicas.items()}
        victim = max(waiting, key=waiting.get)
        if waiting[victim] >= 1:
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
    _wait_until_the_router_drops(launcher, victim_url, "the dead replica")
    for i in range(10):
        response = httpx.post(launcher.url + "/v1/completions", headers=AUTH, timeout=60,
                              json={"model": "tiny", "prompt": f"after {i} {i * 31}", "max_tokens": 4})
        assert response.status_code == 200, response.text

    launcher.wait_for(rf"replica {victim} is healthy again", timeout_s=120)
    new_pid, url = launcher.replicas()[victim]
    assert new_pid != victim_pid and url == victim_url
    assert _served_by_all(launcher.url, [url], "back"), \
        f"the restarted replica gets no requests:\n{launcher.text()[-3000:]}"


def _wait_until_the_router_drops(launcher, url: str, what: str) -> None:
    """The launcher takes a replica it found dead or stuck out of the router within 10 s."""
    deadline = time.monotonic() + 10
    while any(w["url"] == url for w in
              httpx.get(launcher.url + "/workers", headers=AUTH, timeout=10).json()["workers"]):
        assert time.monotonic() < deadline, f"the router still lists {what}"
        time.sleep(0.1)


def test_a_stuck_replica_turns_unhealthy_is_restarted_and_the_router_serves_on(launcher):
    """A replica's step blocks for good (the fault-injection hook): its watchdog fails the request on it
    and turns its /health 503; the launcher kills and restarts it; the router serves throughout."""
    victim = 1
    victim_pid, victim_url = launcher.replicas()[victim]
    num_rejoined = len(re.findall(rf"replica {victim} is healthy again", launcher.text()))
    hang_file = launcher.hang_dir / f"hang-{victim_pid}"
    hang_file.touch()
    try:
        stuck = httpx.post(victim_url + "/v1/completions", headers=AUTH, timeout=120,
                           json={"model": "tiny", "prompt": "hang here", "max_tokens": 4})
        assert stuck.status_code == 503 and "stuck" in stuck.json()["error"]["message"], stuck.text
        health = httpx.get(victim_url + "/health", timeout=30)
        assert health.status_code == 503 and "stuck" in health.json()["error"]["message"]
        launcher.wait_for(rf"replica {victim} \(pid {victim_pid}\) has not answered /health", timeout_s=120)
        launcher.wait_for(rf"replica {victim} \(pid {victim_pid}\) exited", timeout_s=30)
        _wait_until_the_router_drops(launcher, victim_url, "the stuck replica")
        for i in range(6):
            response = httpx.post(launcher.url + "/v1/completions", headers=AUTH, timeout=60,
                                  json={"model": "tiny", "prompt": f"meanwhile {i}", "max_tokens": 4})
            assert response.status_code == 200, response.text
        launcher.wait_for(rf"replica {victim} is healthy again", timeout_s=180, count=num_rejoined + 1)
    finally:
        hang_file.unlink()
    new_pid, url = launcher.replicas()[victim]
    assert new_pid != victim_pid and url == victim_url and not alive(victim_pid)
    assert _served_by_all(launcher.url, [url], "after the hang"), \
        f"the restarted replica gets no requests:\n{launcher.text()[-3000:]}"


def test_the_api_key_is_on_no_child_command_line(launcher):
    """`ps` shows every command line: the replicas get the key in their environment, the router through
    its entry point's environment; a replica still refuses a request without it."""
    children = launcher.descendants()
    assert len(children) >= 3, children
    for pid in children:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            assert API_KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    replica_pid, replica_url = launcher.replicas()[0]
    assert f"JAXSERVE_API_KEY={API_KEY}".encode() in Path(f"/proc/{replica_pid}/environ").read_bytes().split(b"\0")
    refused = httpx.post(replica_url + "/v1/completions", timeout=30,
                         json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 401


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
            "round_robin", "--enable-lora", "--lora-modules", "a=/adapters/a", "b=/adapters/b",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    args = build_parser().parse_args(argv)
    flags = replica_flags(args, add_serve_flags)
    assert not {"--port", "--host", "-dp", "--data-parallel-size", "--router-policy"} & set(flags), flags
    again = build_parser().parse_args(["serve", *flags])
    for name in ("model", "max_num_seqs", "enable_prefix_caching", "chat_page", "tensor_parallel_size",
                 "enable_lora", "lora_modules", "speculative_config"):
        assert getattr(again, name) == getattr(args, name), name
    assert again.data_parallel_size == 1 and again.port != args.port
    assert "k" not in flags and again.api_key is None  # the key goes through the environment


def _router_args(**overrides) -> SimpleNamespace:
    return SimpleNamespace(**{"host": "127.0.0.1", "port": free_port(), "router_policy": "round_robin",
                              "shutdown_timeout": 1.0, "api_key": None, **overrides})


def test_the_routers_command_line_holds_no_key(monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    router = Router(_router_args(api_key="s3cret-key"), ["http://127.0.0.1:1"])
    assert not [arg for arg in router.cmd if "s3cret-key" in arg], router.cmd
    assert router.env["JAXSERVE_ROUTER_API_KEY"] == "s3cret-key"
    assert router.headers == {"Authorization": "Bearer s3cret-key"}


def test_the_routers_worker_management_needs_a_key_when_the_user_gave_none(monkeypatch):
    """Without --api-key the router's /v1 is open (as one server's is), but listing, adding or removing
    workers needs the launcher's random key: nobody else can point the router at a server of theirs."""
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    router = Router(_router_args(), [f"http://127.0.0.1:{free_port()}"])
    assert router.headers and not [arg for arg in router.cmd if router.env["JAXSERVE_ROUTER_ADMIN_KEY"] in arg]
    router.start()
    try:
        deadline = time.monotonic() + 120
        while True:
            assert router.proc.poll() is None, f"the router exited with {router.proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(router.url + "/workers", headers=router.headers, timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the router never answered"
            time.sleep(0.2)
        assert httpx.get(router.url + "/workers", timeout=5).status_code == 401
        added = httpx.post(router.url + "/workers", json={"url": f"http://127.0.0.1:{free_port()}"}, timeout=5)
        assert added.status_code == 401
        guessed = httpx.get(router.url + "/workers", headers={"Authorization": "Bearer guess"}, timeout=5)
        assert guessed.status_code == 401
    finally:
        router.proc.send_signal(signal.SIGTERM)
        try:
            router.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            router.proc.kill()
            router.proc.wait()


class _RouterListingOne:
    """A started router that only ever lists one healthy worker (the other replica is gone)."""

    url = "http://127.0.0.1:1"

    def __init__(self):
        self.proc = SimpleNamespace(poll=lambda: None)

    def start(self):
        pass

    def workers(self):
        return [{"is_healthy": True}]


def test_the_start_up_wait_ends_when_a_replica_goes_unhealthy_meanwhile(monkeypatch):
    """Both replicas were healthy; then, while the router starts, one stops answering /health with 200:
    the wait ends once it is declared stuck and killed, rather than waiting forever for the router to
    list it."""
    monkeypatch.setattr(data_parallel, "UNHEALTHY_AFTER_S", 1.0)
    replicas = [Replica(rank, [], {}, None) for rank in range(2)]
    for replica in replicas:
        replica.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                        start_new_session=True)
        replica.in_router = True
    answers = {0: iter(lambda: True, None), 1: iter([True])}  # replica 1 answers start-up's check only
    for rank, replica in enumerate(replicas):
        replica.healthy = lambda timeout_s=1.0, rank=rank: next(answers[rank], False)
    signals_seen, returned = [], []
    waiting = threading.Thread(target=lambda: returned.append(data_parallel.start_group(
        replicas, _RouterListingOne(), signals_seen, SimpleNamespace(router_policy="round_robin"))), daemon=True)
    try:
        waiting.start()
        waiting.join(60)
        assert returned == [0], "the start-up wait still waits for a replica that is gone"
        assert replicas[1].proc.poll() is not None and replicas[0].proc.poll() is None
    finally:
        signals_seen.append("stop")  # ends a wait that did not end by itself
        for replica in replicas:
            if replica.proc.poll() is None:
                replica.proc.kill()
            replica.proc.wait()


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
