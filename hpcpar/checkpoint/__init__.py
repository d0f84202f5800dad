"""HDF5 checkpoints: the format, conversion from Hugging Face, random init, sharded loading."""

from .convert import convert
from .format import FORMAT_VERSION
from .presets import PRESETS, init_checkpoint, preset_config, random_tensor
from .reader import (Checkpoint, CheckpointError, LoadedShard, load_shard, open_checkpoint,
                     read_tensor)
from ..outputs import AtomicPath
from .writer import CheckpointWriter

__all__ = ["FORMAT_VERSION", "PRESETS", "AtomicPath", "Checkpoint", "CheckpointError",
           "CheckpointWriter", "LoadedShard", "convert", "init_checkpoint", "load_shard",
           "open_checkpoint", "preset_config", "random_tensor", "read_tensor"]
