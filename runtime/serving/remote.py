"""The remote KV tier: prefix pages shared by replicas through Redis.

A fourth, optional tier below the device, host and disk tiers, for *prefix pages only*
(docs/serving.md, "The remote KV tier"). When a replica indexes a full page in its prefix index it also
writes the page — every layer's K and V, encoded with the cache's warm codec when one is
configured (``codec="warm"``), raw otherwise — to Redis under the page's chain key. A replica
admitting a request whose first pages its own index lacks asks Redis for the following
keys (one ``MGET``), verifies each entry and writes the pages it got into the request's
sequence through the cache's own write path (no model compute), so a second replica
serving the same system prompt or document promotes those pages instead of recomputing
them. The pages it read are then indexed locally like computed ones.

Keys: ``<namespace>:<layout>:<chain key hex>``. The chain key (``prefix.py``) already
covers the model id, the cache salt and every token id up to the page's end; ``layout``
adds what the bytes depend on beyond that — the entry format version, the model's KV
shape (layers, KV heads, head dim), page size, stored dtype, the codec and a fingerprint
of the weights — so replicas of different models, dtypes or page sizes never read each
other's pages.

Entries: ``MAGIC | version | auth | layout id | chain key | digest | payload``. The digest
covers everything before it and the payload: the entry names its own chain key and layout,
so a valid entry copied under another key (another prompt's, another layout's) fails
verification instead of answering for pages it does not hold. ``auth`` says what the digest
is: SHA-256 (integrity: a damaged, truncated, misplaced or foreign entry is caught) or, with
a shared ``secret``, HMAC-SHA256 keyed by it (authenticity: a writer without the secret
cannot make an entry the replicas accept). An entry that is missing, evicted (Redis's own
``maxmemory`` policy, or ``ttl_seconds``), truncated, misplaced or fails its digest is not
used: the request computes those pages (counted, never wrong output). docs/serving.md has
the threat model.
Redis being down or slow (``timeout`` per call) skips the tier for ``backoff`` seconds,
doubling up to ``max_backoff``; the server keeps serving.

Writes run on a background thread (a bounded queue; when it is full, pages are not
written and counted as dropped); reads run on the engine thread at admission, one round
trip per request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tieredkv.errors import ConfigError, short

MAGIC = b"TKVR"
VERSION = 2
_HEAD = struct.Struct("<4sBB16sB")  # magic, version, auth, layout id, chain key length (then the key, the digest)
_DIGEST = 32
AUTH_SHA256, AUTH_HMAC = 0, 1
CODEC_CHOICES = ("warm", "none")
#: the environment variable a replica reads its shared secret from when its settings give none
SECRET_ENV = "TIEREDKV_REMOTE_KV_SECRET"
MIN_SECRET_CHARS = 16


def _check_secret(secret: Any, where: str) -> None:
    """A shared key long enough not to be guessed (its value never appears in a message)."""
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
        got = f"{len(secret)} characters" if isinstance(secret, str) else type(secret).__name__
        raise ConfigError(f"{where} must be a string of at least {MIN_SECRET_CHARS} characters (e.g. the output of "
                          f"`openssl rand -hex 32`), got {got}")


@dataclass(frozen=True)
class RemoteConfig:
    """``url``: a Redis URL (``redis://host:port/db``, ``rediss://`` for TLS, ``unix://``);
    ``namespace``: the key prefix replicas that share pages agree on; ``ttl_seconds``: entries
    expire after this (None: Redis's own eviction policy decides); ``codec``: ``warm`` (the
    cache's warm codec when it has one, raw otherwise) or ``none`` (always raw); ``timeout``:
    seconds per Redis call; ``backoff`` / ``max_backoff``: seconds the tier is skipped after a
    failure (doubling); ``write_queue``: pages waiting to be written at most; ``secret``: a
    key shared by the replicas (None: the ``TIEREDKV_REMOTE_KV_SECRET`` environment variable,
    else no key): entries are then signed with HMAC-SHA256 and only entries signed with the
    same key are read."""

    url: str
    namespace: str = "tieredkv"
    ttl_seconds: int | None = None
    codec: str = "warm"
    timeout: float = 0.5
    backoff: float = 1.0
    max_backoff: float = 30.0
    write_queue: int = 4096
    secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"remote url must be a Redis URL (redis://host:port/db, rediss://, unix://), got "
                              f"{short(self.url)}")
        if not isinstance(self.namespace, str) or not self.namespace or ":" in self.namespace:
            raise ConfigError(f"remote namespace must be a non-empty string without ':', got {short(self.namespace)}")
        if self.ttl_seconds is not None and (not isinstance(self.ttl_seconds, int) or self.ttl_seconds <= 0):
            raise ConfigError(f"remote ttl_seconds must be a positive integer or null, got {short(self.ttl_seconds)}")
        if self.codec not in CODEC_CHOICES:
            raise ConfigError(f"remote codec must be one of {list(CODEC_CHOICES)}, got {short(self.codec)}")
        for name in ("timeout", "backoff", "max_backoff"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 3600:
                raise ConfigError(f"remote {name} must be a number of seconds in (0, 3600], got {short(v)}")
        if not isinstance(self.write_queue, int) or isinstance(self.write_queue, bool) or self.write_queue < 1:
            raise ConfigError(f"remote write_queue must be a positive integer, got {short(self.write_queue)}")
        if self.secret is not None:
            _check_secret(self.secret, "remote secret")

    def resolved_secret(self) -> bytes | None:
        """The shared key: ``secret``, else the ``TIEREDKV_REMOTE_KV_SECRET`` environment
        variable, else None (entries carry a plain SHA-256)."""
        secret = self.secret if self.secret is not None else (os.environ.get(SECRET_ENV) or None)
        if secret is None:
            return None
        _check_secret(secret, f"the {SECRET_ENV} environment variable")
        return secret.encode()

    @classmethod
    def from_dict(cls, data: Any) -> "RemoteConfig":
        if isinstance(data, str):
            data = {"url": data}
        if not isinstance(data, dict) or "url" not in data:
            raise ConfigError(f"remote settings must be a mapping with a url, got {short(data)}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown remote setting(s) {unknown}; expected some of {sorted(known)}")
        return cls(**data)


@dataclass
class RemoteStats:
    """What the remote tier did (pages, bytes, failures)."""

    queried_pages: int = 0  # pages asked for (beyond the local prefix hits)
    hit_pages: int = 0  # pages read, verified and used
    miss_pages: int = 0  # asked for and absent (never written, expired or evicted)
    corrupt_pages: int = 0  # present but unusable (bad header or size, another key's or layout's, bad digest)
    written_pages: int = 0
    dropped_writes: int = 0  # not written: the write queue was full or Redis was down
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0  # failed Redis calls (connection refused, timeout, ...)
    skipped: int = 0  # lookups or writes skipped while the tier backs off
    read_seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def model_fingerprint(model) -> str:
    """A short hash of a few of the model's weights (its first and last parameters' first
    bytes and their shapes): two replicas with different weights under one model name do
    not share pages."""
    h = hashlib.sha256()
    params = list(model.parameters())
    for p in (params[:2] + params[-2:]) if params else []:
        t = p.detach().flatten()[:4096].float().cpu().contiguous()
        h.update(str(tuple(p.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


class RemoteTier:
    """One replica's client of the shared tier (see the module docstring). ``cache``: the
    engine's cache (through the KV interface: ``read_pages``, ``load_pages``, ``warm_codec``);
    ``model``: for the weights' fingerprint."""

    def __init__(self, config: RemoteConfig, cache, model) -> None:
        import redis

        self.config, self.cache = config, cache
        self._redis_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                              redis.exceptions.ResponseError, redis.exceptions.BusyLoadingError, OSError)
        self.client = redis.Redis.from_url(config.url, socket_timeout=config.timeout,
                                           socket_connect_timeout=config.timeout, health_check_interval=0)
        spec = cache.spec
        self.L, self.kvh, self.P, self.D = spec.num_layers, spec.num_kv_heads, cache.page_size, spec.head_dim
        self.dtype = spec.dtype
        warm = cache.warm_codec if config.codec == "warm" else None
        codec_name, self.codec = ("raw", None) if warm is None else warm
        self._secret = config.resolved_secret()
        self.auth = AUTH_SHA256 if self._secret is None else AUTH_HMAC
        auth_name = "sha256" if self._secret is None else "hmac-sha256"
        layout = (f"v{VERSION}|L{self.L}|H{self.kvh}|D{self.D}|P{self.P}|{self.dtype}|{codec_name}|"
                  f"{model_fingerprint(model)}|{auth_name}")
        self.layout_id = hashlib.sha256(layout.encode()).digest()[:16]
        self.layout = self.layout_id[:8].hex()
        self.layout_text = layout
        self.stats = RemoteStats()
        self._known: OrderedDict[bytes, None] = OrderedDict()  # keys this replica wrote or read (not rewritten)
        self._known_cap = 1 << 16
        self._down_until = 0.0
        self._delay = config.backoff
        self._lock = threading.Lock()  # stats and backoff, shared with the writer thread
        self._queue: queue.Queue = queue.Queue(maxsize=config.write_queue)
        self._writer = threading.Thread(target=self._write_loop, name="tieredkv-remote-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ keys, entries
    def key(self, chain_key: bytes) -> str:
        return f"{self.config.namespace}:{self.layout}:{chain_key.hex()}"

    @property
    def raw_page_bytes(self) -> int:
        return 2 * self.L * self.kvh * self.P * self.D * torch.tensor([], dtype=self.dtype).element_size()

    def _digest(self, head: bytes, payload) -> bytes:
        h = hashlib.sha256() if self._secret is None else hmac.new(self._secret, digestmod=hashlib.sha256)
        h.update(head)
        h.update(payload)
        return h.digest()

    def entry(self, chain_key: bytes, payload: bytes) -> bytes:
        """The stored value of one page: its header (naming the chain key and the layout), the
        digest of header and payload (SHA-256, or HMAC-SHA256 with the shared secret), the payload."""
        head = _HEAD.pack(MAGIC, VERSION, self.auth, self.layout_id, len(chain_key)) + chain_key
        return head + self._digest(head, payload) + payload

    def header_bytes(self, chain_key: bytes) -> int:
        return _HEAD.size + len(chain_key) + _DIGEST

    @property
    def entry_bytes(self) -> int:
        """Bytes one page's payload takes (the header adds :meth:`header_bytes`)."""
        if self.codec is None:
            return self.raw_page_bytes
        from tieredkv.plugins.codec import page_bytes

        return self.L * page_bytes(self.codec, self.kvh, self.P, self.D)

    def _payload(self, k: torch.Tensor, v: torch.Tensor) -> bytes:
        """One page's K, V [L, KVH, P, D] as bytes."""
        if self.codec is not None:
            from tieredkv.plugins.codec import encode_pages

            return encode_pages(k, v, self.codec).numpy().tobytes()
        return k.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes() + \
            v.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()

    def _unpack(self, blob: bytes | None, chain_key: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K, V [L, KVH, P, D] of an entry verified to be ``chain_key``'s page in this layout;
        None when it is unusable."""
        if blob is None or len(blob) < _HEAD.size:
            return None
        magic, version, auth, layout_id, key_len = _HEAD.unpack_from(blob)
        start = _HEAD.size + key_len + _DIGEST
        if (magic != MAGIC or version != VERSION or auth != self.auth or layout_id != self.layout_id
                or len(blob) < start or blob[_HEAD.size: _HEAD.size + key_len] != chain_key):
            return None
        view = memoryview(blob)
        payload = view[start:]
        if not hmac.compare_digest(self._digest(view[: _HEAD.size + key_len], payload), blob[start - _DIGEST: start]):
            return None
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if self.codec is not None:
            from tieredkv.plugins.codec import decode_pages, page_bytes

            n = page_bytes(self.codec, self.kvh, self.P, self.D)
            if data.numel() != self.L * n:
                return None
            return decode_pages(data.view(self.L, n), self.codec, (self.kvh, self.P, self.D))
        if data.numel() != self.raw_page_bytes:
            return None
        kv = data.view(self.dtype).view(2, self.L, self.kvh, self.P, self.D)
        return kv[0], kv[1]

    # ------------------------------------------------------------------ availability
    def _available(self) -> bool:
        with self._lock:
            if time.monotonic() < self._down_until:
                self.stats.skipped += 1
                return False
            return True

    def _failed(self) -> None:
        with self._lock:
            self.stats.errors += 1
            self._down_until = time.monotonic() + self._delay
            self._delay = min(self._delay * 2, self.config.max_backoff)

    def count_error(self) -> None:
        """A failure outside Redis (writing fetched pages into the cache): counted, no backoff."""
        with self._lock:
            self.stats.errors += 1

    def _ok(self) -> None:
        with self._lock:
            self._delay = self.config.backoff

    def _remember(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > self._known_cap:
            self._known.popitem(last=False)

    # ------------------------------------------------------------------ reads (engine thread)
    def fetch(self, chain_keys: Sequence[bytes]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The pages of the longest run of ``chain_keys`` the tier holds intact, in order (K, V
        [L, KVH, P, D] each); empty when Redis is down."""
        if not chain_keys or not self._available():
            return []
        t0 = time.perf_counter()
        try:
            blobs = self.client.mget([self.key(k) for k in chain_keys])
        except self._redis_errors:
            self._failed()
            return []
        self._ok()
        pages = []
        with self._lock:
            self.stats.queried_pages += len(chain_keys)
            for key, blob in zip(chain_keys, blobs):
                if blob is None:
                    self.stats.miss_pages += 1
                    break
                page = self._unpack(blob, key)
                if page is None:
                    self.stats.corrupt_pages += 1
                    break
                self.stats.bytes_read += len(blob)
                pages.append(page)
            self.stats.hit_pages += len(pages)
            self.stats.read_seconds += time.perf_counter() - t0
        self._remember(chain_keys[:len(pages)])
        return pages

    def load_into(self, seq_id: int, pages: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write fetched pages after sequence ``seq_id``'s tokens (a page boundary) through the
        cache's write path (``load_pages``). Returns the tokens written."""
        k = torch.stack([p[0] for p in pages], dim=1)  # [L, n, KVH, P, D]
        v = torch.stack([p[1] for p in pages], dim=1)
        self.cache.load_pages(seq_id, k, v)
        return len(pages) * self.P

    # ------------------------------------------------------------------ writes
    def publish(self, chain_keys: Sequence[bytes], records: Sequence[int]) -> None:
        """Queue newly indexed pages for writing (engine thread: reads their K/V now)."""
        todo = [(key, rec) for key, rec in zip(chain_keys, records) if key not in self._known]
        if not todo:
            return
        with self._lock:
            down = time.monotonic() < self._down_until
        if down:
            with self._lock:
                self.stats.dropped_writes += len(todo)
            return
        k, v = self.cache.read_pages([rec for _, rec in todo])  # [L, n, KVH, P, D], host memory
        for i, (key, _) in enumerate(todo):
            try:
                self._queue.put_nowait((key, self._payload(k[:, i], v[:, i])))
            except queue.Full:
                with self._lock:
                    self.stats.dropped_writes += 1
                continue
            self._remember([key])

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            batch = [item]
            while len(batch) < 64:  # one pipeline per burst
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # seen after this batch
                    self._queue.task_done()
                    break
                batch.append(nxt)
            self._write(batch)
            for _ in batch:
                self._queue.task_done()

    def _write(self, batch: list[tuple[bytes, bytes]]) -> None:
        if not self._available():
            with self._lock:
                self.stats.dropped_writes += len(batch)
            return
        entries = [(self.key(key), self.entry(key, payload)) for key, payload in batch]
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, value in entries:
                pipe.set(name, value, ex=self.config.ttl_seconds)
            pipe.execute()
        except self._redis_errors:
            self._failed()
            with self._lock:
                self.stats.dropped_writes += len(batch)
            return
        self._ok()
        with self._lock:
            self.stats.written_pages += len(entries)
            self.stats.bytes_written += sum(len(v) for _, v in entries)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued page is written (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout``), stop the writer, close the connections."""
        if self._writer.is_alive():
            self.flush(timeout)
            self._queue.put(None)
            self._writer.join(timeout)
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass

    # ------------------------------------------------------------------ metrics
    def metric_samples(self) -> list[tuple[str, str, str, list]]:
        s = self.stats
        one = lambda v: [({}, float(v))]  # noqa: E731
        return [
            ("remote_pages_total", "counter", "remote KV tier pages, by outcome (hit: read and used; miss: absent; "
             "corrupt: failed verification, recomputed; written; dropped: not written)",
             [({"outcome": o}, float(getattr(s, f"{o}_pages" if o != "dropped" else "dropped_writes")))
              for o in ("hit", "miss", "corrupt", "written", "dropped")]),
            ("remote_bytes_total", "counter", "bytes to and from the remote KV tier",
             [({"direction": "read"}, float(s.bytes_read)), ({"direction": "written"}, float(s.bytes_written))]),
            ("remote_errors_total", "counter", "failed remote KV tier calls (the tier is skipped while it backs off)",
             one(s.errors)),
        ]
