"""Each token's own bytes (OpenAI's log-probs' ``bytes``): a character that byte-level BPE or
SentencePiece's byte fallback splits over tokens is rebuilt by joining its tokens' bytes,
where each piece's text alone is U+FFFD. Checked against the text's UTF-8 and against GPT-2's
byte alphabet as transformers writes it, and end to end in a Batch API output."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from helpers import TINY, hpcpar_here, write_hf_checkpoint
from hpcpar.checkpoint import convert
from hpcpar.models.tokenizer import StoredTokenizer

TEXT = "hé l€ 😀 中"
VOCAB = TINY["vocab_size"]


def _byte_alphabet() -> dict[int, str]:
    """transformers' copy of GPT-2's byte -> printable stand-in (the reference)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return bytes_to_unicode()


def byte_level_bpe() -> Tokenizer:
    """GPT-2's scheme on a vocabulary of bytes 0..VOCAB-3 and two specials, no merges: every
    byte is a token of its own, so each non-ASCII character spans several."""
    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(VOCAB - 2)} | {"<s>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def byte_fallback_sentencepiece() -> Tokenizer:
    """Llama 2's scheme: SentencePiece pieces (``▁`` for a space) and byte tokens
    ``<0x00>``..``<0xF3>`` for what no piece spells."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(0xF4)), "\u2581",
              "h", "\u2581h"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [("\u2581", "h")],
                               unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


@pytest.mark.parametrize("build, text", [(byte_level_bpe, TEXT),
                                         (byte_fallback_sentencepiece, " " + TEXT)])
def test_a_characters_tokens_join_to_its_bytes(build, text):
    tok = build()
    stored = StoredTokenizer(tok.to_str().encode())
    ids = tok.encode(TEXT).ids
    pieces = [stored.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    assert len(ids) > len(TEXT)                       # characters split over tokens
    assert any(stored.decode([i]) == "\ufffd" for i in ids)   # whose texts say nothing
    assert stored.token_bytes(tok.token_to_id("</s>")) == b"</s>"


def test_byte_level_tokens_have_gpt2s_bytes():
    alphabet = {v: k for k, v in _byte_alphabet().items()}
    tok = byte_level_bpe()
    stored = StoredTokenizer(tok.to_str().encode())
    for i in range(VOCAB - 2):
        assert stored.token_bytes(i) == bytes(alphabet[c] for c in tok.id_to_token(i))


def test_word_level_tokens_are_their_texts_utf8():
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "héllo": 1, "wörld": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    stored = StoredTokenizer(tok.to_str().encode())
    assert [stored.token_bytes(i) for i in (1, 2)] == ["héllo".encode(), "wörld".encode()]


def test_a_batch_outputs_bytes_are_each_tokens_own(tmp_path):
    """A chat request asking for log-probs on a byte-level model: each generated token's
    ``bytes`` and its alternatives' are the token's bytes under GPT-2's alphabet."""
    import transformers
    folder = tmp_path / "hf"
    write_hf_checkpoint(folder, TINY)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(),
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}assistant:")
    fast.save_pretrained(folder)
    convert(folder, tmp_path / "m.h5")
    request = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": TEXT}], "logprobs": True,
                        "top_logprobs": 3, "max_completion_tokens": 8}}
    (tmp_path / "requests.jsonl").write_text(json.dumps(request) + "\n")
    proc = hpcpar_here(["generate", "--checkpoint", "m.h5", "--prompts", "requests.jsonl",
                        "--max-new-tokens", "8", "--ignore-eos", "--temperature", "1.0",
                        "--seed", "3", "--out", "out.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (line,) = [json.loads(text) for text in open(tmp_path / "out.jsonl")]
    content = line["response"]["body"]["choices"][0]["logprobs"]["content"]
    alphabet = {v: k for k, v in _byte_alphabet().items()}
    entries = [one for entry in content for one in (entry, *entry["top_logprobs"])]
    assert len(content) == 8 and len(entries) == 32
    for one in entries:
        if one["token"] in ("<s>", "</s>"):
            assert one["bytes"] == list(one["token"].encode())
            continue
        (byte,) = one["bytes"]                 # token b is byte b (byte_level_bpe's vocab)
        assert fast.decode([byte]) == one["token"]
        assert [alphabet[c] for c in fast.convert_ids_to_tokens(byte)] == one["bytes"]
    # the point: lone bytes of multi-byte characters, whose texts are each U+FFFD
    assert any(one["token"] == "\ufffd" for one in entries)
