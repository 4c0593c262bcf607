"""Hands out KV-cache blocks to sequences and keeps full blocks for reuse (prefix caching).

Each sequence owns a :class:`BlockTable`: its blocks in order and the token ids whose keys and
values they hold. A block that is full of *final* tokens gets a key: a hash of its tokens chained
to the key of the block before it (and a salt, such as the LoRA adapter, whose keys differ). A new
sequence whose prompt starts with the same tokens shares those blocks instead of computing them
again (reference counted). Freed blocks keep their contents and key until they are handed out
again, oldest freed first, so a re-sent conversation or a preempted sequence finds its prefix.

Block 0 is reserved: no sequence owns it, so padded rows (CUDA graphs) may write there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

NULL_BLOCK = 0


@dataclass
class BlockTable:
    """One sequence's blocks and the tokens cached in them (``len(tokens)`` = cached length)."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    salt: int = 0  # what else the keys/values depend on (the LoRA adapter)
    num_keyed: int = 0  # leading blocks whose key is registered
    last_key: int | None = None  # key of block ``num_keyed - 1``
    reused_tokens: int = 0  # tokens found in the prefix cache when the sequence was admitted

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def commit(self, tokens: list[int]) -> None:
        """Record tokens whose keys/values were just written after the cached ones."""
        self.tokens.extend(tokens)

    def truncate(self, length: int) -> None:
        """Forget cached tokens past ``length`` (rejected draft tokens); blocks stay allocated."""
        del self.tokens[length:]


class BlockManager:
    """Allocation, sharing and prefix reuse of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks
        self._refs[NULL_BLOCK] = 1  # never handed out
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._by_key: dict[int, int] = {}  # key -> block
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (key, its tokens)
        self.hits = 0  # tokens served from the prefix cache
        self.queries = 0  # prompt tokens looked up

    # ------------------------------------------------------------------ capacity

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached contents included: they are reusable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by sequences."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can hold."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ sequences

    def admit(self, table: BlockTable, tokens: list[int], reserve: int = 0) -> bool:
        """Give a new sequence its cached prefix and blocks for the rest of ``tokens``.

        The longest run of cached full blocks is shared (at least one token is always left to
        compute, so the last one yields logits); those tokens are committed to ``table`` and
        counted in ``table.reused_tokens``. False, with nothing taken, when the blocks left
        would drop below ``reserve``."""
        shared = self._match(tokens, table.salt)
        needed = self.blocks_for(len(tokens)) - len(shared)
        taking_cached = sum(1 for b in shared if self._refs[b] == 0)
        if needed + taking_cached > self.num_free - reserve:
            return False
        for block in shared:
            self._take(block)
        table.blocks = shared + [self._pop_free() for _ in range(needed)]
        table.tokens = list(tokens[: len(shared) * self.block_size])
        table.num_keyed = len(shared)
        table.last_key = self._key_of[shared[-1]][0] if shared else None
        table.reused_tokens = len(table.tokens)
        self.queries += len(tokens)
        self.hits += table.reused_tokens
        return True

    def ensure(self, table: BlockTable, num_tokens: int) -> bool:
        """Make ``table`` hold at least ``num_tokens`` tokens; False (nothing taken) if too few free."""
        needed = self.blocks_for(num_tokens) - len(table.blocks)
        if needed <= 0:
            return True
        if needed > self.num_free:
            return False
        table.blocks.extend(self._pop_free() for _ in range(needed))
        return True

    def register_full_blocks(self, table: BlockTable) -> None:
        """Key the table's blocks that are full of committed tokens, for later sharing."""
        full = min(len(table.tokens) // self.block_size, len(table.blocks))
        while table.num_keyed < full:
            index = table.num_keyed
            block_tokens = tuple(table.tokens[index * self.block_size : (index + 1) * self.block_size])
            key = hash((table.last_key, table.salt, block_tokens))
            block = table.blocks[index]
            if self.enable_prefix_caching and key not in self._by_key and block not in self._key_of:
                self._by_key[key] = block
                self._key_of[block] = (key, block_tokens)
            table.num_keyed, table.last_key = index + 1, key

    def free(self, table: BlockTable) -> None:
        """Release the table's blocks (last first, so a prefix outlives its tail)."""
        self.register_full_blocks(table)
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        table.blocks, table.tokens, table.num_keyed, table.last_key = [], [], 0, None

    def fork(self, table: BlockTable, extra_tokens: int) -> tuple[BlockTable, tuple[int, int] | None] | None:
        """A temporary branch of ``table`` that can take ``extra_tokens`` more tokens: full blocks
        shared, the partly filled last block copied. Returns (branch, (src, dst) block copy or
        None), or None when too few blocks are free. Free the branch with :meth:`free`."""
        length = table.num_tokens
        full = length // self.block_size
        partial = length % self.block_size != 0
        needed = self.blocks_for(length + extra_tokens) - full
        if needed > self.num_free:
            return None
        for block in table.blocks[:full]:
            self._take(block)
        fresh = [self._pop_free() for _ in range(needed)]
        branch = BlockTable(blocks=table.blocks[:full] + fresh, tokens=list(table.tokens), salt=table.salt)
        branch.num_keyed, branch.last_key = table.num_keyed, table.last_key  # keyed blocks are full ones
        copy = (table.blocks[full], fresh[0]) if partial else None
        return branch, copy

    # ------------------------------------------------------------------ internals

    def _match(self, tokens: list[int], salt: int) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        key = None
        for index in range((len(tokens) - 1) // self.block_size):
            block_tokens = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            key = hash((key, salt, block_tokens))
            block = self._by_key.get(key)
            if block is None or self._key_of[block][1] != block_tokens:
                break
            blocks.append(block)
        return blocks

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        cached = self._key_of.pop(block, None)
        if cached is not None:
            del self._by_key[cached[0]]
        self._refs[block] = 1
        return block
