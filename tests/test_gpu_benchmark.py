"""The GPU benchmark (benchmarks/gpu.py) run through on the CPU: ``--backend strict`` takes
every step of the GPU run (hpcpar on the strict pretend device with the GPU's ops, transformers
and torch on the CPU), so that a rare GPU lease is not lost to a bug in the script. Its rows
are checked for what the GPU run must deliver: generation, decode, training against their
baselines, and the measured peaks (the device budget's) against ``hpcpar plan``'s, which is
computed from the config alone; and the training recipe is the plan's."""

from __future__ import annotations

import json
import math
import re
import sys
from argparse import Namespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("transformers")

# a whole benchmark run in the test process (about 8 s each on 2 cores): kept out of the quick loop
pytestmark = pytest.mark.slow

SMALL = ["--backend", "strict", "--models", "tiny", "--train", "tiny", "--batch", "2",
         "--prompt-length", "16", "--new-tokens", "4", "--train-batch", "2",
         "--train-seq-len", "32", "--train-steps", "3"]


@pytest.fixture(autouse=True)
def device_ops(monkeypatch):
    """The strict backend with the GPU's ops table (what gpu.py sets; restored after)."""
    monkeypatch.setenv("HPCPAR_OPS", "device")


def run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "gpu.json"
    gpu.main([*SMALL, "--work", str(tmp_path / "work"), "--out", str(out), *extra])
    return json.loads(out.read_text())


def rows(result: dict, workload: str) -> dict:
    return {r["phase"]: r for r in result["rows"] if r["workload"] == workload}


def check_memory(row: dict, low: float, high: float) -> None:
    """The measured peak (the device budget's) against the plan's, both positive."""
    assert row["planned_bytes"] > 0 and row["measured_bytes"] > 0, row
    assert math.isfinite(row["ratio"]) and low <= row["ratio"] <= high, row
    assert row["ratio"] == pytest.approx(row["measured_bytes"] / row["planned_bytes"])


def plan_text(*argv: str, capsys) -> str:
    """What ``hpcpar plan`` prints for these arguments."""
    from hpcpar.jobs.cli import main
    capsys.readouterr()
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_the_gpu_benchmark_runs_through_on_the_cpu(tmp_path, capsys):
    """Every row of the GPU run (``--cuda-graphs``, ``--fused-optimizer``, the compiled
    baseline), the full-training recipe where the plan fits, and the planned bytes those
    ``hpcpar plan`` prints for the run's settings."""
    result = run(tmp_path, "--cuda-graphs", "--fused-optimizer", "--device-memory-gb", "100")
    printed = capsys.readouterr().out
    assert result["backend"] == "strict" and result["probes"]["gemm_tflops"] > 0
    gen, train = rows(result, "generate-tiny-bf16"), rows(result, "train-tiny-bf16")
    assert set(gen) == {"prefill", "decode", "decode-graphs", "memory", "memory-plan"}
    assert set(train) == {"train", "train-fused", "memory-plan", "memory-plan-fused"}
    for phase in ("prefill", "decode", "decode-graphs"):
        r = gen[phase]
        assert min(r["hpcpar"], r["transformers"], r["transformers_compiled"], r["floor"]) > 0
    for phase in ("train", "train-fused"):
        r = train[phase]
        assert r["hpcpar"] > 0 and r["torch"] > 0 and r["baseline"] == "torch", r
        assert r["recipe"] == "full AdamW, no recompute, 2 micro-batch(es) of 1 row(s)"
    # the plan holds the device path's peak within the 5%, generation and training
    check_memory(gen["memory-plan"], 0.95, 1.05)
    check_memory(train["memory-plan"], 0.95, 1.05)
    check_memory(train["memory-plan-fused"], 0.95, 1.05)        # no optimizer scratch there
    assert train["memory-plan-fused"]["planned_bytes"] < train["memory-plan"]["planned_bytes"]
    assert train["memory-plan"]["capacity_bytes"] == 100e9
    assert re.search(r"generate-tiny-bf16 +[\d.,]+ +[\d.,]+ +- +[\d.]+\n", printed)
    assert "training recipe of tiny: full AdamW, no recompute" in printed
    # the planned bytes are those `hpcpar plan` prints for the same settings
    from hpcpar.jobs.plan import _size
    ckpt = str(tmp_path / "work" / "tiny.h5")
    text = plan_text("--checkpoint", ckpt, "--batch", "2", "--prompt-length", "16",
                     "--max-new-tokens", "4", "--dtype", "bfloat16", capsys=capsys)
    assert f"{_size(gen['memory-plan']['planned_bytes'])} at its peak" in text
    text = plan_text("--checkpoint", ckpt, "--train", "--global-batch", "2", "--seq-len", "32",
                     "--micro-batches", "2", "--dtype", "bfloat16", capsys=capsys)
    row = next(line for line in text.splitlines() if line.split()[:1] == ["0"])
    assert row.endswith(_size(train["memory-plan"]["planned_bytes"])), row


def test_the_recipe_turns_to_lora_where_full_training_does_not_fit(tmp_path):
    """A capacity the plan's full training exceeds (less than its total / 0.9) and LoRA with
    recompute fits, and no other: the run trains LoRA with recompute against peft, one row
    a micro-batch; each recipe is
    chosen where it is the first to fit, none where nothing does."""
    from hpcpar.checkpoint import init_checkpoint
    from hpcpar.parallel.device.dtypes import float_dtype
    ckpt = tmp_path / "work" / "tiny.h5"
    ckpt.parent.mkdir()
    cfg = init_checkpoint(ckpt, "tiny", seed=0, dtype=float_dtype("bfloat16"))
    args = Namespace(train_batch=2, train_seq_len=32, train_steps=3, lora_rank=16,
                     device_memory_gb=None)
    device = gpu.StrictCpu()
    totals = [gpu.training_plan(cfg, gpu.training_job(device, ckpt, args, r, tmp_path / "x"))
              ["total"] for r in gpu.RECIPES]
    # (recompute saves nothing where the optimizer step's scratch is the peak: equal totals)
    assert totals == sorted(totals, reverse=True) and totals[-1] < totals[0] / 2, totals
    for total in totals:
        first = totals.index(total)
        args.device_memory_gb = total / gpu.HEADROOM * 1.001 / 1e9
        recipe, plan, why, _ = gpu.choose_recipe(device, cfg, ckpt, args, tmp_path / "x")
        assert recipe == gpu.RECIPES[first] and plan["total"] == total, (recipe, totals)
        assert len(why) == first + 1
    args.device_memory_gb = totals[-1] / gpu.HEADROOM * 0.999 / 1e9
    assert gpu.choose_recipe(device, cfg, ckpt, args, tmp_path / "x")[0] is None

    between = (totals[2] + totals[3]) / 2 / gpu.HEADROOM
    result = run(tmp_path, "--device-memory-gb", str(between / 1e9), "--no-compiled")
    train = rows(result, "train-tiny-bf16")
    assert set(train) == {"train", "memory-plan"}            # no fused row for adapters
    r = train["train"]
    assert r["recipe"].startswith("LoRA rank 16") and "recompute full" in r["recipe"], r
    assert r["hpcpar"] > 0 and r["torch"] > 0, r
    assert r["baseline"].startswith("peft "), r
    check_memory(train["memory-plan"], 0.95, 1.05)
    assert train["memory-plan"]["planned_bytes"] == totals[3]
    assert len(train["memory-plan"]["why"]) == 4
    assert set(rows(result, "generate-tiny-bf16")) == {"prefill", "decode", "memory",
                                                      "memory-plan"}
