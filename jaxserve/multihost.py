"""Serving across hosts: `jax.distributed` joins the processes, the leader's steps reach the followers.

`jaxserve serve --nnodes N --node-rank R --dist-init-addr HOST:PORT -tp T` runs on every host (vLLM's
and SGLang's flags). Each process calls `jax.distributed.initialize`, after which every process sees
every device, and the tensor-parallel mesh spans them all (T devices in all, T / N on each host).
Rank 0, the leader, runs everything a single host runs: the HTTP server, the scheduler, the engine.
Every other rank, a follower, holds its devices' slices of the weights and KV pages, compiles the same
executables, and runs each step the leader runs, on the same inputs, at the same time: the step's
collectives need every process to take part.

How a step reaches the followers: before launching it, the leader sends its bucket and its host
arrays (the `StepInputs` numpy arrays, a few kilobytes to a few megabytes) over a TCP connection to
each follower, at the coordinator's host and port + 1. Not a JAX collective: a follower does not know
the next step's bucket, so its shapes, until told, which would take a second exchange and a compiled
broadcast per bucket; and a peer that dies turns a collective into a hang, where a socket's end is
seen at once.

Failures: when a follower's connection ends (the process died), the leader's engine loop is failed:
every open stream ends with an error and `/health` answers 503 (a step already waiting in a
collective for the dead follower stays blocked in its thread; no request waits on it). When the
leader's connection ends (it stopped or died), each follower exits.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import struct
import threading
from typing import Callable

import jax

from jaxserve.engine_config import EngineConfig

logger = logging.getLogger(__name__)
_HEADER = struct.Struct("!Q")  # the length of each pickled message


def initialize(cfg: EngineConfig) -> None:
    """Joins this process to the others (nothing for one node); before any other JAX work, so that each
    host's CPU devices can still be asked for. On a CPU each host gives tp / nnodes devices."""
    if cfg.nnodes == 1:
        return
    from jaxserve.tensor_parallel import request_cpu_devices

    request_cpu_devices(cfg.tensor_parallel_size // cfg.nnodes)
    logger.info("joining %d processes at %s as rank %d", cfg.nnodes, cfg.dist_init_addr, cfg.node_rank)
    jax.distributed.initialize(coordinator_address=cfg.dist_init_addr, num_processes=cfg.nnodes,
                               process_id=cfg.node_rank)


def _step_address(cfg: EngineConfig) -> tuple[str, int]:
    host, port = cfg.dist_init_addr.rsplit(":", 1)
    return host, int(port) + 1


def _send(conn: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(_HEADER.pack(len(data)) + data)


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = conn.recv(min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _recv(conn: socket.socket):
    """The next message, or None when the other side has gone."""
    header = _recv_exactly(conn, _HEADER.size)
    if header is None:
        return None
    data = _recv_exactly(conn, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


class Leader:
    """Rank 0's side: accepts every follower's connection, sends each step's inputs to all of them, and
    calls `on_follower_lost` (from a watcher thread) if one goes away."""

    def __init__(self, cfg: EngineConfig, timeout_s: float = 600.0):
        self.followers: dict[int, socket.socket] = {}
        self.on_follower_lost: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._closing = False
        with socket.create_server(_step_address(cfg), reuse_port=False) as server:
            server.settimeout(timeout_s)
            while len(self.followers) < cfg.nnodes - 1:
                conn, _ = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                rank = _recv(conn)
                self.followers[rank] = conn
                logger.info("follower rank %d connected", rank)
        for rank, conn in self.followers.items():
            threading.Thread(target=self._watch, args=(rank, conn), name=f"jaxserve-follower-{rank}",
                             daemon=True).start()

    def send_step(self, kind: str, bucket: int, inputs) -> None:
        """Sends one step to every follower; raises ConnectionError if one has gone."""
        with self._lock:
            for rank, conn in self.followers.items():
                try:
                    _send(conn, (kind, bucket, inputs))
                except OSError as e:
                    raise ConnectionError(f"follower rank {rank} is gone: {e}") from e

    def _watch(self, rank: int, conn: socket.socket) -> None:
        """Followers never send after connecting: the connection's end means the follower's."""
        try:
            conn.recv(1)
        except OSError:
            pass
        if self._closing:
            return
        message = f"follower rank {rank} of the multi-host group has gone; serving stopped"
        logger.error(message)
        if self.on_follower_lost is not None:
            self.on_follower_lost(message)

    def close(self) -> None:
        """Ends every follower's connection (the followers then exit)."""
        self._closing = True
        for conn in self.followers.values():
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv; close alone would not
            conn.close()


def connect_to_leader(cfg: EngineConfig, timeout_s: float = 600.0) -> socket.socket:
    """A follower's connection to the leader's step channel (waiting for the leader to listen)."""
    deadline = timeout_s
    while True:
        try:
            conn = socket.create_connection(_step_address(cfg), timeout=5)
            break
        except OSError:
            deadline -= 1
            if deadline <= 0:
                raise
            threading.Event().wait(1)
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send(conn, cfg.node_rank)
    return conn


def follow(runner, conn: socket.socket) -> int:
    """A follower's life after warm-up: runs every step the leader sends, until the leader goes.
    Returns the number of steps run."""
    num_steps = 0
    while (message := _recv(conn)) is not None:
        kind, bucket, inputs = message
        jax.block_until_ready(runner.launch(kind, bucket, inputs))
        num_steps += 1
    logger.info("the leader has gone after %d steps; stopping", num_steps)
    return num_steps


def run_follower(model, cfg: EngineConfig, show_progress: bool = True) -> None:
    """A follower rank's whole life: load the model, place its slices, compile every bucket as the
    leader does, connect, and run the leader's steps until it goes."""
    import sys

    from jaxserve.model_runner import ModelRunner
    from jaxserve.weights import load_model

    loaded = load_model(model, cfg.dtype, lazy=True)  # only this process's slices are read
    runner = ModelRunner(loaded.config, cfg, loaded.params)
    runner.warmup(show_progress)
    print(f"jaxserve: follower rank {cfg.node_rank} ready ({runner.describe_weights_read()}); connecting to the "
          f"leader", file=sys.stderr, flush=True)
    with connect_to_leader(cfg) as conn:
        follow(runner, conn)
