"""Shared test set-up: one BLAS thread per rank, and a failed MPI test aborts the whole world.

Under pytest-mpi a rank that fails before a collective would leave the others blocked forever;
aborting turns that into a prompt non-zero exit of mpiexec. Reports of MPI tests carry the
rank in their id.
"""

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import pytest  # noqa: E402


def _per_rank_temp_root():
    """Under mpiexec, one temporary root per rank: ranks cleaning a shared one race."""
    import tempfile
    comm = _world()
    if comm.Get_size() > 1 and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
        root = os.path.join(tempfile.gettempdir(), "hpcpar-pytest",
                            f"rank{comm.Get_rank()}-of-{comm.Get_size()}")
        os.makedirs(root, exist_ok=True)
        os.environ["PYTEST_DEBUG_TEMPROOT"] = root


def _world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if item.get_closest_marker("mpi") and item.config.getoption("with_mpi", False):
        comm = _world()
        rep.nodeid = f"{rep.nodeid}[rank{comm.Get_rank()}/{comm.Get_size()}]"
        if rep.failed and comm.Get_size() > 1:
            import sys
            sys.stderr.write(f"\n{rep.nodeid} FAILED:\n{rep.longreprtext}\n")
            sys.stderr.flush()
            comm.Abort(1)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # Under mpiexec only rank 0 reports; a failure elsewhere is printed by the hook above.
    if config.getoption("with_mpi", False) and _world().Get_rank() > 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def _own_preset_cache():
    """Outside mpiexec (a serial run, each pytest-xdist worker): the preset checkpoints jobs
    make go to a cache of this process, so that two workers never write the same one at once
    (the second would find it being written) and the tests leave ~/.cache alone."""
    if _world().Get_size() == 1:
        import atexit
        import shutil
        import tempfile
        path = tempfile.mkdtemp(prefix="hpcpar-presets-")
        os.environ["HPCPAR_CACHE"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)


_per_rank_temp_root()
_own_preset_cache()


@pytest.fixture
def comm():
    return _world()


def _gpu_present() -> bool:
    """The test of ``hpcpar run --backend cupy``: CuPy imports and CUDA reports a device."""
    from hpcpar.parallel.device.backend import select_backend
    from hpcpar.parallel.errors import HpcparError
    try:
        select_backend("cupy")
        return True
    except HpcparError:
        return False


def pytest_addoption(parser):
    parser.addoption("--any-world-size", action="store_true",
                     help="under mpiexec, run every MPI test this world is large enough for "
                          "(its min_size), not only those meant for this size (ranks=...)")


def world_sizes(item) -> tuple[int, ...]:
    """The world sizes tests/run runs an MPI test at: its marker's ``ranks``, else its
    ``min_size`` alone (the smallest world that shows its point)."""
    mark = item.get_closest_marker("mpi")
    return tuple(mark.kwargs.get("ranks", (mark.kwargs.get("min_size", 2),)))


def _select_world_size(config, items):
    """Under mpiexec, keep the MPI tests meant for this world size and deselect the rest:
    tests/run starts 2, 4 and 8 ranks, and each test runs where it shows its point. With
    --any-world-size (the strict backend's 2-rank phase), every test that fits runs."""
    size = _world().Get_size()
    any_size = config.getoption("any_world_size")
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("mpi")
        fits = mark is None or (size >= mark.kwargs.get("min_size", 2) if any_size
                                else size in world_sizes(item))
        (keep if fits else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_ignore_collect(collection_path, config):
    """Under mpiexec, a test module with no MPI test is not imported: every rank would pay for
    its imports (torch, hypothesis: seconds a rank, on the same two cores)."""
    if (config.getoption("with_mpi", False) and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and "pytest.mark.mpi" not in collection_path.read_text()):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    if config.getoption("with_mpi", False):
        _select_world_size(config, items)
    if any(item.get_closest_marker("gpu") for item in items) and not _gpu_present():
        skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
