"""The multi-host step channel's wire format: frames, the step schema and the handshake's pieces.

No pickle anywhere: what arrives is data, never code. `multihost.py` owns the connections (who may
connect, the threads, the failures); this module owns the bytes, each parsed in one place.

- Frames: a fixed 9-byte header (`MAGIC`, b"JXS" + the protocol version; the message type; the body's
  length), then the body. Each message type has its own size cap, checked before a byte of the body
  is read (`recv_frame`): the handshake's messages are at most a few KiB, a step at most what the
  follower's largest bucket can hold (`max_step_bytes`). A frame that does not start with the magic (a
  pickle, an HTTP request, an older jaxserve's length prefix) is a ChannelError.
- A step (`encode_step`, `decode_step`): its kind ("prefill" or "decode"), its bucket, then each array:
  its name (the dotted path of its field in `StepInputs`, e.g. "md.cu_q_lens" or
  "row_updates.sampling.seeds"), its dtype (a code from an allow-list: bool, int8/uint8, int32/uint32,
  int64, float16/float32; never object), its shape (at most 4 dimensions), padding to 8 bytes, its
  bytes (little-endian). The follower rebuilds the `StepInputs` NamedTuples from the names
  (`unflatten_step`) after checking every array's shape and dtype against those its own runner compiled
  for that kind and bucket (`check_step`): a wrong kind or bucket would otherwise start a compilation.
- The handshake: a random challenge from each side and an HMAC-SHA256 keyed by the group's secret over
  the whole transcript (both nonces, the rank, the follower's fingerprint), one MAC per direction
  (`handshake_mac`), so each side proves the secret without sending it and nothing can be replayed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import re
import socket
import struct

import numpy as np

from jaxserve.ops.attention import AttentionMetadata
from jaxserve.runner.device_batch import RowUpdates
from jaxserve.ops.sampling import SamplingTensors
from jaxserve.runner.step_inputs import StepInputs

MAGIC = b"JXS\x01"  # protocol version 1
FRAME = struct.Struct("!4sBI")  # magic, message type, body length
CHALLENGE, HELLO, WELCOME, REFUSE, STEP = 1, 2, 3, 4, 5  # leader->, ->leader, leader->, leader->, leader->
MESSAGE_NAMES = {CHALLENGE: "challenge", HELLO: "hello", WELCOME: "welcome", REFUSE: "refusal", STEP: "step"}
NONCE_BYTES = 32  # each side's challenge
MAC_BYTES = 32  # HMAC-SHA256
# A hello: rank, the follower's nonce, its MAC; then its fingerprint (JSON)
HELLO_HEADER = struct.Struct(f"!I{NONCE_BYTES}s{MAC_BYTES}s")
MAX_HELLO_BYTES = 16 * 1024
MAX_REFUSAL_BYTES = 4 * 1024
MAX_STEP_BYTES = 1 << 30  # when the follower's runner does not say less (max_step_bytes)

STEP_KINDS = ("prefill", "decode")
MAX_ARRAYS = 64
MAX_NDIM = 4
MAX_DIM = 1 << 24
MAX_NAME = 64
ALIGN = 8  # each array's bytes start at a multiple of this in the body
_NAME_RE = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*")
# The dtypes a step's arrays may have, by their code on the wire (little-endian there).
DTYPES = {1: np.dtype("bool"), 2: np.dtype("<i1"), 3: np.dtype("<u1"), 4: np.dtype("<i4"), 5: np.dtype("<u4"),
          6: np.dtype("<i8"), 7: np.dtype("<f2"), 8: np.dtype("<f4")}
_DTYPE_CODES = {dtype.newbyteorder("="): code for code, dtype in DTYPES.items()}
# The fields of the step's NamedTuples that are NamedTuples themselves
_NESTED = {(StepInputs, "md"): AttentionMetadata, (StepInputs, "sampling"): SamplingTensors,
           (StepInputs, "row_updates"): RowUpdates, (RowUpdates, "sampling"): SamplingTensors}


class ChannelError(ConnectionError):
    """The step channel's other end refused this one, or sent what the protocol does not allow."""


# -- frames -----------------------------------------------------------------------------------------------


def frame(message_type: int, body: bytes | bytearray) -> bytes:
    return FRAME.pack(MAGIC, message_type, len(body)) + body


def recv_exactly(conn: socket.socket, size: int) -> bytearray | None:
    """`size` bytes, or None if the connection ends before the first; ChannelError if it ends after."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = conn.recv_into(view[got:], min(size - got, 1 << 22))
        if n == 0:
            if got == 0:
                return None
            raise ChannelError(f"the connection ended inside a message ({got} of {size} bytes)")
        got += n
    return buffer


def recv_frame(conn: socket.socket, allowed: dict[int, int]) -> tuple[int, bytearray] | None:
    """The next message as (type, body), or None when the other side has closed between messages.
    `allowed`: each message type this side accepts now, with its size cap. Anything else: ChannelError."""
    header = recv_exactly(conn, FRAME.size)
    if header is None:
        return None
    magic, message_type, size = FRAME.unpack(header)
    if magic != MAGIC:
        raise ChannelError(f"not jaxserve's step-channel protocol (its first bytes are {bytes(header[:8])!r})")
    if message_type not in allowed:
        expected = " or ".join(MESSAGE_NAMES[t] for t in allowed)
        raise ChannelError(f"got a {MESSAGE_NAMES.get(message_type, f'message of type {message_type}')} where a "
                           f"{expected} was due")
    name = MESSAGE_NAMES[message_type]
    if size > allowed[message_type]:
        raise ChannelError(f"a {name} of {size} bytes is over its cap of {allowed[message_type]}")
    body = recv_exactly(conn, size) if size else bytearray()
    if body is None:
        raise ChannelError(f"the connection ended inside a {name}")
    return message_type, body


def tune_socket(conn: socket.socket, keepalive_idle_s: int, keepalive_interval_s: int, keepalive_count: int,
                user_timeout_s: int) -> None:
    """No Nagle delay; keepalive, and a bound on unacknowledged data (Linux), so a partition ends the
    connection instead of leaving a reader waiting forever."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", keepalive_idle_s), ("TCP_KEEPINTVL", keepalive_interval_s),
                          ("TCP_KEEPCNT", keepalive_count), ("TCP_USER_TIMEOUT", user_timeout_s * 1000)):
        if hasattr(socket, option):
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def peer_name(conn: socket.socket) -> str:
    """HOST:PORT of the other end, for the log."""
    with contextlib.suppress(OSError):
        address = conn.getpeername()
        return f"[{address[0]}]:{address[1]}" if ":" in address[0] else f"{address[0]}:{address[1]}"
    return "an unknown address"


# -- steps: StepInputs <-> named arrays <-> bytes ---------------------------------------------------------


def flatten_step(inputs, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted name, leaf) of every field of a StepInputs that is not None, in field order."""
    out = []
    for name, value in zip(inputs._fields, inputs):
        if value is None:
            continue
        if hasattr(value, "_fields"):
            out += flatten_step(value, f"{prefix}{name}.")
        else:
            out.append((prefix + name, value))
    return out


def unflatten_step(arrays: dict[str, np.ndarray]) -> StepInputs:
    """The StepInputs whose `flatten_step` gives `arrays`; ChannelError for a name it has no field for."""
    used = set()

    def build(cls, prefix: str):
        values = []
        for field in cls._fields:
            name = prefix + field
            if name in arrays:
                values.append(arrays[name])
                used.add(name)
            elif (cls, field) in _NESTED and any(key.startswith(name + ".") for key in arrays):
                values.append(build(_NESTED[cls, field], name + "."))
            else:
                values.append(None)
        return cls(*values)

    inputs = build(StepInputs, "")
    if unknown := sorted(set(arrays) - used):
        raise ChannelError(f"a step carries arrays that StepInputs has no field for: {unknown}")
    return inputs


def encode_step(kind: str, bucket: int, inputs: StepInputs) -> bytes:
    """One step as a frame: its kind, bucket and every array of `inputs` (host numpy arrays)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}")
    leaves = flatten_step(inputs)
    parts = [struct.pack("!B", len(kind)), kind.encode(), struct.pack("!IH", bucket, len(leaves))]
    size = sum(len(p) for p in parts)
    for name, value in leaves:
        if not isinstance(value, np.ndarray):
            raise TypeError(f"step input {name} is a {type(value).__name__}, not a host numpy array")
        code = _DTYPE_CODES.get(value.dtype.newbyteorder("="))
        if code is None or value.ndim > MAX_NDIM:
            raise TypeError(f"step input {name} ({value.dtype}, {value.ndim} dimensions) cannot go on the wire")
        array = np.ascontiguousarray(value, dtype=DTYPES[code])
        meta = (struct.pack("!B", len(name)) + name.encode() + struct.pack("!BB", code, array.ndim)
                + struct.pack(f"!{array.ndim}I", *array.shape))
        pad = bytes(-(size + len(meta)) % ALIGN)
        parts += [meta, pad, memoryview(array).cast("B")]
        size += len(meta) + len(pad) + array.nbytes
    return frame(STEP, b"".join(parts))


def decode_step(body: bytearray) -> tuple[str, int, dict[str, np.ndarray]]:
    """A step's body -> (kind, bucket, {name: array}); every field checked, the arrays views of `body`
    (writable, aligned). ChannelError on anything out of place."""
    view, offset = memoryview(body), 0

    def take(size: int) -> memoryview:
        nonlocal offset
        if offset + size > len(view):
            raise ChannelError(f"a step ends early (needs {offset + size} bytes, has {len(view)})")
        offset += size
        return view[offset - size:offset]

    def unpack(fmt: str) -> tuple:
        return struct.unpack(fmt, take(struct.calcsize(fmt)))

    def text(what: str, limit: int) -> str:
        (size,) = unpack("!B")
        raw = bytes(take(size))
        if size > limit or not raw.isascii():
            raise ChannelError(f"a step's {what} is not a short ASCII name: {raw[:limit]!r}")
        return raw.decode()

    kind = text("kind", 16)
    if kind not in STEP_KINDS:
        raise ChannelError(f"unknown step kind {kind!r} (known: {STEP_KINDS})")
    bucket, count = unpack("!IH")
    if count > MAX_ARRAYS:
        raise ChannelError(f"a step with {count} arrays (at most {MAX_ARRAYS})")
    arrays: dict[str, np.ndarray] = {}
    for _ in range(count):
        name = text("array name", MAX_NAME)
        if not _NAME_RE.fullmatch(name) or name in arrays:
            raise ChannelError(f"bad or repeated array name {name!r}")
        code, ndim = unpack("!BB")
        if code not in DTYPES:
            raise ChannelError(f"array {name}: dtype code {code} is not allowed")
        if ndim > MAX_NDIM:
            raise ChannelError(f"array {name}: {ndim} dimensions (at most {MAX_NDIM})")
        shape = unpack(f"!{ndim}I")
        if any(dim > MAX_DIM for dim in shape):  # a size-0 array's other dimensions too
            raise ChannelError(f"array {name}: shape {list(shape)} has a dimension over {MAX_DIM}")
        if any(take(-offset % ALIGN)):
            raise ChannelError(f"array {name}: non-zero padding")
        dtype = DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize
        data = take(nbytes)
        array = (np.frombuffer(data, dtype) if nbytes else np.empty(0, dtype)).reshape(shape)
        if not array.flags.aligned:  # the body's own buffer was not 8-aligned
            array = array.copy()
        if dtype == np.bool_ and nbytes and array.view(np.uint8).max() > 1:
            raise ChannelError(f"array {name}: bool bytes other than 0 and 1")
        arrays[name] = array
    if offset != len(view):
        raise ChannelError(f"{len(view) - offset} bytes after a step's last array")
    return kind, bucket, arrays


def expected_step_arrays(runner, kind: str, bucket: int, num_update_rows: int) -> dict[str, tuple[tuple, np.dtype]]:
    """{name: (shape, dtype)} of the arrays of a step the runner compiled (`ModelRunner.prepare`'s layout)."""
    num_seqs = bucket if kind == "decode" else min(bucket, runner.cfg.max_num_seqs)
    template = runner.inputs.shapes(bucket, num_seqs)
    if num_update_rows:
        template = template._replace(row_updates=runner.inputs.update_shapes(num_update_rows))
    return {name: (tuple(x.shape), np.dtype(x.dtype)) for name, x in flatten_step(template)}


def check_step(runner, kind: str, bucket: int, arrays: dict[str, np.ndarray]) -> None:
    """Raises ChannelError unless the step is one the runner compiled, each array of that step's shape
    and dtype (so a follower never compiles, nor feeds an executable a wrong shape)."""
    buckets = runner.decode_buckets if kind == "decode" else runner.prefill_buckets
    if bucket not in buckets:
        raise ChannelError(f"a {kind} step of bucket {bucket}, which this follower has not compiled ({buckets})")
    req_indices = arrays.get("row_updates.req_indices")
    num_updates = 0 if req_indices is None or req_indices.ndim != 1 else req_indices.shape[0]
    if req_indices is not None and num_updates not in runner.inputs.update_buckets:
        raise ChannelError(f"row updates of shape {req_indices.shape}; the update buckets are "
                           f"{runner.inputs.update_buckets}")
    expected = expected_step_arrays(runner, kind, bucket, num_updates)
    if set(arrays) != set(expected):
        raise ChannelError(f"a {kind} step of bucket {bucket} lacks {sorted(set(expected) - set(arrays))} and "
                           f"has {sorted(set(arrays) - set(expected))} extra")
    for name, (shape, dtype) in expected.items():
        if arrays[name].shape != shape or arrays[name].dtype != dtype:
            raise ChannelError(f"step array {name} is {arrays[name].dtype}{list(arrays[name].shape)}, expected "
                               f"{dtype}{list(shape)} for a {kind} step of bucket {bucket}")


def max_step_bytes(runner) -> int:
    """The largest step frame a runner's buckets give (plus room for names, shapes and padding)."""
    rows = max(runner.inputs.update_buckets)
    largest = max(sum(math.prod(shape) * dtype.itemsize
                      for shape, dtype in expected_step_arrays(runner, kind, buckets[-1], rows).values())
                  for kind, buckets in (("prefill", runner.prefill_buckets), ("decode", runner.decode_buckets)))
    return largest + 64 * 1024


# -- the handshake's pieces -------------------------------------------------------------------------------


def handshake_mac(secret: bytes, role: bytes, leader_nonce: bytes, follower_nonce: bytes, rank: int,
                  fingerprint: bytes) -> bytes:
    """The MAC one side (role b"follower" or b"leader") sends over the handshake's transcript."""
    transcript = (b"jaxserve-step-channel-v1\0" + role + b"\0" + leader_nonce + follower_nonce
                  + struct.pack("!I", rank) + fingerprint)
    return hmac.new(secret, transcript, hashlib.sha256).digest()


def encode_fingerprint(fingerprint: dict[str, str]) -> bytes:
    return json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()


def decode_fingerprint(raw: bytes) -> dict[str, str]:
    """A fingerprint's fields; ChannelError unless it is a small JSON object of strings."""
    try:
        fingerprint = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        fingerprint = None
    if not (isinstance(fingerprint, dict) and len(fingerprint) <= 64
            and all(isinstance(k, str) and isinstance(v, str) for k, v in fingerprint.items())):
        raise ChannelError("the fingerprint is not a JSON object of strings")
    return fingerprint


def fingerprint_differences(leader: dict[str, str], follower: dict[str, str]) -> list[str]:
    """Each field that differs, as 'field: leader X, follower Y'."""
    return [f"{key}: leader {leader.get(key, '(none)')}, follower {follower.get(key, '(none)')}"
            for key in sorted(set(leader) | set(follower)) if leader.get(key) != follower.get(key)]
