"""Loads and stores without masks, where every dimension of a GEMM is a whole number of its tiles.

A program's tile may run past the edge of its matrix (the last row block of 1,000 rows in tiles of 64, say), so
version 4's GEMM kernels load every tile with a mask (the lanes past the edge read 0) and store it with one (those
lanes are not written). Where each dimension is a whole number of tiles no lane is ever past an edge, and the masks
only cost instructions: the comparisons, and predicated copies where plain ones would do. The seed model's shapes
(where version 4 runs these GEMMs) are whole numbers of the tiles the kernels take, so the kernels take the constexpr
WHOLE_TILES: with it, load_tile and store_tile compile to plain loads and stores, and the mask expression, then
unused, is dropped by the compiler. The wrapper asks whole_tiles(config, M=..., N=..., K=...) for each launch; any
other shape keeps the masks (the small preset's feed-forward width, 1,376, for one). Version 4's attention uses the
same helpers for the rows of its sequence (flash_attention.py: _whole_blocks, _load_rows, _store_rows).
"""
import triton
import triton.language as tl


@triton.jit
def load_tile(pointers, mask, WHOLE_TILES: tl.constexpr, other=0.0):
    """tl.load of a tile; lanes outside `mask` read `other` (0 unless said), unless WHOLE_TILES says there are
    none."""
    if WHOLE_TILES:
        tile = tl.load(pointers)
    else:
        tile = tl.load(pointers, mask=mask, other=other)
    return tile


@triton.jit
def store_tile(pointers, tile, mask, WHOLE_TILES: tl.constexpr):
    """tl.store of a tile; lanes outside `mask` are not written, unless WHOLE_TILES says there are none."""
    if WHOLE_TILES:
        tl.store(pointers, tile)
    else:
        tl.store(pointers, tile, mask=mask)


def whole_tiles(config: dict, **sizes: int) -> bool:
    """Is each size a whole number of its tile? Each keyword names an axis: M=1024 is checked against
    config["BLOCK_M"]. E.g. whole_tiles(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), M=1024, N=512, K=256) is True."""
    return all(size % config[f"BLOCK_{axis}"] == 0 for axis, size in sizes.items())
