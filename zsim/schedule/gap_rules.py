"""How many repeated blocks a shortened step keeps and drops: one home for the rules the engine's
detector (zsim/engine/layer_blocks.py) and ZeRO-3's builder (layer_skip.py) both apply."""
from __future__ import annotations

# periodic blocks simulated before a window: the three periods compared (layer_repeat._window)
# end with it, and one more that may still be settling from the blocks before the run; more when
# a block waits on (or frees a buffer of) a block further back (its reach)
SETTLING_BLOCKS = 3

# the longest period, in layers, tried: IPG buckets that span a few layers repeat every few
# layers; also how far back (and ahead) the builder compares its state as offsets (ZeRO-3
# prefetches several layers ahead when a rank's share of a layer is small)
MAX_PERIOD_LAYERS = 8


def least_copies(reach: int, p: int) -> int:
    """Chunks of `p` layers a gap must drop so that what a kept block after it refers to in the
    gap stands in for a kept op no kept block after the gap refers to itself (fewer, and two
    references would name one op: its buffer freed twice)."""
    return max(1, -(-reach // p))


def settle_chunks(reach: int, p: int) -> int:
    """Periodic chunks of `p` layers kept before a window: SETTLING_BLOCKS, or enough that a
    block `reach` layers on refers back to kept ones only (the window is one more)."""
    return max(SETTLING_BLOCKS, least_copies(reach, p) - 1)
