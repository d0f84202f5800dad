"""Megatron's tensor parallelism, for any model: a weight split over a tp group and a named
collective where the math needs one.

    mappings   the conjugate communication operators (f, g and their kin), each a forward
               and its backward
    layers     ``ColumnParallelLinear`` and ``RowParallelLinear``
    vocab      the vocabulary-parallel embedding, LM head and cross-entropy

Each layer takes ``sequence_axis`` for Megatron's sequence parallelism (see ``layers``).
"""

from ..exports import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    ".mappings": ("CopyToGroup", "GatherFromGroup", "ReduceFromGroup", "ReduceScatterToGroup",
                  "ScatterToGroup", "f", "g"),
    ".layers": ("ColumnParallelLinear", "RowParallelLinear"),
    ".vocab": ("ParallelLMHead", "VocabParallelCrossEntropy", "VocabParallelEmbedding"),
})
