import json
import re
import shutil

import h5py
import numpy as np
import pytest

from hpcpar.checkpoint import (CheckpointError, convert, init_checkpoint, load_shard,
                               open_checkpoint, read_tensor)
from hpcpar.checkpoint.format import CHUNK_TP_SIZES
from hpcpar.models.config import ModelConfig
from hpcpar.jobs.layout import ParallelConfig
from hpcpar.parallel.device.dtypes import FLOAT_DTYPES, bfloat16, nonfinite
from hpcpar.parallel.errors import HpcparError
from hpcpar.models.sharding import piece_of
from hpcpar.models.tensors import model_tensors
from helpers import TINY, expected_slice, write_hf_checkpoint


@pytest.fixture
def hf_dir(tmp_path):
    folder = tmp_path / "hf"
    tensors = write_hf_checkpoint(folder, TINY, seed=1)
    from tokenizers import Tokenizer, models   # a real one: convert refuses a damaged one
    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(
        str(folder / "tokenizer.json"))
    return folder, tensors


def test_convert_copies_every_tensor_and_keeps_the_tokenizer(hf_dir, tmp_path):
    folder, tensors = hf_dir
    out = tmp_path / "model.h5"
    convert(folder, out)
    ckpt = open_checkpoint(out)
    assert set(ckpt.tensors) == set(tensors)
    for name, original in tensors.items():
        np.testing.assert_array_equal(read_tensor(ckpt, name), original)
    assert ckpt.tokenizer_files()["tokenizer.json"] == (folder / "tokenizer.json").read_bytes()
    assert ckpt.hf_config == json.loads((folder / "config.json").read_text())
    assert ckpt.dtype == np.float32


@pytest.mark.parametrize("source, target", [(np.float32, "bfloat16"), (bfloat16, None),
                                            (bfloat16, "float16"), (np.float32, "float16")])
def test_convert_sharded_index_and_dtypes(tmp_path, source, target):
    cfg = dict(TINY, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    tensors = write_hf_checkpoint(tmp_path / "hf", cfg, files=3, dtype=source)
    convert(tmp_path / "hf", tmp_path / "m.h5", dtype=target)
    ckpt = open_checkpoint(tmp_path / "m.h5")
    want = np.dtype(bfloat16 if target == "bfloat16" else (target or source))
    assert ckpt.dtype == want and "lm_head.weight" not in ckpt.tensors
    for name, original in tensors.items():
        np.testing.assert_array_equal(read_tensor(ckpt, name), original.astype(want))


def test_convert_refuses_other_architectures(tmp_path):
    write_hf_checkpoint(tmp_path / "hf", dict(TINY, model_type="gpt_neox",
                                              architectures=["GPTNeoXForCausalLM"]))
    with pytest.raises(HpcparError, match="'gpt_neox'.*not supported"):
        convert(tmp_path / "hf", tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()


def test_convert_names_a_missing_or_misshapen_tensor_and_leaves_no_file(hf_dir, tmp_path):
    folder, tensors = hf_dir
    from safetensors.numpy import save_file
    broken = dict(tensors)
    del broken["model.layers.1.mlp.up_proj.weight"]
    save_file(broken, str(folder / "model.safetensors"))
    with pytest.raises(HpcparError, match="model.layers.1.mlp.up_proj.weight"):
        convert(folder, tmp_path / "m.h5")
    broken["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(broken, str(folder / "model.safetensors"))
    with pytest.raises(HpcparError, match=r"up_proj.weight: shape \(3, 3\)"):
        convert(folder, tmp_path / "m.h5")
    assert list(tmp_path.glob("*.h5")) == [] and list(tmp_path.glob(".*tmp*")) == []


def test_convert_refuses_pickled_weights(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(HpcparError, match="safetensors"):
        convert(folder, tmp_path / "m.h5")


def test_init_is_deterministic_by_seed(tmp_path):
    init_checkpoint(tmp_path / "a.h5", "tiny", seed=3)
    init_checkpoint(tmp_path / "b.h5", "tiny", seed=3)
    init_checkpoint(tmp_path / "c.h5", "tiny", seed=4)
    a, b, c = (open_checkpoint(tmp_path / f"{x}.h5") for x in "abc")
    for name in a.tensors:
        np.testing.assert_array_equal(read_tensor(a, name), read_tensor(b, name))
    assert not np.array_equal(read_tensor(a, "model.norm.weight"),
                              read_tensor(c, "model.norm.weight"))


def test_slices_for_tp_1_2_4_8_are_whole_chunks(tmp_path):
    cfg_dict = dict(TINY, vocab_size=250)
    write_hf_checkpoint(tmp_path / "hf", cfg_dict)
    convert(tmp_path / "hf", tmp_path / "m.h5")
    cfg = ModelConfig.from_hf(cfg_dict)
    with h5py.File(tmp_path / "m.h5") as f:
        for spec in model_tensors(cfg):
            chunks = f[spec.name].chunks
            for tp in CHUNK_TP_SIZES:
                for r in range(tp):
                    region = piece_of(spec, cfg, r, tp).source
                    for dim, (sl, c) in enumerate(zip(region, chunks)):
                        # a slice starts on a chunk edge and ends on one or at the tensor's end
                        assert sl.start % c == 0, (spec.name, tp, r, dim)
                        assert sl.stop % c == 0 or sl.stop == spec.shape[dim], (spec.name, tp, r)


def test_load_reads_only_the_slice(tmp_path):
    write_hf_checkpoint(tmp_path / "hf", TINY)
    convert(tmp_path / "hf", tmp_path / "m.h5")
    ckpt = open_checkpoint(tmp_path / "m.h5")
    specs = model_tensors(ckpt.config)
    whole = load_shard(ckpt, specs, 0, 1)
    half = load_shard(ckpt, specs, 1, 2)
    replicated = sum(s.numel for s in specs if s.role.endswith("norm")) * 4
    assert whole.bytes_read == sum(s.numel for s in specs) * 4
    assert half.bytes_read == pytest.approx((whole.bytes_read - replicated) / 2 + replicated,
                                            rel=0.02)


# ---- bad files: one clear error naming the file and the tensor -------------------------------

@pytest.fixture
def good(tmp_path):
    init_checkpoint(tmp_path / "good.h5", "tiny")
    return tmp_path / "good.h5"


def _copy(good, tmp_path, name="bad.h5"):
    bad = tmp_path / name
    shutil.copy(good, bad)
    return bad


def test_not_hdf5(tmp_path):
    (tmp_path / "x.h5").write_text("hello")
    with pytest.raises(CheckpointError, match="x.h5: not an HDF5 file"):
        open_checkpoint(tmp_path / "x.h5")


def test_truncated(good, tmp_path):
    bad = _copy(good, tmp_path)
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="bad.h5.*truncated or corrupt"):
        ckpt = open_checkpoint(bad)
        load_shard(ckpt, list(ckpt.tensors.values()))


def test_missing_tensor(good, tmp_path):
    bad = _copy(good, tmp_path)
    with h5py.File(bad, "a") as f:
        del f["model.layers.2.mlp.down_proj.weight"]
    with pytest.raises(CheckpointError, match="bad.h5: tensor model.layers.2.mlp.down_proj"
                                              ".weight is missing"):
        open_checkpoint(bad)


@pytest.mark.parametrize("replacement, words", [
    (np.ones(3, np.float32), r"model.norm.weight has shape \(3,\)"),
    (np.ones(64, np.int32), "model.norm.weight has dtype int32"),
])
def test_wrong_shape_or_dtype(good, tmp_path, replacement, words):
    bad = _copy(good, tmp_path)
    with h5py.File(bad, "a") as f:
        del f["model.norm.weight"]
        f["model.norm.weight"] = replacement
    with pytest.raises(CheckpointError, match=words):
        open_checkpoint(bad)


@pytest.mark.parametrize("name", sorted(FLOAT_DTYPES))
def test_nonfinite_reads_the_exponent_bits_as_isfinite_does(name):
    dtype = FLOAT_DTYPES[name]
    big = float(np.finfo(np.float16).max) if name == "float16" else 3.0e38
    values = np.array([0.0, -0.0, 1.0, -2.5, big, -big, 1e-40, np.inf, -np.inf, np.nan, -np.nan],
                      dtype=np.float32).astype(dtype)
    np.testing.assert_array_equal(nonfinite(np, values), ~np.isfinite(values.astype(np.float64)))


@pytest.mark.parametrize("loaded, words", [
    (None, "model.layers.1.mlp.up_proj.weight holds NaN or inf values (first at local index "
           "(2, 5)); the file is damaged or came from a diverged training;"),
    (np.float16, "model.layers.1.mlp.up_proj.weight has values too large for float16 (the "
                 "first at local index (2, 5)); use --dtype float32, the checkpoint's own"),
])
def test_nan_or_overflowing_weights_are_refused_at_load(good, tmp_path, loaded, words):
    """NaN in the file, or a finite value its cast overflows: each named as what it is."""
    bad = _copy(good, tmp_path)
    with h5py.File(bad, "a") as f:
        f["model.layers.1.mlp.up_proj.weight"][2, 5] = np.nan if loaded is None else 1e6
    ckpt = open_checkpoint(bad)
    with pytest.raises(CheckpointError, match=re.escape(words)):
        load_shard(ckpt, list(ckpt.tensors.values()), dtype=loaded)


def test_newer_format_version(good, tmp_path):
    bad = _copy(good, tmp_path)
    with h5py.File(bad, "a") as f:
        f.attrs["hpcpar_format_version"] = 99
    with pytest.raises(CheckpointError, match="format version 99 is newer"):
        open_checkpoint(bad)


# ---- every layout loads the same file: each rank's slices equal the original's ---------------

def _layouts(world_size, cfg):
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 3, 4):
            if world_size % (tp * pp) == 0:
                layout = ParallelConfig.infer(world_size, tp=tp, pp=pp)
                if not layout.problems(cfg, world_size):
                    out.append(layout)
    return out


@pytest.mark.mpi(ranks=(8,))               # tp up to 8, pp up to 4, and dp beside them
@pytest.mark.parametrize("hf_cfg", [
    TINY,
    dict(TINY, vocab_size=251, num_key_value_heads=1, tie_word_embeddings=True,
         attention_bias=True, mlp_bias=True, num_hidden_layers=4),
], ids=["gqa", "mqa-tied-bias"])
def test_every_rank_loads_exactly_its_slices(comm, mpi_tmp_path, hf_cfg):
    from hpcpar.jobs.layout import job_mesh
    from hpcpar.parallel.pipeline.partition import stage_layers
    from hpcpar.models.tensors import stage_tensors

    folder = mpi_tmp_path / "hf"
    if comm.Get_rank() == 0:
        write_hf_checkpoint(folder, hf_cfg, seed=5, files=2)
        convert(folder, mpi_tmp_path / "m.h5", dtype="bfloat16")
    comm.Barrier()
    # every rank regenerates the originals from the same seed: a serial dense reference
    tensors = write_hf_checkpoint(mpi_tmp_path / f"ref{comm.Get_rank()}", hf_cfg, seed=5)
    ckpt = open_checkpoint(mpi_tmp_path / "m.h5")
    layouts = _layouts(comm.Get_size(), ckpt.config)
    assert layouts
    for layout in layouts:
        mesh = job_mesh(comm, layout)
        layers = stage_layers(ckpt.config.num_hidden_layers, layout.pp, mesh.coord("pp"))
        specs = stage_tensors(ckpt.config, layers, mesh.is_first("pp"), mesh.is_last("pp"))
        got = load_shard(ckpt, specs, mesh.coord("tp"), layout.tp, dtype=np.float32)
        for spec in specs:
            want = expected_slice(spec.name, tensors[spec.name].astype(bfloat16)
                                  .astype(np.float32), hf_cfg, mesh.coord("tp"), layout.tp)
            np.testing.assert_array_equal(got.tensors[spec.name], want, err_msg=spec.name)
        mesh.free()
