"""Prefix reuse across requests, tier-aware (docs/serving.md).

Every *full* page of a request's tokens gets a key: a hash chained over the prefix —
``key(page i) = H(key(page i-1) || the page's token ids)``, where the chain starts from the
hash of the request's *extra keys* (the model id and an optional cache salt, each written
with its own tag, so no salt can be mistaken for another key or another salt). H is SHA-256
by default (any ``hashlib`` name). Equal keys mean equal tokens from the start of the
sequence, under the same model and salt: the page's K/V are the same.

The :class:`PrefixIndex` maps keys to records of a :class:`~tieredkv.runtime.tiered.cache.
TieredKVCache` and holds one reference on each (the page table's ``cached`` flag), so a page
outlives the request that computed it. A page no request lists sits in an LRU queue but
keeps its key; when the device needs the room, the tier manager demotes it like any page —
to the host, then the disk — *still indexed*: a later request with the same prefix lists it
again (its pages come back to the device when attended) instead of recomputing it.
``PrefixConfig.tiers`` bounds how far down an unlisted page stays indexed (``device``: a page
leaving the device is forgotten; ``host``; ``disk``), ``max_cached_pages`` how many unlisted
pages are kept (LRU beyond). Partial pages are never shared; a request reuses at most
``(len(prompt) - 1) // page_size`` pages (its last prompt token is always computed: it gives
the first logits).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tieredkv.errors import ConfigError, short

#: the tiers an unlisted cached page may stay indexed in, top down
PREFIX_TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class PrefixConfig:
    """``tiers``: the lowest tier an unlisted cached page stays indexed in; ``max_cached_pages``:
    unlisted pages kept (None: as many as the tiers hold); ``hash``: a ``hashlib`` algorithm."""

    tiers: str = "disk"
    max_cached_pages: int | None = None
    hash: str = "sha256"

    def __post_init__(self) -> None:
        if self.tiers not in PREFIX_TIERS:
            raise ConfigError(f"prefix tiers must be one of {list(PREFIX_TIERS)}, got {short(self.tiers)}")
        if self.max_cached_pages is not None and (not isinstance(self.max_cached_pages, int)
                                                  or isinstance(self.max_cached_pages, bool)
                                                  or self.max_cached_pages < 0):
            raise ConfigError(f"max_cached_pages must be a non-negative integer or None, got "
                              f"{short(self.max_cached_pages)}")
        if self.hash not in hashlib.algorithms_available:
            raise ConfigError(f"prefix hash {short(self.hash)} is not a hashlib algorithm; expected e.g. 'sha256'")


def root_key(*, model_id: str, salt: str | None, hash_name: str = "sha256") -> bytes:
    """The chain's start: the hash of the extra keys, each a (tag, value) pair."""
    if not isinstance(model_id, str):
        raise ConfigError(f"model_id must be a string, got {short(model_id)}")
    if salt is not None and not isinstance(salt, str):
        raise ConfigError(f"cache salt must be a string or None, got {short(salt)}")
    extra = [["tieredkv-prefix", 1], ["model", model_id]] + ([["salt", salt]] if salt is not None else [])
    return hashlib.new(hash_name, json.dumps(extra, ensure_ascii=True).encode()).digest()


@dataclass
class HashChain:
    """The keys of a token sequence's full pages, extended as the sequence grows."""

    root: bytes
    page_size: int
    hash_name: str = "sha256"
    keys: list[bytes] = field(default_factory=list)

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Keys of every full page of ``tokens`` (which start with the pages already keyed); the
        list returned is every key computed so far (it may run ahead of ``tokens``)."""
        P = self.page_size
        for i in range(len(self.keys), len(tokens) // P):
            parent = self.keys[-1] if self.keys else self.root
            page = np.asarray(tokens[i * P:(i + 1) * P], dtype="<i8").tobytes()
            self.keys.append(hashlib.new(self.hash_name, parent + page).digest())
        return self.keys


@dataclass
class PrefixStats:
    """Pages looked up and found, by the tier that held them."""

    lookups: int = 0
    queried_pages: int = 0
    hit_pages: dict[str, int] = field(default_factory=lambda: {t: 0 for t in PREFIX_TIERS})
    published_pages: int = 0
    dropped_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_pages.values()) / self.queried_pages if self.queried_pages else 0.0

    def to_dict(self) -> dict:
        q = max(1, self.queried_pages)
        return {"lookups": self.lookups, "queried_pages": self.queried_pages, "hit_pages": dict(self.hit_pages),
                "hit_rate": round(self.hit_rate, 4),
                "hit_rate_by_tier": {t: round(n / q, 4) for t, n in self.hit_pages.items()},
                "published_pages": self.published_pages, "dropped_pages": self.dropped_pages}


class PrefixIndex:
    """Keys -> records of one tiered cache (see the module docstring).

    Invariants: every indexed record is held once by the index (``cached``) and is a full
    page; key -> record and record -> key are each other's inverse; the LRU queue lists
    exactly the indexed records."""

    def __init__(self, cache, config: PrefixConfig | None = None, *, model_id: str = "model") -> None:
        self.cache, self.config, self.model_id = cache, config or PrefixConfig(), model_id
        self.page_size = cache.page_size
        self._record: dict[bytes, int] = {}
        self._key: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # every indexed record, least recently used first
        self.stats = PrefixStats()
        self.on_publish = None  # called with (keys, records) of newly indexed pages (the remote tier)

    def chain(self, salt: str | None = None) -> HashChain:
        return HashChain(root_key(model_id=self.model_id, salt=salt, hash_name=self.config.hash), self.page_size,
                         self.config.hash)

    def __len__(self) -> int:
        return len(self._record)

    # ------------------------------------------------------------------ lookups
    def match(self, chain: HashChain, prompt: Sequence[int]) -> list[int]:
        """The records of the longest indexed run of ``prompt``'s first full pages (at most
        ``(len(prompt) - 1) // P``), most recently used from now on; counted by tier."""
        records, usable = self._indexed_run(chain, prompt)
        self.stats.lookups += 1
        self.stats.queried_pages += usable
        return self._hit(records, 0)

    def match_more(self, chain: HashChain, prompt: Sequence[int], have: int) -> list[int]:
        """:meth:`match` again for a prompt that found ``have`` pages before (pages published
        since — another request's prefill — may extend its run); counts only the extra hits
        (the lookup and its queried pages were counted the first time)."""
        return self._hit(self._indexed_run(chain, prompt)[0], have)

    def _indexed_run(self, chain: HashChain, prompt: Sequence[int]) -> tuple[list[int], int]:
        """(the records of the longest indexed run of ``prompt``'s first full pages, how many
        pages may be shared: ``(len(prompt) - 1) // P``, the last token is always computed)."""
        usable = (len(prompt) - 1) // self.page_size
        records = []
        for key in chain.extend(prompt)[:usable]:
            rec = self._record.get(key)
            if rec is None:
                break
            records.append(rec)
        return records, usable

    def _hit(self, records: list[int], counted: int) -> list[int]:
        """``records`` found: the ones past the first ``counted`` are counted by tier, and all of
        them are most recently used from now on (when any is new)."""
        if len(records) > counted:
            for tier in self.cache.page_tiers(records[counted:]):
                self.stats.hit_pages[tier] += 1
            for rec in records:
                self._lru.move_to_end(rec)
        return records

    def publish(self, chain: HashChain, seq_id: int, tokens: Sequence[int]) -> int:
        """Index the full pages of sequence ``seq_id`` (whose tokens are ``tokens``) not indexed
        yet; a key already indexed under another record keeps that record. Returns the pages
        newly indexed."""
        keys = chain.extend(tokens)[: len(tokens) // self.page_size]  # the chain may run ahead (match)
        records = self.cache.pages_of(seq_id)[: len(keys)]
        new = []
        for key, rec in zip(keys, records):
            known = self._record.get(key)
            if known is None and rec not in self._key:
                self._record[key], self._key[rec] = rec, key
                self._lru[rec] = None
                new.append(rec)
            elif known is not None:
                self._lru.move_to_end(known)
        if new:
            self.cache.hold_pages(new)
            self.stats.published_pages += len(new)
            if self.on_publish is not None:
                self.on_publish([self._key[r] for r in new], new)
        return len(new)

    # ------------------------------------------------------------------ room
    def unlisted(self) -> list[int]:
        """Indexed records no sequence lists (only the index holds them), least recently used first."""
        recs = list(self._lru)
        if not recs:
            return []
        return [r for r, n in zip(recs, self.cache.page_refs(recs)) if n == 1]

    def drop(self, records: Sequence[int]) -> None:
        records = list(records)
        if not records:
            return
        for rec in records:
            del self._record[self._key.pop(rec)]
            del self._lru[rec]
        self.cache.drop_pages(records)
        self.stats.dropped_pages += len(records)

    def evict(self, n: int) -> int:
        """Drop up to ``n`` unlisted pages, least recently used first; returns how many."""
        victims = self.unlisted()[: max(0, n)]
        self.drop(victims)
        return len(victims)

    def sweep(self) -> None:
        """Keep the index within its bounds: unlisted pages below ``tiers`` are forgotten, and
        beyond ``max_cached_pages`` the least recently used go."""
        unlisted = self.unlisted()
        if self.config.tiers != "disk" and unlisted:
            allowed = PREFIX_TIERS[: PREFIX_TIERS.index(self.config.tiers) + 1]
            below = [r for r, tier in zip(unlisted, self.cache.page_tiers(unlisted)) if tier not in allowed]
            self.drop(below)
            unlisted = [r for r in unlisted if r in self._key]
        cap = self.config.max_cached_pages
        if cap is not None and len(unlisted) > cap:
            self.drop(unlisted[: len(unlisted) - cap])

    def clear(self) -> None:
        self.drop(list(self._lru))

    def check(self) -> None:
        """Raise AssertionError when an invariant (class docstring) does not hold."""
        assert len(self._record) == len(self._key) == len(self._lru)
        assert all(self._key[r] == k for k, r in self._record.items()), "key and record maps disagree"
        recs = list(self._lru)
        if recs:
            assert all(n >= 1 for n in self.cache.page_refs(recs)), "an indexed record is free"
            assert all(self.cache.pages_indexed(recs)), "an indexed record is not held by the index"
        assert self.cache.usage().indexed_pages == len(recs), "the cache holds pages for the index it does not list"
