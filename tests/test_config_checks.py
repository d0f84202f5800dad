"""A model's config is checked as transformers checks it, or run exactly.

Every field that changes the computation is implemented as the family's transformers class
computes it or refused in one line naming the field and its value: the activation, the rope
and its parameters, the windows and layer types, the sizes, the flags; numbers out of their
domain are refused at convert and at load (the checkpoint's stored config); malformed JSON
shapes of config.json, the safetensors index, generation_config.json and
tokenizer_config.json are one line naming the file; a weight that is not a float is refused,
never cast. Through the CLI each is exit status 2, one ``hpcpar: error:`` line, no traceback
and no file left. The supported non-default values run exactly as transformers computes.
"""

import json
import math
import shutil

import h5py
import numpy as np
import pytest

from helpers import PROMPTS, TINY, hpcpar_here, write_hf_checkpoint
from hpcpar.checkpoint.reader import CheckpointError, open_checkpoint
from hpcpar.models.config import ConfigError, ModelConfig
from hpcpar.parallel.errors import HpcparError
from hpcpar.models.family import GATED_ACTIVATIONS

BASE = dict(TINY, num_hidden_layers=2)
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
GEMMA = {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}
PHI3 = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}
MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}


def _set(**fields):
    return lambda cfg: dict(cfg, **fields)


# (id, config.json from BASE, words of the one line)
CONFIG_CASES = [
    # JSON shapes
    ("config-a-list", lambda cfg: [cfg], "holds a JSON list, not an object of fields"),
    ("config-a-number", lambda cfg: 3, "holds a JSON number, not an object of fields"),
    ("rope_scaling-a-string", _set(rope_scaling="linear"),
     "rope_scaling must be an object of rope parameters or null, got a JSON string 'linear'"),
    ("rope_parameters-a-list", _set(rope_parameters=[1, 2]),
     "rope_parameters must be an object of rope parameters or null, got a JSON list"),
    ("rope-per-layer-type", _set(rope_parameters={"full_attention": {"rope_type": "default"}}),
     "rope_parameters per layer type (full_attention) is not supported"),
    ("rope_type-a-number", _set(rope_parameters={"rope_type": 3}),
     "rope_parameters rope_type must be a string, got 3"),
    ("model_type-a-list", _set(model_type=["llama"]), "model_type ['llama'] is not supported"),
    ("architectures-a-string", _set(architectures="LlamaForCausalLM"),
     "architectures 'LlamaForCausalLM' is not ['LlamaForCausalLM']"),
    ("tie_word_embeddings-a-string", _set(tie_word_embeddings="false"),
     "tie_word_embeddings must be true or false, got 'false'"),
    ("attention_bias-a-number", _set(attention_bias=1),
     "attention_bias must be true or false, got 1"),
    ("mlp_bias-null", _set(mlp_bias=None), "mlp_bias must be true or false, got None"),
    ("rms_norm_eps-true", _set(rms_norm_eps=True), "rms_norm_eps must be a number, got True"),
    ("rope_theta-a-string", _set(rope_theta="1e4"), "rope_theta must be a number, got '1e4'"),
    ("rope_theta-null", _set(rope_theta=None), "rope_theta must be a number, got None"),
    ("bos_token_id-a-string", _set(bos_token_id="<s>"),
     "bos_token_id must be an integer or null, got '<s>'"),
    ("pad_token_id-a-float", _set(pad_token_id=0.5),
     "pad_token_id must be an integer or null, got 0.5"),
    # the activation: hpcpar's gated MLP runs silu and the tanh GELU only
    ("hidden_act-relu", _set(hidden_act="relu"), "hidden_act 'relu' is not supported"),
    ("hidden_act-erf-gelu", _set(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    ("hidden_act-null", _set(hidden_act=None), "hidden_act None is not supported"),
    ("hidden_act-a-list", _set(hidden_act=["silu"]), "hidden_act ['silu'] is not supported"),
    ("qwen2-relu", _set(**QWEN2, hidden_act="relu"), "hidden_act 'relu' is not supported"),
    ("phi3-gelu", _set(**PHI3, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    ("mistral-quick_gelu", _set(**MISTRAL, hidden_act="quick_gelu"),
     "hidden_act 'quick_gelu' is not supported"),
    ("gemma-relu", _set(**GEMMA, hidden_act="relu"), "hidden_act 'relu' is not supported"),
    ("gemma-activations-disagree", _set(**GEMMA, hidden_act="gelu_pytorch_tanh",
                                        hidden_activation="gelu"),
     "hidden_activation 'gelu' and hidden_act 'gelu_pytorch_tanh' name different functions"),
    ("gemma-bidirectional", _set(**GEMMA, use_bidirectional_attention=True),
     "use_bidirectional_attention true"),
    # numbers out of their domain
    ("rms_norm_eps-nan", _set(rms_norm_eps=math.nan),
     "rms_norm_eps must be a positive finite number, got nan"),
    ("rms_norm_eps-inf", _set(rms_norm_eps=math.inf),
     "rms_norm_eps must be a positive finite number, got inf"),
    ("rms_norm_eps-0", _set(rms_norm_eps=0), "rms_norm_eps must be a positive finite number"),
    ("rms_norm_eps-negative", _set(rms_norm_eps=-1e-5),
     "rms_norm_eps must be a positive finite number, got -1e-05"),
    ("rope_theta-0", _set(rope_theta=0), "rope_theta must be a positive finite number, got 0.0"),
    ("rope_theta-negative", _set(rope_theta=-10000.0),
     "rope_theta must be a positive finite number, got -10000.0"),
    ("rope_theta-nan", _set(rope_theta=math.nan),
     "rope_theta must be a positive finite number, got nan"),
    ("rope_parameters-theta-0", _set(rope_parameters={"rope_type": "default", "rope_theta": 0}),
     "rope_theta must be a positive finite number, got 0.0"),
    ("linear-factor-0", _set(rope_scaling={"rope_type": "linear", "factor": 0}),
     "rope_scaling factor must be a positive finite number, got 0.0"),
    ("linear-factor-negative", _set(rope_parameters={"rope_type": "linear", "factor": -2.0}),
     "rope_parameters factor must be a positive finite number, got -2.0"),
    ("linear-factor-inf", _set(rope_scaling={"rope_type": "linear", "factor": math.inf}),
     "rope_scaling factor must be a positive finite number, got inf"),
    ("llama3-factor-0", _set(rope_scaling=dict(L3, factor=0.0)),
     "rope_scaling factor must be a positive finite number, got 0.0"),
    ("llama3-low-0", _set(rope_scaling=dict(L3, low_freq_factor=0)),
     "rope_scaling low_freq_factor must be a positive finite number, got 0.0"),
    ("llama3-high-nan", _set(rope_scaling=dict(L3, high_freq_factor=math.nan)),
     "rope_scaling high_freq_factor must be a positive finite number, got nan"),
    ("llama3-high-equals-low", _set(rope_scaling=dict(L3, high_freq_factor=1.0)),
     "high_freq_factor 1.0 equals low_freq_factor"),
    ("llama3-original-0", _set(rope_scaling=dict(L3, original_max_position_embeddings=0)),
     "original_max_position_embeddings must be a positive integer, got 0"),
    ("llama3-factor-a-string", _set(rope_scaling=dict(L3, factor="8")),
     "rope_scaling factor must be a number, got '8'"),
    ("linear-without-factor", _set(rope_scaling={"rope_type": "linear"}),
     "rope_scaling of rope_type 'linear' lacks factor"),
    ("llama3-without-its-factors", _set(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "lacks low_freq_factor, high_freq_factor"),
    ("rope-type-dynamic", _set(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope type 'dynamic' is not supported"),
    ("phi3-linear-rope", _set(**PHI3, rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope type 'linear' is not one Phi3ForCausalLM runs"),
    ("partial-rotary", _set(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    ("partial-rotary-in-rope", _set(rope_parameters={"rope_type": "default",
                                                     "partial_rotary_factor": 0.25}),
     "partial_rotary_factor 0.25"),
    ("hidden_size-0", _set(hidden_size=0), "hidden_size must be a positive integer, got 0"),
    ("num_attention_heads-negative", _set(num_attention_heads=-8),
     "num_attention_heads must be a positive integer, got -8"),
    ("vocab_size-a-float", _set(vocab_size=250.0),
     "vocab_size must be a positive integer, got 250.0"),
    ("num_hidden_layers-true", _set(num_hidden_layers=True),
     "num_hidden_layers must be a positive integer, got True"),
    ("num_key_value_heads-0", _set(num_key_value_heads=0),
     "num_key_value_heads must be a positive integer, got 0"),
    ("head_dim-0", _set(head_dim=0), "head_dim must be a positive integer, got 0"),
    ("max_position_embeddings-0", _set(max_position_embeddings=0),
     "max_position_embeddings must be a positive integer, got 0"),
    ("heads-do-not-divide", _set(num_key_value_heads=3),
     "num_attention_heads 8 is not a multiple of num_key_value_heads 3"),
    ("head_dim-odd", _set(head_dim=7), "head_dim 7 must be even"),
    # windows and layer types
    ("mistral-window-0", _set(**MISTRAL, sliding_window=0),
     "sliding_window must be a positive integer or null, got 0"),
    ("mistral-window-true", _set(**MISTRAL, sliding_window=True),
     "sliding_window must be a positive integer or null, got True"),
    ("qwen2-layer_types-unknown", _set(**QWEN2, layer_types=["full_attention", "bogus"]),
     "layer_types[1] 'bogus' is not a layer type transformers accepts"),
    ("qwen2-layer_types-length", _set(**QWEN2, layer_types=["full_attention"]),
     "layer_types lists 1 layers, num_hidden_layers is 2"),
    ("qwen2-layer_types-chunked", _set(**QWEN2, layer_types=["chunked_attention"] * 2),
     "layer_types[0] 'chunked_attention' is not an attention this family runs"),
    ("qwen2-sliding-without-window", _set(**QWEN2, sliding_window=4,
                                          layer_types=["sliding_attention"] * 2),
     "layer_types[0] is 'sliding_attention' but the model has no window"),
    ("qwen2-layer_types-a-string", _set(**QWEN2, layer_types="full_attention"),
     "layer_types must be a list of layer type names"),
    ("qwen2-use_sliding_window-a-string", _set(**QWEN2, use_sliding_window="no"),
     "use_sliding_window must be true or false, got 'no'"),
    ("qwen2-max_window_layers-a-float", _set(**QWEN2, use_sliding_window=True,
                                             max_window_layers=1.5),
     "max_window_layers must be an integer, got 1.5"),
    ("qwen2-window-negative", _set(**QWEN2, use_sliding_window=True, sliding_window=-4,
                                   max_window_layers=0),
     "sliding_window must be a positive integer or null, got -4"),
    # a field left out means transformers' class default: Qwen2's 32 KV heads for 8 heads
    ("qwen2-kv-heads-default", lambda cfg: {k: v for k, v in dict(cfg, **QWEN2).items()
                                            if k != "num_key_value_heads"},
     "num_attention_heads 8 is not a multiple of num_key_value_heads 32"),
    ("qwen3-attention_bias-a-string", _set(model_type="qwen3", architectures=[
        "Qwen3ForCausalLM"], attention_bias="true"), "attention_bias must be true or false"),
]
CASE_IDS = [c[0] for c in CONFIG_CASES]


def hpcpar_cli(args, cwd):
    """``python -m hpcpar ARGS`` alone (rank 0 of a world of 1, as the test process is), run
    in this process in ``cwd``: its exit status and what it printed. These commands refuse
    their input before any work, so a process of their own would only add its start-up, a
    second for each of the cases (test_env_and_help starts the real processes)."""
    return hpcpar_here(args, cwd)


def assert_one_line(proc, *words):
    """Exit status 2, one ``hpcpar: error:`` line holding every one of ``words``, no
    traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpcpar: error: "), proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "Traceback" not in proc.stderr


def assert_nothing_left(folder):
    assert not [p.name for p in folder.iterdir() if p.name.startswith(("out", ".out"))]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny Llama-layout Hugging Face folder and its good conversion."""
    root = tmp_path_factory.mktemp("config-checks")
    write_hf_checkpoint(root / "hf", BASE)
    from hpcpar.checkpoint import convert
    convert(root / "hf", root / "good.h5")
    return root


@pytest.fixture
def work(hf_folder, tmp_path):
    """A copy of the Hugging Face folder to damage, in an empty folder."""
    shutil.copytree(hf_folder / "hf", tmp_path / "hf")
    return tmp_path


# ---- config.json at convert: one line, status 2, no file --------------------------------

@pytest.mark.parametrize("change, words", [c[1:] for c in CONFIG_CASES], ids=CASE_IDS)
def test_a_bad_config_is_one_line_at_convert(work, change, words):
    cfg = change(dict(BASE))
    (work / "hf" / "config.json").write_text(json.dumps(cfg))
    proc = hpcpar_cli(["convert", "hf", "out.h5"], work)
    assert_one_line(proc, "hf/config.json", words)
    assert_nothing_left(work)


# ---- the same configs stored in a checkpoint: refused at load ---------------------------

def _with_stored_config(good, path, cfg_text):
    shutil.copy(good, path)
    with h5py.File(path, "r+") as f:
        f.attrs["hf_config"] = cfg_text
    return path


@pytest.mark.parametrize("change, words", [c[1:] for c in CONFIG_CASES], ids=CASE_IDS)
def test_a_bad_stored_config_is_refused_at_load(hf_folder, tmp_path, change, words):
    path = _with_stored_config(hf_folder / "good.h5", tmp_path / "bad.h5",
                               json.dumps(change(dict(BASE))))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("cfg, words", [
    (dict(BASE, rms_norm_eps=math.nan), "rms_norm_eps must be a positive finite number"),
    (dict(BASE, rope_scaling="linear"), "rope_scaling must be an object"),
    (dict(BASE, hidden_act="relu"), "hidden_act 'relu' is not supported"),
])
def test_every_job_refuses_a_bad_stored_config_in_one_line(hf_folder, tmp_path, cfg, words):
    _with_stored_config(hf_folder / "good.h5", tmp_path / "bad.h5", json.dumps(cfg))
    np.save(tmp_path / "prompts.npy", np.array([[5, 6, 7]]))
    proc = hpcpar_cli(["generate", "--checkpoint", "bad.h5", "--prompts", "prompts.npy",
                       "--max-new-tokens", "2", "--out", "out.h5"], tmp_path)
    assert_one_line(proc, "bad.h5 config", words)
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 250, (4, 6)))
    proc = hpcpar_cli(["score", "--checkpoint", "bad.h5", "--data", "data.npy",
                       "--out", "out.h5"], tmp_path)
    assert_one_line(proc, "bad.h5 config", words)
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("text, words", [
    ("not json", "unreadable 'hf_config' attribute"),
    (json.dumps([1, 2]), "holds a JSON list, not an object of fields"),
])
def test_an_unreadable_stored_config_is_one_error(hf_folder, tmp_path, text, words):
    path = _with_stored_config(hf_folder / "good.h5", tmp_path / "bad.h5", text)
    with pytest.raises(CheckpointError, match=words):
        open_checkpoint(path)


def test_a_version_attribute_that_is_not_a_number_is_one_error(hf_folder, tmp_path):
    shutil.copy(hf_folder / "good.h5", tmp_path / "bad.h5")
    with h5py.File(tmp_path / "bad.h5", "r+") as f:
        f.attrs["hpcpar_format_version"] = "one"
    with pytest.raises(CheckpointError, match="'one' is not a version number"):
        open_checkpoint(tmp_path / "bad.h5")


# ---- the safetensors index, the shards and the other JSON files at convert ---------------

def _index(folder, weight_map, keep_single=False):
    single = folder / "model.safetensors"
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    if not keep_single:
        single.rename(folder / "model-00001-of-00001.safetensors")


def _names(folder):
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "numpy") as f:
        return list(f.keys())


def _damage(kind, hf):
    """Damage the folder ``hf`` as ``kind`` says; returns the words of the one line."""
    names = _names(hf)
    one = "model-00001-of-00001.safetensors"
    index = "model.safetensors.index.json"
    if kind == "index-a-list":
        (hf / index).write_text("[1, 2]")
        return [index, "holds a JSON list, not an object with a weight_map"]
    if kind == "index-not-json":
        (hf / index).write_bytes(b"{\"weight_map\": \xe9}")
        return [index, "not a readable safetensors index"]
    if kind == "index-without-weight_map":
        (hf / index).write_text("{\"metadata\": {}}")
        return [index, "'weight_map' is missing"]
    if kind == "weight_map-a-list":
        _index(hf, [one])
        return [index, "its weight_map is a JSON list, not an object"]
    if kind == "weight_map-a-number-for-a-file":
        _index(hf, {n: 3 for n in names})
        return [index, "the file 3, not a file name"]
    if kind == "index-names-a-missing-shard":
        _index(hf, {n: "model-00002-of-00002.safetensors" for n in names})
        return ["the index names model-00002-of-00002.safetensors, which is not in the folder"]
    if kind == "index-names-the-wrong-shard":
        from safetensors.numpy import save_file
        save_file({"x": np.zeros(2, np.float32)}, str(hf / "other.safetensors"))
        _index(hf, {n: "other.safetensors" for n in names})
        return [index, "gives tensor", "to other.safetensors, which does not hold it"]
    if kind == "index-names-a-truncated-shard":
        data = (hf / "model.safetensors").read_bytes()
        (hf / "part.safetensors").write_bytes(data[: len(data) - 100])
        _index(hf, {n: "part.safetensors" for n in names})
        return ["part.safetensors: not a readable safetensors file, truncated or damaged"]
    if kind == "index-names-a-path-outside":
        shutil.copy(hf / "model.safetensors", hf.parent / "elsewhere.safetensors")
        _index(hf, {n: "../elsewhere.safetensors" for n in names})
        return [index, "names the shard '../elsewhere.safetensors', outside the model folder"]
    if kind == "index-names-an-absolute-path":
        shutil.copy(hf / "model.safetensors", hf.parent / "elsewhere.safetensors")
        _index(hf, {n: str(hf.parent / "elsewhere.safetensors") for n in names})
        return [index, "outside the model folder"]
    if kind == "single-file-truncated":
        data = (hf / "model.safetensors").read_bytes()
        (hf / "model.safetensors").write_bytes(data[:40])
        return ["model.safetensors: not a readable safetensors file"]
    if kind == "generation_config-a-list":
        (hf / "generation_config.json").write_text("[1]")
        return ["generation_config.json holds a JSON list, not an object"]
    if kind == "generation_config-not-json":
        (hf / "generation_config.json").write_text("{\"eos_token_id\": ")
        return ["generation_config.json is not valid JSON"]
    if kind == "generation_config-not-utf8":
        (hf / "generation_config.json").write_bytes(b"{\"a\": \"\xe9\"}")
        return ["generation_config.json is not valid JSON"]
    if kind == "generation_config-eos-a-string":
        (hf / "generation_config.json").write_text("{\"eos_token_id\": \"</s>\"}")
        return ["generation_config.json: eos_token_id '</s>' is not a token id"]
    if kind == "tokenizer_config-a-list":
        (hf / "tokenizer_config.json").write_text("[1]")
        return ["tokenizer_config.json", "holds a JSON list, not an object"]
    if kind == "tokenizer_config-not-json":
        (hf / "tokenizer_config.json").write_text("{\"chat_template\": ")
        return ["tokenizer_config.json", "is not valid JSON"]
    if kind == "chat_template-a-number":
        (hf / "tokenizer_config.json").write_text("{\"chat_template\": 3}")
        return ["tokenizer_config.json", "not a template's text"]
    raise AssertionError(kind)


DAMAGES = ["index-a-list", "index-not-json", "index-without-weight_map", "weight_map-a-list",
           "weight_map-a-number-for-a-file", "index-names-a-missing-shard",
           "index-names-the-wrong-shard", "index-names-a-truncated-shard",
           "index-names-a-path-outside", "index-names-an-absolute-path",
           "single-file-truncated", "generation_config-a-list", "generation_config-not-json",
           "generation_config-not-utf8", "generation_config-eos-a-string",
           "tokenizer_config-a-list", "tokenizer_config-not-json", "chat_template-a-number"]


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_folder_is_one_line_at_convert(work, kind):
    words = _damage(kind, work / "hf")
    proc = hpcpar_cli(["convert", "hf", "out.h5"], work)
    assert_one_line(proc, *words)
    assert_nothing_left(work)


# ---- weights that are not floats are refused, never cast ---------------------------------

@pytest.mark.parametrize("name, dtype", [
    ("model.embed_tokens.weight", np.int8),              # the first tensor: was the target
    ("model.layers.1.mlp.up_proj.weight", np.int8),
    ("model.layers.0.self_attn.q_proj.weight", np.uint8),
    ("lm_head.weight", np.int32),
])
def test_a_weight_that_is_not_a_float_is_refused_not_cast(tmp_path, name, dtype):
    from safetensors.numpy import save_file
    tensors = write_hf_checkpoint(tmp_path / "hf", BASE)
    tensors[name] = np.clip(tensors[name] * 40, -100, 100).astype(dtype)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    code = {np.int8: "I8", np.uint8: "U8", np.int32: "I32"}[dtype]
    for args in (["convert", "hf", "out.h5"], ["convert", "hf", "out.h5", "--dtype", "float32"]):
        proc = hpcpar_cli(args, tmp_path)
        assert_one_line(proc, f"tensor {name} is {code}, not a floating-point type")
        assert_nothing_left(tmp_path)


def test_float_weights_of_any_float_type_still_convert(tmp_path):
    import ml_dtypes
    tensors = write_hf_checkpoint(tmp_path / "hf", BASE, dtype=ml_dtypes.bfloat16)
    from hpcpar.checkpoint import convert
    from hpcpar.checkpoint.reader import read_tensor
    cfg = convert(tmp_path / "hf", tmp_path / "m.h5")
    ckpt = open_checkpoint(tmp_path / "m.h5")
    assert cfg.num_hidden_layers == 2 and ckpt.dtype == np.dtype(ml_dtypes.bfloat16)
    name = "model.layers.1.mlp.up_proj.weight"
    np.testing.assert_array_equal(read_tensor(ckpt, name).astype(np.float32),
                                  tensors[name].astype(np.float32))


def test_the_legacy_name_of_full_attention_is_full_attention():
    cfg = ModelConfig.from_hf(dict(BASE, **QWEN2, use_sliding_window=True, sliding_window=4,
                                   layer_types=["attention", "full_attention"]))
    assert cfg.sliding_window is None and cfg.window_layers is None


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen2_moe", "gemma2"])
def test_the_layers_with_a_window_are_those_of_transformers_layer_types(model_type):
    """Without layer_types each family's own default: Qwen2's and Qwen3's from
    max_window_layers on, Qwen2-MoE's every other one below it, Gemma 2's every other."""
    _, transformers = _torch()
    sizes = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                 num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                 sliding_window=5, max_window_layers=4)
    ours = ModelConfig.from_hf(dict(sizes, model_type=model_type))
    theirs = transformers.AutoConfig.for_model(model_type, **sizes)
    assert [ours.window_of(i) for i in range(7)] == [
        5 if t == "sliding_attention" else None for t in theirs.layer_types]


def test_a_window_on_some_layers_is_on_those_layers():
    """Qwen2's layer_types, or without it every layer from max_window_layers on."""
    cfg = ModelConfig.from_hf(dict(BASE, **QWEN2, use_sliding_window=True, sliding_window=4,
                                   layer_types=["full_attention", "sliding_attention"]))
    assert [cfg.window_of(i) for i in range(2)] == [None, 4]
    cfg = ModelConfig.from_hf(dict(BASE, **QWEN2, use_sliding_window=True, sliding_window=4,
                                   max_window_layers=1))
    assert [cfg.window_of(i) for i in range(2)] == [None, 4]


# ---- what is supported runs as transformers computes it ----------------------------------

def _torch():
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma",
                                        "gemma2", "olmo2"])
def test_fields_left_out_mean_what_transformers_takes(model_type):
    """A config.json with only the sizes: the KV heads, head_dim, eps, window, tied head,
    context length and activation are those transformers' class of the family builds."""
    _, transformers = _torch()
    sizes = dict(vocab_size=64, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=32)
    ours = ModelConfig.from_hf(dict(sizes, model_type=model_type))
    theirs = transformers.AutoConfig.for_model(model_type, **sizes)
    head_dim = getattr(theirs, "head_dim", None) or 128 // 32
    layer_types = getattr(theirs, "layer_types", None)
    window = (getattr(theirs, "sliding_window", None)
              if layer_types is None or "sliding_attention" in layer_types else None)
    assert (ours.num_key_value_heads, ours.head_dim, ours.rms_norm_eps,
            ours.tie_word_embeddings, ours.max_position_embeddings, ours.sliding_window) == (
        theirs.num_key_value_heads, head_dim, theirs.rms_norm_eps, theirs.tie_word_embeddings,
        theirs.max_position_embeddings, window)
    act = getattr(theirs, "hidden_act", None) or theirs.hidden_activation     # Gemma 2's
    assert ours.activation == GATED_ACTIVATIONS[act]


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {k: v for k, v in L3.items() if k != "original_max_position_embeddings"}},
    {"rope_scaling": L3, "original_max_position_embeddings": 32},           # the top level wins
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
     "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},    # rope_scaling wins
    {"rope_theta": 100.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
    {"rope_theta": 100.0, "rope_scaling": {"type": "linear", "factor": 0.5}},
    {"rope_parameters": dict(L3, rope_theta=20000.0, factor=2.5, high_freq_factor=3.0)},
], ids=["llama3-without-original", "llama3-top-level-original",
        "rope_scaling-and-rope_parameters", "theta-in-rope_parameters", "legacy-type-linear-0.5",
        "llama3-v5"])
def test_rope_frequencies_are_transformers(tmp_path, rope):
    _, transformers = _torch()
    from hpcpar.models.rope import inverse_frequencies
    cfg = dict(BASE, max_position_embeddings=96)
    del cfg["rope_theta"]
    cfg.update(rope)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = inverse_frequencies(ModelConfig.from_json_file(tmp_path / "config.json"))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    theirs = model.model.rotary_emb.inv_freq.double().numpy()
    np.testing.assert_allclose(ours, theirs, rtol=2e-6)


@pytest.mark.parametrize("name", sorted(GATED_ACTIVATIONS))
def test_every_accepted_activation_is_transformers_forward_and_backward(name):
    """act(gate) * up and its gradients, by hpcpar's op for the activation a name maps to
    and by transformers' ACT2FN[name] with torch's autograd (float64)."""
    torch, _ = _torch()
    from transformers.activations import ACT2FN
    from hpcpar.models.family import activation
    from hpcpar.parallel.ops import GeGLU, SwiGLU
    rng = np.random.default_rng(3)
    gate, up, da = (rng.standard_normal((4, 33)) * 3 for _ in range(3))
    op = {"silu": SwiGLU, "gelu_tanh": GeGLU}[activation({"hidden_act": name})](np)
    g, u = (torch.tensor(a, requires_grad=True) for a in (gate, up))
    out = ACT2FN[name](g) * u
    out.backward(torch.tensor(da))
    np.testing.assert_allclose(op.forward(gate, up), out.detach().numpy(), rtol=1e-10,
                               atol=1e-12)
    dgate, dup = op.backward(da, gate, up)
    np.testing.assert_allclose(dgate, g.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(dup, u.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.device
@pytest.mark.parametrize("family, changes", [
    ("qwen2", {"hidden_act": "gelu_new"}),                           # GeGLU in a Qwen2
    ("gqa-llama3", {"hidden_act": "swish", "rope_scaling": {"rope_type": "linear",
                                                             "factor": 0.5}}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4,     # a window on every layer
               "layer_types": ["sliding_attention"] * 3}),
    ("qwen3", {"hidden_act": "gelu_accurate", "attention_bias": True}),
    ("mistral", {"sliding_window": None, "hidden_act": "gelu_pytorch_tanh"}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 3,     # a window from layer 1 on
               "max_window_layers": 1}),
], ids=["qwen2-gelu_new", "llama-swish-linear-0.5", "qwen2-layer_types-sliding",
        "qwen3-gelu_accurate-biases", "mistral-no-window-geglu", "qwen2-max_window_layers"])
def test_a_supported_non_default_config_matches_transformers(tmp_path, family, changes):
    torch, _ = _torch()
    from mpi4py import MPI
    from helpers import build_hf_model
    from hpcpar.jobs.generate import Prompts, run_generation
    from hpcpar.jobs.job import load_job
    model, path = build_hf_model(family, tmp_path, **changes)
    job = load_job(None, [f"model.checkpoint='{path}'", "generate.save_logits=true",
                          "generate.max_new_tokens=1", "generate.stop_at_eos=false"])
    ours = run_generation(MPI.COMM_SELF, job, prompts=Prompts(PROMPTS), progress=False)
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            theirs = model(torch.tensor(prompt[None])).logits[0].numpy()
        np.testing.assert_allclose(ours.prompt_logits[b, :len(prompt)], theirs, atol=1e-4,
                                   rtol=0)


def test_model_config_errors_are_config_errors_with_every_problem():
    """In the library too: one ConfigError, every domain problem of the config in it."""
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(dict(BASE, rms_norm_eps=-1.0, rope_theta=0.0, hidden_size=0))
    text = str(e.value)
    assert "\n" not in text and "hidden_size must be a positive integer" in text
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(dict(BASE, rms_norm_eps=math.nan, rope_theta=-1.0))
    assert "rms_norm_eps" in str(e.value) and "rope_theta" in str(e.value)
    assert isinstance(e.value, HpcparError)
