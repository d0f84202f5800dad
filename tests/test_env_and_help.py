"""Environment variables, and what a newcomer reads: ``--help``, messages, job-file comments.

Every ``HPCPAR_*`` variable is read through one table (``settings.ENVIRONMENT``): a bad value,
or a name hpcpar does not read, is one line naming the variable, the value and what it
accepts, status 2 on every rank, before any work; the variables hpcpar sets for its own
processes keep working. Then what a newcomer reads: each command's ``--help`` equals the
command block of docs/reference/cli.md, the messages and job-file comments a first run meets
say what is true, output to a closed pipe ends quietly, and the Slurm tests skip, with the
reason, where no local Slurm can run.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from helpers import GQA, REPO, make_checkpoint, mpirun
from hpcpar.jobs import settings
from hpcpar.parallel.errors import HpcparError
from test_generate_cli import _assert_one_error

README = (REPO / "README.md").read_text()
# what a user reads: the README and every page of the documentation, as one text
DOCS = "\n".join([README] + [p.read_text() for p in sorted((REPO / "docs").rglob("*.md"))])
CLI_REFERENCE = (REPO / "docs" / "reference" / "cli.md").read_text()
GENERATION_GUIDE = (REPO / "docs" / "guides" / "generation.md").read_text()
SLURM_GUIDE = (REPO / "docs" / "guides" / "slurm.md").read_text()
TOOL_ENV = {k: v for k, v in os.environ.items() if not k.startswith("HPCPAR_")}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("env-and-help")
    make_checkpoint(folder, GQA)
    np.save(folder / "prompts.npy", np.random.default_rng(3).integers(3, 250, (4, 5)))
    return folder


@pytest.fixture
def clean_env(monkeypatch):
    """No HPCPAR_* variable but the ones a test sets."""
    for name in [n for n in os.environ if n.startswith("HPCPAR_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def _run(args, cwd, env=None, **kw):
    """``python -m hpcpar ARGS`` alone (no launcher), with the checkout importable."""
    env = dict(TOOL_ENV if env is None else env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               HPCPAR_CACHE=str(Path(cwd) / "cache"))
    streams = kw or {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    return subprocess.run([sys.executable, "-m", "hpcpar", *args], cwd=cwd, env=env,
                          text=True, timeout=120, **streams)


# ---- one table for every HPCPAR_* variable ---------------------------------------------------

def _names_in(text: str) -> set[str]:
    return set(re.findall(r"\bHPCPAR_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text))


def test_every_variable_read_or_documented_is_in_the_table_and_documented():
    sources = [p for p in (REPO / "hpcpar").rglob("*.py")] + list((REPO / "slurm").iterdir())
    used = set().union(*(_names_in(p.read_text()) for p in sources if p.is_file()))
    used |= _names_in(DOCS)
    assert used <= set(settings.ENVIRONMENT), used - set(settings.ENVIRONMENT)
    for name in settings.ENVIRONMENT:
        assert f"`{name}" in CLI_REFERENCE, f"{name} is not documented in docs/reference/cli.md"
    # nothing reads one past the table: no os.environ / getenv of an HPCPAR_ name elsewhere
    for path in (REPO / "hpcpar").rglob("*.py"):
        if path.name == "settings.py":
            continue
        for line in path.read_text().splitlines():
            assert not re.search(r"(environ|getenv)\b.*[\"']HPCPAR_", line), (path, line)


def test_the_table_names_the_choices_the_code_has():
    from hpcpar.parallel.device.backend import BACKENDS
    from hpcpar.parallel.comm import COMM_KINDS
    assert settings.ENVIRONMENT["HPCPAR_BACKEND"][0].values == BACKENDS
    assert settings.ENVIRONMENT["HPCPAR_COMM"][0].values == COMM_KINDS


@pytest.mark.parametrize("name, text, words", [
    ("HPCPAR_CUDA_AWARE", "maybe", "HPCPAR_CUDA_AWARE='maybe': must be one of auto, 1, 0"),
    ("HPCPAR_CUDA_AWARE", "2", "HPCPAR_CUDA_AWARE='2': must be one of auto, 1, 0"),
    ("HPCPAR_SUPERVISE", "2", "HPCPAR_SUPERVISE='2': must be one of 1, 0"),
    ("HPCPAR_SUPERVISE", "none", "HPCPAR_SUPERVISE='none': must be one of 1, 0"),
    ("HPCPAR_FAKE_NODES", "two", "HPCPAR_FAKE_NODES='two': must be an integer >= 1 and <= 4, "
                                 "the job's ranks"),
    ("HPCPAR_FAKE_NODES", "0", "HPCPAR_FAKE_NODES='0': must be an integer >= 1"),
    ("HPCPAR_FAKE_NODES", "5", "HPCPAR_FAKE_NODES='5': more than the job's 4 ranks; must be"),
    ("HPCPAR_FAULT", "rank=4,phase=load", "HPCPAR_FAULT='rank=4,phase=load': rank 4 is no rank "
                                          "of the job (this job's ranks are 0..3)"),
    ("HPCPAR_FAULT", "rank=-1,phase=load", "rank -1 is no rank of the job"),
    ("HPCPAR_FAULT", "rank=0,phase=decode,step=0", "step 0: steps and writes count from 1"),
    ("HPCPAR_FAULT", "rank=0,phase=lunch", "phase 'lunch' is not one of load, prefill"),
    ("HPCPAR_BACKEND", "gpu", "HPCPAR_BACKEND='gpu': must be one of auto, numpy, cupy, strict"),
    ("HPCPAR_COMM", "ucx", "HPCPAR_COMM='ucx': must be one of auto, mpi, nccl"),
    ("HPCPAR_OPS", "fast", "HPCPAR_OPS='fast': must be one of auto, native"),
    ("HPCPAR_SAVE_SECONDS", "-1", "HPCPAR_SAVE_SECONDS='-1': must be a number >= 0"),
    ("HPCPAR_PROGRESS_SECONDS", "nan", "HPCPAR_PROGRESS_SECONDS='nan': must be a number >= 0"),
    ("HPCPAR_SUPERVISED_FD", "abc", "HPCPAR_SUPERVISED_FD='abc': must be the descriptor of an "
                                    "open pipe (set by hpcpar's rank keeper"),
    ("HPCPAR_SUPERVISED_FD", "987", "HPCPAR_SUPERVISED_FD='987': must be the descriptor"),
    ("HPCPAR_SAVE_SECOND", "1", "HPCPAR_SAVE_SECOND is not a variable hpcpar reads (did you "
                                "mean HPCPAR_SAVE_SECONDS?); unset it"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_it_accepts(clean_env, name, text,
                                                                       words):
    clean_env.setenv(name, text)
    with pytest.raises(HpcparError) as e:
        settings.check_environment(world_size=4)
    assert words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_every_bad_variable_is_in_the_one_line(clean_env):
    clean_env.setenv("HPCPAR_CUDA_AWARE", "maybe")
    clean_env.setenv("HPCPAR_OPS", "fast")
    with pytest.raises(HpcparError, match="HPCPAR_CUDA_AWARE='maybe'.*; HPCPAR_OPS='fast'"):
        settings.check_environment()


@pytest.mark.parametrize("name, text, value", [
    ("HPCPAR_CUDA_AWARE", "auto", "auto"), ("HPCPAR_CUDA_AWARE", "YES", "1"),
    ("HPCPAR_CUDA_AWARE", "false", "0"), ("HPCPAR_CUDA_AWARE", "", "auto"),
    ("HPCPAR_SUPERVISE", "0", "0"), ("HPCPAR_SUPERVISE", "off", "0"),
    ("HPCPAR_SUPERVISE", "", "1"), ("HPCPAR_FAKE_NODES", "4", 4),
    ("HPCPAR_FAKE_NODES", "", None), ("HPCPAR_BACKEND", "strict", "strict"),
    ("HPCPAR_FAULT", "rank=3,phase=write,step=2,kind=enospc",
     {"rank": 3, "phase": "write", "step": 2, "kind": "enospc"}),
    ("HPCPAR_SAVE_SECONDS", "0.5", 0.5), ("HPCPAR_CACHE", "/tmp/c", "/tmp/c"),
    ("HPCPAR_LAUNCH", "srun --mpi=pmix", "srun --mpi=pmix"),
])
def test_good_values_are_read_as_their_meaning(clean_env, name, text, value):
    clean_env.setenv(name, text)
    settings.check_environment(world_size=4)
    assert settings.environment_value(name, 4) == value


def test_the_keepers_pipe_is_accepted_and_nothing_else_is_written_to(clean_env, tmp_path):
    from hpcpar.jobs import supervisor
    read_end, write_end = os.pipe()
    try:
        clean_env.setenv("HPCPAR_SUPERVISED_FD", str(write_end))
        settings.check_environment()                 # what the keeper sets for its rank
        supervisor.mark_known_exit()
        assert os.read(read_end, 1) == b"x"
    finally:
        os.close(read_end)
        os.close(write_end)
    with open(tmp_path / "f", "wb") as f:            # a descriptor that is no pipe: untouched
        clean_env.setenv("HPCPAR_SUPERVISED_FD", str(f.fileno()))
        supervisor.mark_known_exit()
    assert (tmp_path / "f").read_bytes() == b""
    clean_env.setenv("HPCPAR_SUPERVISED_FD", "abc")
    supervisor.mark_known_exit()                     # no traceback on hpcpar's way out


def test_the_readers_go_through_the_table(clean_env):
    from hpcpar.jobs import supervisor
    from hpcpar.parallel.device.backend import NUMPY, select_backend
    from hpcpar.parallel.comm.mpi import cuda_aware
    clean_env.setenv("HPCPAR_CUDA_AWARE", "no")
    assert cuda_aware() == (False, "HPCPAR_CUDA_AWARE=0")
    clean_env.setenv("HPCPAR_CUDA_AWARE", "maybe")
    with pytest.raises(HpcparError, match="HPCPAR_CUDA_AWARE='maybe'"):
        cuda_aware()
    clean_env.setenv("HPCPAR_BACKEND", "numpy")
    assert select_backend("auto") is NUMPY
    clean_env.setenv("HPCPAR_BACKEND", "gpu")
    with pytest.raises(HpcparError, match="HPCPAR_BACKEND='gpu'"):
        select_backend("auto")
    clean_env.setenv("PMI_RANK", "0")
    clean_env.setenv("PMI_SIZE", "2")
    clean_env.setenv("HPCPAR_SUPERVISE", "off")
    assert not supervisor.wanted()
    clean_env.setenv("HPCPAR_SUPERVISE", "bad")      # kept on: the rank reports the value
    assert supervisor.wanted()


GENERATE = ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts", "prompts.npy",
            "--max-new-tokens", "3", "--ignore-eos"]


@pytest.mark.slow
@pytest.mark.parametrize("env, words", [
    ({"HPCPAR_CUDA_AWARE": "maybe"}, "HPCPAR_CUDA_AWARE='maybe': must be one of auto, 1, 0"),
    ({"HPCPAR_SUPERVISE": "2"}, "HPCPAR_SUPERVISE='2': must be one of 1, 0"),
    ({"HPCPAR_FAKE_NODES": "3"}, "HPCPAR_FAKE_NODES='3': more than the job's 2 ranks"),
    ({"HPCPAR_FAULT": "rank=2,phase=decode"}, "rank 2 is no rank of the job (this job's ranks "
                                              "are 0..1)"),
    ({"HPCPAR_PROGRES_SECONDS": "5"}, "HPCPAR_PROGRES_SECONDS is not a variable hpcpar reads"),
])
def test_a_bad_variable_ends_every_rank_with_one_line_before_any_work(work, env, words):
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("HPCPAR_")}
    os.environ.update(env)
    try:
        proc, _ = mpirun(2, GENERATE + ["--out", "env.h5"], work, timeout=120)
    finally:
        for key in env:
            del os.environ[key]
        os.environ.update(saved)
    _assert_one_error(proc, words)
    assert "was killed" not in proc.stderr and "without reporting" not in proc.stderr
    assert not list(work.glob("*env.h5*"))


@pytest.mark.slow
def test_the_variables_hpcpar_sets_for_its_ranks_keep_working(work):
    """Under mpiexec every rank runs inside its keeper, which sets HPCPAR_SUPERVISED_FD."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("HPCPAR_")}
    os.environ.update(HPCPAR_SUPERVISE="1", HPCPAR_CUDA_AWARE="0", HPCPAR_FAKE_NODES="2")
    try:
        proc, _ = mpirun(2, GENERATE + ["--out", "kept.h5"], work, timeout=120)
    finally:
        for key in ("HPCPAR_SUPERVISE", "HPCPAR_CUDA_AWARE", "HPCPAR_FAKE_NODES"):
            del os.environ[key]
        os.environ.update(saved)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(work / "kept.h5") as f:
        assert f["tokens"].shape == (4, 3)


# ---- --help and the command block of docs/reference/cli.md -----------------------------------

def _cli_reference_commands() -> dict[str, str]:
    """The command block under "## Commands" in docs/reference/cli.md: command -> its text
    (continuation lines included)."""
    section = CLI_REFERENCE.split("\n## Commands\n", 1)[1]
    block = section.split("```\n", 2)[1]
    commands, current = {}, None
    for line in block.splitlines():
        if line.startswith("python -m hpcpar"):
            usage = re.split(r" {3,}", line)[0]           # a description after 3+ spaces
            words = usage.split()
            current = words[3] if len(words) > 3 and words[3].isalpha() else "(none)"
            commands[current] = commands.get(current, "") + usage[len("python -m hpcpar"):]
        elif current is not None:
            commands[current] += "\n" + line
    return commands


def _subparsers():
    from hpcpar.jobs.parser import build_parser, command_parsers
    return command_parsers(build_parser())


def _flags(parser) -> dict[str, list | None]:
    """--flag -> its choices (None without), -h/--help left out."""
    out = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                out[option] = [str(c) for c in action.choices] if action.choices else None
    return out


def test_every_command_is_in_the_cli_reference_block():
    assert set(_cli_reference_commands()) == set(_subparsers()) | {"(none)"}


@pytest.mark.parametrize("command", sorted(["demo", "generate", "score", "train", "plan",
                                            "convert", "export", "init", "submit", "run"]))
def test_each_commands_help_and_the_cli_reference_block_have_the_same_flags(command):
    parsers = _subparsers()
    text = _cli_reference_commands()[command]
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    flags = _flags(parsers[command])
    if command == "run":        # "[any flag of generate, score, train]": exactly their union
        assert "any flag of generate, score, train" in text
        union = set().union(*(_flags(parsers[c]) for c in ("generate", "score", "train")))
        assert set(flags) == union, set(flags) ^ union
        flags = {f: c for f, c in flags.items() if f in listed}
    assert set(flags) == listed, (f"in --help only: {sorted(set(flags) - listed)}; "
                                  f"in docs/reference/cli.md only: {sorted(listed - set(flags))}")
    # a value list the command block writes (--batching continuous|static) is the flag's choices
    for flag, values in re.findall(r"(--[a-z][a-z0-9-]*)[ =]([\w.-]+(?:\|[\w.-]+)+)", text):
        values = values.split("|")
        if any(v != v.lower() for v in values):      # OUT.h5|OUT.jsonl, auto|PATH: no choices
            continue
        assert flags[flag] is not None, (flag, "takes any value, the docs list", values)
        assert sorted(values) == sorted(flags[flag]), (flag, values, flags[flag])


@pytest.mark.slow
def test_the_help_texts_say_what_the_docs_say():
    parsers = _subparsers()

    def help_of(command, flag):
        return next(a.help for a in parsers[command]._actions if flag in a.option_strings)

    for command in ("generate", "run"):
        assert ".jsonl" in help_of(command, "--out")
        prompts = help_of(command, "--prompts")
        assert all(w in prompts for w in ("{messages}", "{text}", "{ids}", "random")), prompts
    assert "`random`" in GENERATION_GUIDE.split("- **Prompts**", 1)[1].split("\n- ", 1)[0]
    assert "--signal-seconds" in SLURM_GUIDE
    text = subprocess.run([sys.executable, "-m", "hpcpar", "init", "--help"], cwd=REPO,
                          capture_output=True, text=True, env=dict(TOOL_ENV,
                                                                   PYTHONPATH=str(REPO))).stdout
    assert "llama3-1b" in text and "llama3-1b" in _cli_reference_commands()["init"]


@pytest.mark.slow
def test_run_of_a_scoring_job_takes_data_as_score_does(work):
    """``run`` takes every flag of score: its --data replaces the job file's [score] data."""
    np.save(work / "two.npy", np.array([[5, 17, 3], [4, 5, 6]]))
    (work / "score.toml").write_text('[model]\ncheckpoint = "model.h5"\n[score]\n'
                                     'data = "prompts.npy"\n[output]\npath = "scored.h5"\n')
    proc = _run(["run", "score.toml", "--data", "two.npy"], work)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(work / "scored.h5") as f:
        assert f["token_logprobs"].shape == (2, 3)


# ---- the messages, job-file comments and pipes a first run meets -----------------------------

def test_converts_message_says_how_to_install_from_a_clone(monkeypatch):
    from hpcpar.checkpoint.convert import _safetensors
    monkeypatch.setitem(sys.modules, "safetensors", None)      # as without the hf extra
    with pytest.raises(HpcparError) as e:
        _safetensors()
    assert 'pip install -e ".[hf]"' in str(e.value) and "hpcpar[hf]" not in str(e.value)
    assert "hpcpar[hf]" not in DOCS
    convert = CLI_REFERENCE.split("## convert and export", 1)[1].split("\n## ")[0]
    assert 'pip install -e ".[hf]"' in convert


@pytest.mark.slow
def test_train_tiny_says_how_to_train_further_and_it_does(tmp_path):
    job = REPO / "jobs" / "train_tiny.toml"
    comment = " ".join(line.lstrip("# ") for line in job.read_text().splitlines()
                       if line.startswith("#"))
    assert "--set train.steps=80 --resume auto trains on from step 40 to 80" in comment
    small = [str(job), "--tp", "1", "--save-every", "2", "--out", "run"]

    def train(*more):
        proc, _ = mpirun(2, ["-m", "hpcpar", "run", *small, *more], tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")]

    assert train("--steps", "4") == [1, 2, 3, 4]
    assert train("--steps", "6", "--resume", "auto") == [1, 2, 3, 4, 5, 6]    # on from 4
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-6.h5"
    assert train("--steps", "2") == [1, 2]                   # without it: from step 1 again
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-2.h5"


@pytest.mark.slow
def test_a_training_runs_folder_or_latest_file_names_the_checkpoint_to_pass(work, tmp_path):
    from hpcpar.checkpoint import open_checkpoint
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(work / "model.h5", run / "step-4.h5")
    (run / "latest").write_text("step-4.h5\n")
    for given in (run / "latest", run):
        with pytest.raises(HpcparError) as e:
            open_checkpoint(given)
        assert f"{run / 'step-4.h5'}" in str(e.value) and "latest" in str(e.value), str(e.value)
    proc = _run(["generate", "--checkpoint", "run/latest", "--prompts",
                 str(work / "prompts.npy"), "--max-new-tokens", "2", "--out", "o.h5"], tmp_path)
    _assert_one_error(proc, "run/latest: a training run's pointer, not a checkpoint: it holds "
                            "the name of the run's newest checkpoint, step-4.h5; pass "
                            "run/step-4.h5")
    proc = _run(["plan", "--checkpoint", "run"], tmp_path)
    _assert_one_error(proc, "run: a training run's folder, not a checkpoint file; its newest "
                            "checkpoint is run/step-4.h5 (named by run/latest): pass that")
    assert open_checkpoint(run / "step-4.h5").config.num_hidden_layers == 9


@pytest.mark.slow
@pytest.mark.parametrize("args", [["plan", "--preset", "tiny", "--tp", "2"],
                                  ["plan", "--preset", "100m", "--train", "--pp", "2"]])
def test_output_to_a_closed_pipe_ends_quietly(tmp_path, args):
    """``plan | head -1`` where head has gone before plan writes: status 141, not a word."""
    read_end, write_end = os.pipe()
    os.close(read_end)                                 # the reader is gone before any write
    try:
        proc = _run(args, tmp_path, stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


@pytest.mark.slow
def test_the_docs_say_what_scoring_does_with_rows_shorter_than_cp(work):
    assert "a sequence shorter than cp (training, scoring)" not in DOCS
    assert "a shorter row among longer ones is padded and scored exactly" in DOCS
    np.save(work / "short.npy", np.array([[-1, -1, 5, 17], [3, 4, 5, 6], [-1, -1, -1, 9]]))
    runs = {}
    for n, cp in ((1, 1), (3, 3)):
        out = f"short-cp{cp}.h5"
        proc, _ = mpirun(n, ["-m", "hpcpar", "score", "--checkpoint", "model.h5", "--data",
                             "short.npy", "--out", out, "--cp", str(cp)], work, timeout=180)
        assert proc.returncode == 0, proc.stderr
        with h5py.File(work / out) as f:
            runs[cp] = f["token_logprobs"][()]
    np.testing.assert_array_equal(np.isnan(runs[1]), np.isnan(runs[3]))
    np.testing.assert_allclose(runs[3], runs[1], atol=1e-5, equal_nan=True)


# ---- the Slurm tests skip, with the reason, where no local Slurm can run ---------------------

@pytest.mark.slow
def test_local_cluster_says_why_this_machine_cannot_have_one(tmp_path):
    script = REPO / "slurm" / "local-cluster.sh"
    if os.geteuid() != 0:
        command = ["bash", str(script), "up", str(tmp_path / "s")]
    elif shutil.which("runuser") and _user_exists("nobody"):
        command = ["runuser", "-u", "nobody", "--", "bash", str(script), "up",
                   str(tmp_path / "s")]
    else:
        pytest.skip("root without runuser/nobody: cannot run the script as another user")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 77, proc.stderr
    assert "local-cluster: needs root" in proc.stderr
    assert not (tmp_path / "s").exists()


def _user_exists(name: str) -> bool:
    import pwd
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.mark.slow
def test_the_slurm_tests_skip_with_the_scripts_reason(tmp_path):
    fake = tmp_path / "no-slurm.sh"
    fake.write_text("#!/bin/bash\necho 'local-cluster: needs root (...), and runs as "
                    "someone' >&2\nexit 77\n")
    (tmp_path / "test_probe.py").write_text(
        "import test_slurm\n"
        f"test_slurm.CLUSTER = {str(fake)!r}\n"
        "from test_slurm import slurm  # noqa: F401\n"
        "def test_needs_slurm(slurm):\n"
        "    raise AssertionError('ran without a Slurm')\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           str(tmp_path / "test_probe.py")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              [str(REPO), str(REPO / "tests")])))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout
    assert "no local Slurm on this machine: local-cluster: needs root" in proc.stdout
    assert "-rs" in (REPO / "tests" / "run").read_text()      # tests/run shows the reason
