"""LoRA against transformers + peft: adapters trained on a frozen base follow peft's
``get_peft_model(model, LoraConfig(...))`` step for step from the adapter peft saved
(``--lora-from``), on three families (Llama with a tied embedding, biases and one KV head;
Qwen2 with q/k/v biases; Mixtral, its q, v and routed experts adapted): the loss,
gradient norm and adapter weights of two AdamW steps on masked fine-tuning rows (``{"ids",
"labels"}`` with -100, rows of different lengths: transformers' loss of the right-padded
batch), on one rank, under tp 2 x pp 2 and under dp 2 x cp 2 with ZeRO-1 and recompute
(Mixtral's experts over ep 2 there). The adapter ``export --lora`` writes is a folder
``PeftModel.from_pretrained`` loads and gives the trained model's logits (and so does
``score --lora`` with it); ``--merge-lora`` writes exactly the weights of peft's
``merge_and_unload`` of that adapter; resuming ends where the straight run ends; a resumed
generation keeps its adapter; bad input is one line, exit 2, before any work."""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from helpers import build_hf_model, hpcpar_here, made_once  # noqa: E402
from hpcpar.jobs.job import load_job  # noqa: E402
from hpcpar.jobs.train.engine import run_training  # noqa: E402

B, L, STEPS = 4, 10, 2
RANK, ALPHA = 4, 6                             # scale 1.5
OPTS = dict(lr=2e-3, weight_decay=0.1, eps=1e-6)      # eps: see test_train_torch
# family: (tests/helpers' model, changes to its config, peft's target_modules and
# target_parameters)
FAMILIES = {
    "llama": ("mqa-tied-bias", {}, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"], None),
    "qwen2": ("qwen2", {"num_hidden_layers": 2}, ["q_proj", "v_proj", "o_proj", "up_proj"],
              None),
    # the experts too: transformers' fused gate_up_proj [E, 2I, H] and down_proj; the
    # router's load-balancing loss off, as peft trains the model's own loss
    "mixtral": ("mixtral", {"router_aux_loss_coef": 0.0}, ["q_proj", "v_proj"],
                ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


def _rows(vocab: int) -> list[dict]:
    """STEPS * B fine-tuning rows of 6..L+1 tokens, the first 1..4 labels -100 (the first
    two rows whole, for the logits)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(STEPS * B):
        n = L + 1 if i < 2 else int(rng.integers(6, L + 2))
        ids = rng.integers(0, vocab, n).tolist()
        masked = int(rng.integers(1, 5))
        out.append({"ids": ids, "labels": [-100] * masked + ids[masked:]})
    return out


def _batch(rows: list[dict]):
    """The rows right-padded into one batch: ids, attention mask, labels (-100 on padding)."""
    width = max(len(r["ids"]) for r in rows)
    pad = [width - len(r["ids"]) for r in rows]
    ids = torch.tensor([r["ids"] + [0] * p for r, p in zip(rows, pad)])
    mask = torch.tensor([[1] * len(r["ids"]) + [0] * p for r, p in zip(rows, pad)])
    labels = torch.tensor([r["labels"] + [-100] * p for r, p in zip(rows, pad)])
    return ids, mask, labels


def _adapter_params(model) -> dict:
    """A peft model's adapter parameters by the names of its saved folder."""
    return {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}


def _build(folder: Path, family: str) -> None:
    """The family's tiny model and its rows; peft's adapter on it (A and B random:
    ``init_lora_weights=False``, so every path is exercised from the first step) saved as
    folder/start; peft's two AdamW steps from it (losses, gradient norms, adapters) and the
    trained model's logits of the first two rows."""
    name, changes, modules, parameters = FAMILIES[family]
    hf, _ = build_hf_model(name, folder, **changes)
    rows = _rows(hf.config.vocab_size)
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    np.save(folder / "whole.npy", np.array([r["ids"] for r in rows[:2]]))
    torch.manual_seed(1)
    model = peft.get_peft_model(hf, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=modules, target_parameters=parameters,
        lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM"))
    model.save_pretrained(folder / "start")
    params = _adapter_params(model)
    opt = torch.optim.AdamW(params.values(), lr=OPTS["lr"], betas=(0.9, 0.95), eps=OPTS["eps"],
                            weight_decay=OPTS["weight_decay"])
    model.train()
    losses, norms = [], []
    for s in range(STEPS):
        ids, mask, labels = _batch(rows[s * B:(s + 1) * B])
        opt.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(list(params.values()), float("inf")).item())
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(np.load(folder / "whole.npy"))).logits.numpy()
    np.savez(folder / "peft.npz", losses=losses, norms=norms, logits=logits,
             **{k: p.detach().numpy() for k, p in params.items()})


def _folder(family: str) -> Path:
    return made_once(f"test_lora peft {family}", lambda folder: _build(folder, family))


def _train(comm, folder: Path, out: Path, steps: int = STEPS, *extra: str):
    job = load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/rows.jsonl'",
        f"output.path='{out}'", f"train.steps={steps}", f"train.global_batch={B}",
        f"train.seq_len={L}", "train.optimizer='adamw'", f"train.lr={OPTS['lr']}",
        "train.betas=[0.9, 0.95]", f"train.eps={OPTS['eps']}",
        f"train.weight_decay={OPTS['weight_decay']}", f"train.lora_from='{folder}/start'",
        "train.peak_tflops=1.0", *extra])
    return run_training(comm, job, progress=False)


def _adapters(path: Path) -> dict:
    """A LoRA run's checkpoint's adapters, by peft's names (the experts' stacked per layer
    as peft stacks them: ``to_peft``, whose folder the export test holds to peft)."""
    from hpcpar.checkpoint import open_checkpoint
    from hpcpar.checkpoint.peft import run_settings, to_peft
    settings, base = run_settings(path)
    with h5py.File(path) as f:
        tensors = {k: v[()] for k, v in _datasets(f)}
    return to_peft(open_checkpoint(base).config, settings, tensors)


def _datasets(group, prefix=""):
    for k, v in group.items():
        if isinstance(v, h5py.Dataset) and "lora_" in k:
            yield prefix + k, v
        elif isinstance(v, h5py.Group) and k not in ("optimizer", "train", "tokenizer"):
            yield from _datasets(v, prefix + k + "/")


def _safetensors(folder: Path) -> dict:
    from safetensors.numpy import load_file
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _assert_as_peft(folder: Path, out: Path) -> None:
    """The run's losses, gradient norms and adapters are peft's (AdamW compared by the
    update, normwise per tensor: design.md section 5)."""
    ref = np.load(folder / "peft.npz")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for key, want in (("loss", ref["losses"]), ("grad_norm", ref["norms"])):
        got = [m[key] for m in metrics]
        assert got[0] == pytest.approx(want[0], rel=1e-5), (key, got, want)
        assert abs(got[1] - want[1]) <= 1e-3 * abs(want[1] - want[0]) + 1e-6, (key, got, want)
    start = _safetensors(folder / "start")
    mine = _adapters(out / f"step-{STEPS}.h5")
    assert set(mine) == set(start)
    for name, w in mine.items():
        update = np.linalg.norm(ref[name] - start[name])
        assert update > 0 and np.linalg.norm(w - ref[name]) <= 1e-3 * update, name


def _peft_model(folder: Path, adapter: Path):
    base = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf").float()
    return peft.PeftModel.from_pretrained(base, adapter).eval()


@pytest.mark.device
@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_adamw_steps_from_peft_are_pefts_and_export_and_merge_as_peft(tmp_path, family):
    folder = _folder(family)
    _train(MPI.COMM_SELF, folder, tmp_path / "run")
    _assert_as_peft(folder, tmp_path / "run")
    # the adapter as a peft folder: peft loads it and gives the trained model's logits
    ckpt = tmp_path / "run" / f"step-{STEPS}.h5"
    done = hpcpar_here(["export", ckpt, tmp_path / "adapter", "--lora"], tmp_path)
    assert done.returncode == 0, done.stderr
    config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    assert (config.peft_type, config.task_type, config.r, config.lora_alpha, config.bias,
            config.use_rslora, config.use_dora) == ("LORA", "CAUSAL_LM", RANK, ALPHA, "none",
                                                    False, False)
    assert sorted(config.target_modules) == sorted(FAMILIES[family][2])
    assert config.target_parameters == FAMILIES[family][3]
    ref, start = np.load(folder / "peft.npz"), _safetensors(folder / "start")
    exported = _safetensors(tmp_path / "adapter")
    assert set(exported) == set(start)
    for name, w in exported.items():           # the run's adapters, by peft's names
        update = np.linalg.norm(ref[name] - start[name])
        assert np.linalg.norm(w - ref[name]) <= 1e-3 * update, name
    model = _peft_model(folder, tmp_path / "adapter")
    ids = torch.from_numpy(np.load(folder / "whole.npy"))
    with torch.no_grad():
        logits = model(ids).logits.numpy()
    np.testing.assert_allclose(logits, np.load(folder / "peft.npz")["logits"], atol=1e-4)
    # scored with it merged into the weights at load (--lora): the same log-probabilities
    done = hpcpar_here(["score", "--checkpoint", folder / "model.h5", "--data",
                        folder / "whole.npy", "--out", tmp_path / "scores.h5", "--lora",
                        tmp_path / "adapter"], tmp_path)
    assert done.returncode == 0, done.stderr
    _assert_scores(folder, tmp_path / "scores.h5")
    # merged into the base: the weights of peft's merge_and_unload of that adapter
    done = hpcpar_here(["export", ckpt, tmp_path / "merged", "--merge-lora"], tmp_path)
    assert done.returncode == 0, done.stderr
    model.merge_and_unload().save_pretrained(tmp_path / "peft-merged")
    mine, theirs = _safetensors(tmp_path / "merged"), _safetensors(tmp_path / "peft-merged")
    assert set(mine) == set(theirs)
    for name, w in theirs.items():
        np.testing.assert_allclose(mine[name], w, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.device
def test_resumed_runs_end_as_the_straight_run_and_score_with_the_adapter(tmp_path):
    folder = _folder("llama")
    _train(MPI.COMM_SELF, folder, tmp_path / "run")
    # one step, then the second resumed: the straight run's adapters
    _train(MPI.COMM_SELF, folder, tmp_path / "resumed", 1)
    _train(MPI.COMM_SELF, folder, tmp_path / "resumed", STEPS, "train.resume='auto'")
    straight, resumed = (_adapters(tmp_path / r / f"step-{STEPS}.h5") for r in ("run", "resumed"))
    for name, w in straight.items():
        np.testing.assert_array_equal(resumed[name], w, err_msg=name)
    # scored with the run's adapter merged at load (--lora): peft's log-probabilities
    done = hpcpar_here(["score", "--checkpoint", folder / "model.h5", "--data",
                        folder / "whole.npy", "--out", tmp_path / "scores.h5", "--lora",
                        tmp_path / "run"], tmp_path)
    assert done.returncode == 0, done.stderr
    _assert_scores(folder, tmp_path / "scores.h5")
    done = hpcpar_here(["export", tmp_path / "run" / f"step-{STEPS}.h5", tmp_path / "plain"],
                       tmp_path)
    assert done.returncode == 2 and "--lora" in done.stderr and not (tmp_path / "plain").exists()


@pytest.mark.device
@pytest.mark.mpi(ranks=(4,))       # tp 2 x pp 2; dp 2 x cp 2 with ZeRO-1, recompute (and ep 2)
def test_two_adamw_steps_under_tp_pp_and_dp_cp_are_pefts(tmp_path_factory):
    comm = MPI.COMM_WORLD
    folders = out = None
    if comm.Get_rank() == 0:
        folders = [str(_folder(f)) for f in FAMILIES]
        out = str(tmp_path_factory.mktemp("lora-mpi"))
    folders, out = comm.bcast((folders, out), root=0)
    out = Path(out)
    four = comm.Get_size() == 4        # 2 ranks: the strict backend's phase, pp 2 and dp 2
    layouts = {"tp-pp": ["parallel.pp=2", "parallel.micro_batches=2"] + four * ["parallel.tp=2"],
               "dp-cp": ["parallel.dp=2", "train.zero=1", "train.recompute='full'"]
               + four * ["parallel.cp=2"]}
    for family, folder in zip(FAMILIES, map(Path, folders)):
        for name, layout in layouts.items():
            # Mixtral's experts split over the dp replicas too: ep 2
            ep = ["parallel.ep=2"] if family == "mixtral" and name == "dp-cp" else []
            _train(comm, folder, out / f"{family}-{name}", STEPS, *layout, *ep)
            if comm.Get_rank() == 0:
                _assert_as_peft(folder, out / f"{family}-{name}")
            comm.Barrier()
    # Mixtral's tp 2 x pp 2 run's adapter (its experts' too) merged into each rank's slices
    # at load (score --lora): peft's log-probabilities of the model it trained
    from hpcpar.jobs.score import run_scoring
    folder = Path(folders[2])
    run_scoring(comm, load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"model.lora='{out}/mixtral-tp-pp'",
        f"score.data='{folder}/whole.npy'", f"output.path='{out}/scores.h5'", "parallel.pp=2",
        *four * ["parallel.tp=2"]]), progress=False)
    if comm.Get_rank() == 0:
        _assert_scores(folder, out / "scores.h5")
    comm.Barrier()


def _assert_scores(folder: Path, path: Path) -> None:
    """A scoring output of the two whole rows gives peft's log-probabilities of them."""
    ids = np.load(folder / "whole.npy")
    want = torch.log_softmax(torch.from_numpy(np.load(folder / "peft.npz")["logits"]), -1)
    want = np.take_along_axis(want.numpy()[:, :-1], ids[:, 1:, None], -1)[..., 0]
    with h5py.File(path) as f:
        np.testing.assert_allclose(f["token_logprobs"][()][:, 1:], want, atol=1e-4)


def test_a_new_adapter_starts_as_peft_initialises_it():
    """A kaiming-uniform with a = sqrt 5 as peft draws it (within 1/sqrt(in), the spread of
    peft's own A), by the seed, layer and target alone; B zero, so the model starts as its
    base."""
    from hpcpar.models.lora import AdapterSpec, initial_adapter
    a = AdapterSpec("x.lora_A.weight", (8, 400), "lora", 3, base="x", target="v", half="A")
    b = AdapterSpec("x.lora_B.weight", (64, 8), "v", 3, base="x", target="v", half="B")
    w = initial_adapter(a, seed=5)
    torch.manual_seed(0)
    layer = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(400, 64)),
                                peft.LoraConfig(r=8, target_modules=["0"]))
    theirs = layer.base_model.model[0]
    theirs_a = theirs.lora_A["default"].weight.detach().numpy()
    assert not theirs.lora_B["default"].weight.detach().numpy().any()
    assert w.shape == theirs_a.shape and w.dtype == np.float32
    assert np.abs(w).max() <= 1 / 20 and np.abs(theirs_a).max() <= 1 / 20
    assert w.std() == pytest.approx(theirs_a.std(), rel=0.05) and abs(w.mean()) < 3e-3
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
    folder = _folder("llama")
    job = load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/rows.jsonl'",
        f"output.path='{tmp_path}/run'", "train.steps=1", f"train.global_batch={B}",
        "train.lora_rank=2", "train.seed=3", "train.peak_tflops=1.0"])
    run_training(MPI.COMM_SELF, job, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf").float().eval()
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]
    ids, mask, labels = _batch(rows[:B])
    with torch.no_grad():
        loss = hf(ids, attention_mask=mask, labels=labels).loss.item()
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
    # an adapter of another model (Qwen2's: other layers and shapes)
    (["--lora-from", "{qwen2}/start"], "is it an adapter of this checkpoint's model"),
    (["--lora-from", "{llama}/start", "--lora-rank", "8"], "--lora-rank 8 (the folder's: 4)"),
    (["--lora-rank", "4", "--lora-targets", "q,experts.down"],
     "LoRA target(s) experts.down: llama has no experts; target gate,up,down"),
    (["--lora-rank", "4", "--zero", "3"], "a LoRA run trains only its small adapters"),
])
def test_bad_lora_settings_are_one_line_before_any_work(tmp_path, flags, words):
    folder = _folder("llama")
    flags = [f.format(tmp=tmp_path, llama=folder, qwen2=_folder("qwen2") if "{qwen2}" in f
                      else "") for f in flags]
    done = hpcpar_here(["train", "--checkpoint", folder / "model.h5", "--data",
                        folder / "rows.jsonl", "--steps", "1", "--global-batch", "2", "--out",
                        tmp_path / "out", *flags], tmp_path)
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(errors) == 1 and words in errors[0], done.stderr
    assert not (tmp_path / "out").exists()


def test_a_generation_resumes_only_with_the_same_adapter(tmp_path):
    """A job applies one adapter, merged into the weights, so its prefix cache (which lives
    in the job) never holds another's blocks; across a stop and ``--resume`` the adapter is
    part of the run's settings, by its contents: the same adapter as a peft folder or as the
    run it came from agrees, another (or none) is named as the setting that differs."""
    from hpcpar.checkpoint import open_checkpoint
    from hpcpar.checkpoint.peft import adapter_digest
    from hpcpar.jobs.generate.output_file import settings_differ
    folder = _folder("llama")
    cfg = open_checkpoint(folder / "model.h5").config
    _train(MPI.COMM_SELF, folder, tmp_path / "run", 1)
    done = hpcpar_here(["export", tmp_path / "run" / "step-1.h5", tmp_path / "adapter",
                        "--lora"], tmp_path)
    assert done.returncode == 0, done.stderr
    trained = adapter_digest(tmp_path / "run", cfg)
    assert adapter_digest(tmp_path / "adapter", cfg) == trained
    start = adapter_digest(folder / "start", cfg)
    assert start != trained
    for stopped, now in (({"lora": start}, {"lora": trained}), ({}, {"lora": trained}),
                         ({"lora": trained}, {})):
        assert settings_differ(stopped, now) == ["LoRA adapter (--lora)"]
    assert settings_differ({"lora": trained}, {"lora": trained}) == []


@pytest.mark.device
def test_the_fine_tuning_job_file_runs_as_shipped(tmp_path):
    """jobs/finetune_lora.toml (ten of its steps): its rows' answers alone carry the loss,
    which falls; ``show`` describes its checkpoint (the adapters and their base), which
    exports as a peft folder."""
    repo = Path(__file__).resolve().parents[1]
    job = load_job(repo / "jobs" / "finetune_lora.toml",
                   [f"output.path='{tmp_path}/run'", "train.steps=10", "train.save_every=0"])
    report = run_training(MPI.COMM_SELF, job, progress=False)
    rows = [json.loads(line) for line in
            (repo / "jobs" / "data" / "finetune_tiny.jsonl").read_text().splitlines()]
    answers = sum(sum(t != -100 for t in r["labels"][1:]) for r in rows)
    assert f"{len(rows)} rows of at most 19 tokens, {answers} tokens carrying the loss" \
        in report.data
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.1
    shown = hpcpar_here(["show", tmp_path / "run" / "step-10.h5", "--json"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    about = json.loads(shown.stdout)
    assert about["lora"]["rank"] == 8 and len(about["lora"]["targets"]) == 7
    assert Path(about["lora"]["base"]).name == "tiny-seed0.h5"     # the preset, as made
    assert about["training"]["step"] == 10
    done = hpcpar_here(["export", tmp_path / "run" / "step-10.h5", tmp_path / "adapter",
                        "--lora"], tmp_path)
    assert done.returncode == 0, done.stderr
    config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    assert (config.r, config.lora_alpha, len(config.target_modules)) == (8, 16, 7)



def test_expert_adapters_of_a_model_without_experts_are_refused_in_one_line(tmp_path):
    """A peft folder adapting experts (``target_parameters``) given to a dense model: one line
    naming the setting, exit 2, before any work."""
    folder = _folder("llama")
    (tmp_path / "experts").mkdir()
    config = json.loads((folder / "start" / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.gate_up_proj"]
    (tmp_path / "experts" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "experts" / "adapter_model.safetensors").symlink_to(
        folder / "start" / "adapter_model.safetensors")
    done = hpcpar_here(["train", "--checkpoint", folder / "model.h5", "--data",
                        folder / "rows.jsonl", "--steps", "1", "--global-batch", "2", "--out",
                        tmp_path / "out", "--lora-from", tmp_path / "experts"], tmp_path)
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert "target_parameters ['mlp.experts.gate_up_proj'] (hpcpar adapts none of this " \
        "model)" in errors[0], errors
    assert not (tmp_path / "out").exists()


@pytest.mark.device
def test_a_new_adapter_of_the_experts_down_alone_goes_out_as_peft_names_it(tmp_path):
    """experts.down alone (peft's target_parameters ["mlp.experts.down_proj"], its tensors
    ``...mlp.experts.lora_A.weight`` without the inner wrapper's name), new (A drawn by the
    seed, B zero), one step: peft loads the exported folder and gives the log-probabilities
    ``score --lora`` gives with the run."""
    folder = _folder("mixtral")
    job = load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/rows.jsonl'",
        f"output.path='{tmp_path}/run'", "train.steps=1", f"train.global_batch={B}",
        "train.lora_rank=2", "train.lora_targets=['experts.down']", "train.lr=0.05",
        "train.peak_tflops=1.0"])
    run_training(MPI.COMM_SELF, job, progress=False)
    done = hpcpar_here(["export", tmp_path / "run" / "step-1.h5", tmp_path / "adapter",
                        "--lora"], tmp_path)
    assert done.returncode == 0, done.stderr
    config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    assert not config.target_modules and config.target_parameters == ["mlp.experts.down_proj"]
    assert set(_safetensors(tmp_path / "adapter")) == {
        f"base_model.model.model.layers.{i}.mlp.experts.lora_{h}.weight"
        for i in range(2) for h in "AB"}
    ids = np.load(folder / "whole.npy")
    with torch.no_grad():
        logits = _peft_model(folder, tmp_path / "adapter")(torch.from_numpy(ids)).logits
    want = np.take_along_axis(torch.log_softmax(logits, -1).numpy()[:, :-1],
                              ids[:, 1:, None], -1)[..., 0]
    done = hpcpar_here(["score", "--checkpoint", folder / "model.h5", "--data",
                        folder / "whole.npy", "--out", tmp_path / "scores.h5", "--lora",
                        tmp_path / "run"], tmp_path)
    assert done.returncode == 0, done.stderr
    with h5py.File(tmp_path / "scores.h5") as f:
        np.testing.assert_allclose(f["token_logprobs"][()][:, 1:], want, atol=1e-5)


@pytest.mark.parametrize("family, targets, words", [
    ("phi3", "q,o", "LoRA target(s) q: phi3 stores them fused"),
    ("mixtral", "q,gate", "LoRA target(s) gate: mixtral's MLPs are mixtures of experts; "
                          "target experts.gate_up,experts.down"),
])
def test_a_target_the_family_does_not_adapt_is_one_line(tmp_path, family, targets, words):
    folder = (_folder(family) if family in FAMILIES else
              made_once(f"test_lora {family}", lambda f: build_hf_model(family, f)))
    done = hpcpar_here(["train", "--checkpoint", folder / "model.h5", "--data", "synthetic",
                        "--seq-len", "8", "--steps", "1", "--global-batch", "2", "--out",
                        tmp_path / "out", "--lora-rank", "2", "--lora-targets", targets],
                       tmp_path)
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(errors) == 1 and words in errors[0], done.stderr
    assert not (tmp_path / "out").exists()
