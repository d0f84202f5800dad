"""HDF5 checkpoints, the layer between the models and the jobs: the format (``format``),
sharded reading (``reader``), writing (``writer``), conversion from Hugging Face
(``convert``), random init (``presets``), and the rules every file hpcpar writes follows
(``files``).

Names load on first use (PEP 562), so ``files`` (standard library only) does not pull in
h5py and the models.
"""

from importlib import import_module

_HOME = {
    ".convert": ("convert",),
    ".files": ("AtomicPath",),
    ".format": ("FORMAT_VERSION",),
    ".presets": ("PRESETS", "init_checkpoint", "preset_config", "random_tensor"),
    ".reader": ("Checkpoint", "CheckpointError", "LoadedShard", "load_shard",
                "open_checkpoint", "read_tensor"),
    ".writer": ("CheckpointWriter",),
}
_WHERE = {name: module for module, names in _HOME.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'hpcpar.checkpoint' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
