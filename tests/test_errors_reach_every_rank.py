"""An error on one rank of a library program reaches every rank of the mesh, whichever group
it shares with them, even when the program catches it: the others' waits raise
``PeerFailed`` naming the rank and its message (``comm.failfast.ErrorBoard``), not
``CommTimeout`` after the mesh's timeout. Checks the ranks must agree on are agreed before
any collective: ``MoE.from_full``'s settings, ``all_to_all_rows``' counts."""

import numpy as np
import pytest

import hpcpar.parallel as hp

pytestmark = pytest.mark.mpi

TIMEOUT = 60          # a rank left waiting fails its test with CommTimeout after this


def _moe_layer(rng, experts=4, hidden=6, inter=8):
    return (rng.standard_normal((experts, hidden)), rng.standard_normal((experts, inter, hidden)),
            rng.standard_normal((experts, inter, hidden)),
            rng.standard_normal((experts, hidden, inter)))


def test_a_caught_bad_moe_input_on_one_rank_frees_the_others_from_the_all_to_all(comm):
    mesh = hp.Mesh(comm, {"ep": -1}, timeout=TIMEOUT)
    layer = hp.MoE.from_full(*_moe_layer(np.random.default_rng(0)), top_k=2,
                             ep=mesh.group("ep"))
    width = 5 if mesh.rank == 0 else 6                 # rank 0's input is one feature short
    try:
        with pytest.raises(hp.HpcparError) as raised:
            layer.forward(np.ones((3, width)))
        if mesh.rank == 0:
            assert "MoE: input of shape (3, 5); the layer takes 6 features" in str(raised.value)
        else:
            assert isinstance(raised.value, hp.PeerFailed), raised.value
            assert "rank 0 failed: MoE: input of shape (3, 5)" in str(raised.value)
    finally:
        mesh.free()


class Stage:
    """A pipeline stage whose forward raises on one rank."""

    def __init__(self, fails: bool, xp):
        self.fails, self.xp = fails, xp

    def forward(self, x):
        if self.fails:
            raise ValueError("a bug in this stage")
        return x, None

    def backward(self, dy, ctx):
        return dy


@pytest.mark.mpi(min_size=4)
def test_a_stage_that_raises_frees_its_tp_partners_waiting_in_another_group(comm):
    """pp 2 x tp 2: the stage of (pp 0, tp 0) raises; (pp 0, tp 1) is in a tp all-reduce
    that rank never joins, and the pp 1 ranks wait for its activations."""
    mesh = hp.Mesh(comm, {"pp": 2, "tp": comm.Get_size() // 2}, timeout=TIMEOUT)
    failing = mesh.rank_of(pp=0, tp=0)
    xp = mesh.backend.xp
    try:
        pipe = hp.Pipeline(mesh.group("pp"), Stage(mesh.rank == failing, xp),   # collective
                           loss=lambda y, t: (float((y * y).sum()), 2 * y))
        with pytest.raises(Exception) as raised:
            if mesh.coord("pp") == 0 and mesh.rank != failing:
                mesh.group("tp").all_reduce(np.ones(4))
            else:
                pipe.train_step([xp.ones((2, 3))] * 2, [None] * 2)
        if mesh.rank == failing:
            assert isinstance(raised.value, ValueError)
        else:
            assert isinstance(raised.value, hp.PeerFailed), raised.value
            assert f"rank {failing} failed: ValueError: a bug in this stage" \
                in str(raised.value)
    finally:
        mesh.free()


def test_moe_settings_that_differ_between_ranks_are_one_error_on_every_rank(comm):
    mesh = hp.Mesh(comm, {"ep": -1}, timeout=TIMEOUT)
    layer = _moe_layer(np.random.default_rng(0))
    try:
        top_k = 2 if mesh.rank == 0 else 1
        with pytest.raises(hp.comm.agreement.Disagreement, match="MoE.from_full.*top_k"):
            hp.MoE.from_full(*layer, top_k=top_k, ep=mesh.group("ep"))
        narrow = [a[:, :4] if a.ndim == 3 and mesh.rank == 0 and i < 3 else a
                  for i, a in enumerate(layer)]          # rank 0's gate and up: 4 features
        with pytest.raises(hp.HpcparError, match="MoE.from_full"):
            hp.MoE.from_full(*narrow, top_k=2, ep=mesh.group("ep"))
        # and the mesh goes on: those errors were raised on every rank at once
        assert mesh.group("ep").all_reduce(np.ones(2))[0] == mesh.size("ep")
    finally:
        mesh.free()


def test_all_to_all_rows_refuses_recv_rows_that_the_senders_do_not_send(comm):
    mesh = hp.Mesh(comm, {"x": -1}, timeout=TIMEOUT)
    group, n = mesh.group("x"), comm.Get_size()
    x = np.arange(2.0 * n).reshape(2 * n, 1)            # two rows to every rank
    try:
        out, recv = group.all_to_all_rows(x, [2] * n, recv_rows=[2] * n)
        assert recv == [2] * n and out.shape == (2 * n, 1)
        wrong = [2] * n if mesh.rank else [3] + [2] * (n - 1)
        with pytest.raises(hp.HpcparError, match=r"recv_rows \[3, 2.*, where the ranks send "
                                                 r"\[2, 2"):
            group.all_to_all_rows(x, [2] * n, recv_rows=wrong)
    finally:
        mesh.free()


def test_a_programs_own_error_is_told_with_tell_peers(comm):
    mesh = hp.Mesh(comm, {"x": -1}, timeout=TIMEOUT)
    try:
        if mesh.rank == 0:
            try:
                raise KeyError("no such sample")
            except KeyError as e:
                hp.comm.failfast.tell_peers(e)
        else:
            with pytest.raises(hp.PeerFailed, match="rank 0 failed: KeyError: 'no such sample'"):
                mesh.group("x").all_reduce(np.ones(2))
    finally:
        mesh.free()


def test_a_stop_request_leaves_a_collective_as_itself_and_is_told_to_nobody(comm):
    """A stop request (SIGTERM: every rank hears it through the jobs' watchdog) raised in a
    wait is ``Stopped`` as it is, not a failed collective, and not a failure of the rank."""
    from hpcpar.parallel.device import waits
    from hpcpar.parallel.errors import Stopped
    mesh = hp.Mesh(comm, {"x": -1}, timeout=TIMEOUT, check=False)
    group, n = mesh.group("x"), comm.Get_size()
    x = np.ones((n, 2))
    try:
        if mesh.rank == 1:
            waits.listen_for_alarm(lambda: Stopped("SIGTERM", 1))
            try:
                with pytest.raises(Stopped, match="SIGTERM to rank 1"):
                    group.all_to_all_rows(x, [1] * n, recv_rows=[1] * n)
            finally:
                waits.listen_for_alarm(None)
            comm.Barrier()
        else:
            comm.Barrier()                     # rank 1 has left the all-to-all: join it now
            out, _ = group.all_to_all_rows(x, [1] * n, recv_rows=[1] * n)
            assert out.shape == (n, 2)
    finally:
        mesh.free()


def test_a_failed_mesh_runs_no_more_collectives_on_any_rank(comm):
    """After a failure the ranks are no longer in step: a collective matched with another
    step's would move wrong numbers. Every later call on the mesh's groups raises the
    failure, on the failed rank too."""
    mesh = hp.Mesh(comm, {"x": -1}, timeout=TIMEOUT, abort_on_error=False)
    group, outcomes = mesh.group("x"), []
    try:
        for step in range(3):
            try:
                if mesh.rank == 1 and step == 0:
                    try:
                        raise ValueError("a bad batch")
                    except ValueError as e:
                        hp.comm.failfast.tell_peers(e)
                        raise
                x = np.full(2, 10.0 ** step)
                group.all_reduce(x)
                outcomes.append(x.tolist())
            except (ValueError, hp.PeerFailed) as e:
                outcomes.append(str(e))
        told = "rank 1 failed: ValueError: a bad batch"
        first = "a bad batch" if mesh.rank == 1 else told
        assert outcomes == [first, told, told], outcomes
    finally:
        mesh.free()


def test_a_programs_own_function_tells_with_fails_together(comm):
    mesh = hp.Mesh(comm, {"x": -1}, timeout=TIMEOUT)

    @hp.comm.failfast.fails_together
    def load_batch(step: int):
        if mesh.rank == 0:
            raise FileNotFoundError(f"batch {step} is missing")
        return np.ones(2)

    try:
        with pytest.raises(Exception) as raised:
            mesh.group("x").all_reduce(load_batch(3))
        if mesh.rank == 0:
            assert isinstance(raised.value, FileNotFoundError)
        else:
            assert isinstance(raised.value, hp.PeerFailed)
            assert "rank 0 failed: FileNotFoundError: batch 3 is missing" in str(raised.value)
    finally:
        mesh.free()
