"""Block allocation, prefix sharing, eviction order and forks of the paged KV cache."""

import pytest

from server.engine.block_manager import NULL_BLOCK, BlockManager, BlockTable


def admitted(manager: BlockManager, tokens: list[int], salt: int = 0) -> BlockTable:
    table = BlockTable(salt=salt)
    assert manager.admit(table, tokens)
    return table


def finish(manager: BlockManager, table: BlockTable, tokens: list[int]) -> None:
    """The sequence's tokens were computed and cached; it ends."""
    table.commit(tokens[table.num_tokens :])
    manager.free(table)


def test_blocks_cover_the_prompt_and_never_the_null_block():
    manager = BlockManager(num_blocks=8, block_size=4)
    table = admitted(manager, list(range(10)))
    assert len(table.blocks) == 3 and NULL_BLOCK not in table.blocks
    assert manager.num_free == 7 - 3
    assert table.num_tokens == 0  # nothing cached yet: everything is computed


def test_shared_prefix_is_reused_but_last_token_is_always_computed():
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # exactly three blocks
    first = admitted(manager, prompt)
    finish(manager, first, prompt)
    again = admitted(manager, prompt)  # the same prompt: two blocks reused, the third recomputed
    assert again.reused_tokens == 8 and again.tokens == prompt[:8]
    longer = admitted(manager, prompt + [7, 8, 9])  # shares all three of the first's blocks
    assert longer.reused_tokens == 12
    assert longer.blocks[:2] == again.blocks[:2]


def test_different_salt_or_tokens_do_not_match():
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    finish(manager, admitted(manager, prompt, salt=1), prompt)
    assert admitted(manager, prompt, salt=2).reused_tokens == 0
    assert admitted(manager, [0, 1, 2, 99, 4, 5, 6, 7, 8], salt=1).reused_tokens == 0
    assert admitted(manager, prompt, salt=1).reused_tokens == 8


def test_prefix_caching_off_never_shares():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    prompt = list(range(9))
    finish(manager, admitted(manager, prompt), prompt)
    assert admitted(manager, prompt).reused_tokens == 0


def test_shared_blocks_are_reference_counted():
    manager = BlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    a = admitted(manager, prompt)
    a.commit(prompt)
    manager.register_full_blocks(a)  # a is still running; its full blocks can be shared
    b = admitted(manager, prompt)
    assert b.blocks[:2] == a.blocks[:2]
    manager.free(a)
    assert manager.num_free == 7 - 3  # b still holds the shared two and its own third
    manager.free(b)
    assert manager.num_free == 7


def test_oldest_freed_block_is_evicted_first_and_loses_its_key():
    manager = BlockManager(num_blocks=6, block_size=2)  # 5 usable blocks
    old, new = [1, 2, 3], [4, 5, 6]
    finish(manager, admitted(manager, old), old)
    finish(manager, admitted(manager, new), new)
    filler = admitted(manager, [9, 9, 9, 9, 9, 9])  # 3 of 5 free blocks: old's go before new's
    assert admitted(manager, new).reused_tokens == 2
    manager.free(filler)
    assert admitted(manager, old).reused_tokens == 0


def test_admit_respects_reserve_and_takes_nothing_on_failure():
    manager = BlockManager(num_blocks=5, block_size=4)  # 4 usable blocks
    table = BlockTable()
    assert not manager.admit(table, list(range(17)))  # 5 blocks needed
    assert table.blocks == [] and manager.num_free == 4
    assert not manager.admit(table, list(range(16)), reserve=1)
    assert manager.admit(table, list(range(12)), reserve=1)  # 3 blocks + 1 in reserve
    assert not manager.admit(BlockTable(), [1, 2, 3, 4, 5])
    assert manager.num_free == 1


def test_ensure_grows_and_refuses_without_taking():
    manager = BlockManager(num_blocks=4, block_size=4)
    table = admitted(manager, [1, 2, 3])
    assert manager.ensure(table, 4) and len(table.blocks) == 1
    assert manager.ensure(table, 12) and len(table.blocks) == 3
    assert not manager.ensure(table, 13) and len(table.blocks) == 3


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    manager = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(6))
    table = admitted(manager, prompt)
    table.commit(prompt)
    branch, copy = manager.fork(table, extra_tokens=5)
    assert branch.blocks[0] == table.blocks[0]
    assert copy == (table.blocks[1], branch.blocks[1])
    assert len(branch.blocks) == 3  # 6 + 5 tokens
    manager.free(branch)
    manager.free(table)
    assert manager.num_free == 9


def test_fork_refuses_when_blocks_run_out():
    manager = BlockManager(num_blocks=3, block_size=4)
    table = admitted(manager, [1, 2, 3, 4, 5])
    table.commit([1, 2, 3, 4, 5])
    assert manager.fork(table, extra_tokens=8) is None
    assert manager.num_free == 0


def test_truncate_keeps_blocks_and_drops_tokens():
    manager = BlockManager(num_blocks=6, block_size=2)
    table = admitted(manager, [1, 2, 3])
    table.commit([1, 2, 3])
    assert manager.ensure(table, 6)
    table.commit([4, 5, 6])
    table.truncate(4)
    assert table.tokens == [1, 2, 3, 4] and len(table.blocks) == 3


def test_too_few_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(num_blocks=1, block_size=16)
