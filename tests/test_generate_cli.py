"""The generate / run / plan commands as users run them, under mpiexec in a subprocess:
outputs on disk, text prompts through the checkpoint's tokenizer, the shipped job files, and
bad input reported once with no output file left behind."""

import json

import h5py
import numpy as np
import pytest

from helpers import GQA, REPO, hpcpar_here, mpirun, realistic_tensors, write_hf_checkpoint


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A converted checkpoint with a word-level tokenizer, and prompt files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from hpcpar.checkpoint import convert
    folder = tmp_path_factory.mktemp("cli")
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(247)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    write_hf_checkpoint(folder / "hf", GQA, extra=realistic_tensors(GQA, 0))
    tok.save(str(folder / "hf" / "tokenizer.json"))
    convert(folder / "hf", folder / "model.h5")
    (folder / "text.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in ["w5 w6 w7", "w100 w3", "w9 w9 w9 w9 w9"]))
    rows = [[5, 6, 7, 8], [9, 10, 11, 12], [100, 3, 4, 8]]
    (folder / "ids.jsonl").write_text("".join(json.dumps({"ids": r}) + "\n" for r in rows))
    np.save(folder / "ids.npy", np.array(rows))
    return folder


def _generate(workdir, n, prompts, out, *extra, timeout=120):
    return mpirun(n, ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts",
                      prompts, "--max-new-tokens", "5", "--out", out, *extra], workdir,
                  timeout=timeout)[0]


@pytest.mark.slow
@pytest.mark.device
def test_generate_writes_tokens_logits_text_and_the_report(workdir):
    proc = _generate(workdir, 4, "text.jsonl", "text_out.h5", "--pp", "2", "--tp", "2",
                     "--save-logits", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("layout: dp 1 x pp 2 x tp 2") == 1
    with h5py.File(workdir / "text_out.h5") as f:
        assert f["tokens"].shape == (3, 5) and f["tokens"].dtype == np.int64
        assert f["prompt_logits"].shape == (3, 5, GQA["vocab_size"])
        assert f["prompt_lengths"][()].tolist() == [3, 2, 5]
        texts = [t.decode() for t in f["text"][()]]
        tokens, lengths = f["tokens"][()], f["lengths"][()]
        assert f.attrs["tp"] == 2 and f.attrs["pp"] == 2
        assert f.attrs["report_prefill_tokens_per_s"] > 0
        assert len(f.attrs["report_stage_compute_s"]) == 2
    # the text beside the ids is the checkpoint tokenizer's decoding of them
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(workdir / "hf" / "tokenizer.json"))
    assert texts == [tok.decode(row[:n].tolist(), skip_special_tokens=True)
                     for row, n in zip(tokens, lengths)]
    assert all(texts)


@pytest.mark.slow
def test_npy_and_jsonl_ids_agree_across_rank_counts(workdir):
    proc = _generate(workdir, 1, "ids.npy", "one.h5")
    assert proc.returncode == 0, proc.stderr
    proc = _generate(workdir, 2, "ids.jsonl", "two.h5", "--dp", "2")
    assert proc.returncode == 0, proc.stderr
    with h5py.File(workdir / "one.h5") as a, h5py.File(workdir / "two.h5") as b:
        assert a["tokens"].shape == (3, 5)
        assert a["tokens"][()].tolist() == b["tokens"][()].tolist()


@pytest.mark.slow
def test_each_prompt_stops_at_its_own_max_new_tokens(workdir):
    """Per-prompt limits cut each row's greedy tokens where the row asks, on one rank and
    under pp x tp: the same tokens as the job's limit, then the pad id."""
    rows, limits = [[5, 6, 7, 8], [9, 10, 11, 12], [100, 3, 4, 8]], [2, None, 1]
    (workdir / "limits.jsonl").write_text("".join(
        json.dumps({"ids": r} | ({} if k is None else {"max_new_tokens": k})) + "\n"
        for r, k in zip(rows, limits)))
    proc = _generate(workdir, 1, "ids.jsonl", "all.h5", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    for n, flags in ((1, []), (4, ["--pp", "2", "--tp", "2"])):
        proc = _generate(workdir, n, "limits.jsonl", f"limits{n}.h5", "--ignore-eos", *flags)
        assert proc.returncode == 0, proc.stderr
        with h5py.File(workdir / "all.h5") as a, h5py.File(workdir / f"limits{n}.h5") as b:
            full, tokens = a["tokens"][()], b["tokens"][()]
            assert b["lengths"][()].tolist() == [2, 5, 1]
            for r, k in enumerate([2, 5, 1]):
                assert tokens[r, :k].tolist() == full[r, :k].tolist()
                # the pad id after: the model's pad_token_id, else its first EOS (GQA: 2)
                assert (tokens[r, k:] == GQA.get("pad_token_id", GQA["eos_token_id"])).all()


@pytest.mark.parametrize("prompts, words", [
    ('{"ids": [' + ",".join(["5"] * 95) + "]}", "has 95 tokens, which plus 5 new tokens exceeds"),
    ('{"ids": [' + ",".join(["5"] * 97) + "]}", "has 97 tokens, and the model holds 96 "
     "positions in all (max_position_embeddings 96); shorten it to at most 95"),
    ('{"ids": [5, 250, 7]}', "token id 250, outside the model's vocabulary [0, 250)"),
    ("", "the prompt file is empty"),
    ('{"ids": []}', "the prompt is empty"),
    ('{"nope": 1}', 'each line needs exactly one of "ids", "text" or "messages"'),
    ('{"ids": [5, 6], "max_new_tokens": -1}', 'max_new_tokens must be >= 1, got -1'),
    ('{"ids": [5, 6], "max_new_tokens": 2.5}', '"max_new_tokens" must be an integer, got 2.5'),
    ('{"ids": [5, 6], "max_new_tokens": true}', '"max_new_tokens" must be an integer'),
    ('{"ids": [5, 6]}\n{"ids": [5], "max_new_tokens": 9}',
     "prompt 1 asks for max_new_tokens 9, more than the job's 5"),
    ('{"ids": [5, 6], "top_n": 1.0}', "bad.jsonl:1: unknown key 'top_n'"),
    ('{"ids": [5]}\n{"ids": [5, 6], "temperature": -1}',
     "bad.jsonl:2: temperature must be >= 0 (0 is greedy), got -1"),
    ('{"ids": [5, 6], "top_k": 2.5}', 'bad.jsonl:1: "top_k" must be an integer, got 2.5'),
    ('{"ids": [5, 6], "top_p": 0}', "bad.jsonl:1: top_p must be in (0, 1], got 0"),
    ('{"ids": [5, 6], "seed": true}', 'bad.jsonl:1: "seed" must be an integer, got true'),
    ('{"ids": [5, 6], "temperature": "hot"}', '"temperature" must be a number, got "hot"'),
])
def test_bad_prompts_are_one_error_and_no_output(workdir, prompts, words):
    (workdir / "bad.jsonl").write_text(prompts)
    proc = hpcpar_here(["generate", "--checkpoint", "model.h5", "--prompts", "bad.jsonl",
                        "--max-new-tokens", "5", "--out", "bad_out.h5"], workdir)
    _assert_one_error(proc, words)
    assert not (workdir / "bad_out.h5").exists()


@pytest.mark.slow
def test_a_bad_prompt_is_one_error_from_one_of_four_ranks(workdir):
    """The prompts are checked on every rank, and the ranks agree: one line for the job
    (the cases above run on one rank, in this process)."""
    (workdir / "bad4.jsonl").write_text('{"ids": [5]}\n{"ids": [5, 6], "temperature": -1}')
    proc = _generate(workdir, 4, "bad4.jsonl", "bad4_out.h5", "--tp", "2")
    _assert_one_error(proc, "bad4.jsonl:2: temperature must be >= 0 (0 is greedy), got -1")
    assert not (workdir / "bad4_out.h5").exists()


@pytest.mark.slow
@pytest.mark.parametrize("flags, words", [
    (["--dp", "3", "--tp", "2"], "dp(3) * pp(1) * tp(2) = 6 != world size 4"),
    (["--tp", "3"], "num_attention_heads 8 is not divisible by tp 3"),
    (["--pp", "2", "--stage-layers", "4,4"], "stage_layers [4, 4] sum to 8, not num_hidden_layers 9"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--set", "generate.top_k=x"], "generate.top_k = 'x': expected int"),
    (["--top-k", "5"], "every prompt is greedy (temperature 0), so they would do nothing"),
])
def test_bad_layouts_and_settings_are_one_error_and_no_output(workdir, flags, words):
    proc = _generate(workdir, 4, "ids.jsonl", "bad_out.h5", *flags)
    _assert_one_error(proc, words)
    assert not (workdir / "bad_out.h5").exists()


@pytest.mark.slow
def test_a_missing_output_folder_is_reported_before_any_work(workdir):
    proc = _generate(workdir, 2, "ids.jsonl", "no/such/dir/out.h5")
    _assert_one_error(proc, "output folder no/such/dir does not exist")


def _assert_one_error(proc, words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcpar: error:")]
    assert len(errors) == 1, proc.stderr
    assert words in errors[0], errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_shipped_job_files_run(workdir):
    proc, _ = mpirun(4, ["-m", "hpcpar", "run", str(REPO / "jobs" / "demo.toml")], workdir,
                     timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "layout: dp 1 x pp 2 x tp 2" in proc.stdout
    proc, _ = mpirun(2, ["-m", "hpcpar", "run", str(REPO / "jobs" / "generate_hf.toml"),
                         "--set", "model.checkpoint=model.h5", "--set",
                         "generate.max_new_tokens=4", "--out", "hf_job.h5"], workdir,
                     timeout=120)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(workdir / "hf_job.h5") as f:
        assert f["tokens"].shape == (4, 4) and len(f["text"]) == 4
        assert f.attrs["temperature"] == pytest.approx(0.7)
    proc, _ = mpirun(4, ["-m", "hpcpar", "run", str(REPO / "jobs" / "throughput.toml"),
                         "--set", "model.checkpoint=model.h5", "--set", "data.random_count=8",
                         "--set", "data.random_lengths=[8, 16]", "--max-new-tokens", "4",
                         "--out", "tp_job.h5"], workdir, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(workdir / "tp_job.h5") as f:
        assert f["tokens"].shape == (8, 4)


@pytest.mark.slow
def test_plan_prints_memory_communication_bubble_and_schedule(workdir):
    proc, _ = mpirun(1, ["-m", "hpcpar", "plan", "--checkpoint", "model.h5", "--pp", "2",
                         "--tp", "2", "--micro-batches", "3", "--batch", "4",
                         "--prompt-length", "10", "--max-new-tokens", "6"], workdir)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "dp 1 x pp 2 x tp 2 = 4 ranks" in out
    assert "(S-1)/(S+M-1) = 25.0%" in out
    assert "stage 1: .. F0 F1 F2" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [r[1] for r in rows] == ["0-4", "5-8"]
    proc, _ = mpirun(1, ["-m", "hpcpar", "plan", "--preset", "llama3-8b", "--tp", "8",
                         "--dtype", "bfloat16"], workdir)
    assert proc.returncode == 0 and "8030.3 M parameters" in proc.stdout, proc.stderr


def _lines(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.mark.slow
@pytest.mark.device
def test_jsonl_results_hold_what_the_hdf5_output_holds_in_input_order(workdir):
    """--out NAME.jsonl: a line per prompt, in input order, with the text, token ids,
    finish reason and counts the HDF5 output of the same run holds."""
    (workdir / "texts.jsonl").write_text("".join(
        json.dumps({"text": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(3, 40, 3)))
    assert _generate(workdir, 4, "texts.jsonl", "many.h5", "--dp", "2", "--tp", "2"
                     ).returncode == 0
    proc = _generate(workdir, 4, "texts.jsonl", "many.jsonl", "--dp", "2", "--tp", "2",
                     "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    lines = _lines(workdir / "many.jsonl")
    with h5py.File(workdir / "many.h5") as f:
        tokens, lengths = f["tokens"][()], f["lengths"][()]
        texts = [t.decode() for t in f["text"][()]]
        reasons = [r.decode() for r in f["finish_reason"][()]]
        prompt_lengths = f["prompt_lengths"][()]
    assert [line["index"] for line in lines] == list(range(len(tokens)))
    for r, line in enumerate(lines):
        assert list(line) == ["index", "text", "token_ids", "finish_reason", "prompt_tokens",
                              "completion_tokens"]
        assert line["token_ids"] == tokens[r, :lengths[r]].tolist()
        assert line["text"] == texts[r] and line["finish_reason"] == reasons[r]
        assert line["prompt_tokens"] == prompt_lengths[r]
        assert line["completion_tokens"] == lengths[r]
    assert not [p for p in workdir.iterdir() if p.name.startswith(".many.jsonl")]


@pytest.mark.slow
def test_jsonl_results_resume_as_the_hdf5_output_does(workdir):
    """A run that fails mid-way leaves the finished prompts' lines and its partial record;
    --resume auto ends with the lines of an uninterrupted run."""
    import os
    (workdir / "resume.jsonl").write_text("".join(json.dumps({"ids": [5 + i, 6, 7]}) + "\n" for i in range(30)))
    args = ["--ignore-eos", "--batch-size", "2"]
    assert _generate(workdir, 2, "resume.jsonl", "whole.jsonl", *args).returncode == 0
    os.environ.update(HPCPAR_FAULT="rank=1,phase=decode,step=25,kind=raise",
                      HPCPAR_SAVE_SECONDS="0")
    try:
        proc = _generate(workdir, 2, "resume.jsonl", "cut.jsonl", "--pp", "2", *args)
    finally:
        del os.environ["HPCPAR_FAULT"], os.environ["HPCPAR_SAVE_SECONDS"]
    assert proc.returncode == 1, proc.stderr
    assert not (workdir / "cut.jsonl").exists()
    written = _lines(workdir / ".cut.jsonl.lines")
    assert 0 < len(written) < 30                        # a prefix, written as rows finished
    assert written == _lines(workdir / "whole.jsonl")[:len(written)]
    proc = _generate(workdir, 2, "resume.jsonl", "cut.jsonl", "--dp", "2", "--resume", "auto",
                     *args)
    assert proc.returncode == 0, proc.stderr
    assert _lines(workdir / "cut.jsonl") == _lines(workdir / "whole.jsonl")
    assert not [p for p in workdir.iterdir() if p.name.startswith(".cut.jsonl")]


@pytest.mark.slow
def test_a_jsonl_output_is_refused_for_prompt_logits_and_over_other_files(workdir):
    proc = _generate(workdir, 2, "ids.jsonl", "logits.jsonl", "--save-logits")
    _assert_one_error(proc, "--save-logits stores the prompt logits in HDF5")
    (workdir / "notes.jsonl").write_text('{"note": 1}\n')
    proc = _generate(workdir, 2, "ids.jsonl", "notes.jsonl")
    _assert_one_error(proc, "notes.jsonl exists and is not an hpcpar output")
    assert (workdir / "notes.jsonl").read_text() == '{"note": 1}\n'


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.parametrize("flags", [["--batching", "static"], ["--pp", "2", "--tp", "2"]])
def test_stop_strings_end_rows_where_their_text_first_holds_one(workdir, flags):
    """A row ends at the token that completes one of its stop strings (the job's, or its
    line's own); its tokens are those of an unstopped run up to there, its text is cut before
    the string, and its finish reason is "stop". Checked against the unstopped run's tokens
    decoded here with the tokenizer itself."""
    from tokenizers import Tokenizer
    from hpcpar.checkpoint import open_checkpoint
    tok = Tokenizer.from_str(open_checkpoint(workdir / "model.h5").tokenizer_files()[
        "tokenizer.json"].decode())
    prompts = [[5 + 3 * i, 6, 7] for i in range(8)]
    (workdir / "free.jsonl").write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    assert _generate(workdir, 4, "free.jsonl", "free.h5", "--ignore-eos", "--pp", "2",
                     "--set", "generate.max_new_tokens=8").returncode == 0
    with h5py.File(workdir / "free.h5") as f:
        free = f["tokens"][()]
    words = [tok.decode(row.tolist(), skip_special_tokens=True).split() for row in free]
    job_stop = words[0][2]                            # row 0's third word, as a stop string
    own = {3: [words[3][1] + " " + words[3][2]], 5: "nowhere-in-the-vocabulary"}
    lines = [json.dumps({"ids": p} | ({"stop": own[i]} if i in own else {})) + "\n"
             for i, p in enumerate(prompts)]
    (workdir / "stops.jsonl").write_text("".join(lines))
    out = f"stops-{'-'.join(flags)}.jsonl"
    proc = _generate(workdir, 4, "stops.jsonl", out, "--ignore-eos", "--stop", job_stop,
                     *flags)
    assert proc.returncode == 0, proc.stderr
    got = _lines(workdir / out)
    for r, line in enumerate(got):
        stops = own.get(r, [job_stop])
        stops = [stops] if isinstance(stops, str) else stops
        first = next((k for k in range(1, 6) if any(
            s in tok.decode(free[r, :k].tolist(), skip_special_tokens=True) for s in stops)),
            None)
        if first is None:
            assert line["finish_reason"] == "length" and line["completion_tokens"] == 5
            continue
        assert line["finish_reason"] == "stop", r
        assert line["token_ids"] == free[r, :first].tolist(), r
        text = tok.decode(free[r, :first].tolist(), skip_special_tokens=True)
        assert line["text"] == text[:min(text.find(s) for s in stops if s in text)], r
    assert got[0]["finish_reason"] == "stop" and got[3]["finish_reason"] == "stop"
    assert got[5]["finish_reason"] == "length"


@pytest.mark.slow
def test_bad_stop_strings_are_one_error(workdir):
    (workdir / "badstop.jsonl").write_text(json.dumps({"ids": [5, 6], "stop": [""]}) + "\n")
    _assert_one_error(_generate(workdir, 2, "badstop.jsonl", "badstop.h5"),
                      'badstop.jsonl:1: "stop" must be a non-empty string or a list of them')
    _assert_one_error(_generate(workdir, 2, "ids.jsonl", "badstop.h5", "--stop", ""),
                      "generate.stop holds an empty string")
    _assert_one_error(_generate(workdir, 2, "ids.jsonl", "badstop.h5", "--batching", "static",
                                "--batch-size", "2"),
                      "generate.batch_size 2 applies to continuous batching")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--batching", "static", "--pp", "2"]])
def test_min_tokens_ignores_a_stop_string_its_first_tokens_complete(workdir, flags):
    """vLLM's min_tokens: a stop string completed within a row's first min_tokens - 1 tokens
    does not end it, then or later; one completed from the min_tokens-th token on does, and
    the text is cut there (not at the earlier occurrence). Checked against the unstopped
    run's tokens decoded here with the tokenizer itself."""
    from tokenizers import Tokenizer
    from hpcpar.checkpoint import open_checkpoint
    tok = Tokenizer.from_str(open_checkpoint(workdir / "model.h5").tokenizer_files()[
        "tokenizer.json"].decode())
    prompts = [[5 + 3 * i, 6, 7] for i in range(6)]
    (workdir / "mt.jsonl").write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    assert _generate(workdir, 1, "mt.jsonl", "mt-free.h5", "--ignore-eos").returncode == 0
    with h5py.File(workdir / "mt-free.h5") as f:
        free = f["tokens"][()]
    decode = lambda ids: tok.decode([int(t) for t in ids], skip_special_tokens=True)  # noqa
    stop, min_tokens = decode(free[0, 1:2]), 3          # row 0's second word: early
    out = f"mt-{'-'.join(flags)}.jsonl"
    proc = _generate(workdir, 2 if flags else 1, "mt.jsonl", out, "--ignore-eos", "--stop",
                     stop, "--min-tokens", str(min_tokens), *flags)
    assert proc.returncode == 0, proc.stderr
    for r, line in enumerate(_lines(workdir / out)):
        held = len(decode(free[r, :min_tokens - 1]))
        end = next((k for k in range(min_tokens, 6)
                    if decode(free[r, :k]).find(stop, max(0, held - len(stop) + 1)) >= 0), None)
        if end is None:
            assert line["finish_reason"] == "length" and line["token_ids"] == free[r].tolist()
            continue
        text = decode(free[r, :end])
        assert line["finish_reason"] == "stop" and line["token_ids"] == free[r, :end].tolist()
        assert line["text"] == text[:text.find(stop, max(0, held - len(stop) + 1))]
    first = _lines(workdir / out)[0]
    assert len(first["token_ids"]) >= min_tokens              # the early stop did not count
    assert decode(first["token_ids"]).startswith(first["text"])


@pytest.mark.slow
def test_a_text_holding_nul_is_stored_in_hdf5_and_kept_in_json_lines(tmp_path):
    """HDF5's strings end at a NUL, which a byte-level tokenizer decodes from byte 0: the
    HDF5 text holds U+FFFD there (counted in an attribute), JSON lines the NUL itself, and
    the tokens are the same (it was a traceback after the whole run)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from hpcpar.checkpoint import convert
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}\0" for i in range(247)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    write_hf_checkpoint(tmp_path / "hf", GQA, extra=realistic_tensors(GQA, 0))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    convert(tmp_path / "hf", tmp_path / "model.h5")
    np.save(tmp_path / "ids.npy", np.array([[5, 6, 7, 8], [9, 10, 11, 12]]))
    for out in ("out.h5", "out.jsonl"):
        proc = _generate(tmp_path, 1, "ids.npy", out, "--ignore-eos")
        assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    with h5py.File(tmp_path / "out.h5") as f:
        texts = [t.decode() for t in f["text"][()]]
        assert f["text"].attrs["nul_replaced"] == 2
        assert f["tokens"][()].tolist() == [line["token_ids"] for line in lines]
    assert all("\0" in line["text"] for line in lines)
    assert texts == [line["text"].replace("\0", "\ufffd") for line in lines]
