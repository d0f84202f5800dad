"""Module paths that moved, still importable for one release: importing one warns
(``DeprecationWarning``) with its new path and gives the module at that path, the same
object. Names that moved inside a package: ``hpcpar.parallel.exports``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from importlib import import_module

_P = "hpcpar.parallel."
# old path -> new path; a package's submodules follow it (hpcpar.ops.rotary ->
# hpcpar.parallel.ops.rotary). The modules optim and data_parallel became packages of those
# names, which give the modules' names.
MOVED = {
    # the parallel core, one sub-package per concept
    **{_P + old: _P + new for old, new in {
        "backend": "device.backend", "strict": "device.strict_arrays",
        "budget": "device.budget", "capture": "device.capture", "graphs": "device.graphs",
        "dtypes": "device.dtypes", "waits": "device.waits",
        "placement": "tensor.placement", "splits": "tensor.splits",
        "pieces": "tensor.piece_layout", "darray": "tensor.darray",
        "redistribute": "tensor.redistribute", "sharded_matmul": "tensor.sharded_matmul",
        "feedforward": "tensor.feedforward",
        "mappings": "tensor_parallel.mappings", "layers": "tensor_parallel.layers",
        "vocab": "tensor_parallel.vocab",
        "context": "context_parallel.ring_attention",
        "routing": "expert_parallel.routing", "moe": "expert_parallel.moe",
        "flat": "data_parallel.flat_buffers", "optim_layout": "optim.flat_layout",
        "optim_settings": "optim.settings", "ops.known_shift": "ops.softmax_shift",
    }.items()},
    # the library's modules before the parallel core was one package
    "hpcpar.ops": _P + "ops", "hpcpar.comm": _P + "comm", "hpcpar.errors": _P + "errors",
    "hpcpar.backend": _P + "device.backend", "hpcpar.dtypes": _P + "device.dtypes",
    # the jobs' shared inputs, and module names that say what is inside
    "hpcpar.jobs.generate.batching": "hpcpar.jobs.inputs.batching",
    "hpcpar.jobs.generate.prompts": "hpcpar.jobs.inputs.prompts",
    "hpcpar.jobs.generate.schedule": "hpcpar.jobs.inputs.schedule",
    "hpcpar.jobs.generate.setup": "hpcpar.jobs.inputs.stage",
    "hpcpar.jobs.generate.output": "hpcpar.jobs.generate.output_file",
    "hpcpar.jobs.generate.lines": "hpcpar.jobs.generate.jsonl_output",
    "hpcpar.jobs.outputs": "hpcpar.jobs.output_lock",
    "hpcpar.jobs.train.holders": "hpcpar.jobs.train.weight_holders",
    "hpcpar.jobs.train.chunk": "hpcpar.jobs.train.model_chunk",
    "hpcpar.jobs.generate.plan": "hpcpar.jobs.generate.validation",
}


def new_path(name: str) -> str | None:
    """Where module ``name`` is now, or None if it did not move."""
    if name in MOVED:
        return MOVED[name]
    package, _, leaf = name.rpartition(".")
    while package:
        if package in MOVED:
            return f"{MOVED[package]}.{name[len(package) + 1:]}"
        package, _, leaf = package.rpartition(".")
    return None


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new one."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("hpcpar.") and new_path(fullname) is not None:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = new_path(spec.name)
        warnings.warn(f"module {spec.name} is now {new}; import that instead (the old path "
                      "goes in the next release)", DeprecationWarning, stacklevel=2)
        module = import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # the import system gave the module the old path's spec: its own goes back
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
