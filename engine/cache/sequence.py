"""CacheSeq: what the cache manager knows about one sequence (a plain record)."""

from __future__ import annotations

from typing import Any


class CacheSeq:
    """One sequence's cache bookkeeping.

    Invariants (checked by ``check_invariants``):
    - ``len(block_table) == ceil(num_tokens / block_size)``: blocks are allocated on
      demand, so at most the last block has unfilled slots;
    - ``token_ids`` may run ahead of ``num_tokens`` (sampled tokens whose slots come next
      step) or, with lookahead allocation, behind it;
    - the first ``num_stored`` blocks of the table have been offered to the prefix index
      (hit, stored, or found duplicate); ``chain_hash`` is the hash of the last of them
      (``root_hash`` when none) and ``chain_id`` the serial of the cache entry holding
      its content (``root_id`` when none), or None when that could not be proven (then
      no later block is indexed). Only the tip is kept: the next block needs no more.
    - ``tier`` is the pool ``block_table`` points into: "cpu" exactly while the sequence
      is swapped out (status "swapped"); it keeps the last tier when the table empties,
      as the event mirror does.
    """

    __slots__ = (
        "seq_id", "token_ids", "num_prompt_tokens", "num_tokens", "block_table", "status",
        "started", "priority", "cache_salt", "root_hash", "root_id", "chain_hash", "chain_id",
        "num_stored", "reported_tokens", "tier", "prompt_written",
    )

    def __init__(
        self, seq_id: str, token_ids: list[int], priority: int, cache_salt: str | None,
        root_hash: int,
    ) -> None:
        self.seq_id = seq_id
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_tokens = 0  # token positions that hold a slot (computed or being computed)
        self.block_table: list[int] = []
        self.status = "waiting"
        self.started = False
        self.priority = priority
        self.cache_salt = cache_salt
        self.root_hash = root_hash
        self.root_id: Any = (cache_salt,)  # parent identity of block 0; never an int serial
        self.chain_hash = root_hash
        self.chain_id: Any = self.root_id
        self.num_stored = 0
        self.reported_tokens = 0  # num_tokens as the event stream last stated it
        self.tier = "gpu"
        # prompt tokens this sequence wrote into the prefix cache (new entries, in whole
        # blocks; kept across preemptions): the API's cache_write_tokens
        self.prompt_written = 0

    def drop_table(self) -> None:
        self.block_table = []
        self.num_tokens = 0
        self.reported_tokens = 0  # the ``free`` event zeroes it in the mirror too
        self.chain_hash = self.root_hash
        self.chain_id = self.root_id
        self.num_stored = 0
