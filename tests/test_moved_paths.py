"""Paths and names that moved keep working for one release: each import or read warns once
with its new home and gives the very object at that home. And the public surface of
``hpcpar.parallel`` stays small enough to hold in one's head."""

import importlib
import sys
import warnings

import pytest

import hpcpar.parallel as hp
from hpcpar.moved import MOVED, new_path


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_imports_with_a_warning_naming_its_new_path(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"module {old} is now {MOVED[old]};"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__spec__.name == MOVED[old]          # its own spec, not the old path's


def test_a_moved_packages_modules_follow_it():
    sys.modules.pop("hpcpar.ops.tiled_attention", None)
    with pytest.warns(DeprecationWarning, match="hpcpar.parallel.ops.tiled_attention"):
        from hpcpar.ops.tiled_attention import TiledAttention
    from hpcpar.parallel.ops.tiled_attention import TiledAttention as now
    assert TiledAttention is now
    assert new_path("hpcpar.comm.mpi") == "hpcpar.parallel.comm.mpi"
    assert new_path("hpcpar.parallel.mesh") is None and new_path("hpcpar.jobs") is None


def test_a_moved_name_reads_with_a_warning_naming_its_home():
    for name, home in sorted(hp._MOVED.items()):
        module, _, attr = home.rpartition(".")
        with pytest.warns(DeprecationWarning, match=f"hpcpar.parallel.{name} is now {home};"):
            value = getattr(hp, name)
        assert value is getattr(importlib.import_module(module), attr), name


def test_the_public_names_are_few_and_each_one_loads_without_a_warning():
    assert len(hp.__all__) <= 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in hp.__all__:
            assert getattr(hp, name) is not None
        assert hp.tensor.even_sizes(7, 2) == [4, 3]      # a sub-package is an attribute
    assert set(hp.__all__) <= set(dir(hp))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        hp.no_such_name
