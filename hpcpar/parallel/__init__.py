"""hpcpar's parallel core, for any NumPy/CuPy model under mpiexec (SPMD: every rank runs the
same program). See the README's "Use it as a library" and its reference section.

    from mpi4py import MPI
    import hpcpar.parallel as hp

    mesh = hp.Mesh(MPI.COMM_WORLD, {"dp": 2, "tp": -1})
    w = hp.DArray.from_full(weight, mesh, {"tp": hp.Shard(1)})
    y = hp.matmul(x, w)                      # the policy follows from the placements

The pieces, one module each: ``mesh`` (named axes, groups), ``placement`` (Shard /
Replicate / Partial), ``splits`` (the split rules), ``darray`` and ``redistribute``
(distributed arrays), ``matmul`` and ``feedforward`` (sharded products under named policies),
``mappings`` (Megatron's f and g), ``layers`` (column-, row- and vocabulary-parallel layers),
``params``, ``data_parallel`` and ``optim`` (parameters, gradient buckets, SGD/AdamW), and
``hpcpar.pipeline`` (schedules as data, and the executor that runs stage functions).
"""

from ..comm import Communicator, Request, create_communicator
from ..errors import CommError, CommTimeout, HpcparError, PeerFailed
from ..pipeline.partition import stage_layer_counts, stage_layers
from ..pipeline.runner import Pipeline, Stage, concat_micro_batches, split_micro_batches
from ..pipeline.schedule import bubble_fraction, draw
from ..pipeline.training_schedules import (TRAINING_SCHEDULES, bubble_formula,
                                           training_schedule)
from .darray import DArray, PlacementError
from .data_parallel import GradientReducer, grad_norm
from .feedforward import ACTIVATIONS, FFN_POLICIES, FeedForward
from .layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                     VocabParallelCrossEntropy, VocabParallelEmbedding)
from .mappings import (CopyToGroup, GatherFromGroup, ReduceFromGroup, ReduceScatterToGroup,
                       ScatterToGroup, f, g)
from .matmul import POLICIES, PolicyError, matmul, matmul_backward, matmul_forward
from .matmul import communication as matmul_communication
from .mesh import Mesh, MeshError
from .optim import SGD, AdamW, Optimizer, OptimizerSettings, clip_coefficient
from .params import GradSink, Parameter
from .placement import Partial, Replicate, Shard
from .redistribute import plan as redistribute_plan
from .splits import ShardingError, bounds, even_sizes, merge, split

__all__ = [
    "ACTIVATIONS", "AdamW", "ColumnParallelLinear", "CommError", "CommTimeout", "Communicator",
    "CopyToGroup", "DArray", "FFN_POLICIES", "FeedForward", "GatherFromGroup", "GradSink",
    "GradientReducer", "HpcparError", "Mesh", "MeshError", "Optimizer", "OptimizerSettings",
    "POLICIES", "ParallelLMHead", "Parameter", "Partial", "PeerFailed", "Pipeline", "PlacementError",
    "PolicyError", "ReduceFromGroup", "ReduceScatterToGroup", "Replicate", "Request",
    "RowParallelLinear", "SGD", "ScatterToGroup", "Shard", "ShardingError", "Stage",
    "TRAINING_SCHEDULES", "VocabParallelCrossEntropy", "VocabParallelEmbedding", "bounds",
    "bubble_formula", "bubble_fraction", "clip_coefficient", "concat_micro_batches",
    "create_communicator", "draw", "even_sizes", "f", "g", "grad_norm", "matmul",
    "matmul_backward", "matmul_communication", "matmul_forward", "merge", "redistribute_plan", "split",
    "split_micro_batches", "stage_layer_counts", "stage_layers", "training_schedule",
]
