"""Prefix-cache block hashes: deterministic 64-bit ints, chained from a per-salt root.

    h(block i) = hash((h(block i-1), tokens_i))      h(block -1) = root_hash(cache_salt)

``hash`` is CPython's tuple hash over ints. It is fast (several times cheaper than packing
the ints to bytes for blake2b or sha256) and deterministic across processes:
PYTHONHASHSEED randomizes only str/bytes hashes, never int or tuple-of-int hashes (the int
hash is fixed by the language; the tuple hash has been CPython's xxHash-style combiner
since 3.8, on 64-bit builds a signed 64-bit value, so it fits msgpack int64). The one
string in a key, the cache salt, goes through blake2b once per request instead.

The hash is NOT collision resistant, so it is only an index, never proof: a hit is
verified by exact comparison (see ``BlockPool``): the cached block's token ids must equal
the request's and its parent must be the very cache entry the request matched one block
earlier (a unique serial), not merely an entry with an equal hash. A crafted collision
therefore costs a cache miss, never a wrong hit (the attack that made vLLM move from
builtin ``hash`` to sha256).
"""

from __future__ import annotations

import hashlib

# Root of every unsalted chain: "kvscope" in ASCII, a fixed constant (never a str hash).
NO_SALT_ROOT = 0x6B7673636F7065


def root_hash(cache_salt: str | None) -> int:
    """The parent hash of a request's first block: salts separate tenants' caches."""
    if cache_salt is None:
        return NO_SALT_ROOT
    digest = hashlib.blake2b(
        cache_salt.encode("utf-8"), digest_size=8, person=b"kvscope-salt"
    ).digest()
    return int.from_bytes(digest, "little", signed=True)


def block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """The chained hash of one full block (the manager inlines this in its loops)."""
    return hash((parent_hash, tokens))


def chain_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Hashes of every full block of ``token_ids``; the reference the tests compare with."""
    out, parent = [], root_hash(cache_salt)
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out
