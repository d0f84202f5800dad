"""``hpcpar export``: an HDF5 checkpoint back to a Hugging Face folder. Converting and exporting
gives back the source's tensors exactly, transformers loads the folder as it is and computes
the source model's logits, and a model trained under pp x tp and exported gives the
log-probabilities hpcpar's own scoring gives. An export checks its target and holds its lock
as every command that writes does, refuses NaN weights as jobs do, and stops on request."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import transformers
from helpers import HF_CONFIGS, build_hf_model, hpcpar_here, made_once, mpirun
from safetensors.numpy import load_file

from hpcpar.checkpoint.export import export

PROMPT = np.array([[3, 17, 99, 5, 42, 7, 128, 64, 1, 200]])


def _python(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcpar", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def small() -> Path:
    """The smallest model these tests export (qwen3's), converted once for all of them: an
    input, never changed."""
    return made_once("test_export small", lambda folder: build_hf_model("qwen3", folder)) / \
        "model.h5"


def _exported(folder) -> dict[str, np.ndarray]:
    files = sorted(folder.glob("*.safetensors"))
    out = {}
    for f in files:
        out |= load_file(str(f))
    return out


def _logits(model, ids=PROMPT) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_convert_then_export_gives_back_the_source_and_transformers_loads_it(tmp_path, name):
    source, checkpoint = build_hf_model(name, tmp_path)
    proc = _python("export", str(checkpoint), "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("wrote out (")
    mine = _exported(tmp_path / "out")
    theirs = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(mine) == sorted(theirs)                 # tied heads once, Phi-3's fused
    for key, value in theirs.items():
        np.testing.assert_array_equal(mine[key], value, err_msg=key)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded) is type(source)
    np.testing.assert_array_equal(_logits(loaded), _logits(source))


def test_bfloat16_and_shards_load_as_transformers_writes_them(tmp_path):
    source, checkpoint = build_hf_model("gqa-llama3", tmp_path)
    files = export(checkpoint, tmp_path / "out", dtype="bfloat16", shard_size=40_000)
    shards = sorted(p.name for p in files if p.suffix == ".safetensors")
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert loaded.dtype == torch.bfloat16
    want = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()}
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, want[key]), key


@pytest.mark.parametrize("template_in", ["tokenizer_config.json", "chat_template.jinja"])
def test_the_tokenizer_and_chat_template_come_back_as_transformers_reads_them(tmp_path,
                                                                               template_in):
    from test_chat import _tokenizer_folder

    from hpcpar.checkpoint import convert
    build_hf_model("gqa-llama3", tmp_path)
    source = _tokenizer_folder(tmp_path / "hf", template_in)
    convert(tmp_path / "hf", tmp_path / "with-tokenizer.h5")
    export(tmp_path / "with-tokenizer.h5", tmp_path / "out")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text, chat = "w1 w17 w3 user", [{"role": "user", "content": "w5 w6"}]
    assert loaded("w1 w17 w3 user")["input_ids"] == source(text)["input_ids"]
    assert (loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == source.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_bad_export_input_is_one_error_and_nothing_written(tmp_path, small):
    """A link, the folder it runs in ('.') and a folder it cannot write were a traceback
    (status 1) after the checks passed."""
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    (tmp_path / "a-file.txt").write_text("mine too")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to("empty")
    for where, args, words in [
        ("", ["taken"], "taken exists and is not an empty folder"),
        ("", ["new", "--shard-size", "lots"], "--shard-size 'lots' is not a size"),
        ("", ["new", "--shard-size", "inf"], "--shard-size 'inf' is not a size"),
        ("", ["a-file.txt"], "a-file.txt is a file; export writes a new folder"),
        ("", ["missing/new"], "output folder missing does not exist"),
        ("", ["link"], "link is a symbolic link (to empty)"),
        ("empty", ["."], ". is the folder export runs in"),
        ("", ["/proc/new"], "cannot write into /proc"),
    ]:
        proc = hpcpar_here(["export", small, *args], tmp_path / where)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    assert (tmp_path / "a-file.txt").read_text() == "mine too"
    assert not any((tmp_path / "empty").iterdir())
    # no folder, temporary folder or lock beside them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file.txt", "empty", "link", "taken"]


@pytest.mark.parametrize("dtype, value, words", [
    (None, np.nan, "holds NaN or inf values (first at local index (2, 5)); the file is "
                   "damaged or came from a diverged training;"),
    ("float16", 1e6, "has values too large for float16 (the first at local index (2, 5)); "
                     "use --dtype float32"),
])
def test_nan_or_inf_weights_are_refused_naming_the_tensor(tmp_path, small, dtype, value, words):
    """As generate, score and train refuse them at load (the same check); export wrote them
    (status 0) and transformers loaded the NaN."""
    bad = tmp_path / "bad.h5"
    shutil.copy(small, bad)
    with h5py.File(bad, "a") as f:
        f["model.layers.1.mlp.up_proj.weight"][2, 5] = value
    proc = hpcpar_here(["export", bad, "out", *(["--dtype", dtype] if dtype else [])], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "bad.h5: model.layers.1.mlp.up_proj.weight " in proc.stderr, proc.stderr
    assert words in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.h5"]


def test_a_live_exports_lock_refuses_a_second_and_a_dead_ones_leftovers_are_removed(tmp_path,
                                                                                     small):
    """Another export of the same target holds its lock: this one stops before any work and
    leaves that one's temporary folder alone (the second export used to write it all, then
    fail with a traceback). Once that export is dead (a kill -9), the next one takes over
    its lock and removes its temporary folder (no export ever removed it)."""
    writer = subprocess.Popen(["sleep", "60"])          # alive, as the other export
    owner = f"{socket.gethostname()}:{writer.pid}"
    (tmp_path / ".out.lock").write_text(owner + "\n")
    leftover = tmp_path / f".out.tmp-{socket.gethostname()}-{writer.pid}"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    try:
        proc = hpcpar_here(["export", small, "out"], tmp_path)
    finally:
        writer.kill()
        writer.wait()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"another job ({owner}) is writing" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (leftover / "model.safetensors").read_bytes() == b"half"
    assert not (tmp_path / "out").exists()
    proc = hpcpar_here(["export", small, "out"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.slow
def test_a_stop_signal_ends_the_export_with_one_line_and_leaves_nothing(tmp_path, small):
    """SIGTERM mid-export: one line, status 3 (a stop on request, as scoring's), and no
    folder, temporary folder or lock left (it was status 143, silent, and the temporary
    folder stayed). The export stops itself at its first write (SIGSTOP, HPCPAR_FAULT's
    hang), inside its temporary folder, so the signal lands mid-export every time."""
    env = dict(os.environ, HPCPAR_FAULT="rank=0,phase=write,kind=hang")
    proc = subprocess.Popen([sys.executable, "-m", "hpcpar", "export", str(small), "out"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_until_stopped(proc, time.monotonic() + 60)
    assert list(tmp_path.glob(".out.tmp-*"))
    proc.send_signal(signal.SIGTERM)            # pending until it runs again
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, out + err
    assert err.splitlines() == ["hpcpar: stopped on request (SIGTERM to rank 0) while "
                                "exporting: nothing was written; run it again to export"], err
    assert list(tmp_path.iterdir()) == []


def _wait_until_stopped(proc: subprocess.Popen, deadline: float) -> None:
    """Until ``proc`` is stopped (state T: it sent itself SIGSTOP)."""
    while _state(proc.pid) != "T":
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the export never stopped itself: {proc.communicate()}")
        time.sleep(0.01)


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
def test_a_model_trained_under_pp_and_tp_exports_to_the_logprobs_hpcpar_scores(tmp_path):
    """One step under dp 1 x pp 2 x tp 2, exported; transformers' log-probabilities of the
    exported model equal those hpcpar's scoring computes from the training checkpoint."""
    build_hf_model("gqa-llama3", tmp_path)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "rows.npy", rng.integers(0, 250, size=(8, 17)))
    np.save(tmp_path / "score.npy", PROMPT)
    proc, _ = mpirun(4, ["-m", "hpcpar", "train", "--checkpoint", "model.h5", "--data",
                         "rows.npy", "--steps", "1", "--global-batch", "4", "--pp", "2",
                         "--tp", "2", "--micro-batches", "2", "--lr", "1e-2", "--out", "run"],
                     tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trained = tmp_path / "run" / "step-1.h5"
    proc, _ = mpirun(1, ["-m", "hpcpar", "score", "--checkpoint", str(trained), "--data",
                         "score.npy", "--out", "scores.h5"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _python("export", str(trained), "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    import h5py
    with h5py.File(tmp_path / "scores.h5") as f:
        ours = f["token_logprobs"][0, 1:]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    logp = torch.log_softmax(torch.tensor(_logits(loaded)[0]).double(), dim=-1)[:-1]
    theirs = logp[torch.arange(PROMPT.shape[1] - 1), torch.tensor(PROMPT[0, 1:])].numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert not np.allclose(theirs, _python_source_logprobs(tmp_path), atol=1e-3)


def _python_source_logprobs(tmp_path) -> np.ndarray:
    """The untrained source's log-probabilities (the step changed the weights)."""
    source = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    logp = torch.log_softmax(torch.tensor(_logits(source)[0]).double(), dim=-1)[:-1]
    return logp[torch.arange(PROMPT.shape[1] - 1), torch.tensor(PROMPT[0, 1:])].numpy()
