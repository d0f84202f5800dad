"""A decode step's device side on a whole stage (one pipeline stage, no cp): each row's last
token through the embedding, every layer over the micro-batch's KV cache, the final norm and
the head, to this rank's logits.

Its inputs sit in one device buffer allocated once per micro-batch and written in place, one
upload a step (each row's last token, and the keys the row has with this step's), so the step
reads and writes fixed addresses only, and its shapes never change: a CUDA graph can replay it
(``--cuda-graphs``: ``parallel.device.graphs``, one graph per micro-batch, each over its own rows
and cache). On a device its attention reads the whole cache, graphed or not (cuDNN's kernel does;
the per-row lengths mask the rest), so a graphed step computes what the eager one does; on the
host, the keys the longest row has.
"""

from __future__ import annotations

import numpy as np

from ...models.config import ModelConfig
from ...models.decoder import DecoderStage
from ...models.kv_cache import KVCache
from ...parallel.device.dtypes import dtype_name
from ...parallel.environment import environment_value
from ...parallel.errors import HpcparError
from ...parallel.device.graphs import StepGraph
from ...parallel.ops import AttentionRows
from ..layout import ParallelConfig


class DecodeStep:
    def __init__(self, stage: DecoderStage, cache: KVCache, rows: int, backend,
                 graphed: bool = False):
        xp = stage.xp
        self.stage, self.cache, self.backend = stage, cache, backend
        self.inputs = xp.zeros((2, rows), dtype=xp.int32)     # last tokens; keys per row
        self.q_lengths = xp.ones(rows, dtype=xp.int32)         # one query per row
        self.max_kv = cache.capacity
        self.whole_cache = backend.on_device
        self.graph = (StepGraph(backend, self._compute, f"the decode step of {rows} rows")
                      if graphed else None)

    def __call__(self, tokens: np.ndarray, kv_lengths: np.ndarray):
        """(rows, 1, vocab_i) this rank's logits of each row's next token, from each row's
        last token ``tokens`` and its keys ``kv_lengths`` with this step's (host (rows,))."""
        self.backend.copy_in(self.inputs, np.stack([tokens, kv_lengths]))
        if self.graph is not None:
            return self.graph()
        if not self.whole_cache:
            self.max_kv = int(np.max(kv_lengths))
        return self._compute()

    @property
    def graph_bytes(self) -> int:
        """Device bytes its graph holds beside CuPy's default pool (0 without one)."""
        return self.graph.held_bytes if self.graph is not None else 0

    def _compute(self):
        stage, tokens, kv_lengths = self.stage, self.inputs[0], self.inputs[1]
        rows = AttentionRows(self.q_lengths, kv_lengths, self.max_kv, from_start=False)
        return stage.logits(stage.forward(stage.embed(tokens[:, None]), rows, self.cache))


def decode_steps(stage: DecoderStage, caches: list[KVCache], rows: list[int], backend,
                 graphed: bool, cp=None) -> list[DecodeStep] | None:
    """A ``DecodeStep`` per micro-batch where this rank runs the whole model (the first and
    the last stage, no cp); None elsewhere (the programs' own steps, over received
    activations or a split cache)."""
    if not (stage.first and stage.last) or cp is not None:
        return None
    return [DecodeStep(stage, cache, n, backend, graphed) for cache, n in zip(caches, rows)]


def check_graphed_layout(layout: ParallelConfig, cfg: ModelConfig) -> None:
    """``--cuda-graphs`` where each rank runs a whole model (replicas over dp only), a dense
    one (a MoE layer's routing sizes its expert batches on the host)."""
    split = [f"--{axis} {n}" for axis, n in (("tp", layout.tp), ("pp", layout.pp),
                                             ("cp", layout.cp)) if n > 1]
    if split:
        raise HpcparError(f"--cuda-graphs replays a decode step of a whole model on one rank, "
                          f"and this layout splits it ({', '.join(split)}): run it with "
                          "replicas over dp alone, or drop --cuda-graphs")
    if cfg.num_experts:
        raise HpcparError("--cuda-graphs: a mixture of experts routes its tokens with host "
                          "decisions a graph cannot replay; drop --cuda-graphs for this model")


def check_graphed_backend(backend, dtype: np.dtype, cfg: ModelConfig) -> None:
    """``--cuda-graphs`` on a device backend, where every kernel of the step can be captured:
    cuDNN's attention (half precision, no sliding window). The strict backend refuses what a
    GPU would, whose path it checks."""
    if not backend.on_device:
        raise HpcparError("--cuda-graphs needs a GPU (--backend cupy), or the strict backend "
                          "that checks the GPU path on the CPU; this job's arrays are NumPy's")
    if not backend.is_gpu and environment_value("HPCPAR_OPS") != "device":
        raise HpcparError("--cuda-graphs on the strict backend checks the GPU's path, whose "
                          "ops are the device kernels': set HPCPAR_OPS=device")
    if np.dtype(dtype).itemsize > 2 or cfg.sliding_window is not None:
        what = ("a sliding window" if cfg.sliding_window is not None
                else f"{dtype_name(dtype)} attention")
        raise HpcparError(f"--cuda-graphs: {what} runs the reference attention, whose "
                          "matmuls CUDA-graph capture refuses; use --dtype bfloat16 or "
                          "float16 (cuDNN's kernel), or drop --cuda-graphs")
