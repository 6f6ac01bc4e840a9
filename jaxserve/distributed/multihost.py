"""Serving across hosts: `jax.distributed` joins the processes, the leader's steps reach the followers.

`jaxserve serve --nnodes N --node-rank R --dist-init-addr HOST:PORT -tp T` runs on every host (vLLM's
and SGLang's flags). Each process calls `jax.distributed.initialize`, after which every process sees
every device, and the tensor-parallel mesh spans them all (T devices in all, T / N on each host).
Rank 0, the leader, runs everything a single host runs: the HTTP server, the scheduler, the engine.
Every other rank, a follower, holds its devices' slices of the weights and KV pages, compiles the same
executables, and runs each step the leader runs, on the same inputs, at the same time: the step's
collectives need every process to take part.

How a step reaches the followers: before launching it, the leader sends its kind, bucket and host
arrays (the `StepInputs` numpy arrays, a few kilobytes to a few megabytes) over a TCP connection to
each follower, at HOST:PORT + 1, listening on the address HOST resolves to, not on every interface.
Not a JAX collective: a follower does not know the next step's bucket, so its shapes, until told,
which would take a second exchange and a compiled broadcast per bucket; and a peer that dies turns a
collective into a hang, where a socket's end is seen at once. The bytes on that connection, a fixed
binary schema with no pickle, are `step_channel.py`'s; this module owns who may connect:

- Every rank is given the group's shared secret: `JAXSERVE_MULTIHOST_SECRET`, or a file named by
  `JAXSERVE_MULTIHOST_SECRET_FILE`. A group without one refuses to start unless `--insecure-multihost`
  says so (the handshake then runs with an empty key: fingerprints are still checked, but anyone who
  reaches PORT + 1 during start-up could join). The secret authenticates connections; it does not
  encrypt them, and the JAX coordinator at PORT has no authentication of its own: keep both ports on a
  network only the group's hosts reach.
- Each connection is handshaken in its own thread, each message under a timeout: the leader's random
  challenge; the follower's rank, nonce, fingerprint (model, dtypes, KV pages, buckets, backends, jax
  and jaxserve versions) and HMAC; the leader checks the HMAC (a wrong secret is refused and logged with
  the claimed rank and the peer's address), the fingerprint (a mismatch is refused naming each
  differing field), that the rank is in [1, nnodes) and has not joined, and answers with its own HMAC,
  which the follower checks (it takes no steps from a process without the secret either). A rank's
  slot is taken only by a connection that passed, so a probe that connects and stays silent, connects
  and closes, or sends garbage, neither holds up start-up nor takes a follower's place. Once every
  follower has joined the leader stops listening.
- TCP keepalive (and TCP_USER_TIMEOUT on Linux) on both ends, so that a network partition ends the
  leader's watcher and the follower's wait within about a minute instead of never.

Why plain TCP with `step_channel`'s framing rather than ZeroMQ: the rules above are about connections
(one per rank, authenticated before it counts, its peer's address in the log, its end failing the
engine at once). A ZeroMQ ROUTER hides connections behind routing ids: a peer's disconnect reaches the
application only through a socket monitor (whose events name file descriptors, not routing ids) or
ROUTER_NOTIFY, draft API absent from pyzmq's wheels; a DEALER reconnects by itself after a drop,
silently losing the steps in between, where a follower must stop; and the handshake's per-connection
state would be rebuilt by hand on top. The framing is one fixed header and length-checked fields,
parsed in one place, every cap enforced before reading.

Failures: when a follower's connection ends (the process died, or keepalive gave up on it), the
leader's engine is failed through `on_follower_lost`: the server's engine loop ends every open stream
with an error and `/health` answers 503; the offline `LLM` raises in `generate` (a step already
waiting in a collective for the dead follower stays blocked in its thread). A loss that happens before
a handler is set is kept and handed to the handler as soon as it is set. When the leader's connection
ends (it stopped or died), each follower exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib.metadata
import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Callable

import jax
import numpy as np

from jaxserve.distributed import step_channel as wire
from jaxserve.config.engine_config import EngineConfig
from jaxserve.distributed.step_channel import ChannelError
from jaxserve.log import STARTUP

logger = logging.getLogger(__name__)

SECRET_ENV = "JAXSERVE_MULTIHOST_SECRET"
SECRET_FILE_ENV = "JAXSERVE_MULTIHOST_SECRET_FILE"
# Seconds a rank may send the JAX coordinator no heartbeat (its process stopped, or starved of the CPU)
# before the coordinator ends the whole group; jax.distributed's own default unless set.
HEARTBEAT_TIMEOUT_ENV = "JAXSERVE_MULTIHOST_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
INSECURE_FLAG = "--insecure-multihost"
MIN_SECRET_BYTES = 16

HANDSHAKE_TIMEOUT_S = 10.0  # each handshake message must arrive within this
MAX_PENDING_HANDSHAKES = 32  # connections being handshaken at once; more are closed at once
# An idle connection is probed after 10 s, every 5 s: 3 unanswered probes end it (~25 s), except on Linux,
# where TCP_USER_TIMEOUT decides instead: 60 s without an acknowledgement, of a probe or of sent data. Not
# shorter: older kernels count a full receive window too, which a follower busy in a long step can leave.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
USER_TIMEOUT_S = 60


class MissingSecret(ValueError):
    """A multi-host group was started without a shared secret and without --insecure-multihost."""


# -- the shared secret --------------------------------------------------------------------------------


def load_secret(cfg: EngineConfig, environ=os.environ) -> bytes:
    """The group's shared secret from the environment (b"" for one node, or with insecure_multihost and
    none given); raises MissingSecret naming the variables and the flag when there is none."""
    if cfg.nnodes == 1:
        return b""
    value, path = environ.get(SECRET_ENV, ""), environ.get(SECRET_FILE_ENV, "")
    if value and path:
        raise ValueError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: give the multi-host secret one way")
    secret = value.strip().encode()
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read(64 * 1024).strip()
        except OSError as e:
            raise ValueError(f"cannot read the multi-host secret from {SECRET_FILE_ENV}={path!r}: {e}") from None
        if not secret:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r} is empty")
    if secret:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the multi-host secret ({SECRET_FILE_ENV if path else SECRET_ENV}) has {len(secret)} "
                             f"bytes; it needs at least {MIN_SECRET_BYTES} (for example `openssl rand -hex 32`)")
        return secret
    if cfg.insecure_multihost:
        return b""
    raise MissingSecret(
        f"a multi-host group (--nnodes {cfg.nnodes}) needs a shared secret for its step channel: set {SECRET_ENV} "
        f"(or {SECRET_FILE_ENV}, a file holding it) to the same value on every rank, for example from "
        f"`openssl rand -hex 32`; or pass {INSECURE_FLAG} (insecure_multihost=True) on every rank to run "
        f"without one on a network nobody else reaches")


# -- joining the processes --------------------------------------------------------------------------------


def initialize(cfg: EngineConfig) -> None:
    """Joins this process to the others (nothing for one node); before any other JAX work, and after this
    host's CPU devices were asked for (on a CPU each host gives tp / nnodes: `LLMEngine.from_config` asks).
    Checks the shared secret first, so that a group without one fails before loading anything."""
    if cfg.nnodes == 1:
        return
    if not load_secret(cfg):
        STARTUP.warning(f"warning: the multi-host step channel runs without a shared secret ({INSECURE_FLAG}): "
                        f"anyone who reaches {cfg.dist_init_addr.rsplit(':', 1)[0]}:{_step_address(cfg)[1]} during "
                        f"start-up could join the group")
    warn_if_loopback(cfg)
    logger.debug("joining %d processes at %s as rank %d", cfg.nnodes, cfg.dist_init_addr, cfg.node_rank)
    jax.distributed.initialize(coordinator_address=cfg.dist_init_addr, num_processes=cfg.nnodes,
                               process_id=cfg.node_rank, heartbeat_timeout_seconds=heartbeat_timeout_s())


def heartbeat_timeout_s() -> int:
    """HEARTBEAT_TIMEOUT_ENV's whole number of seconds (DEFAULT_HEARTBEAT_TIMEOUT_S unset); ValueError naming
    the variable for anything but a positive integer."""
    value = os.environ.get(HEARTBEAT_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_HEARTBEAT_TIMEOUT_S
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{HEARTBEAT_TIMEOUT_ENV}={value!r}: give a positive whole number of seconds")
    return int(value)


def _step_address(cfg: EngineConfig) -> tuple[str, int]:
    host, port = cfg.dist_init_addr.rsplit(":", 1)
    return host.removeprefix("[").removesuffix("]"), int(port) + 1


def _resolve(host: str, port: int) -> list[tuple]:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)


def loopback_address(host: str) -> str | None:
    """The loopback address `host` resolves to, if every address it resolves to is one (None if it
    resolves elsewhere or not at all)."""
    try:
        addresses = {info[4][0] for info in _resolve(host, 0)}
    except OSError:
        return None
    loopback = sorted(a for a in addresses if ipaddress.ip_address(a.split("%")[0]).is_loopback)
    return loopback[0] if loopback and len(loopback) == len(addresses) else None


def warn_if_loopback(cfg: EngineConfig) -> str | None:
    """Prints a warning when --dist-init-addr's host resolves to a loopback address here, which only
    processes on this machine reach; returns the warning."""
    host = _step_address(cfg)[0]
    address = loopback_address(host)
    if address is None:
        return None
    message = (f"warning: --dist-init-addr host {host!r} resolves to {address}, a loopback address: only "
               f"processes on this machine can reach the leader there, not other hosts (Debian's /etc/hosts maps "
               f"a machine's own name to 127.0.1.1). Across hosts give an address, or a name, that the other "
               f"hosts reach rank 0 at.")
    STARTUP.warning("%s", message)
    return message


# -- the handshake ----------------------------------------------------------------------------------------


def _tune(conn: socket.socket) -> None:
    wire.tune_socket(conn, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT, USER_TIMEOUT_S)


def _version() -> str:
    try:
        return importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def fingerprint(runner) -> dict[str, str]:
    """What must be equal on every rank for the ranks' steps to fit together, as text: the model, the
    resolved settings that shape the compiled steps and the KV pool, and the software."""
    cfg, model = runner.cfg, runner.model_cfg
    digest = hashlib.sha256(repr(model).encode()).hexdigest()[:16]
    return {
        "model": f"{model.architecture}, {model.num_layers} layers, hidden {model.hidden_size}, vocab "
                 f"{model.vocab_size} (config {digest})",
        "dtype": str(cfg.dtype), "kv_cache_dtype": str(cfg.kv_cache_dtype),
        "kv_pages": str(runner.num_pages), "block_size": str(cfg.page_size),
        "max_model_len": str(cfg.max_model_len), "max_num_seqs": str(cfg.max_num_seqs),
        "max_num_batched_tokens": str(cfg.max_num_batched_tokens),
        "prefill_buckets": str(list(runner.prefill_buckets)), "decode_buckets": str(list(runner.decode_buckets)),
        "tensor_parallel_size": str(cfg.tensor_parallel_size), "nnodes": str(cfg.nnodes),
        "attention_backend": str(runner.attention_backend), "matmul_backend": str(runner.matmul_backend),
        "platform": str(runner.platform), "jax": jax.__version__, "jaxserve": _version(),
    }


class _Refused(Exception):
    """A handshake the leader refuses: `reason` for its log, `told` for the peer, the rank it claimed."""

    def __init__(self, rank: int, reason: str, told: str):
        super().__init__(reason)
        self.rank, self.told = rank, told


class Leader:
    """Rank 0's side: accepts one authenticated connection per follower rank, sends each step's inputs
    to all of them, and calls `on_follower_lost` (from a watcher thread) if one goes away — or at once
    when it is set, if one went away before."""

    def __init__(self, cfg: EngineConfig, fingerprint: dict[str, str], *, secret: bytes | None = None,
                 timeout_s: float = 600.0, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S):
        """Waits until every follower rank has joined (TimeoutError after timeout_s). secret: the group's
        (default: from the environment, `load_secret`)."""
        self.cfg, self.fingerprint = cfg, dict(fingerprint)
        self.secret = load_secret(cfg) if secret is None else secret
        self.handshake_timeout_s = handshake_timeout_s
        self.followers: dict[int, socket.socket] = {}
        self.addresses: dict[int, str] = {}
        self.refusals: list[str] = []  # every refused connection, as logged (for tests and debugging)
        self._on_follower_lost: Callable[[str], None] | None = None
        self._lost: str | None = None
        self._lock = threading.Lock()  # followers, handler and loss
        self._send_lock = threading.Lock()
        self._closing = False
        self._joining = True
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        wanted = set(range(1, cfg.nnodes))
        with self._listen() as server:
            server.settimeout(0.2)
            deadline = time.monotonic() + timeout_s
            while True:
                with self._lock:
                    joined, lost = set(self.followers), self._lost
                    if joined == wanted:
                        self._joining = False
                        break
                if lost is not None:
                    self._joining = False
                    self.close()
                    raise ConnectionError(f"{lost} while the group was starting")
                if time.monotonic() > deadline:
                    self._joining = False
                    self.close()
                    raise TimeoutError(f"follower rank(s) {sorted(wanted - joined)} did not join the leader at "
                                       f"{server.getsockname()[0]}:{server.getsockname()[1]} within {timeout_s:.0f} s")
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                if not self._pending.acquire(blocking=False):
                    self._refuse_log(f"refused a step-channel connection from {wire.peer_name(conn)}: "
                                     f"{MAX_PENDING_HANDSHAKES} handshakes already under way")
                    conn.close()
                    continue
                threading.Thread(target=self._admit, args=(conn,), name="jaxserve-step-handshake",
                                 daemon=True).start()

    def _listen(self) -> socket.socket:
        """A listening socket at --dist-init-addr's host (its first address this host can bind), PORT + 1."""
        host, port = _step_address(self.cfg)
        errors = []
        try:
            addresses = _resolve(host, port)
        except OSError as e:
            raise OSError(f"the leader cannot resolve --dist-init-addr's host {host!r}: {e}") from None
        for family, _, _, _, address in addresses:
            try:
                return socket.create_server(address, family=family, reuse_port=False)
            except OSError as e:
                errors.append(f"{address[0]}: {e}")
        raise OSError(f"the leader cannot listen for its followers at {host}:{port} ({'; '.join(errors)}): "
                      f"--dist-init-addr must name rank 0's host as the other hosts reach it")

    # -- one connection's handshake (its own thread) --

    def _admit(self, conn: socket.socket) -> None:
        peer = wire.peer_name(conn)
        try:
            _tune(conn)
            conn.settimeout(self.handshake_timeout_s)
            self._handshake(conn, peer)
        except _Refused as e:
            self._refuse_log(f"refused follower rank {e.rank} from {peer}: {e}")
            with contextlib.suppress(OSError):
                conn.sendall(wire.frame(wire.REFUSE, e.told.encode()[:wire.MAX_REFUSAL_BYTES]))
            conn.close()
        except (TimeoutError, socket.timeout):
            self._refuse_log(f"refused a step-channel connection from {peer}: no handshake within "
                             f"{self.handshake_timeout_s:.0f} s")
            conn.close()
        except (ChannelError, OSError) as e:
            self._refuse_log(f"refused a step-channel connection from {peer}: {e}")
            conn.close()
        finally:
            self._pending.release()

    def _handshake(self, conn: socket.socket, peer: str) -> None:
        leader_nonce = os.urandom(wire.NONCE_BYTES)
        try:
            conn.sendall(wire.frame(wire.CHALLENGE, leader_nonce))
            message = wire.recv_frame(conn, {wire.HELLO: wire.MAX_HELLO_BYTES})
        except (ConnectionResetError, BrokenPipeError):
            # A peer that closes with the challenge unread in its socket resets the connection rather than
            # closing it (which of the two depends on whether the challenge reached it first): the same event.
            message = None
        if message is None:
            raise ChannelError("it closed before the handshake")
        body = bytes(message[1])
        if len(body) < wire.HELLO_HEADER.size:
            raise ChannelError(f"a hello of {len(body)} bytes is too short")
        rank, follower_nonce, mac = wire.HELLO_HEADER.unpack_from(body)
        fp_bytes = body[wire.HELLO_HEADER.size:]
        expected = wire.handshake_mac(self.secret, b"follower", leader_nonce, follower_nonce, rank, fp_bytes)
        if not hmac.compare_digest(mac, expected):
            hint = " (this leader runs without one: --insecure-multihost)" if not self.secret else ""
            raise _Refused(rank, f"wrong secret (its {SECRET_ENV} differs from the leader's{hint})",
                           f"authentication failed: this follower's {SECRET_ENV} is not the leader's")
        fp = wire.decode_fingerprint(fp_bytes)
        if differences := wire.fingerprint_differences(self.fingerprint, fp):
            raise _Refused(rank, f"its fingerprint differs: {'; '.join(differences)}",
                           f"the follower's fingerprint differs from the leader's: {'; '.join(differences)}")
        if not 1 <= rank < self.cfg.nnodes:
            raise _Refused(rank, f"rank {rank} is not a follower rank of --nnodes {self.cfg.nnodes}",
                           f"rank {rank} is not in [1, {self.cfg.nnodes})")
        with self._lock:
            if not self._joining:
                raise _Refused(rank, "the group has already started", "the group has already started")
            if rank in self.followers:
                raise _Refused(rank, f"rank {rank} has already joined from {self.addresses[rank]}",
                               f"rank {rank} has already joined")
            proof = wire.handshake_mac(self.secret, b"leader", leader_nonce, follower_nonce, rank, fp_bytes)
            conn.sendall(wire.frame(wire.WELCOME, proof))
            conn.settimeout(None)
            self.followers[rank], self.addresses[rank] = conn, peer
        logger.info("follower rank %d joined from %s", rank, peer)
        threading.Thread(target=self._watch, args=(rank, conn, peer), name=f"jaxserve-follower-{rank}",
                         daemon=True).start()

    def _refuse_log(self, message: str) -> None:
        logger.warning("step channel: %s", message)
        self.refusals.append(message)

    # -- serving --

    @property
    def on_follower_lost(self) -> Callable[[str], None] | None:
        return self._on_follower_lost

    @on_follower_lost.setter
    def on_follower_lost(self, handler: Callable[[str], None] | None) -> None:
        """Set from another thread than the watchers': a loss already seen is handed to it at once."""
        with self._lock:
            self._on_follower_lost, lost = handler, self._lost
        if handler is not None and lost is not None:
            handler(lost)

    @property
    def lost(self) -> str | None:
        """Why the group broke (a follower gone), or None."""
        return self._lost

    def send_step(self, kind: str, bucket: int, inputs) -> None:
        """Sends one step to every follower; raises ConnectionError if one has gone."""
        if self._lost is not None:
            raise ConnectionError(self._lost)
        frame = wire.encode_step(kind, bucket, inputs)
        with self._send_lock:
            for rank, conn in self.followers.items():
                try:
                    conn.sendall(frame)
                except OSError as e:
                    raise ConnectionError(f"follower rank {rank} is gone: {e}") from e

    def _watch(self, rank: int, conn: socket.socket, peer: str) -> None:
        """Followers never send after the handshake: the connection's end means the follower's."""
        try:
            data = conn.recv(1)
            why = "sent data on the step channel, which followers never do" if data else "closed its connection"
        except OSError as e:
            why = f"its connection failed: {e}"
        if self._closing:
            return
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        message = f"follower rank {rank} ({peer}) of the multi-host group has gone ({why}); serving stopped"
        logger.error(message)
        with self._lock:
            if self._lost is None:
                self._lost = message
            handler = self._on_follower_lost
        if handler is not None:
            handler(message)

    def close(self) -> None:
        """Ends every follower's connection (the followers then exit)."""
        self._closing = True
        with self._lock:
            conns = list(self.followers.values())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv; close alone would not
            conn.close()


# -- the follower's side --------------------------------------------------------------------------------------


class FollowerChannel:
    """A follower's authenticated connection to the leader: `recv_step` gives each step."""

    def __init__(self, conn: socket.socket, address: str, max_step_bytes: int = wire.MAX_STEP_BYTES):
        self.conn, self.address, self.max_step_bytes = conn, address, max_step_bytes

    def recv_step(self) -> tuple[str, int, dict[str, np.ndarray]] | None:
        """The next step as (kind, bucket, {name: array}), or None when the leader has closed the channel."""
        message = wire.recv_frame(self.conn, {wire.STEP: self.max_step_bytes})
        return None if message is None else wire.decode_step(message[1])

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "FollowerChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _follower_handshake(conn: socket.socket, cfg: EngineConfig, fp: dict[str, str], secret: bytes,
                        address: str) -> None:
    message = wire.recv_frame(conn, {wire.CHALLENGE: wire.NONCE_BYTES})
    if message is None or len(message[1]) != wire.NONCE_BYTES:
        raise EOFError("the leader closed the connection before its challenge")
    leader_nonce, follower_nonce = bytes(message[1]), os.urandom(wire.NONCE_BYTES)
    fp_bytes = wire.encode_fingerprint(fp)
    mac = wire.handshake_mac(secret, b"follower", leader_nonce, follower_nonce, cfg.node_rank, fp_bytes)
    conn.sendall(wire.frame(wire.HELLO, wire.HELLO_HEADER.pack(cfg.node_rank, follower_nonce, mac) + fp_bytes))
    message = wire.recv_frame(conn, {wire.WELCOME: wire.MAC_BYTES, wire.REFUSE: wire.MAX_REFUSAL_BYTES})
    if message is None:
        raise EOFError("the leader closed the connection during the handshake")
    kind, body = message
    if kind == wire.REFUSE:
        raise ChannelError(f"the leader at {address} refused rank {cfg.node_rank}: "
                           f"{bytes(body).decode('utf-8', 'replace')}")
    expected = wire.handshake_mac(secret, b"leader", leader_nonce, follower_nonce, cfg.node_rank, fp_bytes)
    if not hmac.compare_digest(bytes(body), expected):
        raise ChannelError(f"the step channel at {address} did not prove the shared secret ({SECRET_ENV}): "
                           f"not this group's leader")


def connect_to_leader(cfg: EngineConfig, fingerprint: dict[str, str], *, secret: bytes | None = None,
                      timeout_s: float = 600.0, handshake_timeout_s: float = 30.0,
                      max_step_bytes: int = wire.MAX_STEP_BYTES) -> FollowerChannel:
    """A follower's authenticated connection to the leader's step channel, waiting (up to timeout_s) for
    the leader to listen. ChannelError when the leader refuses it, or what answers is not a jaxserve
    leader holding the secret (no retry: that will not change)."""
    secret = load_secret(cfg) if secret is None else secret
    host, port = _step_address(cfg)
    address = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        conn = None
        try:
            conn = socket.create_connection((host, port), timeout=5)
            _tune(conn)
            conn.settimeout(handshake_timeout_s)
            _follower_handshake(conn, cfg, fingerprint, secret, address)
            conn.settimeout(None)
            return FollowerChannel(conn, address, max_step_bytes)
        except ChannelError:
            if conn is not None:
                conn.close()
            raise
        except (OSError, EOFError) as e:  # not listening yet, or dropped us while starting: try again
            if conn is not None:
                conn.close()
            if time.monotonic() > deadline:
                raise ConnectionError(f"could not join the leader's step channel at {address} within "
                                      f"{timeout_s:.0f} s: {e}") from e
            time.sleep(1)


def follow(runner, channel: FollowerChannel) -> int:
    """A follower's life after warm-up: runs every step the leader sends, until the leader goes.
    Returns the number of steps run; ChannelError for a step this follower cannot run."""
    num_steps = 0
    while (message := channel.recv_step()) is not None:
        kind, bucket, arrays = message
        wire.check_step(runner, kind, bucket, arrays)
        jax.block_until_ready(runner.launch(kind, bucket, wire.unflatten_step(arrays)))
        num_steps += 1
    logger.info("the leader has gone after %d steps; stopping", num_steps)
    return num_steps


def run_follower(model, cfg: EngineConfig, dtype: str, show_progress: bool = True) -> None:
    """A follower rank's whole life: load the model (in `dtype`, the leader's `resolve_dtype`), place its
    slices, compile every bucket as the leader does, connect, and run the leader's steps until it goes.
    `cfg` is resolved as the leader resolves it (dtype "auto" included), so both choose the same backends."""
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.runner.resolve import resolve_config
    from jaxserve.weights import load_model

    secret = load_secret(cfg)
    loaded = load_model(model, dtype, lazy=True)  # only this process's slices are read
    runner = ModelRunner(loaded.config, resolve_config(cfg, loaded.config, dtype=dtype, source=loaded.source), loaded.params)
    runner.warmup(show_progress)
    STARTUP.info("follower rank %d ready (%s); connecting to the leader", cfg.node_rank, runner.describe_weights_read())
    try:
        channel = connect_to_leader(cfg, fingerprint(runner), secret=secret,
                                    max_step_bytes=wire.max_step_bytes(runner))
        with channel:
            STARTUP.info("follower rank %d joined the leader at %s", cfg.node_rank, channel.address)
            follow(runner, channel)
    except OSError as e:  # refused, or the channel broke (ChannelError, a reset, a keepalive timeout): exit non-zero
        STARTUP.error("follower rank %d: %s", cfg.node_rank, e)
        raise SystemExit(1) from None
