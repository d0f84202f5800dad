"""``hpcpar export``: an HDF5 checkpoint back to a Hugging Face folder. Converting and exporting
gives back the source's tensors exactly, transformers loads the folder as it is and computes
the source model's logits, and a model trained under pp x tp and exported gives the
log-probabilities hpcpar's own scoring gives."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from helpers import HF_CONFIGS, build_hf_model, mpirun
from safetensors.numpy import load_file

from hpcpar.checkpoint.export import export

PROMPT = np.array([[3, 17, 99, 5, 42, 7, 128, 64, 1, 200]])


def _python(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcpar", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


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


@pytest.mark.slow
def test_bad_export_input_is_one_error_and_nothing_written(tmp_path):
    _, checkpoint = build_hf_model("qwen3", tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    (tmp_path / "a-file.txt").write_text("mine too")
    for args, words in [
        (["taken"], "taken exists and is not an empty folder"),
        (["new", "--shard-size", "lots"], "--shard-size 'lots' is not a size"),
        (["new", "--shard-size", "inf"], "--shard-size 'inf' is not a size"),
        (["a-file.txt"], "a-file.txt is a file; export writes a new folder"),
        (["missing/new"], "output folder missing does not exist"),
    ]:
        proc = _python("export", str(checkpoint), *args, cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    assert (tmp_path / "a-file.txt").read_text() == "mine too"
    assert not (tmp_path / "new").exists()
    assert not list(tmp_path.glob(".new.tmp-*"))


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
