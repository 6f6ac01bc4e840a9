"""The multi-host step channel (jaxserve/distributed/multihost.py; its wire format, jaxserve/distributed/step_channel.py) on its
own, in one process over loopback: no pickle on either side, the HMAC handshake, one connection per rank,
probes, fingerprints, the binary step schema, keepalive, the bind address, a loss before the handler is
set, the missing-secret error, and the multi-host manifest's Service and Secret.

The Leader and the follower's channel are driven directly (threads, a fake runner around a real
StepInputBuilder), which takes seconds; tests/test_multihost.py runs two real `jaxserve serve` processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.distributed import multihost
from jaxserve.distributed import step_channel as wire
from jaxserve.config.model_config import ModelConfig, RopeConfig
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.buckets import decode_buckets, prefill_buckets
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.distributed.step_channel import ChannelError
from jaxserve.runner.step_inputs import ScheduledSeq, StepInputBuilder
from server_helpers import REPO_ROOT

SECRET = b"correct horse battery staple 42"
MODEL = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, intermediate_size=128, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0),
                    max_position_embeddings=512, tie_word_embeddings=True, eos_token_ids=(2,))
FINGERPRINT = {"model": "llama, 2 layers (config 0123)", "kv_pages": "33", "dtype": "float32", "jax": "x"}


# -- helpers ------------------------------------------------------------------------------------------------


class Evil:
    """Unpickling this creates `path`: the payload a pickle-reading channel would run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _step_port() -> int:
    """A free port P > 1: the group's coordinator is at P - 1, its step channel at P."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 1:
            return port


def _cfg(nnodes: int = 2, rank: int = 0, host: str = "127.0.0.1", port: int | None = None, **kwargs) -> EngineConfig:
    port = _step_port() if port is None else port
    return EngineConfig(nnodes=nnodes, node_rank=rank, tensor_parallel_size=nnodes,
                        dist_init_addr=f"{host}:{port - 1}", **kwargs)


def _port(cfg: EngineConfig) -> int:
    return int(cfg.dist_init_addr.rsplit(":", 1)[1]) + 1


class LeaderThread:
    """`multihost.Leader(cfg, ...)` built in a thread (it waits for its followers): .leader or .error."""

    def __init__(self, cfg: EngineConfig, fingerprint=FINGERPRINT, **kwargs):
        self.leader = self.error = None
        self.done = threading.Event()
        kwargs.setdefault("secret", SECRET)
        kwargs.setdefault("timeout_s", 30)

        def run():
            try:
                self.leader = multihost.Leader(cfg, fingerprint, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                self.error = e
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()
        _wait_listening(_port(cfg), cfg.dist_init_addr.rsplit(":", 1)[0])

    def result(self, timeout: float = 20) -> multihost.Leader:
        assert self.done.wait(timeout), "the leader is still waiting for followers"
        if self.error is not None:
            raise self.error
        return self.leader


def _wait_listening(port: int, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1) as probe:
            probe.close()
            return
        time.sleep(0.02)
    raise AssertionError(f"nothing listens on {host}:{port}")


def _follower(cfg: EngineConfig, rank: int = 1, fingerprint=FINGERPRINT, secret: bytes = SECRET, **kwargs):
    import dataclasses

    nnodes = max(cfg.nnodes, rank + 1)  # a rank outside the leader's group: claimed by a config of its own
    cfg = dataclasses.replace(cfg, node_rank=rank, nnodes=nnodes, tensor_parallel_size=nnodes)
    return multihost.connect_to_leader(cfg, fingerprint, secret=secret,
                                       timeout_s=kwargs.pop("timeout_s", 10), **kwargs)


def _wait(predicate, timeout: float = 10, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.02)


class FakeRunner:
    """What `follow` and `check_step` use of a ModelRunner, around a real StepInputBuilder; `launch`
    records the steps it is given."""

    def __init__(self):
        self.cfg = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
                                num_kv_pages=32)
        self.inputs = StepInputBuilder(MODEL, self.cfg)
        self.prefill_buckets, self.decode_buckets = prefill_buckets(self.cfg), decode_buckets(self.cfg)
        self.launched = []

    def prepare(self, seqs: list[ScheduledSeq]):
        """ModelRunner.prepare's buckets and layout."""
        num_tokens = sum(len(s.token_ids) for s in seqs)
        if all(len(s.token_ids) == 1 for s in seqs):
            kind, bucket = "decode", next(b for b in self.decode_buckets if b >= len(seqs))
            num_seqs = bucket
        else:
            kind, bucket = "prefill", next(b for b in self.prefill_buckets if b >= num_tokens)
            num_seqs = min(bucket, self.cfg.max_num_seqs)
        return kind, bucket, self.inputs.build(seqs, num_tokens=bucket, num_seqs=num_seqs)

    def launch(self, kind, bucket, inputs):
        self.launched.append((kind, bucket, inputs))


def _prefill_step(runner: FakeRunner):
    seqs = [ScheduledSeq(list(range(5, 16)), 0, [1, 2], SamplingParams(temperature=0.7, top_k=5, seed=3), seed=3,
                         prompt_len=11, history=list(range(5, 16))),
            ScheduledSeq([7, 8, 9], 4, [3], SamplingParams(logit_bias={4: 2.0}), seed=9, prompt_len=7)]
    return runner.prepare(seqs)


def _decode_step(runner: FakeRunner):
    seqs = [ScheduledSeq([11], 12, [1, 2], SamplingParams(), seed=1, req_index=0, write_row=False, write_history=False),
            ScheduledSeq([12], 7, [3], SamplingParams(), seed=2, req_index=1, write_row=False, write_history=False),
            ScheduledSeq([13], 3, [4], SamplingParams(), seed=5, req_index=None)]
    return runner.prepare(seqs)


def _same_inputs(a, b) -> None:
    left, right = wire.flatten_step(a), wire.flatten_step(b)
    assert [name for name, _ in left] == [name for name, _ in right]
    for (name, x), (_, y) in zip(left, right):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a pickled payload ran"


# -- the step schema ----------------------------------------------------------------------------------------


def test_a_step_goes_over_the_wire_and_comes_back_the_same_step():
    runner = FakeRunner()
    for kind, bucket, inputs in (_prefill_step(runner), _decode_step(runner)):
        frame = wire.encode_step(kind, bucket, inputs)
        magic, message_type, size = wire.FRAME.unpack_from(frame)
        assert (magic, message_type, size) == (wire.MAGIC, wire.STEP, len(frame) - wire.FRAME.size)
        got_kind, got_bucket, arrays = wire.decode_step(bytearray(frame[wire.FRAME.size:]))
        assert (got_kind, got_bucket) == (kind, bucket)
        wire.check_step(runner, got_kind, got_bucket, arrays)
        rebuilt = wire.unflatten_step(arrays)
        assert type(rebuilt) is type(inputs) and rebuilt.sampling is None and rebuilt.md.block_tables is None
        _same_inputs(rebuilt, inputs)
        assert all(a.flags.aligned and a.flags.writeable for a in arrays.values())
        assert len(frame) <= wire.max_step_bytes(runner)
    assert _prefill_step(runner)[2].row_updates is not None and "row_updates.sampling.seeds" in arrays


def test_only_allowed_dtypes_and_known_fields_cross():
    runner = FakeRunner()
    kind, bucket, inputs = _decode_step(runner)
    with pytest.raises(TypeError, match="cannot go on the wire"):
        wire.encode_step(kind, bucket, inputs._replace(token_ids=np.array([object()] * bucket, dtype=object)))
    with pytest.raises(ValueError, match="unknown step kind"):
        wire.encode_step("exec", bucket, inputs)
    body = bytearray(wire.encode_step(kind, bucket, inputs)[wire.FRAME.size:])
    # The first array's dtype code, rewritten to one off the allow-list (object arrays have no code at all)
    name_at = 1 + len(kind) + 6
    code_at = name_at + 1 + body[name_at]
    body[code_at] = 99
    with pytest.raises(ChannelError, match="dtype code 99 is not allowed"):
        wire.decode_step(body)
    body = bytearray(wire.encode_step(kind, bucket, inputs)[wire.FRAME.size:])
    body[code_at + 2:code_at + 6] = struct.pack("!I", 0)  # token_ids [0, 2**32 - 1]: no bytes, yet too big
    body[code_at + 1] = 2
    body[code_at + 6:code_at + 6] = struct.pack("!I", 2**32 - 1)
    with pytest.raises(ChannelError, match="has a dimension over"):
        wire.decode_step(body)
    with pytest.raises(ChannelError, match="no field for"):
        wire.unflatten_step({"token_ids": np.zeros(1, np.int32), "os.system": np.zeros(1, np.int32)})


def test_a_step_the_follower_did_not_compile_is_refused():
    runner = FakeRunner()
    kind, bucket, inputs = _decode_step(runner)
    arrays = dict(wire.flatten_step(inputs))
    with pytest.raises(ChannelError, match="has not compiled"):
        wire.check_step(runner, kind, 3, arrays)
    with pytest.raises(ChannelError, match="token_ids is int32\\[5\\], expected int32\\[4\\]"):
        wire.check_step(runner, kind, bucket, {**arrays, "token_ids": np.zeros(5, np.int32)})
    with pytest.raises(ChannelError, match="lacks \\['positions'\\]"):
        wire.check_step(runner, kind, bucket, {k: v for k, v in arrays.items() if k != "positions"})
    with pytest.raises(ChannelError, match="float32"):
        wire.check_step(runner, kind, bucket, {**arrays, "positions": arrays["positions"].astype(np.float32)})


def test_garbled_steps_raise_channel_errors_only(marker):
    """Every truncation and many random byte flips of a real step, and a pickle: ChannelError or a
    well-formed step, never another exception, never code run."""
    runner = FakeRunner()
    body = bytes(wire.encode_step(*_prefill_step(runner))[wire.FRAME.size:])
    for payload in (pickle.dumps(Evil(marker)), pickle.dumps(("prefill", 16, Evil(marker)), protocol=5), b""):
        with pytest.raises(ChannelError):
            wire.decode_step(bytearray(payload))
    for cut in range(0, len(body), max(1, len(body) // 400)):
        with pytest.raises(ChannelError):
            wire.decode_step(bytearray(body[:cut]))
    rng = np.random.default_rng(0)
    for _ in range(1500):
        garbled = bytearray(body)
        for at in rng.integers(0, min(len(body), 600), rng.integers(1, 4)):  # the headers of the first arrays
            garbled[at] = rng.integers(0, 256)
        try:
            wire.unflatten_step(wire.decode_step(garbled)[2])
        except ChannelError:
            pass


# -- the secret -----------------------------------------------------------------------------------------------


def test_a_group_without_a_secret_refuses_to_start_naming_the_variable_and_the_flag(tmp_path):
    cfg = _cfg()
    with pytest.raises(multihost.MissingSecret) as error:
        multihost.load_secret(cfg, environ={})
    assert multihost.SECRET_ENV in str(error.value) and multihost.SECRET_FILE_ENV in str(error.value)
    assert "--insecure-multihost" in str(error.value)
    assert multihost.load_secret(_cfg(insecure_multihost=True), environ={}) == b""
    assert multihost.load_secret(EngineConfig(), environ={}) == b""  # one node needs none
    assert multihost.load_secret(cfg, environ={multihost.SECRET_ENV: SECRET.decode()}) == SECRET
    with pytest.raises(ValueError, match="at least 16"):
        multihost.load_secret(cfg, environ={multihost.SECRET_ENV: "short"})
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    assert multihost.load_secret(cfg, environ={multihost.SECRET_FILE_ENV: str(secret_file)}) == SECRET
    with pytest.raises(ValueError, match="cannot read"):
        multihost.load_secret(cfg, environ={multihost.SECRET_FILE_ENV: str(tmp_path / "none")})


def test_serve_without_a_secret_fails_at_start_up_before_loading_anything():
    env = {k: v for k, v in os.environ.items() if k not in (multihost.SECRET_ENV, multihost.SECRET_FILE_ENV)}
    for rank in ("0", "1"):
        done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "/nonexistent/model", "-tp", "2",
                               "--nnodes", "2", "--node-rank", rank, "--dist-init-addr", "127.0.0.1:1"],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-2000:]
        assert multihost.SECRET_ENV in done.stderr and "--insecure-multihost" in done.stderr, done.stderr[-2000:]


# -- the handshake ------------------------------------------------------------------------------------------


def test_pickled_payloads_to_the_leader_are_refused_logged_and_the_group_serves_on(marker, caplog):
    caplog.set_level(logging.WARNING, logger="jaxserve.distributed.multihost")
    cfg = _cfg()
    started = LeaderThread(cfg)
    port = _port(cfg)
    payload = pickle.dumps(Evil(marker))
    peers = []
    # As the old channel took it (a length-prefixed pickle, nothing read first), and after the challenge.
    for read_challenge in (False, True):
        with socket.create_connection(("127.0.0.1", port)) as attacker:
            peers.append("127.0.0.1:%d" % attacker.getsockname()[1])
            if read_challenge:
                assert attacker.recv(4) == wire.MAGIC
            attacker.sendall(struct.pack("!Q", len(payload)) + payload)
            attacker.settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                while attacker.recv(1 << 16):  # the leader closes it
                    pass
    # A well-formed hello whose fingerprint bytes are a pickle: its MAC is checked first (and fails)
    with socket.create_connection(("127.0.0.1", port)) as attacker:
        peers.append("127.0.0.1:%d" % attacker.getsockname()[1])
        attacker.settimeout(10)
        attacker.recv(wire.FRAME.size + wire.NONCE_BYTES)
        hello = wire.HELLO_HEADER.pack(1, bytes(32), bytes(32)) + payload
        attacker.sendall(wire.frame(wire.HELLO, hello))
        refusal = attacker.recv(4096)
        assert b"authentication failed" in refusal
    with _follower(cfg) as channel:
        leader = started.result()
        for peer in peers:
            assert any(peer in line for line in leader.refusals), (peer, leader.refusals)
            assert peer in caplog.text
        assert "not jaxserve's step-channel protocol" in caplog.text
        assert "wrong secret" in caplog.text
        # The group serves on: steps reach the follower intact; the step port no longer listens.
        runner = FakeRunner()
        for kind, bucket, inputs in (_prefill_step(runner), _decode_step(runner)):
            leader.send_step(kind, bucket, inputs)
            got_kind, got_bucket, arrays = channel.recv_step()
            wire.check_step(runner, got_kind, got_bucket, arrays)
            _same_inputs(wire.unflatten_step(arrays), inputs)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        leader.close()
        assert channel.recv_step() is None  # the leader's end, seen by the follower


def _fake_leader(script) -> tuple[EngineConfig, threading.Thread]:
    """A server at a group's step port that runs script(conn) on the first connection."""
    cfg = _cfg(rank=1)
    server = socket.create_server(("127.0.0.1", _port(cfg)))

    def run():
        with server:
            conn, _ = server.accept()
            with conn:
                script(conn)
                with contextlib.suppress(OSError):
                    conn.recv(1 << 16)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return cfg, thread


@pytest.mark.parametrize("when", ["instead of the challenge", "instead of the welcome", "as a step frame"])
def test_pickled_payloads_to_a_follower_are_refused(marker, when):
    payload = pickle.dumps(Evil(marker))

    def script(conn):
        if when == "instead of the challenge":
            conn.sendall(struct.pack("!Q", len(payload)) + payload)
            return
        conn.sendall(wire.frame(wire.CHALLENGE, os.urandom(32)))
        conn.recv(1 << 16)  # the hello
        if when == "instead of the welcome":
            conn.sendall(payload)
        else:
            conn.sendall(wire.frame(wire.STEP, payload))

    cfg, thread = _fake_leader(script)
    with pytest.raises(ChannelError, match="protocol|got a step where|not jaxserve"):
        _follower(cfg)
    thread.join(10)


def test_a_follower_takes_no_steps_from_a_leader_without_the_secret(marker):
    def script(conn):
        conn.sendall(wire.frame(wire.CHALLENGE, os.urandom(32)))
        conn.recv(1 << 16)
        conn.sendall(wire.frame(wire.WELCOME, bytes(32)))  # a MAC it cannot compute
        conn.sendall(wire.frame(wire.STEP, pickle.dumps(Evil(marker))))

    cfg, thread = _fake_leader(script)
    with pytest.raises(ChannelError, match="did not prove the shared secret"):
        _follower(cfg)
    thread.join(10)


def test_a_follower_with_the_wrong_secret_is_refused_by_rank_and_address(caplog):
    caplog.set_level(logging.WARNING, logger="jaxserve.distributed.multihost")
    cfg = _cfg()
    started = LeaderThread(cfg)
    with pytest.raises(ChannelError, match="refused rank 1: authentication failed"):
        _follower(cfg, secret=b"not the group's secret at all")
    assert "refused follower rank 1 from 127.0.0.1:" in caplog.text and "wrong secret" in caplog.text
    with _follower(cfg):  # the right one still gets the slot
        assert sorted(started.result().followers) == [1]
        started.result().close()


def test_an_insecure_leader_refuses_a_follower_that_has_a_secret():
    cfg = _cfg(insecure_multihost=True)
    started = LeaderThread(cfg, secret=b"")
    with pytest.raises(ChannelError, match="authentication failed"):
        _follower(cfg)
    with _follower(cfg, secret=b""):
        started.result().close()


def test_silent_and_closing_probes_neither_hang_start_up_nor_take_the_slot(caplog):
    caplog.set_level(logging.WARNING, logger="jaxserve.distributed.multihost")
    cfg = _cfg()
    started = LeaderThread(cfg, handshake_timeout_s=3)
    port = _port(cfg)
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # connect and stay silent
    for _ in range(3):  # connect and close
        socket.create_connection(("127.0.0.1", port)).close()
    for _ in range(2):  # connect and reset (a close with the challenge unread does the same)
        probe = socket.create_connection(("127.0.0.1", port))
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        probe.close()
    time.sleep(0.2)
    begun = time.monotonic()
    with _follower(cfg):
        leader = started.result()
        assert time.monotonic() - begun < 2, "the real follower waited for the probes"
        assert sorted(leader.followers) == [1]
        _wait(lambda: sum("no handshake within" in line for line in leader.refusals) == 3,
              what="the silent probes' end")
        # a close and a reset before the hello are the same event, whichever the timing made of a close
        assert sum("closed before the handshake" in line for line in leader.refusals) >= 5, leader.refusals
        assert not any("reset" in line for line in leader.refusals), leader.refusals
        for probe in silent:
            probe.settimeout(5)
            assert probe.recv(1 << 16).startswith(wire.MAGIC)  # the challenge, then the leader's close
            assert probe.recv(1 << 16) == b""
            probe.close()
        leader.close()


def test_one_connection_per_rank():
    cfg = _cfg(nnodes=3)
    started = LeaderThread(cfg)
    with _follower(cfg, rank=1):
        with pytest.raises(ChannelError, match="rank 1 has already joined"):
            _follower(cfg, rank=1)
        with pytest.raises(ChannelError, match="rank 7 is not in \\[1, 3\\)"):
            _follower(cfg, rank=7)
        with pytest.raises(ChannelError, match="rank 0 is not in"):
            _follower(cfg, rank=0)
        assert not started.done.is_set()
        with _follower(cfg, rank=2):
            leader = started.result()
            assert sorted(leader.followers) == [1, 2]
            assert all("127.0.0.1:" in address for address in leader.addresses.values())
            leader.close()


def test_a_fingerprint_mismatch_is_refused_naming_the_field(caplog):
    caplog.set_level(logging.WARNING, logger="jaxserve.distributed.multihost")
    cfg = _cfg()
    started = LeaderThread(cfg)
    with pytest.raises(ChannelError, match="kv_pages: leader 33, follower 65") as error:
        _follower(cfg, fingerprint={**FINGERPRINT, "kv_pages": "65"})
    assert "model" not in str(error.value).split("differs from the leader's:")[1]  # only the differing field
    assert "its fingerprint differs: kv_pages: leader 33, follower 65" in caplog.text
    with pytest.raises(ChannelError, match="jaxserve: leader \\(none\\), follower 9"):
        _follower(cfg, fingerprint={**FINGERPRINT, "jaxserve": "9"})
    with _follower(cfg):
        started.result().close()


def test_the_fingerprint_covers_what_must_match():
    runner = SimpleNamespace(cfg=FakeRunner().cfg, model_cfg=MODEL, num_pages=33, prefill_buckets=[16, 32],
                             decode_buckets=[1, 2, 4], attention_backend="xla", matmul_backend="xla", platform="cpu")
    fp = multihost.fingerprint(runner)
    for field in ("model", "dtype", "kv_cache_dtype", "kv_pages", "prefill_buckets", "decode_buckets", "jax",
                  "jaxserve", "tensor_parallel_size", "max_model_len", "block_size"):
        assert field in fp, field
    other = multihost.fingerprint(SimpleNamespace(**{**vars(runner), "model_cfg": ModelConfig(
        **{**MODEL.__dict__, "rms_norm_eps": 1e-6})}))
    assert wire.fingerprint_differences(fp, other) == [f"model: leader {fp['model']}, follower {other['model']}"]


# -- the connections ----------------------------------------------------------------------------------------


def test_keepalive_on_both_ends():
    cfg = _cfg()
    started = LeaderThread(cfg)
    with _follower(cfg) as channel:
        leader = started.result()
        for conn in (leader.followers[1], channel.conn):
            assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == multihost.KEEPALIVE_IDLE_S
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == multihost.KEEPALIVE_COUNT
        leader.close()


def test_the_leader_listens_only_where_dist_init_addr_says():
    cfg = _cfg(host="127.0.0.2")  # the whole of 127/8 is this machine on Linux
    started = LeaderThread(cfg)  # listening at 127.0.0.2
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", _port(cfg)), timeout=5)
    with _follower(cfg):
        started.result().close()


def test_the_heartbeat_timeout_is_jaxs_default_or_the_variables_positive_seconds(monkeypatch):
    """jax.distributed ends the group when a rank sends no heartbeat for this long; the variable sets it, and
    anything but a positive whole number of seconds is refused naming the variable."""
    monkeypatch.delenv(multihost.HEARTBEAT_TIMEOUT_ENV, raising=False)
    assert multihost.heartbeat_timeout_s() == multihost.DEFAULT_HEARTBEAT_TIMEOUT_S == 100
    monkeypatch.setenv(multihost.HEARTBEAT_TIMEOUT_ENV, "600")
    assert multihost.heartbeat_timeout_s() == 600
    for bad in ("0", "-5", "1.5", "ten"):
        monkeypatch.setenv(multihost.HEARTBEAT_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=multihost.HEARTBEAT_TIMEOUT_ENV):
            multihost.heartbeat_timeout_s()


def test_a_loopback_dist_init_addr_is_reported(capsys):
    assert "loopback" in multihost.warn_if_loopback(_cfg(host="localhost"))
    assert "127.0.1.1" in capsys.readouterr().err
    assert multihost.warn_if_loopback(_cfg(host="192.0.2.1")) is None  # an address literal: no lookup, no warning


def test_a_follower_lost_before_the_handler_is_set_is_reported_when_it_is():
    cfg = _cfg()
    started = LeaderThread(cfg)
    channel = _follower(cfg)
    leader = started.result()
    channel.close()  # the follower dies between from_config and the server's handler
    _wait(lambda: leader.lost is not None, what="the leader seeing the loss")
    assert "follower rank 1 (127.0.0.1:" in leader.lost
    with pytest.raises(ConnectionError, match="follower rank 1"):
        leader.send_step(*_decode_step(FakeRunner()))
    calls = []
    leader.on_follower_lost = calls.append
    assert calls == [leader.lost]
    leader.close()


def test_a_follower_lost_while_serving_calls_the_handler():
    cfg = _cfg()
    started = LeaderThread(cfg)
    channel = _follower(cfg)
    leader = started.result()
    lost = threading.Event()
    leader.on_follower_lost = lambda message: lost.set()
    channel.conn.shutdown(socket.SHUT_RDWR)
    channel.close()
    assert lost.wait(10)
    leader.close()


def test_the_offline_llm_raises_after_a_follower_is_lost(monkeypatch):
    from jaxserve import llm as llm_module

    cfg = _cfg()
    started = LeaderThread(cfg)
    channel = _follower(cfg)
    leader = started.result()
    channel.close()
    _wait(lambda: leader.lost is not None, what="the leader seeing the loss")
    engine = SimpleNamespace(cfg=cfg, tokenizer=None, leader=leader)
    monkeypatch.setattr(llm_module.LLMEngine, "from_config", classmethod(lambda cls, *a, **k: (engine, None)))
    offline = llm_module.LLM("unused")  # from_config returned after the loss: the handler gets it at once
    with pytest.raises(RuntimeError, match="follower rank 1"):
        offline.generate("hello")
    leader.close()


def test_follow_runs_the_steps_and_stops_when_the_leader_goes():
    cfg = _cfg()
    started = LeaderThread(cfg)
    runner, leader_runner = FakeRunner(), FakeRunner()
    steps = [_prefill_step(leader_runner), _decode_step(leader_runner)]
    with _follower(cfg) as channel:
        leader = started.result()
        followed = []
        thread = threading.Thread(target=lambda: followed.append(multihost.follow(runner, channel)), daemon=True)
        thread.start()
        for step in steps:
            leader.send_step(*step)
        leader.close()
        thread.join(10)
    assert followed == [2]
    for (kind, bucket, inputs), (got_kind, got_bucket, got) in zip(steps, runner.launched):
        assert (got_kind, got_bucket) == (kind, bucket)
        _same_inputs(got, inputs)


def test_the_multi_host_manifest_publishes_the_leader_early_and_gives_every_pod_the_secret():
    import yaml

    docs = [d for d in yaml.safe_load_all((REPO_ROOT / "deploy/multi-host/tensor-parallel.yaml").read_text()) if d]
    headless = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"]
    assert headless and all(d["spec"]["publishNotReadyAddresses"] is True for d in headless)
    containers = [c for d in docs if d["kind"] == "StatefulSet" for c in d["spec"]["template"]["spec"]["containers"]]
    assert len(containers) == 2
    for container in containers:
        env = {e["name"]: e for e in container.get("env", [])}
        assert "secretKeyRef" in env[multihost.SECRET_ENV]["valueFrom"], container["name"]
        assert "SECRET" not in " ".join(container["command"]).upper()
