"""A package's names, each loaded from its module on first use (PEP 562), so that importing a
package costs nothing until one of its names is read: the pure modules (``tensor.splits``,
``tensor.placement``, ``environment``) that the models' config and the jobs' settings import
stay free of MPI and the array backends.

A name that moved keeps working for one release: reading it warns (``DeprecationWarning``)
with the name's new home. Module paths that moved: ``hpcpar.moved``.
"""

from __future__ import annotations

import sys
import warnings
from importlib import import_module
from importlib.util import find_spec


def lazy_names(package: str, homes: dict[str, tuple[str, ...]],
               moved: dict[str, str] | None = None):
    """``(__getattr__, __dir__, __all__)`` for ``package``: ``homes`` maps a module (relative
    to the package) to the names it gives; ``moved`` maps an old name to its new dotted
    path (``"hpcpar.parallel.tensor.even_sizes"``). A sub-module is an attribute too, imported
    when first read."""
    where = {name: module for module, names in homes.items() for name in names}
    moved = dict(moved or {})

    def __getattr__(name: str):
        if name in where:
            value = getattr(import_module(where[name], package), name)
            setattr(sys.modules[package], name, value)
            return value
        if name in moved:
            home, _, attr = moved[name].rpartition(".")
            warnings.warn(f"{package}.{name} is now {moved[name]}; import it from {home} "
                          "(the old name goes in the next release)", DeprecationWarning,
                          stacklevel=2)
            return getattr(import_module(home), attr)
        if not name.startswith("_") and find_spec(f"{package}.{name}") is not None:
            return import_module(f".{name}", package)     # a sub-package: hp.tensor.split
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(where)
