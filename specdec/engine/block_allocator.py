"""KV block ids for requests: one block table shared by the target and the draft head."""


class BlockAllocator:
    """Hands out KV block ids; every model (target and draft) shares one block table."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))

    def ensure(self, block_ids: list[int], num_positions: int) -> None:
        """Grow ``block_ids`` in place to cover positions ``[0, num_positions)``."""
        needed = -(-num_positions // self.block_size) - len(block_ids)
        if needed > len(self.free):
            raise RuntimeError(
                f"out of KV blocks: need {needed}, {len(self.free)} free; raise num_kv_blocks"
            )
        for _ in range(max(needed, 0)):
            block_ids.append(self.free.pop())

    def release(self, block_ids: list[int]) -> None:
        self.free.extend(reversed(block_ids))
        block_ids.clear()
