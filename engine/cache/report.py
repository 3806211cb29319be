"""The manager's state as data: ``snapshot`` (KVState.canonical's form) and ``metrics``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvscope.engine.events import schema as S

if TYPE_CHECKING:
    from kvscope.engine.cache.view import CacheView


def snapshot(m: CacheView) -> dict[str, Any]:
    """The state in exactly the form of ``KVState.canonical()`` (a window group's pool is
    the tier ``schema.group_pool("gpu", 1)``, its host pool ``group_pool("cpu", 1)``; a
    sequence's held blocks in them its ``group_tables["1"]``, present when it holds any)."""
    pools = dict(m.pools)
    window = getattr(m, "window", None)
    if window is not None:
        pools[S.group_pool("gpu", 1)] = window.pool
        if window.host is not None:
            pools[S.group_pool("cpu", 1)] = window.host

    def groups(s) -> dict[str, Any]:
        held = s.window_table[s.window_first:] if window is not None else []
        return {"group_tables": {"1": list(held)}} if held else {}

    return {
        "tiers": {
            name: {
                "num_blocks": p.num_blocks,
                "block_size": p.block_size,
                "format": p.kv_format,
                "ref": list(p.ref),
                "hash": [None if e is None else e[0] for e in p.entry],
                "block_formats": _block_formats(p),
            }
            for name, p in sorted(pools.items())
        },
        "seqs": {
            sid: {
                "status": s.status,
                "tier": s.tier,
                "block_table": list(s.block_table),
                "num_tokens": s.num_tokens,
                **groups(s),
            }
            for sid, s in sorted(m.sequences.items())
        },
    }


def _block_formats(pool) -> dict[int, str]:
    """Blocks whose format differs from the tier's (demoted pages; engine.cache.mixed_pool)."""
    fmt = getattr(pool, "fmt", None)
    if fmt is None:
        return {}
    return {b: f for b, f in enumerate(fmt) if f != pool.kv_format}


def _block_usage(pool) -> float:
    if not hasattr(pool, "num_frames"):
        return pool.num_used_blocks / pool.num_blocks
    return (pool.num_frames - len(pool.free_frames) - pool.num_reclaimable) / pool.num_frames


def metrics(m: CacheView) -> dict[str, Any]:
    """Counters and gauges of the cache (gpu tier unless per tier):

    tiers               {tier: {"total", "used", "cached", "free"}} blocks: used = ref > 0,
                        cached = ref 0 but hashed (evictable), free = ref 0 unhashed; the
                        shape of the step stats' "tiers" map (schema docstring)
    block_usage         used / total blocks (a mixed-precision pool, --kv-demotion: frames
                        held by pages in use / frames; "tiers" stays in block ids, which
                        is what the event mirror and the block map count)
    token_usage         used_tokens / (total blocks * block_size)
    used_tokens         token slots filled in used blocks (a shared block counts once):
                        differs from used blocks * block_size by the partial last blocks
    prefix_query_tokens tokens looked up by match_prefix; prefix_hit_tokens of them hit
    prefix_hit_rate     hit / query tokens
    stored_blocks       blocks ever indexed; evictions: cached blocks ever evicted
    cow_copies          copy-on-write copies; preemptions; num_seqs (known sequences)
    demoted_blocks      blocks ever demoted (a block demoted twice counts twice)
    cpu tier (zeros without one):
    swapped             sequences swapped out now; swap_outs, swap_ins: sequences moved
    swap_out_blocks     table entries moved to the host (a block shared on the host counts
                        per holder); swap_in_blocks likewise back
    copied_out_blocks   gpu -> host block copies (swap-outs and write-backs, the transfer
                        volume); copied_in_blocks host -> gpu (swap-ins and host hits)
    offloaded_blocks    evicted cached gpu blocks written back to the host
    host_hit_tokens     prefix tokens loaded from the host instead of recomputed (also in
                        prefix_hit_tokens)
    swap_fallbacks      swap preemptions done by recompute because the host was full
    """
    tiers = {
        name: {
            "total": p.num_blocks,
            "used": p.num_used_blocks,
            "cached": p.num_cached_free_blocks,
            "free": len(p.free_blocks),
        }
        for name, p in m.pools.items()
    }
    gpu, bs = m.gpu, m.block_size
    # Tokens held: every used block is full except the partial last blocks; a shared
    # partial block has the same fill for all holders (appending to it copies first).
    unfilled = {
        s.block_table[-1]: bs - s.num_tokens % bs
        for s in m.sequences.values() if s.num_tokens % bs
    }
    used_tokens = gpu.num_used_blocks * bs - sum(unfilled.values())
    h = m.host
    return {
        "tiers": tiers,
        "block_usage": _block_usage(gpu),
        "token_usage": used_tokens / (gpu.num_blocks * bs),
        "used_tokens": used_tokens,
        "prefix_query_tokens": m.num_query_tokens,
        "prefix_hit_tokens": m.num_hit_tokens,
        "prefix_hit_rate": m.num_hit_tokens / max(1, m.num_query_tokens),
        "stored_blocks": gpu.num_stored,
        "evictions": gpu.num_evictions,
        "cow_copies": m.num_cow_copies,
        "demoted_blocks": getattr(gpu, "num_demoted", 0),
        "preemptions": m.num_preemptions,
        "num_seqs": len(m.sequences),
        "swapped": m.num_swapped,
        "swap_outs": h.num_swap_outs if h else 0,
        "swap_ins": h.num_swap_ins if h else 0,
        "swap_out_blocks": h.swapped_out_blocks if h else 0,
        "swap_in_blocks": h.swapped_in_blocks if h else 0,
        "copied_out_blocks": h.copied_out_blocks if h else 0,
        "copied_in_blocks": h.copied_in_blocks if h else 0,
        "offloaded_blocks": h.offloaded_blocks if h else 0,
        "host_hit_tokens": h.host_hit_blocks * bs if h else 0,
        "swap_fallbacks": m.num_swap_fallbacks,
    }
