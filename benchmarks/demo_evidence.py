"""How often the pre-training demo's retriever puts the masked span in front of the encoder.

  python experiments/pretrain.py --flagfile=experiments/flags/pretrain_demo.flags   # first
  python benchmarks/demo_evidence.py                     # reads work/pretrain_demo/data
  python benchmarks/demo_evidence.py --layers 2 4 6 --every=1
  python benchmarks/demo_evidence.py --num_candidates=4   # K - 1 = 3, as benchmarks/README.md

For each training example (every `--every`-th, one span masked as in training) the demo's index
is built with all-MiniLM-L6-v2 cut to each of `--layers` layers, the K - 1 nearest blocks are
retrieved with the example's own block excluded, and `CandidateBuilder` lays out the encoder's
inputs; its `span_found` says whether the masked word pieces occur in a retrieved body as the
encoder sees it. Printed for each depth, with the queries' [MASK] tokens seen by the query tower
(REALM) and hidden from it (`config.query_hides_mask`). Also: the share of masked spans that
occur anywhere in the corpus outside their own block (the most any retriever could give).
"""

import argparse
import glob
import os

import grain
import jax
import numpy as np

from realm_jax.configs.pretrain import get_config
from realm_jax.data.pretrain import MaskOneSpan, special_ids
from realm_jax.models import RealmRetriever
from realm_jax.retrieval.build import open_corpus
from realm_jax.retrieval.embed import embed_in_buckets
from realm_jax.retrieval.index import DocIndex
from realm_jax.retrieval.towers import load_tower
from realm_jax.train.candidates import CandidateBuilder, masked_span


def cut_towers(tower, layers: int, query_ignore_id: int):
  """Jitted batch -> [B, D] functions (queries, documents) of the pre-training retriever made of the
  first `layers` layers of a mean-pooled tower; `query_ignore_id` as `query_hides_mask` sets it."""
  config = tower.module.config
  if not 1 <= layers <= config.num_hidden_layers:
    raise ValueError(f"--layers {layers}: the weights have 1 to {config.num_hidden_layers}.")
  module = RealmRetriever(config.replace(num_hidden_layers=layers), pooling="mean",
                          normalize=True, query_ignore_id=query_ignore_id)
  realm = dict(tower.params["realm"])
  realm["encoder"] = {f"layer_{i}": realm["encoder"][f"layer_{i}"] for i in range(layers)}
  params = {"params": {"embedder": {"realm": realm}}}
  embed = lambda method: jax.jit(lambda b: module.apply(
      params, b["input_ids"], b["attention_mask"], b["token_type_ids"], method=method))
  return embed("embed_queries"), embed("embed_documents")


def occurs_elsewhere(corpus, queries) -> float:
  """Share of examples whose masked span occurs in the body of a block other than their own."""
  rows = queries["block_row"]
  grams: dict[tuple, set] = {}
  spans = [tuple(masked_span(queries, i)) for i in range(len(rows))]
  wanted = set(spans)
  lengths = {len(s) for s in wanted}
  for r in range(len(corpus)):
    body = list(corpus[r]["token_ids"])
    for n in lengths:
      for i in range(len(body) - n + 1):
        g = tuple(body[i:i + n])
        if g in wanted:
          grams.setdefault(g, set()).add(r)
  return float(np.mean([bool(grams.get(s, set()) - {int(r)}) for s, r in zip(spans, rows)]))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default="work/pretrain_demo")
  p.add_argument("--layers", type=int, nargs="+", default=[2, 6])
  p.add_argument("--every", type=int, default=2, help="use every n-th training example")
  p.add_argument("--seed", type=int, default=0, help="which span of each example is masked")
  p.add_argument("--num_candidates", type=int, default=None,
                 help="K, the null document included (default: the demo's; K - 1 are retrieved)")
  args = p.parse_args()
  config = get_config("demo")
  if args.num_candidates is not None:
    if args.num_candidates < 2:
      p.error(f"--num_candidates={args.num_candidates}: need at least 2 (one retrieved block).")
    config.num_candidates = args.num_candidates
  data_dir = os.path.join(args.workdir, "data")
  found = sorted(glob.glob(os.path.join(data_dir, "examples-*", "train.array_record")))
  if not found:
    raise FileNotFoundError(
        f"No examples under {data_dir}: run the demo first (experiments/pretrain.py "
        "--flagfile=experiments/flags/pretrain_demo.flags) or pass its --workdir.")
  tower = load_tower("minilm")
  tok = tower.tokenizer
  corpus = open_corpus(config, data_dir, tok.vocab_file)

  source = grain.sources.ArrayRecordDataSource(found[-1])
  mask = MaskOneSpan(config.query_length, config.max_masked, *special_ids(tok))
  rng = np.random.default_rng(args.seed)
  examples = [mask(source[i], rng) for i in range(0, len(source), args.every)]
  queries = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
  builder = CandidateBuilder(corpus, tok.cls_id, tok.sep_id, config.num_candidates,
                             config.doc_length, config.joint_length)
  docs = corpus.model_inputs(range(len(corpus)), config.doc_length, tok)
  print(f"{len(examples)} training examples of {found[-1]}, {len(corpus)} blocks, "
        f"K - 1 = {config.num_candidates - 1} retrieved")
  print(f"masked span in some other block's body: {occurs_elsewhere(corpus, queries):.3f}")
  print("| retriever layers | [MASK] seen by the query tower | span in a retrieved body |")
  print("| --- | --- | --- |")
  q = {k: queries[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
  for layers in args.layers:
    _, embed_docs = cut_towers(tower, layers, -1)
    index = DocIndex(embed_in_buckets(embed_docs, docs, 64, desc=f"{layers} layers"),
                     corpus.block_ids)
    for with_mask in (True, False):
      embed_queries, _ = cut_towers(tower, layers, -1 if with_mask else tok.mask_id)
      emb = np.asarray(embed_queries(q))
      _, ids = index.search(emb, config.num_candidates - 1, exclude_ids=queries["block_id"])
      rows = corpus.rows_of(np.asarray(ids))
      hit = builder.build(queries, rows)["span_found"].mean()
      print(f"| {layers} | {'yes' if with_mask else 'no'} | {hit:.3f} |", flush=True)


if __name__ == "__main__":
  main()
