"""Distributed arrays, as torch's DTensor has them: a local array, the global shape and a
placement per mesh axis, moved between placements with the fewest collectives and multiplied
under named policies.

    placement       Shard / Replicate / Partial, one per mesh axis
    splits          how one dimension is cut over p ranks (even, given sizes, whole units,
                    the vocabulary's padded cut): pure math, shared with the checkpoint
    piece_layout    where each rank's piece lies, checked at every coordinate
    darray          ``DArray``: made from a whole array or pieces, redistributed, gathered
    redistribute    the steps from one list of placements to another, and running them
    sharded_matmul  Y = A B under named policies (Megatron's column/row, SUMMA-like ...)
    feedforward     Y = act(X W1) W2 under three tensor-parallel policies

Why a package of its own (docs/design.md §11): the model layers (``tensor_parallel``) keep
Megatron's explicit form, local arrays and a named collective where the math needs one, which
is what a kernel and a CUDA graph want; the distributed arrays are the general form, for
programs that place arrays on a mesh and let the placements choose the collectives. Both
cut a dimension by the same rules (``splits``), and a checkpoint's pieces are written with the
same placements.
"""

from ..exports import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    ".placement": ("Partial", "Placement", "Replicate", "Shard"),
    ".splits": ("ShardingError", "bounds", "even_sizes", "merge", "split"),
    ".piece_layout": ("PlacementError",),
    ".darray": ("DArray",),
    ".redistribute": ("redistribution_steps",),
    ".sharded_matmul": ("POLICIES", "PolicyError", "matmul", "matmul_backward",
                        "matmul_communication", "matmul_forward"),
    ".feedforward": ("ACTIVATIONS", "FFN_POLICIES", "FeedForward"),
})
