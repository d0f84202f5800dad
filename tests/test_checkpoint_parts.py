"""Checkpoints every rank writes at once (part files under HDF5 virtual datasets), in the
background with --async-save: the same tensors, optimizer state and training state as the
checkpoint written one rank at a time into one file (bit for bit), read back by one rank, by
another layout, by export and by a resumed run; a failed write leaves ``latest`` at the
previous checkpoint; the folder moves as a whole, and a missing part is one error."""

import errno
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from helpers import GQA, losses, make_checkpoint
from hpcpar.checkpoint import CheckpointError, load_shard, open_checkpoint
from hpcpar.checkpoint import files
from hpcpar.checkpoint.export import export
from hpcpar.jobs.job import load_job
from hpcpar.jobs.launch import JobFailed
from hpcpar.jobs.train import checkpoint as tc
from hpcpar.jobs.train.engine import run_training
from hpcpar.models.tensors import model_tensors, stored_tensors

CFG = dict(GQA, num_hidden_layers=2)
STATES = ("exp_avg", "exp_avg_sq")


def _inputs(folder: Path) -> None:
    make_checkpoint(folder, CFG)
    rows = np.random.default_rng(1).integers(0, CFG["vocab_size"], (16, 9))
    rows[3, :4] = -1                                      # left padding
    np.save(folder / "data.npy", rows)


def _job(folder, out, layout=(1, 1, 1), *extra):
    dp, pp, tp = layout
    return load_job(None, [f"model.checkpoint='{folder}/model.h5'",
                           f"data.dataset='{folder}/data.npy'", f"output.path='{folder}/{out}'",
                           f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}",
                           "parallel.micro_batches=2", "train.global_batch=8", "train.steps=2",
                           "train.save_every=1", "train.lr=0.01", "train.peak_tflops=1.0",
                           *extra])


def _datasets(path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, d: out.__setitem__(name, d[()])
                     if isinstance(d, h5py.Dataset) else None)
        out["train attrs"] = {k: v for k, v in f["train"].attrs.items()}
    return out


def assert_same_files(path, ref):
    got, want = _datasets(path), _datasets(ref)
    assert sorted(got) == sorted(want)
    for name, values in want.items():
        if name == "train attrs":
            assert got[name].keys() == values.keys()
            assert all(np.array_equal(got[name][k], v) for k, v in values.items()), name
        else:
            np.testing.assert_array_equal(got[name], values, err_msg=name)


def _shared_dir(tmp_path_factory, name):
    comm = MPI.COMM_WORLD
    folder = str(tmp_path_factory.mktemp(name)) if comm.Get_rank() == 0 else None
    return Path(comm.bcast(folder, root=0))


@pytest.mark.mpi(ranks=(4,))
@pytest.mark.parametrize("layout, zero, threads", [((1, 2, 2), 0, "multiple"),
                                                   ((2, 1, 2), 3, "serialized")])
def test_every_rank_writes_at_once_the_checkpoint_one_rank_at_a_time_writes(
        tmp_path_factory, monkeypatch, layout, zero, threads):
    """tp 2 x pp 2, and dp 2 x tp 2 with ZeRO-3 (weights and optimizer state in flat
    segments, every replica writing its own): the parallel and the background saves equal
    the serial one bit for bit, losses too; each reads back by one rank and by tp 4 slices
    as the serial file; export gives the same folder; a resume under another layout ends on
    the same files as from the serial one.
    The background writes agree in their threads (MPI thread-multiple), or, as where MPI
    is not, at the next step on the main thread."""
    comm = MPI.COMM_WORLD
    if threads == "serialized":
        monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    folder = _shared_dir(tmp_path_factory, "parts")
    if comm.Get_rank() == 0:
        _inputs(folder)
    comm.Barrier()
    runs = {"serial": ["train.serial_save=true"], "parallel": [],
            "async": ["train.async_save=true"]}
    for out, extra in runs.items():
        run_training(comm, _job(folder, out, layout, f"train.zero={zero}", *extra),
                     progress=False)
    for step in (1, 2):
        ref = folder / "serial" / f"step-{step}.h5"
        for out in ("parallel", "async"):
            path = folder / out / f"step-{step}.h5"
            if comm.Get_rank() == 0:
                assert_same_files(path, ref)
                assert (folder / out / f"step-{step}.parts").is_dir()
            # read back as a rank of tp 4 reads it (another layout), the state as resuming does
            ckpt, serial = open_checkpoint(path), open_checkpoint(ref)
            specs = stored_tensors(ckpt.config)
            rank = comm.Get_rank()
            a, b = load_shard(ckpt, specs, rank, 4), load_shard(serial, specs, rank, 4)
            for name in a.tensors:
                np.testing.assert_array_equal(a.tensors[name], b.tensors[name], err_msg=name)
            sa = tc.load_optimizer_state(ckpt, model_tensors(ckpt.config), STATES, rank, 4,
                                         a_backend())
            sb = tc.load_optimizer_state(serial, model_tensors(ckpt.config), STATES, rank, 4,
                                         a_backend())
            for name, states in sb.items():
                for state, value in states.items():
                    np.testing.assert_array_equal(sa[name][state], value, err_msg=name)
    if comm.Get_rank() == 0:
        np.testing.assert_array_equal(losses(folder / "async"), losses(folder / "serial"))
        np.testing.assert_array_equal(losses(folder / "parallel"), losses(folder / "serial"))
        assert (folder / "async" / "latest").read_text().strip() == "step-2.h5"
        export(folder / "parallel" / "step-2.h5", folder / "hf-parallel")
        export(folder / "serial" / "step-2.h5", folder / "hf-serial")
        for f in sorted((folder / "hf-serial").iterdir()):
            assert (folder / "hf-parallel" / f.name).read_bytes() == f.read_bytes(), f.name
    comm.Barrier()
    if zero:
        return
    other = (4, 1, 1)
    for out in ("serial", "parallel"):
        run_training(comm, _job(folder, f"{out}-resumed", other,
                                f"train.resume='{folder}/{out}/step-1.h5'"), progress=False)
    if comm.Get_rank() == 0:
        assert_same_files(folder / "parallel-resumed" / "step-2.h5",
                          folder / "serial-resumed" / "step-2.h5")
    comm.Barrier()


def a_backend():
    from hpcpar.parallel.device.backend import NUMPY
    return NUMPY


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("where", ["part", "top"])
def test_a_failed_write_leaves_latest_at_the_previous_checkpoint(tmp_path, capsys, background,
                                                                  where):
    """The write of step 2's part file (or of its top file, once the parts are complete)
    fails as on a full disk: one error naming the checkpoint, ``latest`` still names step 1,
    which reads back whole, no temporary is left once the run folder is opened again, and
    the run resumes from it to the same end as a run never interrupted."""
    _inputs(tmp_path)
    marker = ".step-2.parts.tmp" if where == "part" else ".step-2.h5.tmp"

    def full_disk(path):
        if marker in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    extra = ["train.async_save=true"] if background else []
    files.WRITE_HOOKS.append(full_disk)
    try:
        with pytest.raises(JobFailed):
            run_training(MPI.COMM_SELF, _job(tmp_path, "run", (1, 1, 1), "train.steps=3",
                                             *extra), progress=False)
    finally:
        files.WRITE_HOOKS.remove(full_disk)
    err = capsys.readouterr().err
    assert "step-2.h5" in err and "No space left on device" in err, err
    run = tmp_path / "run"
    assert (run / "latest").read_text().strip() == "step-1.h5"
    assert not (run / "step-2.h5").exists() and not (run / "step-2.parts").exists()
    open_checkpoint(run / "step-1.h5")
    run_training(MPI.COMM_SELF, _job(tmp_path, "run", (1, 1, 1), "train.steps=3",
                                     "train.resume='auto'", *extra), progress=False)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith("metrics")) == [
        "latest", "step-1.h5", "step-1.parts", "step-2.h5", "step-2.parts", "step-3.h5",
        "step-3.parts"]
    run_training(MPI.COMM_SELF, _job(tmp_path, "straight", (1, 1, 1), "train.steps=3"),
                 progress=False)
    assert_same_files(run / "step-3.h5", tmp_path / "straight" / "step-3.h5")


def test_the_run_folder_moves_whole_and_a_missing_part_is_one_error(tmp_path):
    _inputs(tmp_path)
    run_training(MPI.COMM_SELF, _job(tmp_path, "run", (1, 1, 1), "train.steps=1"),
                 progress=False)
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.copytree(tmp_path / "run", moved)
    shutil.rmtree(tmp_path / "run")
    ckpt = open_checkpoint(moved / "step-1.h5")          # the relative paths still hold
    with h5py.File(moved / "step-1.h5") as f:
        assert f["model.norm.weight"].is_virtual
        assert np.isfinite(f["model.embed_tokens.weight"][()]).all()
    assert load_shard(ckpt, stored_tensors(ckpt.config)).tensors
    from hpcpar.jobs.show.checkpoints import checkpoint as shown     # its size: the parts too
    values = sum(int(np.prod(s.shape)) for s in model_tensors(ckpt.config))
    assert shown(moved / "step-1.h5")["bytes"] > values * 4 * 3
    shutil.move(moved / "step-1.parts", tmp_path / "away")
    with pytest.raises(CheckpointError, match=r"step-1.h5: its part file .*step-1.parts/"
                                              r"rank-00000.h5 is missing; .* copied or moved "
                                              r"together"):
        open_checkpoint(moved / "step-1.h5")


def test_async_save_without_host_memory_for_its_snapshot_is_one_error_before_step_one(
        tmp_path, monkeypatch, capsys):
    from hpcpar.jobs.launch import EXIT_INVALID
    from hpcpar.jobs.train import saver
    _inputs(tmp_path)
    monkeypatch.setattr(saver, "available_memory", lambda: 1000)
    with pytest.raises(JobFailed) as failed:
        run_training(MPI.COMM_SELF, _job(tmp_path, "run", (1, 1, 1), "train.async_save=true"),
                     progress=False)
    assert failed.value.code == EXIT_INVALID
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--async-save: a snapshot of this node's ranks needs" in err[0] \
        and "save without --async-save" in err[0], err
    assert not list((tmp_path / "run").glob("step-*"))
    with pytest.raises(JobFailed):
        run_training(MPI.COMM_SELF, _job(tmp_path, "run", (1, 1, 1), "train.async_save=true",
                                         "train.serial_save=true"), progress=False)
    assert "choose one" in capsys.readouterr().err
