"""OpenAI Batch API files end to end at their sizes: ``python -m hpcpar generate`` on files of
2,000 to 50,000 requests (OpenAI's per-batch maximum), as a user runs it. Prints each size's
time, requests per second and peak memory of the rank, and its time per request against the
smallest size's (1.0: linear in the requests; reading, checking, generating and writing the
lines all count).

    python benchmarks/batch_api.py                       # 2k, 8k, 50k requests, 16 tokens
    python benchmarks/batch_api.py --sizes 1000,4000 --max-tokens 4

The model is the tiny preset with a byte-level BPE tokenizer (every byte a token) and a chat
template; requests alternate chat completions (top_logprobs 2) and text completions
(logprobs 1), each with its own prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcpar.checkpoint.files import OutputLock
from hpcpar.checkpoint.presets import preset_config, random_tensor
from hpcpar.checkpoint.writer import CheckpointWriter
from hpcpar.models.tensors import stored_tensors

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "assistant:")


def byte_level_tokenizer() -> bytes:
    """tokenizer.json of GPT-2's byte-level scheme over 256 byte tokens, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = sorted(ByteLevel.alphabet(), key=lambda c: ord(c))
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str().encode()


def write_model(path: Path) -> None:
    hf = preset_config("tiny")
    with OutputLock(path), CheckpointWriter(path, hf, np.float32, source="benchmark") as w:
        for spec in stored_tensors(w.config):
            w.write(spec, random_tensor(spec, 0, hf["initializer_range"]))
        w.add_file("tokenizer.json", byte_level_tokenizer())
        w.add_file("tokenizer_config.json", json.dumps({"chat_template": TEMPLATE}).encode())


def write_requests(path: Path, count: int, max_tokens: int) -> None:
    with open(path, "w") as f:
        for i in range(count):
            if i % 2:
                url, body = "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": f"question {i}: how?"}],
                    "max_completion_tokens": max_tokens, "logprobs": True, "top_logprobs": 2}
            else:
                url, body = "/v1/completions", {"prompt": f"text {i} goes on",
                                                "max_tokens": max_tokens, "logprobs": 1}
            f.write(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": url,
                                "body": {"model": "tiny", **body}}) + "\n")


def run(folder: Path, count: int, max_tokens: int) -> tuple[float, int]:
    """(seconds, peak resident bytes) of one batch of ``count`` requests."""
    write_requests(folder / "requests.jsonl", count, max_tokens)
    (folder / "out.jsonl").unlink(missing_ok=True)
    start = time.perf_counter()
    with open(folder / "stderr.txt", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hpcpar", "generate", "--checkpoint",
                                 "model.h5", "--prompts", "requests.jsonl", "--max-new-tokens",
                                 str(max_tokens), "--ignore-eos", "--out", "out.jsonl"],
                                cwd=folder, stdout=subprocess.DEVNULL, stderr=err,
                                env=dict(os.environ, HPCPAR_SUPERVISE="0"))
        _, status, usage = os.wait4(proc.pid, 0)     # the rank's own peak memory
        seconds = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"the batch of {count} requests failed:\n{err.read()}")
    with open(folder / "out.jsonl") as f:
        assert sum(1 for _ in f) == count
    return seconds, usage.ru_maxrss * 1024


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000,8000,50000")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_model(folder / "model.h5")
        print(f"{'requests':>9} {'seconds':>8} {'req/s':>7} {'peak MB':>8} "
              f"{'s/request vs smallest':>22}")
        first = None
        for count in sizes:
            seconds, peak = run(folder, count, args.max_tokens)
            per = seconds / count
            first = first or per
            print(f"{count:9d} {seconds:8.1f} {count / seconds:7.0f} {peak / 2**20:8.0f} "
                  f"{per / first:22.2f}", flush=True)


if __name__ == "__main__":
    main()
