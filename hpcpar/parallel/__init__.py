"""hpcpar's parallel core, for any NumPy/CuPy model under mpiexec (SPMD: every rank runs the
same program). See docs/guides/library.md and docs/reference/library.md.

    from mpi4py import MPI
    import hpcpar.parallel as hp

    mesh = hp.Mesh(MPI.COMM_WORLD, {"dp": 2, "tp": -1})
    w = hp.DArray.from_full(weight, mesh, {"tp": hp.Shard(1)})
    y = hp.matmul(x, w)                      # the policy follows from the placements

The bottom layer of hpcpar: nothing in it names a model or a job (``tests/test_layers.py``).
The pieces, one module each: ``mesh`` (named axes, groups), ``placement`` (Shard /
Replicate / Partial), ``splits`` (the split rules), ``pieces`` (where each rank's piece
lies), ``darray`` and ``redistribute`` (distributed arrays), ``sharded_matmul`` and
``feedforward`` (sharded products under named policies), ``context`` (context parallelism: a
sequence split over a cp group, ring attention), ``mappings`` (Megatron's f and g),
``layers`` and ``vocab`` (column-, row- and vocabulary-parallel layers), ``routing`` and
``moe`` (a mixture of experts: the top-k router, the experts and their expert-parallel
dispatch), ``params``,
``data_parallel``, ``optim`` and ``optim_settings`` (parameters, gradient buckets,
SGD/AdamW); and below them ``comm`` (collectives and messages over MPI or NCCL),
``pipeline`` (schedules as data, and the executor that runs stage functions), ``ops`` (the
per-device math, a NumPy reference and a CUDA kernel per op), ``backend`` and ``strict``
(NumPy, CuPy, a pretend device), ``dtypes``, ``waits`` (bounded waits), ``trace`` (spans
for a timeline of every rank), ``errors`` and ``environment`` (checked numbers and
``HPCPAR_*`` variables).
"""

from importlib import import_module

# Names load on first use (PEP 562): the pure modules (``splits``, ``placement``,
# ``environment``) that the models' config and split plan and the jobs' settings import stay
# free of MPI and the array backends.
_HOME = {
    ".comm": ("Communicator", "Request", "create_communicator"),
    ".comm.agreement": ("Disagreement",),
    ".comm.failfast": ("abort", "fails_together", "tell_peers"),
    ".errors": ("CommError", "CommTimeout", "HpcparError", "PeerFailed"),
    ".ops.attention": ("AttentionRows",),
    ".ops.tiled_attention": ("TiledAttention",),
    ".pipeline.partition": ("stage_layer_counts", "stage_layers"),
    ".pipeline.runner": ("Pipeline", "Stage", "concat_micro_batches", "split_micro_batches"),
    ".pipeline.schedule": ("bubble_fraction", "draw"),
    ".pipeline.training_schedules": ("TRAINING_SCHEDULES", "bubble_formula",
                                      "training_schedule"),
    ".context": ("ContextShard", "RingAttention", "SplitKV", "split_batch"),
    ".darray": ("DArray",),
    ".pieces": ("PlacementError",),
    ".data_parallel": ("GradientReducer", "grad_norm", "sum_partial_grads"),
    ".feedforward": ("ACTIVATIONS", "FFN_POLICIES", "FeedForward"),
    ".layers": ("ColumnParallelLinear", "RowParallelLinear"),
    ".vocab": ("ParallelLMHead", "VocabParallelCrossEntropy", "VocabParallelEmbedding"),
    ".moe": ("ExpertDispatch", "Experts", "MoE"),
    ".routing": ("Routing", "TopKRouter", "load_balancing_loss", "route"),
    ".mappings": ("CopyToGroup", "GatherFromGroup", "ReduceFromGroup", "ReduceScatterToGroup",
                  "ScatterToGroup", "f", "g"),
    ".sharded_matmul": ("POLICIES", "PolicyError", "matmul", "matmul_backward",
                        "matmul_forward"),
    ".mesh": ("Mesh", "MeshError"),
    ".optim": ("SGD", "AdamW", "Optimizer", "clip_coefficient"),
    ".optim_settings": ("OptimizerSettings",),
    ".params": ("GradSink", "Parameter", "named_parameters", "parameters"),
    ".placement": ("Partial", "Replicate", "Shard"),
    ".splits": ("ShardingError", "bounds", "even_sizes", "merge", "split"),
    ".trace": ("Tracer",),
}
_RENAMED = {"matmul_communication": (".sharded_matmul", "communication"),
            "merge_attention": (".ops.tiled_attention", "merge"),
            "redistribute_plan": (".redistribute", "plan")}
_WHERE = {name: (module, name) for module, names in _HOME.items() for name in names}
_WHERE.update(_RENAMED)

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'hpcpar.parallel' has no attribute {name!r}")
    module, attr = _WHERE[name]
    value = getattr(import_module(module, __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
