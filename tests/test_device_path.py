"""The GPU path's decisions, checked on the CPU with stand-ins for what a GPU machine reports:
which communicator a group gets, whether MPI takes device buffers, the NCCL unique id on the
wire, a float format the device cannot hold, how much memory the weights take, and that the
strict device backend catches host/device mixing (the pre-flight bug it was built to find)."""

import os
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import GQA, TIED, make_checkpoint
from hpcpar.parallel.device.backend import require_dtype, select_backend
from hpcpar.parallel.comm import choice
from hpcpar.parallel.comm.nccl import pack_unique_id, unpack_unique_id
from hpcpar.parallel.device.dtypes import bfloat16
from hpcpar.parallel.errors import HpcparError

GPU = dict(host="node1", nccl=True)


def ranks(*gpus, **kw):
    return [choice.RankDevice(**dict(GPU, gpu=g, **kw)) for g in gpus]


def test_nccl_for_distinct_gpus_even_when_every_rank_calls_its_gpu_device_0():
    # CUDA_VISIBLE_DEVICES=<one GPU> per rank: every ordinal is 0, the bus ids differ
    assert choice.choose("auto", True, ranks("0000:3B:00.0", "0000:5E:00.0")) == "nccl"
    assert choice.choose("auto", True, [choice.RankDevice("a", "0000:3B:00.0", True),
                                        choice.RankDevice("b", "0000:3B:00.0", True)]) == "nccl"


def test_two_ranks_on_one_gpu_get_mpi_or_a_clear_error():
    same = ranks("0000:3B:00.0", "0000:3B:00.0")
    assert choice.choose("auto", True, same) == "mpi"
    with pytest.raises(HpcparError, match="share one GPU.*--comm mpi"):
        choice.choose("nccl", True, same)


def test_no_nccl_library_or_no_gpu_means_mpi():
    without = ranks("0000:3B:00.0", "0000:5E:00.0", nccl=False)
    assert choice.choose("auto", True, without) == "mpi"
    with pytest.raises(HpcparError, match="no NCCL library.*gpu-cuda12"):
        choice.choose("nccl", True, without)
    assert choice.choose("auto", False, []) == "mpi"
    with pytest.raises(HpcparError, match="not on GPUs"):
        choice.choose("nccl", False, [])
    assert choice.choose("mpi", True, ranks("x", "y")) == "mpi"


def test_the_nccl_library_check_reads_cupys_available_flag(monkeypatch):
    import sys
    from hpcpar.parallel.comm.nccl import nccl_library_present
    fake = SimpleNamespace(available=False)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(nccl=fake)))
    monkeypatch.setitem(sys.modules, "cupy.cuda", sys.modules["cupy"].cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", fake)
    assert nccl_library_present() is False          # importable, but without its library
    fake.available = True
    assert nccl_library_present() is True


@pytest.mark.parametrize("setting, library, mpi4py, expected", [
    ("auto", True, "4.1.0", True),
    ("auto", False, "4.1.0", False),
    ("auto", None, "4.1.0", False),       # no query in the library: stage
    ("1", None, "4.1.0", True),           # the user knows better
    ("0", True, "4.1.0", False),
    ("auto", True, "4.0.2", False),       # mpi4py < 4.0.3 double-frees CuPy buffers
    ("1", True, "3.1.6", False),
])
def test_cuda_aware_mpi_is_decided_by_the_library_the_setting_and_mpi4py(setting, library,
                                                                          mpi4py, expected):
    aware, why = choice.cuda_aware(setting, library, mpi4py)
    assert aware is expected and why


def test_the_mpich_wheel_says_it_is_not_cuda_aware():
    """Only where the MPI loaded is the pip mpich wheel's (a site MPI may well be
    CUDA-aware, as docs/guides/mpi.md recommends)."""
    import importlib.metadata
    import re
    from mpi4py import MPI  # noqa: F401  (loads the library)
    from hpcpar.parallel.comm.mpi import library_cuda_support
    try:
        wheel = importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("not the mpich wheel's MPI")
    libraries = set(re.findall(r"(/\S*libmpi\S*)", open("/proc/self/maps").read()))
    owned = {str(wheel.locate_file(f)) for f in wheel.files or ()
             if "libmpi" in str(f)}
    if not libraries & {os.path.realpath(p) for p in owned} and not libraries & owned:
        pytest.skip(f"the MPI loaded ({', '.join(sorted(libraries))}) is not the wheel's")
    assert library_cuda_support() is False


@pytest.mark.parametrize("uid", [
    bytes(range(128)),                                        # newer CuPy: bytes
    tuple(range(-64, 64)),                                    # x86-64: signed char
    tuple(range(128, 256)),                                   # aarch64 (GH200): unsigned char
    tuple([0] * 128),
])
def test_the_nccl_unique_id_survives_the_wire_in_its_own_form(uid):
    msg = pack_unique_id(uid)
    assert msg.dtype == np.uint8 and msg.shape == (129,)
    wire = np.frombuffer(msg.tobytes(), dtype=np.uint8)       # what MPI carries
    assert unpack_unique_id(wire) == uid


def test_a_dtype_the_device_cannot_hold_is_one_clear_error():
    def ones(shape, dtype):
        if np.dtype(dtype) == bfloat16:
            raise TypeError("Unsupported dtype bfloat16")
        return np.ones(shape, dtype)

    OldCupy = SimpleNamespace(__name__="cupy", __version__="13.6.0", float32=np.float32,
                              ones=ones)                           # CuPy 13: no bfloat16

    with pytest.raises(HpcparError, match="bfloat16 is not supported by cupy 13.6.0.*float16"):
        require_dtype(OldCupy, bfloat16)
    require_dtype(OldCupy, np.float16)
    require_dtype(np, bfloat16)                     # NumPy through ml_dtypes: fine


@pytest.mark.parametrize("cfg", [GQA, TIED], ids=["untied", "tied"])
def test_a_stage_holds_each_weight_once(tmp_path, cfg):
    """The bytes the stage's arrays occupy equal the loaded shard's (what ``plan`` reports):
    no second, transposed copy stays behind, and a tied head shares the embedding table."""
    from hpcpar.checkpoint import load_shard, open_checkpoint
    from hpcpar.parallel.comm import MpiCommunicator
    from hpcpar.models.decoder import DecoderStage
    from hpcpar.models.tensors import StageSpan, stage_tensors
    from mpi4py import MPI
    path, _ = make_checkpoint(tmp_path, cfg)
    ckpt = open_checkpoint(path)
    layers = range(ckpt.config.num_hidden_layers)
    specs = stage_tensors(ckpt.config, layers, True, True)
    shard = load_shard(ckpt, specs)
    loaded = sum(a.nbytes for a in shard.tensors.values())
    tp = MpiCommunicator(MPI.COMM_SELF)
    from hpcpar.parallel.device.backend import NUMPY
    from hpcpar.parallel.ops import ops_for
    stage = DecoderStage.from_tensors(ckpt.config, specs, shard.tensors, StageSpan(layers), tp,
                                      ops_for(NUMPY), np.dtype(np.float32))
    assert not shard.tensors                          # the stage took them all
    rope = _held_bytes(stage.rope)                   # position tables, not weights
    assert _held_bytes(stage) - rope == loaded == stage.weight_bytes


def _held_bytes(obj) -> int:
    """Bytes of the distinct memory blocks behind every array reachable from ``obj``."""
    blocks: dict[int, int] = {}
    seen: set[int] = set()

    def walk(x):
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, np.ndarray):
            base = x
            while base.base is not None and isinstance(base.base, np.ndarray):
                base = base.base
            blocks[id(base)] = base.nbytes
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif hasattr(x, "__dict__") and not isinstance(x, type) and x.__class__.__module__ \
                .startswith(("hpcpar.models", "hpcpar.parallel")):   # the model and its layers
            for v in vars(x).values():
                walk(v)

    walk(obj)
    return sum(blocks.values())


def test_the_strict_backend_catches_host_arrays_handed_to_a_device_communicator():
    """The pre-flight bug: the schedule check gave NumPy arrays to a communicator whose arrays
    live on the device. CuPy refuses that; so does the strict backend, where NumPy does not."""
    from hpcpar.parallel.comm import MpiCommunicator
    from mpi4py import MPI
    strict = select_backend("strict")
    device_comm = MpiCommunicator(MPI.COMM_SELF, strict)
    host_rows = np.zeros((3, 4), dtype=np.int64)
    with pytest.raises(TypeError, match="incorrect type"):
        device_comm.all_gather(host_rows)
    assert MpiCommunicator(MPI.COMM_SELF).all_gather(host_rows).shape == (3, 4)   # NumPy: fine
    rows = device_comm.on_host().all_gather(host_rows)         # the fix: host metadata on host
    assert isinstance(rows, np.ndarray) and rows.shape == (3, 4)


def test_strict_arrays_refuse_implicit_host_conversion_and_mixing():
    xp = select_backend("strict").xp
    a = xp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Unsupported type"):
        a + np.ones(3, dtype=np.float32)
    with pytest.raises(TypeError, match="Unsupported type"):
        xp.concatenate([a, np.zeros((1, 3), dtype=np.float32)])
    b = np.exp(a) @ a.T                   # NumPy functions on device arrays stay on the device
    assert isinstance(b, xp.ndarray)
    np.testing.assert_allclose(b.get(), np.exp(a.get()) @ a.get().T, rtol=1e-6)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        a[0] = np.array([7, 8, 9])        # CuPy 14 fills a view from scalars alone (H100)
    a[0].set(np.array([7, 8, 9], dtype=np.float32))     # the host-to-device copy it takes
    a[1] = 2.0                                           # and a scalar fill
    assert a.get().tolist() == [[7, 8, 9], [2, 2, 2]] and float(a.sum()) == 30.0


def test_free_memory_on_a_gpu_is_the_drivers_free_plus_the_pools_free_blocks():
    """The CuPy calls behind continuous batching's default rows in flight, with a stand-in
    for CuPy (test_ops_gpu checks them on a real GPU)."""
    from types import SimpleNamespace
    from hpcpar.parallel.device.backend import ArrayBackend
    pool = SimpleNamespace(free_bytes=lambda: 3 << 30)
    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(
        memGetInfo=lambda: (5 << 30, 80 << 30))), get_default_memory_pool=lambda: pool)
    assert ArrayBackend("cupy", fake).free_memory_bytes() == 8 << 30


@pytest.mark.parametrize("cls", ["MpiCommunicator", "NcclCommunicator"])
def test_a_communicator_overrides_the_base_methods_only_with_their_own_signatures(cls):
    # the NCCL communicator once named its reduction-op lookup `_op`, replacing the base's
    # prepared-collective `_op` with a one-argument function: every all-gather on a GPU failed
    import inspect
    from hpcpar.parallel.comm import base, mpi, nccl
    sub = getattr(mpi, cls, None) or getattr(nccl, cls)
    clashes = [name for name, fn in vars(sub).items()
               if callable(fn) and callable(getattr(base.Communicator, name, None))
               and not name.startswith("__")
               and list(inspect.signature(fn).parameters)
               != list(inspect.signature(getattr(base.Communicator, name)).parameters)]
    assert clashes == [], f"{cls} replaces {clashes} of Communicator with other signatures"
