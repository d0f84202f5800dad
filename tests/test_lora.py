"""LoRA: adapters trained on a frozen base equal a LoRA written by hand in torch on
transformers' model (W x + B A x * alpha / r, peft's ``LoraLayer``; peft itself when it is
installed), step for step from the same peft folder (``--lora-from``): the loss, gradient
norm and adapter weights of two AdamW steps, on one rank and under pp 2 x tp 2 (and dp 2 x
tp 2 with ZeRO-1 and recompute); resuming ends where the straight run ends; ``export --lora``
writes a peft folder whose adapter gives the trained model's logits (and so does ``score
--lora`` with it), ``--merge-lora`` a folder transformers loads with them; bad input is one line, exit 2, before any work."""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import build_hf_model, hpcpar_here, made_once  # noqa: E402
from hpcpar.jobs.job import load_job  # noqa: E402
from hpcpar.jobs.train.engine import run_training  # noqa: E402

B, L, STEPS = 4, 10, 2
RANK, ALPHA = 4, 6.0                           # scale 1.5
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPTS = dict(lr=2e-3, weight_decay=0.1, eps=1e-6)      # eps: see test_train_torch


def _write_peft(folder: Path, tensors: dict) -> None:
    """A peft folder as ``PeftModel.save_pretrained`` writes it (its documented files)."""
    from safetensors.numpy import save_file
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
        "target_modules": MODULES, "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": "tiny", "use_rslora": False, "use_dora": False}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


class _Lora(torch.nn.Module):
    """peft's LoRA of one nn.Linear, by hand: base(x) + lora_B(lora_A(x)) * scaling."""

    def __init__(self, base, a, b, scale):
        super().__init__()
        self.base, self.scale = base, scale
        self.lora_A = torch.nn.Parameter(torch.from_numpy(a.copy()))
        self.lora_B = torch.nn.Parameter(torch.from_numpy(b.copy()))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T * self.scale


def _with_adapter(hf_dir: Path, adapter: Path):
    """transformers' model of ``hf_dir`` with the peft folder ``adapter``: by peft when it is
    installed, else by hand (the folder's documented names); returns it and its adapter
    parameters by peft's names."""
    from safetensors.numpy import load_file
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float()
    try:
        import peft
    except ImportError:
        peft = None
    if peft is not None:
        model = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
        return model, {n.replace(".default", ""): p for n, p in model.named_parameters()
                       if "lora_" in n}
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    for p in model.parameters():
        p.requires_grad_(False)
    params = {}
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in config["target_modules"]:
            key = f"base_model.model.{name}"
            lora = _Lora(module, tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"],
                         config["lora_alpha"] / config["r"])
            parent, leaf = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), leaf, lora)
            params[f"{key}.lora_A.weight"], params[f"{key}.lora_B.weight"] = lora.lora_A, lora.lora_B
    assert len(params) == len(tensors)
    return model, params


def _build(folder: Path) -> None:
    """The model (tied embedding, biases, one KV head: replicated under tp 2), its data, a
    peft folder of non-zero adapters, and torch's two AdamW steps from it."""
    hf, _ = build_hf_model("mqa-tied-bias", folder)
    rows = np.random.default_rng(0).integers(0, hf.config.vocab_size, (STEPS * B, L + 1))
    np.save(folder / "data.npy", rows)
    rng = np.random.default_rng(1)
    tensors = {}
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in MODULES:
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = (0.1 * rng.standard_normal(
                (RANK, module.in_features))).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.1 * rng.standard_normal(
                (module.out_features, RANK))).astype(np.float32)
    _write_peft(folder / "start", tensors)
    model, params = _with_adapter(folder / "hf", folder / "start")
    model.train()
    opt = torch.optim.AdamW(params.values(), lr=OPTS["lr"], betas=(0.9, 0.95), eps=OPTS["eps"],
                            weight_decay=OPTS["weight_decay"])
    losses, norms = [], []
    for s in range(STEPS):
        ids = torch.from_numpy(rows[s * B:(s + 1) * B])
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(list(params.values()), float("inf")).item())
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(rows[:2])).logits.numpy()
    np.savez(folder / "torch.npz", losses=losses, norms=norms, logits=logits,
             **{k: p.detach().numpy() for k, p in params.items()})


def _folder() -> Path:
    return made_once("test_lora model", _build)


def _train(comm, folder: Path, out: Path, steps: int = STEPS, *extra: str):
    job = load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/data.npy'",
        f"output.path='{out}'", f"train.steps={steps}", f"train.global_batch={B}",
        "train.optimizer='adamw'", f"train.lr={OPTS['lr']}", "train.betas=[0.9, 0.95]",
        f"train.eps={OPTS['eps']}", f"train.weight_decay={OPTS['weight_decay']}",
        f"train.lora_from='{folder}/start'", "train.peak_tflops=1.0", *extra])
    return run_training(comm, job, progress=False)


def _adapters(path: Path) -> dict:
    """A LoRA run's checkpoint's adapters, by peft's names."""
    with h5py.File(path) as f:
        return {f"base_model.model.{k}": v[()] for k, v in _datasets(f)}


def _datasets(group, prefix=""):
    for k, v in group.items():
        if isinstance(v, h5py.Dataset) and "lora_" in k:
            yield prefix + k, v
        elif isinstance(v, h5py.Group) and k not in ("optimizer", "train", "tokenizer"):
            yield from _datasets(v, prefix + k + "/")


def _assert_as_torch(folder: Path, out: Path) -> None:
    ref = np.load(folder / "torch.npz")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for key, want in (("loss", ref["losses"]), ("grad_norm", ref["norms"])):
        got = [m[key] for m in metrics]
        assert got[0] == pytest.approx(want[0], rel=1e-5)
        assert abs(got[1] - want[1]) <= 1e-3 * abs(want[1] - want[0]) + 1e-6, (key, got, want)
    start = _peft_tensors(folder / "start")
    mine = _adapters(out / f"step-{STEPS}.h5")
    assert set(mine) == set(start)
    for name, w in mine.items():             # AdamW compared by the update (design.md §5)
        update = np.linalg.norm(ref[name] - start[name])
        assert update > 0 and np.linalg.norm(w - ref[name]) <= 1e-3 * update, name


def _peft_tensors(folder: Path) -> dict:
    from safetensors.numpy import load_file
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.device
def test_two_adamw_steps_from_a_peft_folder_are_torchs_and_resume_and_export(tmp_path):
    folder = _folder()
    _train(MPI.COMM_SELF, folder, tmp_path / "run")
    _assert_as_torch(folder, tmp_path / "run")
    # one step, then the second resumed: the straight run's adapters
    _train(MPI.COMM_SELF, folder, tmp_path / "resumed", 1)
    _train(MPI.COMM_SELF, folder, tmp_path / "resumed", STEPS, "train.resume='auto'")
    straight, resumed = (_adapters(tmp_path / r / f"step-{STEPS}.h5") for r in ("run", "resumed"))
    for name, w in straight.items():
        np.testing.assert_array_equal(resumed[name], w, err_msg=name)
    # the adapter as a peft folder: its model gives the trained model's logits
    ckpt = tmp_path / "run" / f"step-{STEPS}.h5"
    done = hpcpar_here(["export", ckpt, tmp_path / "adapter", "--lora"], tmp_path)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "bias",
                                   "use_rslora", "use_dora")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
        "bias": "none", "use_rslora": False, "use_dora": False}
    assert sorted(config["target_modules"]) == sorted(MODULES)
    exported = _peft_tensors(tmp_path / "adapter")
    assert set(exported) == set(straight)
    for name, w in straight.items():
        np.testing.assert_array_equal(exported[name], w, err_msg=name)
    ref = np.load(folder / "torch.npz")
    ids = torch.from_numpy(np.load(folder / "data.npy")[:2])
    model, _ = _with_adapter(folder / "hf", tmp_path / "adapter")
    with torch.no_grad():
        logits = model.eval()(ids).logits.numpy()
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4)
    # scored with the adapter merged at load (--lora): the same log-probabilities
    np.save(tmp_path / "rows.npy", ids.numpy())
    done = hpcpar_here(["score", "--checkpoint", folder / "model.h5", "--data",
                        tmp_path / "rows.npy", "--out", tmp_path / "scores.h5", "--lora",
                        tmp_path / "adapter"], tmp_path)
    assert done.returncode == 0, done.stderr
    _assert_scores(folder, tmp_path / "scores.h5")
    # merged into the base: transformers loads it and gives the same logits
    done = hpcpar_here(["export", ckpt, tmp_path / "merged", "--merge-lora"], tmp_path)
    assert done.returncode == 0, done.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float()
    with torch.no_grad():
        np.testing.assert_allclose(merged.eval()(ids).logits.numpy(), logits, atol=1e-4)
    done = hpcpar_here(["export", ckpt, tmp_path / "plain"], tmp_path)
    assert done.returncode == 2 and "--lora" in done.stderr and not (tmp_path / "plain").exists()


@pytest.mark.device
@pytest.mark.mpi(ranks=(4,))             # pp 2 x tp 2; dp 2 x tp 2, ZeRO-1, recompute
def test_two_adamw_steps_under_pp_and_tp_and_zero_are_torchs(tmp_path_factory):
    comm = MPI.COMM_WORLD
    folder = out = None
    if comm.Get_rank() == 0:
        folder, out = _folder(), tmp_path_factory.mktemp("lora-mpi")
    folder, out = (Path(p) for p in comm.bcast((str(folder), str(out)), root=0))
    tp = ["parallel.tp=2"] if comm.Get_size() == 4 else []  # 2 ranks: the strict backend's
    for name, layout in (("pp-tp", ["parallel.pp=2", "parallel.micro_batches=2"] + tp),
                         ("dp-tp", ["parallel.dp=2", "train.zero=1",
                                    "train.recompute='full'"] + tp)):
        _train(comm, folder, out / name, STEPS, *layout)
        if comm.Get_rank() == 0:
            _assert_as_torch(folder, out / name)
        comm.Barrier()
    # the run's adapter merged into each rank's slices at load (score --lora): torch's
    # log-probabilities of the model it trained
    from hpcpar.jobs.score import run_scoring
    if comm.Get_rank() == 0:
        np.save(out / "rows.npy", np.load(folder / "data.npy")[:2])
    comm.Barrier()
    run_scoring(comm, load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"model.lora='{out}/pp-tp'",
        f"score.data='{out}/rows.npy'", f"output.path='{out}/scores.h5'", "parallel.pp=2",
        *tp]), progress=False)
    if comm.Get_rank() == 0:
        _assert_scores(folder, out / "scores.h5")
    comm.Barrier()


def _assert_scores(folder: Path, path: Path) -> None:
    """A scoring output of the first two rows gives torch's log-probabilities of them."""
    ids = np.load(folder / "data.npy")[:2]
    want = torch.log_softmax(torch.from_numpy(np.load(folder / "torch.npz")["logits"]), -1)
    want = np.take_along_axis(want.numpy()[:, :-1], ids[:, 1:, None], -1)[..., 0]
    with h5py.File(path) as f:
        np.testing.assert_allclose(f["token_logprobs"][()][:, 1:], want, atol=1e-4)


def test_a_new_adapter_starts_as_peft_initialises_it():
    """A kaiming-uniform (a = sqrt 5: within 1/sqrt(in)), drawn by the seed, layer and
    target alone; B zero, so the model starts as its base."""
    from hpcpar.models.lora import AdapterSpec, initial_adapter
    a = AdapterSpec("x.lora_A.weight", (8, 400), "lora", 3, base="x", target="v", half="A")
    b = AdapterSpec("x.lora_B.weight", (64, 8), "v", 3, base="x", target="v", half="B")
    w = initial_adapter(a, seed=5)
    assert w.dtype == np.float32 and np.abs(w).max() <= 1 / 20 and np.abs(w).max() > 0.045
    assert abs(w.mean()) < 3e-3 and w.std() == pytest.approx(1 / 20 / np.sqrt(3), rel=0.05)
    np.testing.assert_array_equal(initial_adapter(a, seed=5), w)
    assert not np.array_equal(initial_adapter(a, seed=6), w)
    assert not initial_adapter(b, seed=5).any()


@pytest.mark.device
def test_a_new_adapter_trains_from_the_base_and_its_checkpoint_is_no_model(tmp_path):
    """--lora-rank alone: q and v adapted, the first step's loss the base's (B is zero), A
    unmoved by it (its gradient is zero) and drawn by the seed; the checkpoint holds the
    adapters only, which generate refuses as a model in one line."""
    from hpcpar.models.lora import adapter_specs, initial_adapter
    from hpcpar.checkpoint import open_checkpoint
    from hpcpar.checkpoint.peft import run_settings
    folder = _folder()
    job = load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/data.npy'",
        f"output.path='{tmp_path}/run'", "train.steps=1", f"train.global_batch={B}",
        "train.lora_rank=2", "train.seed=3", "train.peak_tflops=1.0"])
    run_training(MPI.COMM_SELF, job, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf").float().eval()
    ids = torch.from_numpy(np.load(folder / "data.npy")[:B])
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss.item()
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    ckpt = tmp_path / "run" / "step-1.h5"
    settings, base = run_settings(ckpt)
    assert (settings.rank, settings.alpha, settings.targets) == (2, 2.0, ("q", "v"))
    assert Path(base) == (folder / "model.h5").resolve()
    cfg = open_checkpoint(folder / "model.h5").config
    with h5py.File(ckpt) as f:
        specs = adapter_specs(cfg, range(cfg.num_hidden_layers), settings)
        assert {n for n, _ in _datasets(f)} == {s.name for s in specs}
        for spec in specs:
            if spec.half == "A":
                np.testing.assert_array_equal(f[spec.name][()], initial_adapter(spec, 3))
            else:
                assert np.abs(f[spec.name][()]).max() > 0
    done = hpcpar_here(["generate", "--checkpoint", ckpt, "--prompts", "random",
                        "--max-new-tokens", "2", "--out", tmp_path / "g.h5"], tmp_path)
    assert done.returncode == 2 and "a LoRA run's checkpoint" in done.stderr


@pytest.mark.parametrize("flags, words", [
    (["--lora-rank", "0"], "LoRA rank 0: give a positive integer"),
    (["--lora-rank", "4", "--lora-targets", "q,attn"], "LoRA target(s) 'attn': choose among"),
    (["--lora-rank", "100"], "LoRA rank 100 is above the smallest dimension"),
    (["--lora-alpha", "8"], "--lora-alpha without --lora-rank"),
    (["--lora-from", "{tmp}"], "no adapter_config.json; a peft LoRA adapter folder holds"),
])
def test_bad_lora_settings_are_one_line_before_any_work(tmp_path, flags, words):
    folder = _folder()
    flags = [f.format(tmp=tmp_path) for f in flags]
    done = hpcpar_here(["train", "--checkpoint", folder / "model.h5", "--data",
                        folder / "data.npy", "--steps", "1", "--global-batch", "2", "--out",
                        tmp_path / "out", *flags], tmp_path)
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(errors) == 1 and words in errors[0], done.stderr
    assert not (tmp_path / "out").exists()
