"""CUDA-graph decode (``--cuda-graphs``), checked on the CPU: the strict backend stands in for
the GPU (``parallel.device.graphs``): it refuses in a captured step what a CUDA graph cannot hold (a
read, an upload, CuPy's matmul) and checks every replay against the capture. There a graphed
step is the eager step's computation, so the tokens and log-probs are the eager ones, bit for
bit, under both batchings (in float16: float32 runs the reference attention, which a GPU's
capture refuses); the GPU's own run is ``tests/test_ops_gpu.py``'s."""

import numpy as np
import pytest
from mpi4py import MPI

from helpers import refused
from hpcpar.checkpoint import init_checkpoint, preset_config
from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import load_job
from hpcpar.parallel.device import budget as device_budget
from hpcpar.parallel.device.backend import NUMPY, ArrayBackend
from hpcpar.parallel.device.capture import CaptureError, kernel
from hpcpar.parallel.errors import HpcparError
from hpcpar.parallel.device.graphs import StepGraph
from hpcpar.parallel.device.strict_arrays import xp

STRICT = ArrayBackend("strict", xp)
PROMPTS = [np.arange(1, 7), np.arange(3, 12), np.arange(2, 5), np.arange(5, 9),
           np.arange(7, 20)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs") / "model.h5"
    init_checkpoint(path, dict(preset_config("tiny"), num_hidden_layers=2))
    return path


def _generate(path, *sets, graphs=False, prompts=PROMPTS):
    job = load_job(None, [f"model.checkpoint='{path}'", "parallel.backend='strict'",
                          "model.dtype='float16'", "generate.max_new_tokens=7",
                          "generate.stop_at_eos=false",
                          f"generate.cuda_graphs={str(graphs).lower()}", *sets])
    return run_generation(MPI.COMM_SELF, job, prompts=Prompts(prompts), progress=False)


def _same_steps(eager, graphed):
    assert graphed.tokens.tolist() == eager.tokens.tolist()
    assert graphed.lengths.tolist() == eager.lengths.tolist()
    if eager.logprobs is not None:
        np.testing.assert_array_equal(graphed.logprobs.values, eager.logprobs.values)
        np.testing.assert_array_equal(graphed.logprobs.top_ids, eager.logprobs.top_ids)


@pytest.mark.parametrize("sets", [
    ("generate.batching='static'", "parallel.micro_batches=2"),
    ("generate.batch_size=2", "generate.logprobs=2"),   # refills: slots change prompts
    ("generate.temperature=1.5", "generate.top_k=5", "generate.seed=3",
     "generate.repetition_penalty=1.3", "generate.max_new_tokens=40"),
    ("generate.temperature=1.5", "generate.top_p=0.9", "generate.seed=2",
     "generate.batch_size=3", "generate.max_new_tokens=40"),
], ids=["static", "continuous-refills-logprobs", "sampled-penalized", "sampled-top-p"])
def test_graphed_decode_gives_the_eager_steps(checkpoint, monkeypatch, sets):
    monkeypatch.setenv("HPCPAR_OPS", "device")
    replays = []
    call = StepGraph.__call__
    monkeypatch.setattr(StepGraph, "__call__",
                        lambda self: replays.append(self._impl.captured) or call(self))
    eager = _generate(checkpoint, *sets)
    graphed = _generate(checkpoint, *sets, graphs=True)
    _same_steps(eager, graphed)
    assert replays.count(False) >= 1 and replays.count(True) >= 4   # captured, then replayed


def test_a_sequence_past_the_reference_attentions_first_tile(checkpoint, monkeypatch):
    """Past 128 keys the attention's reference reads which tiles to skip: the kernel's own
    work, which a device kernel does on the device (it was refused as the step's read)."""
    monkeypatch.setenv("HPCPAR_OPS", "device")
    sets = ("generate.max_new_tokens=140",)
    prompts = [np.arange(1, 7)]
    _same_steps(_generate(checkpoint, *sets, prompts=prompts),
                _generate(checkpoint, *sets, graphs=True, prompts=prompts))


@pytest.mark.parametrize("family", ["gemma", "qwen3", "qwen2", "phi3"])
def test_each_familys_graphed_decode_gives_the_eager_steps(tmp_path, monkeypatch, family):
    """Gemma's scaled embedding copied its scale in at every step (refused under capture)."""
    from helpers import build_hf_model
    monkeypatch.setenv("HPCPAR_OPS", "device")
    _, path = build_hf_model(family, tmp_path)
    _same_steps(_generate(path, "generate.logprobs=1"),
                _generate(path, "generate.logprobs=1", graphs=True))


def test_a_graphed_decode_step_uploads_its_inputs_once_and_reads_its_tokens_once(
        checkpoint, monkeypatch):
    monkeypatch.setenv("HPCPAR_OPS", "device")
    b = device_budget.Budget()
    with b.counting():
        _generate(checkpoint, "generate.batching='static'", graphs=True)
    steps = b.per_run("decode")[2:]                 # past the eager warm-up and the capture
    assert steps and [(s.reads, s.uploads) for s in steps] == [(1, 1)] * len(steps)


def test_the_job_refuses_graphs_where_they_cannot_run(checkpoint, monkeypatch, capfd):
    monkeypatch.delenv("HPCPAR_OPS", raising=False)
    message = refused(capfd, lambda: _generate(checkpoint, "parallel.backend='numpy'",
                                               graphs=True))
    assert "--cuda-graphs needs a GPU" in message and "NumPy" in message
    assert "HPCPAR_OPS=device" in refused(capfd, lambda: _generate(checkpoint, graphs=True))
    monkeypatch.setenv("HPCPAR_OPS", "device")
    message = refused(capfd, lambda: _generate(checkpoint, "model.dtype='float32'",
                                               graphs=True))
    assert "float32 attention runs the reference" in message and "bfloat16" in message


def test_a_sliding_window_is_refused(tmp_path, monkeypatch, capfd):
    from helpers import build_hf_model
    monkeypatch.setenv("HPCPAR_OPS", "device")
    _, path = build_hf_model("mistral", tmp_path)
    assert "a sliding window runs the reference" in refused(
        capfd, lambda: _generate(path, graphs=True))


def test_a_layout_that_splits_the_model_is_refused():
    from hpcpar.jobs.generate.decode import check_graphed_layout
    from hpcpar.jobs.layout import ParallelConfig
    from hpcpar.models.config import ModelConfig
    cfg = ModelConfig.from_hf(preset_config("tiny"))
    check_graphed_layout(ParallelConfig(dp=4), cfg)
    with pytest.raises(HpcparError, match="splits it .--tp 2, --pp 2.*dp alone"):
        check_graphed_layout(ParallelConfig(dp=1, tp=2, pp=2), cfg)


# ---- the graph itself --------------------------------------------------------------------

class Step:
    """A step over fixed buffers: out = x * 2 + the step's own extra work."""

    def __init__(self, extra=None):
        self.x = xp.asarray(np.arange(4, dtype=np.float32))
        self.extra = extra

    def __call__(self):
        y = self.x * 2
        return y if self.extra is None else self.extra(self, y)


def test_a_replay_computes_from_the_buffers_and_returns_the_captured_arrays():
    step = Step()
    graph = StepGraph(STRICT, step)
    first = graph()                       # eager, then captured
    np.testing.assert_array_equal(first.get(), [0, 2, 4, 6])
    step.x.set(np.full(4, 5, np.float32))
    second = graph()
    step.x.set(np.full(4, 1, np.float32))
    third = graph()
    assert third is second                # the captured outputs, as a CUDA replay leaves them
    np.testing.assert_array_equal(third.get(), [2, 2, 2, 2])
    assert graph.replays == 2


@pytest.mark.parametrize("extra, what", [
    (lambda s, y: y + float(y.sum()), "reads the device back"),
    (lambda s, y: y + xp.asarray(np.ones(4, np.float32)), "copies host data to the device"),
    (lambda s, y: y @ xp.ones((4, 4), np.float32), "matmul outside the ops' capture-safe GEMM"),
], ids=["read", "upload", "matmul"])
def test_what_a_graph_cannot_hold_is_refused_at_capture(extra, what):
    with pytest.raises(CaptureError, match=what):
        StepGraph(STRICT, Step(extra), "the test step")()


def test_a_device_kernels_own_products_are_captured():
    def in_kernel(s, y):
        with kernel("product", y):        # ops.counted: cuDNN's attention, the planned GEMM
            return y @ xp.ones((4, 4), np.float32)
    graph = StepGraph(STRICT, Step(in_kernel))
    graph()
    np.testing.assert_array_equal(graph().get(), [12, 12, 12, 12])


def test_a_host_value_that_changes_between_steps_is_found_at_the_replay():
    calls = []

    def grows(s, y):                      # a length read from the host at every step
        calls.append(1)
        return y[:len(calls)]
    graph = StepGraph(STRICT, Step(grows), "the test step")
    with pytest.raises(CaptureError, match="the test step gave other results"):
        graph()
    calls.clear()
    graph = StepGraph(STRICT, Step(lambda s, y: y[:2] if calls.append(1) or len(calls) < 3
                                   else y[:3]), "the test step")
    graph()
    with pytest.raises(CaptureError, match=r"not the computation captured \(operation \d+: "
                                           r"captured getitem.*now getitem"):
        graph()


def test_graphs_need_a_device_backend():
    with pytest.raises(HpcparError, match="need a device backend"):
        StepGraph(NUMPY, Step())
