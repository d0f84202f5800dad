"""Bad input that every rank of a call finds the same way (a split that does not fit, a
``top_k`` outside 1..E, ranks that disagree) is raised on every rank of the call together,
as ``DArray.from_full``'s is, and told to nobody: the mesh goes on, and the corrected call
works (``comm.failfast.fails_together``, ``comm.agreement.agreed``). A call over a group
smaller than the mesh (a layer's ``from_full`` over tp on a dp x tp mesh) is the case that
matters: the ranks outside the group did not take part in its agreement. An error agreed
over one group still reaches the ranks of a call over another that wait for it (a pipeline's
next stage)."""

import numpy as np
import pytest

import hpcpar.parallel as hp
from hpcpar.parallel.comm.agreement import Disagreement
from hpcpar.parallel.context_parallel import AttentionRows, ContextShard

pytestmark = pytest.mark.mpi(ranks=(2, 4))

TIMEOUT = 30            # a rank left waiting fails its test with CommTimeout after this


def _moe_layer(experts=4, hidden=6, inter=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((experts, hidden)),
            rng.standard_normal((experts, inter, hidden)),
            rng.standard_normal((experts, inter, hidden)),
            rng.standard_normal((experts, hidden, inter)))


class Layer:
    def forward(self, x):
        return x, None

    def backward(self, dy, ctx):
        return dy


def _cases(mesh):
    """(what, the bad call, what its error says, the corrected call) on a dp x tp mesh;
    every rank passes the same arguments (the Disagreement's: each tp group the same)."""
    dp, tp = mesh.group("dp"), mesh.group("tp")
    rng = np.random.default_rng(0)
    w7 = rng.standard_normal((7, 4))
    odd = tp.rank == tp.size - 1
    taken = hp.Parameter(np.zeros(3))
    hp.GradientReducer(dp, [[taken]])
    shard = ContextShard(9, tp.size, tp.rank)
    q = rng.standard_normal((1, shard.local_length(), 2, 4))
    kv = rng.standard_normal((1, 1, shard.local_length(), 4))
    whole = AttentionRows.build(np, [9], [9], from_start=True)     # no context: not a shard's
    return [
        ("ColumnParallelLinear", lambda: hp.ColumnParallelLinear.from_full(tp, w7),
         "output features of length 7 does not split evenly over 2 ranks",
         lambda: hp.ColumnParallelLinear.from_full(tp, w7, sizes=(4, 3))),
        ("RowParallelLinear", lambda: hp.RowParallelLinear.from_full(tp, w7.T),
         "input features of length 7 does not split evenly",
         lambda: hp.RowParallelLinear.from_full(tp, w7.T, sizes=(3, 4))),
        ("VocabParallelEmbedding",
         lambda: hp.VocabParallelEmbedding.from_full(tp, np.zeros(10)),
         "a table [vocab, hidden]; got one of shape (10,)",
         lambda: hp.VocabParallelEmbedding.from_full(tp, np.zeros((10, 4)))),
        ("a table the tp ranks disagree on",
         lambda: hp.VocabParallelEmbedding.from_full(tp, np.zeros((10 + odd, 4))),
         "the ranks disagree on table's shape",
         lambda: hp.VocabParallelEmbedding.from_full(tp, np.zeros((10, 4)))),
        ("ParallelLMHead", lambda: hp.ParallelLMHead.from_full(tp, np.zeros((10, 4 + odd))),
         "the ranks disagree", lambda: hp.ParallelLMHead.from_full(tp, np.zeros((10, 4)))),
        ("VocabParallelCrossEntropy",
         lambda: hp.VocabParallelCrossEntropy(None, 50 + odd, tp), "vocab_size",
         lambda: hp.VocabParallelCrossEntropy(None, 50, tp)),
        ("MoE top_k", lambda: hp.MoE.from_full(*_moe_layer(), top_k=5, ep=dp, tp=tp),
         "top_k 5 must be an integer from 1 to the 4 experts",
         lambda: hp.MoE.from_full(*_moe_layer(), top_k=2, ep=dp, tp=tp)),
        ("MoE over tp", lambda: hp.MoE.from_full(*_moe_layer(inter=3), top_k=2, ep=dp, tp=tp),
         "experts of 3 features do not split over tp 2",
         lambda: hp.MoE.from_full(*_moe_layer(inter=4), top_k=2, ep=dp, tp=tp)),
        ("MoE over ep", lambda: hp.MoE.from_full(*_moe_layer(experts=3), top_k=2, ep=tp),
         "3 experts do not split over ep 2",
         lambda: hp.MoE.from_full(*_moe_layer(experts=4), top_k=2, ep=tp)),
        ("GradientReducer", lambda: hp.GradientReducer(dp, [[taken]]),
         "already belongs to another GradientReducer",
         lambda: hp.GradientReducer(dp, [[hp.Parameter(np.zeros(3))]])),
        ("Pipeline", lambda: hp.Pipeline(tp, object()),
         "a stage of type object needs forward",
         lambda: hp.Pipeline(tp, Layer())),
        ("RingAttention", lambda: hp.RingAttention(tp).forward_train(q, kv, kv, whole),
         "the rows' context must be this rank's ContextShard",
         lambda: hp.RingAttention(tp).forward_train(q, kv, kv, shard.rows(np, [9]))),
        ("a collective", lambda: tp.all_reduce(np.ones(2), op="min"), "op 'min'",
         lambda: tp.all_reduce(np.ones(2), op="max")),
        ("DArray", lambda: hp.DArray.from_full(w7, mesh, {"tp": hp.Shard(0)}),
         "length 7 does not split evenly",
         lambda: hp.DArray.from_full(w7, mesh, {"tp": hp.Shard(0, sizes=(4, 3))})),
    ]


def test_bad_input_every_rank_finds_is_raised_together_and_the_mesh_goes_on(comm):
    """On 2 ranks dp is 1 (a group of one: this rank is the whole call), on 4 dp is 2 and
    every tp group is half the mesh."""
    mesh = hp.Mesh(comm, {"dp": -1, "tp": 2}, timeout=TIMEOUT)
    try:
        for what, bad, says, good in _cases(mesh):
            with pytest.raises(hp.HpcparError) as raised:
                bad()
            assert not isinstance(raised.value, hp.PeerFailed), (what, raised.value)
            assert says in str(raised.value), (what, raised.value)
            assert mesh.errors.alarm() is None, (what, mesh.errors.alarm())
            good()                                       # the corrected call works
        assert mesh.everyone.all_reduce(np.ones(1))[0] == comm.Get_size()
        assert mesh.errors.alarm() is None
    finally:
        mesh.free()


def test_ranks_of_a_group_that_disagree_leave_the_mesh_going_on(comm):
    """A Disagreement over tp (each tp group's last rank passes another shape) is raised on
    every rank of each group; the mesh goes on."""
    mesh = hp.Mesh(comm, {"dp": -1, "tp": 2}, timeout=TIMEOUT)
    tp = mesh.group("tp")
    w = np.ones((8, 4 + (tp.rank == 1)))
    try:
        with pytest.raises(Disagreement, match="weight's shape: \\(8, 4\\) on rank"):
            hp.ColumnParallelLinear.from_full(tp, w)
        layer = hp.ColumnParallelLinear.from_full(tp, np.ones((8, 4)))
        assert layer.forward(np.ones((3, 4)))[0].shape == (3, 4)
        assert mesh.everyone.all_reduce(np.ones(1))[0] == comm.Get_size()
    finally:
        mesh.free()


class FrontStage:
    """Stage 0's forward gathers over tp with sizes that fit no tp group: an error every tp
    rank of the stage raises together, while stage 1 waits for its activations."""

    def __init__(self, tp):
        self.tp = tp

    def forward(self, x):
        return self.tp.all_gather(x, sizes=[1] * (self.tp.size + 1)), None

    def backward(self, dy, ctx):
        return dy


@pytest.mark.mpi(ranks=(4,))                 # pp 2 x tp 2
def test_an_error_agreed_over_tp_still_frees_the_next_stage_waiting_for_it(comm):
    mesh = hp.Mesh(comm, {"pp": 2, "tp": 2}, timeout=TIMEOUT)
    pp, tp = mesh.group("pp"), mesh.group("tp")
    stage = FrontStage(tp) if mesh.is_first("pp") else Layer()
    pipe = hp.Pipeline(pp, stage, loss=lambda y, t: (float((y * y).sum()), 2 * y))
    try:
        with pytest.raises(hp.HpcparError) as raised:
            pipe.train_step([np.ones((1, 3))] * 2, [None] * 2)
        if mesh.is_first("pp"):
            assert "all_gather" in str(raised.value) and not isinstance(raised.value,
                                                                         hp.PeerFailed)
        else:
            assert isinstance(raised.value, hp.PeerFailed), raised.value
            assert "failed: " in str(raised.value)
    finally:
        mesh.free()


@pytest.mark.mpi(ranks=(2,))
def test_a_darrays_collective_on_a_failed_mesh_raises_the_failure_at_once(comm):
    """Rank 0 gathers a DArray alone and times out, which fails the mesh; rank 1 comes late
    to the same gather: it raises rank 0's failure (PeerFailed) without joining, as the
    groups' calls do. It used to complete the check against rank 0's abandoned one and then
    wait out the timeout in the gather (a trial from the docs found it)."""
    import time
    mesh = hp.Mesh(comm, {"tp": 2}, timeout=1)
    x = hp.DArray.from_full(np.ones((4, 4)), mesh, {"tp": hp.Shard(0)})
    if mesh.rank == 0:
        with pytest.raises(hp.CommTimeout):
            x.full()
    else:
        # rank 0's word of its failure arrives meanwhile (well after its 1 s timeout: a
        # rank 1 that came in time would complete rank 0's gather, and nothing would fail)
        time.sleep(2.5)
    with pytest.raises(hp.PeerFailed) as raised:
        x.full()
    assert "rank 0 failed" in str(raised.value)
