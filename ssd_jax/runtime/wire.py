"""The two-process transport's wire: typed, size-checked frames over a socket, and the handshake.

Nothing on the wire is executable: no pickle. A frame is

    b"SSDJ" | version u8 | header length u32 (big-endian) | header | array bytes

where the header is UTF-8 JSON `{"kind": str, "fields": {...}, "arrays": [[name, dtype, shape]]}`
and the array bytes follow in that order, C-contiguous. Every kind has a schema (`SCHEMAS`): the
fields it carries and their JSON types, the arrays with their dtypes and ranks. A receiver checks
the frame against the schema of the kinds it expects before it reads any array byte: magic,
version, header size (`MAX_HEADER`), dtype (`DTYPES`: bool, int32, float16, bfloat16, float32),
rank, the message's total size (`Channel.max_bytes`), field names and types. A frame that fails
raises `TransportError` (kind "malformed") naming what was wrong.

Peers authenticate when they connect (`handshake_target` / `handshake_draft`): a challenge-response
with HMAC-SHA256 over a shared secret, both ways, so neither side talks to a process that does not
know the secret. The bytes after the handshake are neither encrypted nor authenticated per message:
across hosts, run the transport on a network you trust (or through an SSH tunnel).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import os
import secrets
import socket
import struct
import time

import numpy as np

MAGIC = b"SSDJ"
VERSION = 6  # 2: the run's temperature / top-k / top-p are lists, one per request; 3: "compiling";
# 4: "compiled"; 5: "warm" / "warmed"; 6: the round's packed outcome in place of the host's state
# and histories, the lookup counters in "resolved"
_PREFIX = struct.Struct("!4sBI")
MAX_HEADER = 1 << 16  # bytes of JSON header
MAX_MESSAGE_BYTES = 1 << 30  # default cap on one message's array bytes (1 GiB)
MAX_ARRAYS = 16
MAX_NDIM = 4
MAX_LIST = 1 << 16  # entries of a list field
MAX_STR = 1 << 12  # characters of a string field
SECRET_ENV = "SSD_JAX_DRAFT_SECRET"
SECRET_FILE_ENV = "SSD_JAX_DRAFT_SECRET_FILE"
MIN_SECRET = 16  # bytes


def _dtypes() -> dict[str, np.dtype]:
    import ml_dtypes  # a JAX dependency: numpy's bfloat16
    return {"bool": np.dtype(np.bool_), "int32": np.dtype(np.int32),
            "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
            "float32": np.dtype(np.float32)}


DTYPES = _dtypes()
ROWS = ("float32", "bfloat16", "float16")  # proposal rows' dtypes (SSDConfig.row_dtype)


class TransportError(RuntimeError):
    """The peer process broke the exchange. `kind`: "closed" (it went away), "timeout" (no answer
    in time), "malformed" (a frame that fails its checks), "auth" (a peer without the secret),
    "remote" (the peer reported an error of its own; the connection stays usable)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


# ------------------------------------------------------------------------------------ schemas
# field types: int, float, str, bool, "ints" (a list of ints), "reals" (a list of finite numbers),
# "floats" (a str -> float dict), "str?" / "float?" / "bool?" (or null), "records" (compile
# records, below)
# a round's rows as the target's device loop has them: `round_steps.Outcome` packed, [B, 6 + R]
# int32 (the verify's outcome, the rows after its commit, the round's report; before round 1 the
# rows after the prefill and its report, no outcome)
_OUTCOME = {"outcome": (("int32",), 2)}
_RUN = {"seed": "int", "request_ids": "ints", "temperature": "reals", "top_k": "ints",
        "top_p": "reals", "k": "int", "fanout_hit": "ints", "fanout_backup": "ints",
        "saguaro_c": "float", "backup": "str", "row_dtype": "str"}
_SPEC = {"spec": (("int32",), 2), "rows": (ROWS, 3)}

# kind -> (fields, arrays {name: (dtypes, ndim)})
REQUESTS = {  # target -> draft
    "start": ({"cache_len": "int", "row_vocab": "int"},
              {"tokens": (("int32",), 2), "lens": (("int32",), 1)}),
    "ready": ({}, {}),
    "propose": (_RUN, _OUTCOME),
    "first": (_RUN, _OUTCOME),
    # neural: backup="auto"'s choice for this round (null for the other backups)
    "resolve": ({**_RUN, "neural": "bool?"}, _OUTCOME),
    "finish": ({}, {}),
    "shutdown": ({}, {}),
    # a throwaway call of a coming call's shapes (`warmup.CallPlan`), run after the "ok": the
    # draft's programs compile or load while the target loads; "warmed" says when it is done
    "warm": ({**_RUN, "cache_len": "int", "row_vocab": "int", "mode": "str"},
             {"tokens": (("int32",), 2), "lens": (("int32",), 1)}),
}
REPLIES = {  # draft -> target
    "info": ({"vocab_rows": "int", "vocab_size": "int", "fingerprint": "str?", "name": "str",
              "backend": "str"}, {}),
    "ok": ({}, {}),
    "spec": ({}, _SPEC),
    # the lookup's hit per row, and the call's lookup counters so far (summed over the rows)
    "resolved": ({"times": "floats"}, {**_SPEC, "hit": (("bool",), 1),
                                        "lookups_by_accept": (("int32",), 1),
                                        "hits_by_accept": (("int32",), 1),
                                        "backups": (("int32",), 1)}),
    "error": ({"message": "str", "during": "str"}, {}),
    # a heartbeat, about every HEARTBEAT_S while the draft lowers or compiles a step (so a reply
    # timeout measures the answer, never a compile); the target skips it wherever it reads
    "compiling": ({}, {}),
    # before a reply: what the draft compiled or loaded since its last reply, one record a program
    # [name, source, seconds, trace_s, lower_s, compile_s, count] (`metrics.CompileTimer`'s)
    "compiled": ({"programs": "records"}, {}),
    # after a "warm" request's "ok", once its warm-up ended: its seconds, what it compiled or
    # loaded (up to 100 records), its error if it failed; read before the next reply
    "warmed": ({"seconds": "float", "programs": "records", "error": "str?"}, {}),
}
HEARTBEAT_S = 0.25
SCHEMAS = {**REQUESTS, **REPLIES}


@dataclasses.dataclass
class Message:
    """One frame: its kind, JSON fields and numpy arrays."""
    kind: str
    fields: dict = dataclasses.field(default_factory=dict)
    arrays: dict = dataclasses.field(default_factory=dict)


def _bad(msg: str) -> TransportError:
    return TransportError("malformed", f"malformed message refused: {msg}")


def _check_field(kind: str, name: str, typ: str, v) -> None:
    ok = {
        "int": lambda: type(v) is int,
        "float": lambda: type(v) in (int, float) and math.isfinite(v),
        "bool": lambda: type(v) is bool,
        "bool?": lambda: v is None or type(v) is bool,
        "str": lambda: type(v) is str and len(v) <= MAX_STR,
        "str?": lambda: v is None or (type(v) is str and len(v) <= MAX_STR),
        "float?": lambda: v is None or (type(v) in (int, float) and math.isfinite(v)),
        "ints": lambda: type(v) is list and len(v) <= MAX_LIST and all(type(x) is int for x in v),
        "reals": lambda: type(v) is list and len(v) <= MAX_LIST and all(
            type(x) in (int, float) and math.isfinite(x) for x in v),
        "records": lambda: type(v) is list and len(v) <= MAX_LIST and all(
            type(r) is list and len(r) == 7 and all(type(x) is str and len(x) <= MAX_STR
                                                    for x in r[:2])
            and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in r[2:6])
            and type(r[6]) is int and r[6] >= 0 for r in v),
        "floats": lambda: type(v) is dict and len(v) <= 64 and all(
            type(k) is str and len(k) <= 64 and type(x) in (int, float) and math.isfinite(x)
            for k, x in v.items()),
    }[typ]
    if not ok():
        raise _bad(f"{kind!r} field {name!r} must be {typ}, got {type(v).__name__}")


def encode(msg: Message) -> list:
    """The frame of `msg` as a list of buffers (header, then each array's bytes); checks `msg`
    against its schema first, so a sender cannot emit what a receiver would refuse."""
    fields_t, arrays_t = SCHEMAS[msg.kind]
    arrays = []
    for name in arrays_t:
        a = np.ascontiguousarray(msg.arrays[name])
        arrays.append(a)
    header = {"kind": msg.kind, "fields": msg.fields,
              "arrays": [[n, a.dtype.name, list(a.shape)] for n, a in zip(arrays_t, arrays)]}
    _validate_header(header, SCHEMAS, None)
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return [_PREFIX.pack(MAGIC, VERSION, len(raw)) + raw] + [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]


def _validate_header(h, schemas: dict, max_bytes: int | None) -> list[tuple[str, np.dtype, tuple]]:
    if type(h) is not dict or set(h) != {"kind", "fields", "arrays"}:
        raise _bad("the header must be an object with kind, fields and arrays")
    kind = h["kind"]
    if type(kind) is not str or kind not in schemas:
        raise _bad(f"unexpected kind {str(kind)[:40]!r} (expected one of {', '.join(schemas)})")
    fields_t, arrays_t = schemas[kind]
    fields = h["fields"]
    if type(fields) is not dict or set(fields) != set(fields_t):
        got = sorted(fields) if type(fields) is dict else type(fields).__name__
        raise _bad(f"{kind!r} needs fields {sorted(fields_t)}, got {got}")
    for name, typ in fields_t.items():
        _check_field(kind, name, typ, fields[name])
    arrays = h["arrays"]
    if type(arrays) is not list or len(arrays) != len(arrays_t) or len(arrays) > MAX_ARRAYS:
        raise _bad(f"{kind!r} needs arrays {list(arrays_t)}")
    out, total = [], 0
    for entry, (want, (dtypes, ndim)) in zip(arrays, arrays_t.items()):
        if type(entry) is not list or len(entry) != 3:
            raise _bad(f"{kind!r}: an array entry must be [name, dtype, shape]")
        name, dtype, shape = entry
        if name != want:
            raise _bad(f"{kind!r}: array {str(name)[:40]!r} where {want!r} belongs")
        if type(dtype) is not str or dtype not in dtypes:
            raise _bad(f"{kind!r} array {want!r}: dtype {str(dtype)[:40]!r} is not allowed "
                       f"(allowed: {', '.join(dtypes)})")
        if (type(shape) is not list or len(shape) != ndim or len(shape) > MAX_NDIM
                or not all(type(d) is int and 0 <= d < (1 << 31) for d in shape)):
            raise _bad(f"{kind!r} array {want!r}: shape {str(shape)[:60]} is not {ndim} sizes >= 0")
        dt = DTYPES[dtype]
        total += math.prod(shape) * dt.itemsize
        out.append((want, dt, tuple(shape)))
    if max_bytes is not None and total > max_bytes:
        raise _bad(f"{kind!r} declares {total} bytes of arrays, over the limit of {max_bytes}")
    return out


class Channel:
    """One authenticated connection: `send(Message)`, `recv(expect)`. `seconds`: time spent in
    both (including waits for the peer)."""

    def __init__(self, sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES):
        self.sock = sock
        self.max_bytes = int(max_bytes)
        self.seconds = 0.0
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go at once
        except OSError:  # not TCP (a socketpair in tests)
            pass

    def send(self, msg: Message, timeout: float | None = None) -> None:
        """Write `msg`'s frame (TransportError "closed" / "timeout" if the peer is gone or stuck)."""
        t0 = time.perf_counter()
        bufs = encode(msg)
        try:
            self.sock.settimeout(timeout)
            for b in bufs:
                self.sock.sendall(b)
        except socket.timeout as e:
            raise TransportError("timeout", f"sending {msg.kind!r} took over {timeout} s") from e
        except OSError as e:
            raise TransportError("closed", f"the peer closed the connection ({e})") from e
        finally:
            self.seconds += time.perf_counter() - t0

    def recv(self, expect: dict, timeout: float | None = None, alive=None) -> Message:
        """The next frame, checked against the schemas `expect` (kind -> schema). timeout: seconds
        for the whole message (None: wait forever); alive(): called about once a second while
        waiting, raises to stop waiting (e.g. the peer process exited)."""
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        try:
            prefix = self._read(_PREFIX.size, deadline, alive, timeout)
            magic, version, hlen = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise _bad(f"not an ssd_jax frame (starts {bytes(prefix[:4])!r})")
            if version != VERSION:
                raise _bad(f"wire version {version}, this side speaks {VERSION}")
            if hlen > MAX_HEADER:
                raise _bad(f"header of {hlen} bytes, over the limit of {MAX_HEADER}")
            try:
                header = json.loads(bytes(self._read(hlen, deadline, alive, timeout)),
                                    parse_constant=_no_constant)
            except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
                raise _bad(f"the header is not JSON ({e})") from None
            specs = _validate_header(header, expect, self.max_bytes)
            arrays = {}
            for name, dt, shape in specs:
                buf = self._read(math.prod(shape) * dt.itemsize, deadline, alive, timeout)
                a = np.frombuffer(buf, dt).reshape(shape)
                if dt == np.bool_ and a.size and a.view(np.uint8).max() > 1:
                    raise _bad(f"array {name!r}: a bool byte other than 0 or 1")
                arrays[name] = a
            return Message(header["kind"], header["fields"], arrays)
        finally:
            self.seconds += time.perf_counter() - t0

    def _read(self, n: int, deadline, alive, timeout) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            wait = 1.0 if alive is not None else None
            if deadline is not None:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TransportError("timeout", f"no answer in {timeout:g} s")
                wait = left if wait is None else min(wait, left)
            self.sock.settimeout(wait)
            try:
                k = self.sock.recv_into(view[got:])
            except socket.timeout:
                if alive is not None:
                    alive()
                continue
            except OSError as e:
                raise TransportError("closed", f"the peer closed the connection ({e})") from e
            if k == 0:
                raise TransportError("closed", "the peer closed the connection")
            got += k
        return buf

    def close(self) -> None:
        """Close the socket (the peer reads an end of stream)."""
        try:
            self.sock.close()
        except OSError:
            pass


def _no_constant(name):
    raise ValueError(f"{name} is not allowed")


# ------------------------------------------------------------------------------------ secrets
def read_secret(secret=None, secret_file=None, env=None) -> bytes | None:
    """The shared secret: `secret` (str or bytes), else the file `secret_file`, else the
    environment's SSD_JAX_DRAFT_SECRET, else the file named by SSD_JAX_DRAFT_SECRET_FILE; None if
    none is given. Surrounding whitespace is dropped; at least 16 bytes (ValueError)."""
    env = os.environ if env is None else env
    if secret is None and secret_file is None:
        secret, secret_file = env.get(SECRET_ENV) or None, env.get(SECRET_FILE_ENV) or None
    if secret is None and secret_file is not None:
        with open(secret_file, "rb") as fh:
            secret = fh.read()
    if secret is None:
        return None
    key = (secret.encode() if isinstance(secret, str) else bytes(secret)).strip()
    if len(key) < MIN_SECRET:
        raise ValueError(f"the draft transport's secret has {len(key)} bytes; use at least "
                         f"{MIN_SECRET} (e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return key


def new_secret() -> str:
    """A fresh random secret (hex), for a draft process this process spawns itself."""
    return secrets.token_hex(32)


# ---------------------------------------------------------------------------------- handshake
_HELLO, _NONCE, _MAC = b"SSDJ-AUTH1", 32, 32


def _mac(key: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, role + a + b, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise TransportError("auth", "the peer closed the connection during the handshake")
        buf += chunk
    return buf


def handshake_target(sock: socket.socket, key: bytes, timeout: float = 10.0) -> None:
    """The target's side (it accepted `sock`): challenge the peer, check its HMAC, prove its own.
    TransportError("auth") for a peer without the secret (told "DENY" before the close)."""
    sock.settimeout(timeout)
    try:
        nonce = secrets.token_bytes(_NONCE)
        sock.sendall(_HELLO + nonce)
        reply = _read_exact(sock, _NONCE + _MAC)
        peer_nonce, mac = reply[:_NONCE], reply[_NONCE:]
        if not hmac.compare_digest(mac, _mac(key, b"draft", nonce, peer_nonce)):
            try:
                sock.sendall(b"DENY")
            except OSError:
                pass
            raise TransportError("auth", "the peer does not know the secret")
        sock.sendall(b"OKAY" + _mac(key, b"target", peer_nonce, nonce))
    except socket.timeout as e:
        raise TransportError("auth", f"no handshake from the peer in {timeout:g} s") from e
    except OSError as e:
        raise TransportError("auth", f"the handshake failed ({e})") from e
    finally:
        sock.settimeout(None)


def handshake_draft(sock: socket.socket, key: bytes, timeout: float = 30.0) -> None:
    """The draft's side (it connected `sock`): answer the challenge, check the target's proof.
    TransportError("auth") if the target refuses this secret or cannot prove its own."""
    sock.settimeout(timeout)
    try:
        hello = _read_exact(sock, len(_HELLO) + _NONCE)
        if hello[:len(_HELLO)] != _HELLO:
            raise TransportError("auth", "the peer is not an ssd_jax target (no handshake)")
        nonce, mine = hello[len(_HELLO):], secrets.token_bytes(_NONCE)
        sock.sendall(mine + _mac(key, b"draft", nonce, mine))
        verdict = _read_exact(sock, 4)
        if verdict == b"DENY":
            raise TransportError("auth", "the target refused this draft: wrong secret "
                                         f"({SECRET_ENV} / --secret-file must match the target's)")
        proof = _read_exact(sock, _MAC)
        if verdict != b"OKAY" or not hmac.compare_digest(proof, _mac(key, b"target", mine, nonce)):
            raise TransportError("auth", "the target did not prove the secret")
    except socket.timeout as e:
        raise TransportError("auth", f"no handshake from the target in {timeout:g} s") from e
    except OSError as e:
        raise TransportError("auth", f"the handshake failed ({e})") from e
    finally:
        sock.settimeout(None)


def parse_address(addr: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """"host:port", ":port" or "[v6]:port" -> (host, port); ValueError naming the problem."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"address {addr!r}: give host:port (e.g. 127.0.0.1:12355)")
    host = host.strip("[]") or default_host
    return host, int(port)
