"""Chunking: run a memory-amplifying region of a joint graph slice by slice.

`kinds`: how each kind of op carries a sliced dim (declared per op in the rule files);
`region`: the regions and per-value chunk metadata a backend builds; `grow`: how a region
grows from a chunk rule's match (its docstring says how).
"""
from .grow import grow_chunk
from .kinds import CHUNK_KINDS, INDEXED, TYPE_ONLY, DimMap, Refused, dim_map, reshape_map
from .region import (ChunkMeta, ChunkPhase, ChunkRegion, Rows, even_slices, grouped, inside_groups, shifted_edges,
                     slice_sizes)

__all__ = ["CHUNK_KINDS", "INDEXED", "TYPE_ONLY", "ChunkMeta", "ChunkPhase", "ChunkRegion", "DimMap",
           "Refused", "Rows", "dim_map", "even_slices", "grouped", "grow_chunk", "inside_groups", "reshape_map",
           "shifted_edges", "slice_sizes"]
