"""`jaxserve serve --data-parallel-size N`: N replicas of the server behind sglang-router, one command.

Each replica is a plain `jaxserve serve` process on a private 127.0.0.1 port with its own share of
the machine: on a CPU a contiguous share of the cores this process may run on (its affinity, set before
the child starts, which XLA's CPU thread pools should follow), on GPUs its own `-tp` devices through CUDA_VISIBLE_DEVICES.
The router (the `router` extra, `sglang-router`) listens on the public --host/--port and spreads
requests with a cache-aware policy by default. This module owns starting, watching and stopping
them; what a replica serves to the router (/health, /server_info, the router's extra request fields)
is `server/app.py`'s.

Failover: a replica that exits is removed from the router at once (the router's own health checks
would take seconds, and its retries go back to the same dead replica), restarted on the same port
with a growing back-off, and added again when its /health answers 200. A replica whose /health stops
answering 200 for `UNHEALTHY_AFTER_S` (its engine declared stuck by the step watchdog, or the whole
process wedged) is killed, its process group at once, and then restarted the same way. Requests in
flight on it end with an error (the router cuts their connections); the others never see it.

The API key never appears on a command line (`ps` shows those to every user): the replicas get it as
JAXSERVE_API_KEY, the router through the environment of a small entry point (`ROUTER_MAIN`) that puts
it into sglang-router's arguments in-process, as sglang-router 0.3.2 reads no key from the environment
itself. Its worker-management endpoints (/workers: list, add, remove) always need a key: the user's,
or else a random one only the launcher knows, so that nobody who can reach the router's port can
point it at a server of theirs.

Stopping: the first SIGTERM/SIGINT is passed on once to the router and every replica, which drain
(up to --shutdown-timeout) and exit; a second one kills them. The children run in their own session,
so a terminal's Ctrl-C reaches only this process (a replica that got it twice would stop at once),
and the kernel sends each of them SIGTERM if this process dies without stopping them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
POLL_S = 0.2
MAX_BACKOFF_S = 30.0
HEALTH_POLL_S = 1.0  # how often a replica in the router has its /health polled
# A replica is killed after this long without a 200 from /health (and at least 3 polls): long enough
# that a loaded machine's slow answers never take a healthy replica out.
UNHEALTHY_AFTER_S = 10.0
# Flags that describe the group rather than one replica; the launcher sets host and port itself, and
# passes the API key through the environment.
LAUNCHER_DESTS = {"data_parallel_size", "router_policy", "host", "port", "func", "command", "api_key"}
# sglang-router's own `python -m sglang_router.launch_router`, with the keys from the environment (then
# dropped from it) set in its arguments in-process: no key on its command line.
ROUTER_MAIN = """import os, sys
from sglang_router.launch_router import launch_router, parse_router_args
args = parse_router_args(sys.argv[1:])
args.api_key = os.environ.pop("JAXSERVE_ROUTER_API_KEY", None)
args.control_plane_api_keys = [("jaxserve", "jaxserve launcher", os.environ.pop("JAXSERVE_ROUTER_ADMIN_KEY"), "admin")]
launch_router(args)
"""


def log(message: str) -> None:
    print(f"jaxserve: {message}", file=sys.stderr, flush=True)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_flags(args: argparse.Namespace, add_serve_flags) -> list[str]:
    """The `serve` flags of `args` that differ from their defaults, as a command line for one replica.
    `add_serve_flags`: server/main.py's, passed in so that this module does not import the server."""
    from jaxserve.config.engine_config import add_engine_flags

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_flags(parser, positional_model=True)
    add_serve_flags(parser)
    flags = ["-v"] if getattr(args, "verbose", False) else []
    for action in parser._actions:  # argparse keeps its declarations here; there is no public accessor
        if action.dest in LAUNCHER_DESTS or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if not action.option_strings:  # the positional model
            flags.append(str(value))
        elif isinstance(action, argparse.BooleanOptionalAction):
            flags.append(next(o for o in action.option_strings if o.startswith("--no-") != bool(value)))
        elif action.nargs == 0:  # store_true / store_false
            flags.append(action.option_strings[-1])
        elif isinstance(value, list):  # a flag of several values (--lora-modules a=... b=...)
            flags += [action.option_strings[-1], *map(str, value)]
        elif dataclasses.is_dataclass(value):  # parsed from JSON (--speculative-config): JSON again
            flags += [action.option_strings[-1], json.dumps(dataclasses.asdict(value))]
        else:
            flags += [action.option_strings[-1], str(value)]
    return flags


def split_cpus(cpus: list[int], num_replicas: int) -> list[list[int]]:
    """Contiguous shares of `cpus`, as even as they come; with fewer cores than replicas, they share."""
    cpus = sorted(cpus)
    if len(cpus) < num_replicas:
        return [[cpus[i % len(cpus)]] for i in range(num_replicas)]
    return [cpus[i * len(cpus) // num_replicas:(i + 1) * len(cpus) // num_replicas] for i in range(num_replicas)]


def visible_gpus() -> list[str]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES, else what nvidia-smi lists), without starting
    JAX here: a backend started in the launcher would hold memory the replicas need."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]
    return []


def replica_placements(num_replicas: int, tensor_parallel_size: int) -> list[tuple[dict, list[int] | None]]:
    """For each replica: the environment it adds, and the cores it is pinned to (None: not pinned)."""
    gpus = visible_gpus()
    if gpus:
        needed = num_replicas * tensor_parallel_size
        if needed > len(gpus):
            raise ValueError(f"--data-parallel-size {num_replicas} x -tp {tensor_parallel_size} needs {needed} "
                             f"GPUs; {len(gpus)} are visible ({','.join(gpus)})")
        return [({"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tensor_parallel_size:(i + 1) * tensor_parallel_size])},
                 None) for i in range(num_replicas)]
    return [({}, share) for share in split_cpus(list(os.sched_getaffinity(0)), num_replicas)]


def _child_setup(cpus: list[int] | None):
    """Runs in the child between fork and exec: its cores, and SIGTERM when the launcher dies."""
    libc = ctypes.CDLL(None, use_errno=True)

    def setup():
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    return setup


class Replica:
    def __init__(self, rank: int, flags: list[str], env: dict, cpus: list[int] | None, api_key: str | None = None):
        self.rank, self.flags, self.env, self.cpus, self.api_key = rank, flags, env, cpus, api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.in_router = False
        self.backoff_s = 1.0
        self.restart_at: float | None = None
        self.next_health_poll = 0.0
        self.failing_since: float | None = None  # the first of the current run of failed /health polls
        self.num_failed_polls = 0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *self.flags, "--host", "127.0.0.1",
               "--port", str(self.port)]
        env = {**os.environ, **self.env, **({"JAXSERVE_API_KEY": self.api_key} if self.api_key else {})}
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_child_setup(self.cpus))
        self.failing_since, self.num_failed_polls = None, 0
        placed = f"cores {self.cpus}" if self.cpus is not None else ", ".join(f"{k}={v}" for k, v in self.env.items())
        log(f"replica {self.rank}: pid {self.proc.pid} at {self.url} ({placed or 'unpinned'})")

    def healthy(self, timeout_s: float = 1.0) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(self.url + "/health", timeout=timeout_s).status_code == 200
        return False

    def stuck(self, now: float) -> bool:
        """Polls /health (at most every HEALTH_POLL_S); True once it has failed for UNHEALTHY_AFTER_S."""
        if now < self.next_health_poll:
            return False
        self.next_health_poll = now + HEALTH_POLL_S
        if self.healthy(timeout_s=2.0):
            self.failing_since, self.num_failed_polls = None, 0
            return False
        self.failing_since = self.failing_since or now
        self.num_failed_polls += 1
        return self.num_failed_polls >= 3 and now - self.failing_since >= UNHEALTHY_AFTER_S

    def kill(self) -> None:
        """SIGKILL to its whole process group (it runs in its own session), then reaps it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Router:
    """sglang-router's process, and the calls that change its workers."""

    def __init__(self, args: argparse.Namespace, worker_urls: list[str]):
        self.url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        self.cmd = [sys.executable, "-c", ROUTER_MAIN, "--host", args.host, "--port", str(args.port),
                    "--worker-urls", *worker_urls, "--policy", args.router_policy,
                    # The router balances by in-flight requests only past this gap (64 by default): more
                    # than a replica's batch here, so one replica could queue while the other idles.
                    "--balance-abs-threshold", "4",
                    # Quick health checks take out a replica that hangs; one that exits, the launcher takes out.
                    "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                    "--health-success-threshold", "1", "--health-check-timeout-secs", "5",
                    # Its circuit breaker, opened by the requests that failed on a dead replica, would keep
                    # the restarted one (same URL) out for a minute; exits and hangs are handled as above.
                    "--disable-circuit-breaker",
                    "--shutdown-grace-period-secs", str(int(args.shutdown_timeout) + 5),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
        api_key = args.api_key or os.environ.get("JAXSERVE_API_KEY")
        # With a key the router asks clients for it and sends it to the replicas; without one, /v1 is open
        # as a single server's is, but /workers still needs the launcher's random key.
        admin_key = api_key or secrets.token_urlsafe(32)
        self.env = {"JAXSERVE_ROUTER_ADMIN_KEY": admin_key, **({"JAXSERVE_ROUTER_API_KEY": api_key} if api_key else {})}
        self.headers = {"Authorization": f"Bearer {admin_key}"}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, start_new_session=True,
                                     preexec_fn=_child_setup(None))

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/workers", headers=self.headers, timeout=5.0).json()["workers"]

    def add(self, url: str) -> None:
        httpx.post(self.url + "/workers", json={"url": url}, headers=self.headers, timeout=5.0).raise_for_status()

    def remove(self, url: str) -> None:
        for worker in self.workers():
            if worker["url"] == url:
                httpx.delete(f"{self.url}/workers/{worker['id']}", headers=self.headers,
                             timeout=5.0).raise_for_status()


def check_router_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("--data-parallel-size needs sglang-router: pip install 'jaxserve[router]'")


def serve_data_parallel(args: argparse.Namespace, add_serve_flags) -> None:
    """Starts the replicas, then the router in front of them; watches both until a signal stops them."""
    check_router_installed()
    if args.nnodes > 1:
        raise ValueError("--data-parallel-size runs replicas on this host; for multi-host groups start each "
                         "group's leader yourself and point a router at them (docs/deploy.md)")
    flags = replica_flags(args, add_serve_flags)
    api_key = args.api_key or os.environ.get("JAXSERVE_API_KEY")
    replicas = [Replica(rank, flags, env, cpus, api_key) for rank, (env, cpus) in
                enumerate(replica_placements(args.data_parallel_size, args.tensor_parallel_size))]
    router = Router(args, [r.url for r in replicas])
    signals_seen = []
    previous = {sig: signal.signal(sig, lambda sig, _: signals_seen.append(sig)) for sig in (signal.SIGTERM,
                                                                                            signal.SIGINT)}
    children = lambda: [p for p in [router.proc] + [r.proc for r in replicas] if p is not None]  # noqa: E731
    code = 0
    try:
        for replica in replicas:
            replica.start()
        code = start_group(replicas, router, signals_seen, args)
        if code == 0:
            code = _watch(replicas, router, signals_seen)
    finally:
        _stop(children(), signals_seen, args.shutdown_timeout + 10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code:
        sys.exit(code)


def start_group(replicas: list[Replica], router: Router, signals_seen: list, args) -> int:
    """Waits for every replica's /health, then starts the router and waits until it lists them all, or
    until a replica exits or turns unhealthy meanwhile (then `_watch` restarts it)."""
    pending = list(replicas)
    while pending and not signals_seen:
        for replica in list(pending):
            if replica.proc.poll() is not None:
                log(f"error: replica {replica.rank} exited with code {replica.proc.returncode} before it was "
                    f"healthy; stopping")
                return 1
            if replica.healthy():
                replica.in_router = True
                pending.remove(replica)
        time.sleep(POLL_S)
    if signals_seen:
        return 0
    router.start()
    while not signals_seen:
        if router.proc.poll() is not None:
            log(f"error: sglang-router exited with code {router.proc.returncode} at start; stopping")
            return 1
        if any(_lost(replica, time.monotonic()) for replica in replicas):
            log(f"sglang-router started at {router.url}/v1 before every replica was in it")
            break
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if sum(w["is_healthy"] for w in router.workers()) == len(replicas):
                log(f"{len(replicas)} replicas behind sglang-router ({args.router_policy}) at {router.url}/v1")
                break
        time.sleep(POLL_S)
    return 0


def _watch(replicas: list[Replica], router: Router, signals_seen: list) -> int:
    """Until a signal: takes out and restarts replicas that exit, adds them back once healthy."""
    while not signals_seen:
        if router.proc.poll() is not None:
            log(f"error: sglang-router exited with code {router.proc.returncode}; stopping the replicas")
            return 1
        now = time.monotonic()
        for replica in replicas:
            _lost(replica, now)
            if replica.restart_at is None and replica.proc.poll() is not None:
                log(f"replica {replica.rank} (pid {replica.proc.pid}) exited with code {replica.proc.returncode}; "
                    f"taking it out of the router and restarting it in {replica.backoff_s:.0f} s")
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    router.remove(replica.url)
                replica.in_router = False
                replica.restart_at = now + replica.backoff_s
                replica.backoff_s = min(2 * replica.backoff_s, MAX_BACKOFF_S)
            elif replica.restart_at is not None and now >= replica.restart_at:
                replica.restart_at = None
                replica.start()
            elif not replica.in_router and replica.restart_at is None and replica.healthy():
                with contextlib.suppress(httpx.HTTPError):
                    router.add(replica.url)
                    replica.in_router = True
                    replica.backoff_s = 1.0
                    log(f"replica {replica.rank} is healthy again; back in the router")
        time.sleep(POLL_S)
    return 0


def _lost(replica: Replica, now: float) -> bool:
    """Whether a replica that was serving has exited, or is stuck (then killed here, so it has exited)."""
    if replica.restart_at is not None or replica.proc.poll() is not None:
        return replica.restart_at is None
    if replica.in_router and replica.stuck(now):
        log(f"replica {replica.rank} (pid {replica.proc.pid}) has not answered /health with 200 for "
            f"{now - replica.failing_since:.0f} s; killing it")
        replica.kill()
        return True
    return False


def _stop(procs: list[subprocess.Popen], signals_seen: list, timeout_s: float) -> None:
    """SIGTERM to every child at once (each drains), SIGKILL after `timeout_s` or at a second signal."""
    num_signals = len(signals_seen)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and len(signals_seen) <= max(
            num_signals, 1):
        time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
