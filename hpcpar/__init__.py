"""hpcpar: run Llama, Mistral, Qwen, Phi-3 and Gemma models across GPUs and nodes with MPI
(dp × pp × cp × tp, and ep for mixtures of experts).

    mpiexec -n 8 python -m hpcpar            # the demo job
    python -m hpcpar --help                  # every command
"""

from . import moved

__version__ = "0.1.0"

moved.install()
