"""Corpus embedding speed: realm_jax vs the HF PyTorch BertModel, same weights, articles, max length
and batch size, side by side in one run.

  python benchmarks/embed_corpus.py                     # all 10,033 articles (~15 min on 2 cores)
  python benchmarks/embed_corpus.py --max_docs=1000     # quick

Both embed every article of the embedded corpus as the segment pair (title, text) truncated to
`--max_length` word pieces with all-MiniLM-L6-v2, mean pooling. PyTorch: `transformers.BertModel`
in `torch.inference_mode()`, batches in corpus order padded to their longest member (HF
tokenizer `padding=True`). realm_jax: the library's own path, `embed_in_buckets` (length
buckets, batch sharded over the devices, jitted). Also checks that both give the same vectors.
"""

import argparse
import os
import time

os.environ.setdefault("USE_TF", "0")

import numpy as np  # noqa: E402


def run_torch(articles, max_length, batch_size, threads):
  import torch
  import transformers
  from realm_jax.checkpoints import minilm_dir
  torch.set_num_threads(threads)
  tok = transformers.BertTokenizerFast(os.path.join(minilm_dir(), "vocab.txt"))
  model = transformers.BertModel.from_pretrained(minilm_dir(), local_files_only=True).eval()
  out = []
  start = time.perf_counter()
  with torch.inference_mode():
    for lo in range(0, len(articles), batch_size):
      chunk = articles[lo:lo + batch_size]
      enc = tok([a["title"] for a in chunk], [a["text"] for a in chunk], padding=True,
                truncation="longest_first", max_length=max_length, return_tensors="pt")
      hidden = model(**enc).last_hidden_state
      m = enc["attention_mask"][..., None].float()
      emb = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
      out.append(emb.numpy())
  return np.concatenate(out), time.perf_counter() - start


def run_jax(articles, max_length, batch_size):
  from realm_jax.retrieval.embed import embed_in_buckets
  from realm_jax.retrieval.towers import load_tower
  from realm_jax.text import batch_join
  tower = load_tower("minilm")
  tok = tower.tokenizer
  start = time.perf_counter()
  titles = tok.encode_batch([a["title"] for a in articles])
  texts = tok.encode_batch([a["text"] for a in articles])
  inputs = batch_join(zip(titles, texts), max_length, tok, truncate="longest")
  emb = embed_in_buckets(tower.embed, inputs, batch_size, desc="realm_jax")
  return emb, time.perf_counter() - start


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--max_docs", type=int, default=None)
  p.add_argument("--max_length", type=int, default=256)
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--jax_batch_size", type=int, default=None, help="default: --batch_size")
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--keep_freed_memory", action="store_true",
                 help="glibc keeps freed blocks for reuse (no mmap, no trim) for both "
                      "implementations: realm_jax/host_memory.py")
  args = p.parse_args()
  if args.keep_freed_memory:
    from realm_jax.host_memory import keep_freed_memory
    keep_freed_memory()
  from realm_jax.data.wiki_vital import load_articles
  articles = load_articles()[:args.max_docs]
  n = len(articles)
  jax_emb, jax_s = run_jax(articles, args.max_length, args.jax_batch_size or args.batch_size)
  torch_emb, torch_s = run_torch(articles, args.max_length, args.batch_size, args.threads)
  err = float(np.abs(jax_emb - torch_emb).max())
  print(f"\n{n} articles, max length {args.max_length}, batch {args.batch_size}, "
        f"{os.cpu_count()} CPU cores; host allocator: "
        + ("glibc keeps freed blocks" if args.keep_freed_memory else "glibc defaults"))
  print("| implementation | seconds | docs/s |\n| --- | --- | --- |")
  print(f"| HF PyTorch BertModel (torch {__import__('torch').__version__}) | {torch_s:.1f} | {n / torch_s:.1f} |")
  print(f"| realm_jax (jax {__import__('jax').__version__}) | {jax_s:.1f} | {n / jax_s:.1f} |")
  print(f"speed-up {torch_s / jax_s:.2f}x; max abs difference of the embeddings {err:.1e}")


if __name__ == "__main__":
  main()
