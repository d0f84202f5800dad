"""hpcpar's parallel core, for any NumPy/CuPy model under mpiexec (SPMD: every rank runs the
same program). See docs/guides/library.md and docs/reference/library.md.

    from mpi4py import MPI
    import hpcpar.parallel as hp

    mesh = hp.Mesh(MPI.COMM_WORLD, {"dp": 2, "tp": -1})
    w = hp.DArray.from_full(weight, mesh, {"tp": hp.Shard(1)})
    y = hp.matmul(x, w)                      # the policy follows from the placements

The bottom layer of hpcpar: nothing in it names a model or a job (``tests/test_layers.py``).
This package names what a program reaches for first; the rest is in its sub-package, one per
concept:

    mesh              named axes over a communicator, a group per axis
    tensor            placements (Shard / Replicate / Partial), the split rules, distributed
                      arrays, redistribution, sharded products under named policies
    tensor_parallel   Megatron's f and g, column- and row-parallel linear layers, the
                      vocabulary-parallel embedding, head and cross-entropy
    context_parallel  a sequence split over a cp group, ring attention
    expert_parallel   a mixture of experts: the top-k router, the experts, their dispatch
    pipeline          schedules as data, and the executor that runs stage functions
    data_parallel     gradient buckets summed over replicas, flat buffers
    optim             SGD / AdamW over flat buffers, their settings
    params            parameters, how a model's are found and named, where gradients go
    comm              collectives and messages over MPI or NCCL
    ops               the per-device math: a NumPy reference and a CUDA kernel per op
    device            NumPy, CuPy or the strict pretend device; dtypes, bounded waits, the
                      device budget, CUDA graphs
    trace             spans for a timeline of every rank
    errors, environment   the errors users see; checked numbers and ``HPCPAR_*`` variables
"""

from .exports import lazy_names

# the public surface: what a program written from the library guide needs
_HOMES = {
    ".mesh": ("Mesh",),
    ".tensor.placement": ("Partial", "Replicate", "Shard"),
    ".tensor.darray": ("DArray",),
    ".tensor.sharded_matmul": ("matmul",),
    ".tensor_parallel.layers": ("ColumnParallelLinear", "RowParallelLinear"),
    ".tensor_parallel.vocab": ("ParallelLMHead", "VocabParallelCrossEntropy",
                               "VocabParallelEmbedding"),
    ".context_parallel.ring_attention": ("ContextShard", "RingAttention"),
    ".expert_parallel.moe": ("MoE",),
    ".pipeline.runner": ("Pipeline", "Stage", "split_micro_batches"),
    ".data_parallel.reducer": ("GradientReducer", "grad_norm"),
    ".params": ("Parameter", "named_parameters"),
    ".optim.optimizers": ("AdamW", "SGD", "clip_coefficient"),
    ".errors": ("CommError", "CommTimeout", "HpcparError", "PeerFailed"),
}

# names this package gave before its sub-packages: each warns and points to its home
_P = "hpcpar.parallel."
_MOVED = {name: f"{_P}{package}.{name}" for package, names in {
    "comm": ("Communicator", "Request", "create_communicator"),
    "comm.agreement": ("Disagreement",),
    "comm.failfast": ("abort", "fails_together", "tell_peers"),
    "ops": ("AttentionRows",),
    "ops.tiled_attention": ("TiledAttention",),
    "pipeline": ("TRAINING_SCHEDULES", "bubble_formula", "training_schedule",
                 "bubble_fraction", "draw", "stage_layer_counts", "stage_layers",
                 "concat_micro_batches"),
    "context_parallel": ("SplitKV", "split_batch"),
    "tensor": ("PlacementError", "ACTIVATIONS", "FFN_POLICIES", "FeedForward", "POLICIES",
               "PolicyError", "matmul_backward", "matmul_forward", "ShardingError", "bounds",
               "even_sizes", "merge", "split"),
    "data_parallel": ("sum_partial_grads",),
    "expert_parallel": ("ExpertDispatch", "Experts", "Routing", "TopKRouter",
                        "load_balancing_loss", "route"),
    "tensor_parallel": ("CopyToGroup", "GatherFromGroup", "ReduceFromGroup",
                        "ReduceScatterToGroup", "ScatterToGroup", "f", "g"),
    "mesh": ("MeshError",),
    "optim": ("Optimizer", "OptimizerSettings"),
    "params": ("GradSink", "parameters"),
    "trace": ("Tracer",),
}.items() for name in names}
_MOVED.update({"matmul_communication": _P + "tensor.matmul_communication",
               "merge_attention": _P + "ops.tiled_attention.merge",
               "redistribute_plan": _P + "tensor.redistribution_steps"})

__getattr__, __dir__, __all__ = lazy_names(__name__, _HOMES, _MOVED)
