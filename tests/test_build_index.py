"""experiments/build_index.py's pipeline with HF REALM weights: corpus -> embeddings -> index."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import importorskip_scann, jit_init

from realm_jax.checkpoints import save_hf_checkpoint
from realm_jax.configs.build_index import get_config
from realm_jax.models import RealmRetriever, tiny_config
from realm_jax.retrieval import build
from realm_jax.retrieval.index import DocIndex

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("build")
  config = tiny_config(vocab_size=len(WORDS), max_position_embeddings=64)
  ids = np.ones((1, 8), np.int32)
  q = dict(input_ids=ids, attention_mask=ids, token_type_ids=0 * ids)
  c = {k: v[:, None] for k, v in q.items()}
  params = jit_init(RealmRetriever(config, share_embedders=False), 3, q, c)
  weights = root / "retriever"
  save_hf_checkpoint(weights, config, params, "retriever")
  (weights / "vocab.txt").write_text("\n".join(WORDS) + "\n")
  rng = np.random.default_rng(0)
  docs = [{"title": f"w{i}", "text": " ".join(f"w{j}" for j in rng.integers(0, 60, 12)) + "."}
          for i in range(25)]
  (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  (root / "q.jsonl").write_text("".join(json.dumps({"question": d["text"][:20], "answer": [d["title"]]})
                                        + "\n" for d in docs[:5]))
  cfg = get_config("tiny")
  cfg.weights = str(weights)
  cfg.corpus.source, cfg.corpus.paths = "jsonl", (str(root / "docs.jsonl"),)
  cfg.eval.questions = str(root / "q.jsonl")
  return root, cfg, params


@pytest.mark.slow
def test_build_index_with_hf_retriever_weights(setup):
  root, cfg, params = setup
  result = build.build_and_evaluate(cfg, str(root / "work"))
  assert set(result["recall"]) == {1, 5, 20} and result["block_ids"].shape == (5, 20)
  corpus, index, query_tower = build.load_built_index(cfg, str(root / "work"))
  assert len(corpus) == 25 and index.dim == 16 and index.count == 25
  # The document tower embeds blocks, the (separate) query tower questions.
  from realm_jax.retrieval.recall import embed_questions
  from realm_jax.models import RealmEmbedder
  rows = np.arange(len(corpus))
  inputs = corpus.model_inputs(rows, cfg.max_length, query_tower.tokenizer)
  doc_model = RealmEmbedder(tiny_config(vocab_size=len(WORDS), max_position_embeddings=64))
  want = doc_model.apply({"params": params["embedder"]}, inputs["input_ids"],
                         inputs["attention_mask"], inputs["token_type_ids"])
  np.testing.assert_allclose(index.embeddings(), want, atol=1e-5)
  q = embed_questions(query_tower, ["w1 w2 w3"])
  q_doc = embed_questions(build.towers_of(cfg)["document"], ["w1 w2 w3"])
  assert not np.allclose(q, q_doc)  # separate towers


def test_towers_keep_the_first_layers_they_are_told_to(setup):
  """config.num_layers: each tower is the weights' model cut to its first N transformer layers
  (the same model applied to the parameters with the later layers deleted here by hand); a count
  the weights do not have is refused naming the flag."""
  import copy
  root, cfg, params = setup
  cut = copy.deepcopy(cfg)
  cut.num_layers = 1
  towers = build.towers_of(cut)
  from realm_jax.models import RealmEmbedder
  from realm_jax.text import batch_join
  model = RealmEmbedder(tiny_config(vocab_size=len(WORDS), max_position_embeddings=64,
                                    num_hidden_layers=1))
  full = build.towers_of(cfg)
  for which, part in (("document", "embedder"), ("query", "query_embedder")):
    first = copy.deepcopy(jax.device_get(params[part]))
    del first["realm"]["encoder"]["layer_1"]
    tok = towers[which].tokenizer
    inputs = batch_join([(tok.encode_batch(["w1 w2 w3 ."])[0], None)], 16, tok)
    want = model.apply({"params": first}, inputs["input_ids"], inputs["attention_mask"],
                       inputs["token_type_ids"])
    got = np.asarray(towers[which].embed(inputs))
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=which)
    assert not np.allclose(got, full[which].embed(inputs), atol=1e-3), which
  for bad in (3, -1):
    cut.num_layers = bad
    with pytest.raises(ValueError, match=rf"--config.num_layers={bad}: .* has 2 transformer "
                                         r"layers; keep 1 to 2 of them, or 0 for all"):
      build.towers_of(cut)


def test_index_of_another_corpus_is_refused(setup, tmp_path):
  root, cfg, _ = setup
  build.build_index(cfg, str(tmp_path))
  path = tmp_path / "index" / "index-00000000"
  with pytest.raises(ValueError, match="corpus"):
    DocIndex.load(path, expected_corpus_fingerprint="somethingelse")
  with pytest.raises(ValueError, match="dim"):
    DocIndex.load(path, expected_dim=384)
  # Other retriever weights of the same shape: their queries would be scored against blocks
  # another document tower embedded.
  config = tiny_config(vocab_size=len(WORDS), max_position_embeddings=64)
  ids = np.ones((1, 8), np.int32)
  q = dict(input_ids=ids, attention_mask=ids, token_type_ids=0 * ids)
  other = jit_init(RealmRetriever(config, share_embedders=False), 4, q,
                   {k: v[:, None] for k, v in q.items()})
  save_hf_checkpoint(tmp_path / "other", config, other, "retriever")
  (tmp_path / "other" / "vocab.txt").write_text("\n".join(WORDS) + "\n")
  other_cfg = cfg.copy_and_resolve_references()
  other_cfg.weights = str(tmp_path / "other")
  with pytest.raises(ValueError, match="embedded by retriever weights .*rebuild the index"):
    build.load_built_index(other_cfg, str(tmp_path))
  assert build.load_built_index(cfg, str(tmp_path))[1].count == 25
  # Nor is an update (or a rebuild in place) with another tower or tokenizer settings: the error
  # names the index's weights and settings and the new ones.
  from realm_jax.retrieval.index_store import read_manifest
  manifest = read_manifest(path)
  with pytest.raises(ValueError, match=(
      rf"was embedded by {cfg.weights} \(model {manifest['model_fingerprint']}, settings "
      rf"{manifest['embedding_settings']}, float32\); --config.weights={other_cfg.weights} is "
      r"model \w+, settings 64-b-\w+, float32: .*another --workdir")):
    build.build_index(other_cfg, str(tmp_path))
  longer = cfg.copy_and_resolve_references()
  longer.max_length = 48
  with pytest.raises(ValueError, match=rf"settings {manifest['embedding_settings']}.*settings 48-b-"):
    build.build_index(longer, str(tmp_path))
  assert sorted(os.listdir(tmp_path / "index")) == ["LATEST", "index-00000000"]


def test_bad_settings_fail_before_the_corpus_is_built(setup, tmp_path):
  _, cfg, _ = setup
  for key, value, match in (
      ("index.searcher", "faiss", r"--config.index.searcher='faiss': use one of \('exact'"),
      ("index.dtype", "float16", r"--config.index.dtype='float16': use one of"),
      ("truncate", "left", r"--config.truncate='left': use one of \('b', 'longest', 'none'\)"),
      ("eval.questions", str(tmp_path / "nope.jsonl"), r"nope.jsonl"),
      ("eval.ks", (1, 0), r"--config.eval.ks=\(1, 0\): give the k of recall@k as positive")):
    bad = cfg.copy_and_resolve_references()
    section, _, name = key.rpartition(".")
    setattr(bad[section] if section else bad, name, value)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
      build.build_and_evaluate(bad, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()  # nothing built
  (tmp_path / "run" / "checkpoints" / "2").mkdir(parents=True)  # a training run's workdir
  (tmp_path / "run" / "index").mkdir()
  with pytest.raises(ValueError, match=r"run holds a training run \(checkpoints/\): building an "
                                       "index there would replace its index-00000000"):
    build.build_and_evaluate(cfg, str(tmp_path / "run"))
  assert os.listdir(tmp_path / "run" / "index") == []


def test_missing_index_and_bad_weights_are_clear(setup, tmp_path):
  root, cfg, _ = setup
  with pytest.raises(FileNotFoundError, match="No index in .*build one with experiments/build_index.py"):
    build.load_built_index(cfg, str(tmp_path / "empty"))
  bad = cfg.copy_and_resolve_references()
  bad.weights = str(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="--config.weights=.*nowhere is not a directory"):
    build.build_index(bad, str(tmp_path / "w"))


def test_scann_settings_come_from_the_config(setup, tmp_path):
  importorskip_scann()
  _, cfg, _ = setup
  exact = build.build_index(cfg, str(tmp_path))[1]
  scann_cfg = cfg.copy_and_resolve_references()
  scann_cfg.index.searcher = "scann"
  scann_cfg.index.scann.dims_per_block = 4
  scann_cfg.index.scann.reorder_num_neighbors = 25
  _, index, query_tower = build.load_built_index(scann_cfg, str(tmp_path))
  assert index.searcher.settings == dict(num_leaves=1, num_leaves_to_search=1,
                                         reorder_num_neighbors=25, dims_per_block=4)
  # Re-ordering all 25 blocks exactly: the same top 10 as exact search, with its scores.
  from realm_jax.retrieval.recall import embed_questions
  q = embed_questions(query_tower, ["w1 w2 w3", "w7 w8"])
  want_scores, want_ids = exact.search(q, 10)
  scores, found = index.search(q, 10)
  np.testing.assert_array_equal(found, want_ids)
  np.testing.assert_allclose(scores, want_scores, atol=1e-5)
  scann_cfg.index.scann.dims_per_block = 0  # 0: DocIndex's default (2)
  assert build.load_built_index(scann_cfg, str(tmp_path))[1].searcher.settings[
      "dims_per_block"] == 2


def test_refresher_refuses_a_config_other_than_the_trainers(tmp_path):
  """experiments/refresh_index.py with other settings than the trainer on its workdir: checkpoints
  of other shapes, or indexes of other blocks (doc_length), published silently otherwise. Refused
  before the corpus and examples are built."""
  from realm_jax.configs.pretrain import get_config as pretrain_config
  from realm_jax.train import refresher
  trainer = pretrain_config("tiny")
  (tmp_path / "config.json").write_text(trainer.to_json())
  for key, value in (("doc_length", 32), ("num_layers", 1)):
    other = pretrain_config("tiny")
    setattr(other, key, value)
    with pytest.raises(ValueError, match=rf"another config .*\('{key}', \d+, {value}\)"):
      refresher.run_refresher(other, str(tmp_path), poll_seconds=0, max_refreshes=1,
                              stop_after_idle_s=0)
  bad_index = pretrain_config("tiny")
  bad_index.index.searcher = "faiss"
  with pytest.raises(ValueError, match="--config.index.searcher='faiss'"):
    refresher.run_refresher(bad_index, str(tmp_path), poll_seconds=0, max_refreshes=1,
                            stop_after_idle_s=0)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # nothing built
  assert refresher.check_trainer_config(trainer, str(tmp_path))
  assert not refresher.check_trainer_config(trainer, str(tmp_path / "not_started"))


def test_recall_at_more_blocks_than_the_corpus_names_the_flag(setup, tmp_path):
  """The default ks (1, 5, 20) on a corpus of fewer blocks: the error names --config.eval.ks."""
  _, cfg, _ = setup
  bad = cfg.copy_and_resolve_references()
  bad.eval.ks = (1, 5, 30)
  with pytest.raises(ValueError, match=r"--config.eval.ks=\(1, 5, 30\) asks for recall@30, but the "
                                       r"corpus .* has 25 blocks"):
    build.build_and_evaluate(bad, str(tmp_path))
  bad.eval.ks = (1, 25)  # every block: the whole corpus ranked
  assert set(build.build_and_evaluate(bad, str(tmp_path))["recall"]) == {1, 25}


@pytest.mark.slow
def test_a_changed_corpus_embeds_only_its_new_blocks_and_equals_a_full_rebuild(setup, tmp_path,
                                                                              monkeypatch, capsys):
  """100 documents, then 10 added, 5 edited and 5 removed: only the 15 new blocks are embedded,
  the update is published as the next version and equals a full rebuild (ids, vectors, search);
  an update killed midway leaves the previous version in use and the next run finishes it."""
  root, cfg, _ = setup
  rng = np.random.default_rng(1)
  text = lambda: " ".join(f"w{j}" for j in rng.integers(0, 60, 12)) + "."
  docs = [{"title": f"doc {i}", "text": text()} for i in range(100)]
  source = tmp_path / "docs.jsonl"
  write = lambda ds: source.write_text("".join(json.dumps(d) + "\n" for d in ds))
  cfg = cfg.copy_and_resolve_references()
  cfg.corpus.paths, cfg.corpus.max_docs = (str(source),), 0
  embedded = []
  real_embed = build.embed_corpus
  monkeypatch.setattr(build, "embed_corpus", lambda part, *a, **k: (
      embedded.append(len(part)), real_embed(part, *a, **k))[1])
  work = str(tmp_path / "work")
  write(docs)
  build.build_index(cfg, work)
  assert embedded == [100]

  changed = [dict(d) for d in docs[:95]] + [{"title": f"new {i}", "text": text()}
                                            for i in range(10)]
  for d in changed[:5]:
    d["text"] = text()
  write(changed)
  corpus, index, _ = build.build_index(cfg, work)
  assert embedded == [100, 15]
  assert "embedded 15 new blocks, reused 90 (10 removed)" in capsys.readouterr().out
  from realm_jax.retrieval.index_store import index_path, latest_index_dir
  assert latest_index_dir(os.path.join(work, "index")) == index_path(os.path.join(work, "index"), 1)

  rebuilt_corpus, rebuilt, _ = build.build_index(cfg, str(tmp_path / "full"))
  np.testing.assert_array_equal(index.block_ids, rebuilt.block_ids)
  np.testing.assert_allclose(index.embeddings(), rebuilt.embeddings(), atol=1e-5)
  queries = rebuilt.embeddings()[:7] + 0.01
  np.testing.assert_array_equal(index.search(queries, 5)[1], rebuilt.search(queries, 5)[1])
  loaded = build.load_built_index(cfg, work)[1]  # what fine-tuning and evaluation load
  np.testing.assert_array_equal(loaded.block_ids, rebuilt.block_ids)

  # Killed while embedding the next update: the previous version stays; the next run finishes.
  write(changed + [{"title": "late", "text": text()}])
  def killed(*a, **k):
    raise KeyboardInterrupt
  monkeypatch.setattr(build, "embed_corpus", killed)
  with pytest.raises(KeyboardInterrupt):
    build.build_index(cfg, work)
  from realm_jax.retrieval.index_store import read_manifest
  previous = latest_index_dir(os.path.join(work, "index"))
  assert previous.endswith("index-00000001") and read_manifest(previous)["count"] == 105
  monkeypatch.setattr(build, "embed_corpus", lambda part, *a, **k: (
      embedded.append(len(part)), real_embed(part, *a, **k))[1])
  _, index, _ = build.build_index(cfg, work)
  assert embedded[-1] == 1 and index.count == 106
  assert latest_index_dir(os.path.join(work, "index")).endswith("index-00000002")
  build.build_index(cfg, work)  # unchanged: nothing embedded, nothing written
  assert embedded[-1] == 1 and len(embedded) == 4
  assert latest_index_dir(os.path.join(work, "index")).endswith("index-00000002")
