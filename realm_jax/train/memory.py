"""How much memory a pre-training run needs on each device, estimated before it starts.

    est = estimate(config, devices=32, index_rows=13_353_718)
    print(format_estimate(est))

Per device (the state is replicated with the default mesh, or split as config.mesh splits it:
realm_jax/sharding.py; the batch over "data" x "fsdp", the index over every device):

  parameters        4 P bytes (float32; P = retriever + encoder parameters, counted exactly by
                    abstract initialisation of the models, nothing allocated)
  optimiser state   8 P (AdamW's two moments)
  gradients         4 P, on the CPU and GPU only (see UPDATE_BUFFERS)
  update buffers    4 P (the new parameters, while the old are kept in case the step is
                    skipped), on the CPU and GPU only
  activations       kept for the backward pass by the three BERT passes of a step: the query tower
                    on b x Lq tokens, the document tower on b x K x Ld and the encoder on b x K x Le
                    (b = examples per device). Per layer and token, (34 h + 5 a L) bytes with 16-bit
                    activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
                    Large Transformer Models", section 4.1: h hidden, a heads, L sequence length),
                    twice that for float32 compute (with config.remat: each layer's input, h x
                    dtype bytes, plus one layer's activations); plus the float32 MLM logits over the vocabulary
                    at the b x K x M masked positions, and their gradient.
  index shard       ceil(N / devices) x D x (2 for bfloat16, 4 for float32)
  search scratch    the float32 scores of one query batch against the shard:
                    min(256, global batch) x ceil(N / devices) x 4, at most 256 MiB (a larger
                    shard is scored in blocks of rows: realm_jax/retrieval/exact.py)

It is an estimate of what XLA allocates, not a measurement: `benchmarks/memory.py` compares it with
XLA's own buffer assignment of the compiled train step (and the index arrays) for the `tiny` and
`demo` configs on the CPU. Pre-training logs it against `device_memory()` (an accelerator's memory,
or the host's RAM), and a warning when it does not fit with its MARGIN.
"""

from __future__ import annotations

import math
import os

import jax

from realm_jax import config_checks
from realm_jax.models.config import RealmConfig
from realm_jax.retrieval.exact import MAX_SCORE_BYTES
from realm_jax.retrieval.searcher import SEARCHERS

GIB = 1024**3
# The blocks of REALM's English Wikipedia (Guu et al. 2020, section 4.1), for runs not built yet.
WIKIPEDIA_BLOCKS = 13_353_718
SEARCH_QUERY_BATCH = 256  # ExactSearcher's query_batch_size (retrieval/exact.py)
# XLA:CPU's compiled train step of the tiny and earlier 2-layer demo configs took up to 1.65x the
# estimate (benchmarks/memory.py; benchmarks/README.md): the verdict keeps that margin.
MARGIN = 1.7
# Whether a platform's compiled train step holds a float32 gradient and an update buffer of every
# trained parameter beside the parameters and AdamW's moments (docs/tpu.md, 2026-11-30). XLA:CPU's
# does (its buffer assignment of the REALM step, benchmarks/memory.py: 1.15-1.41x the estimate with
# them, 1.44-1.72x without); the TPU compiler's does not (it all-reduces the gradient in the
# compute dtype as it is made and updates in place: REALM's paper configs on v4-64 and v5e-256
# came to 1.35x / 1.41x the compiler's figure with them, 1.08x / 0.91x without). Not measured on a
# GPU: counted there, the safe side.
UPDATE_BUFFERS = {"cpu": True, "gpu": True, "tpu": False}


def update_buffers(platform: str, trained: int) -> dict[str, int]:
  """The parts {"gradients", "update buffers"} that `platform`'s compiled step holds for
  `trained` parameters per device (none on a TPU; UPDATE_BUFFERS)."""
  if platform not in UPDATE_BUFFERS:
    raise ValueError(f"no memory estimate for the {platform!r} platform: use one of "
                     f"{tuple(UPDATE_BUFFERS)}.")
  if not UPDATE_BUFFERS[platform]:
    return {}
  return {"gradients": 4 * trained, "update buffers": 4 * trained}


def platform_of(device=None) -> str:
  """The memory estimate's platform of `device` (default: this process's first): "cpu", "tpu",
  or "gpu" for any other accelerator (CUDA, ROCm, ...: its buffers counted, the safe side)."""
  device = device or jax.local_devices()[0]
  return device.platform if device.platform in ("cpu", "tpu") else "gpu"


def run_kind(config, flag: str = "--config") -> str:
  """"pretrain" for a pre-training config (realm_jax/configs/pretrain.py: `estimate`), "retro"
  for a RETRO one (realm_jax/configs/retro.py: `retro_estimate`).

  Raises:
    ValueError naming `flag` for any other config (ICT, DPR, fine-tuning, ...).
  """
  kind = config_checks.config_kind(config)
  if kind in ("pretrain", "retro"):
    return kind
  raise ValueError(f"{flag}: the memory estimate is for pre-training and RETRO runs; give a "
                   "config of realm_jax/configs/pretrain.py or realm_jax/configs/retro.py.")


def model_config(config) -> RealmConfig:
  """The model sizes of a run without loading weights: the config.json of the weights it starts
  from (`init.starting_weights`: the MiniLM package's, or --config.retriever_weights'), else
  config.model: for random weights, and for init=hf weights not made yet (an estimate may come
  before the ICT run that exports them; the `paper` variants name BERT-base)."""
  from realm_jax.train.init import sized_model_config, starting_weights
  try:
    weights = starting_weights(config)
  except FileNotFoundError:
    if config.init != "hf":
      raise
    weights = {}
  base = weights["retriever"].config if weights else RealmConfig(**dict(config.model))
  return sized_model_config(config, base)


def count_params(config, mc: RealmConfig, per_device: dict | None = None,
                 shapes: dict | None = None) -> dict[str, int]:
  """Exact parameter counts {"retriever", "encoder"} of the run's models, from shapes only
  (`shapes`: the models' `init.param_shapes`, traced here when not given); with `per_device`
  ({mesh axis: size}), those one device holds (realm_jax/sharding.py)."""
  from realm_jax import sharding
  from realm_jax.train.init import make_models, param_shapes
  shapes = shapes or param_shapes(make_models(config, mc), mc)
  if per_device:
    rules = sharding.config_rules(config)
    return {name: sharding.elements_per_device(tree, per_device, rules)
            for name, tree in shapes.items()}
  return {name: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
          for name, tree in shapes.items()}


def _bert_activations(tokens: int, length: int, mc: RealmConfig, act_bytes: int) -> float:
  per_token_layer = (34 * mc.hidden_size + 5 * mc.num_attention_heads * length) * act_bytes / 2
  if mc.remat:  # each layer's input, plus one layer's activations while it is recomputed
    return tokens * (mc.num_hidden_layers * mc.hidden_size * act_bytes + per_token_layer)
  return tokens * mc.num_hidden_layers * per_token_layer


def _dropout_masks(tokens: int, length: int, mc: RealmConfig) -> float:
  """Bytes of the dropout masks a tower's recomputed layers keep over `tokens` tokens of
  sequences of `length`: one byte an element (the compiled mask), per layer and token the
  attention probabilities' [heads, length] and the two hidden-size ones, and the embeddings'
  once. With every activation kept, _bert_activations counts them already (Korthikanti et al.'s
  34 and 5 include them); with layers recomputed the layer inputs do not, yet the TPU compiler
  keeps masks from the forward pass: this counts every layer's, on the safe side (REALM's paper
  step: 0.61 of the 0.69 GiB counted with 2 examples a device, 2.95 of 5.54 with 16; docs/tpu.md,
  2026-11-30)."""
  attention = mc.num_attention_heads * length if mc.attention_probs_dropout_prob > 0 else 0
  hidden = mc.hidden_size if mc.hidden_dropout_prob > 0 else 0
  return tokens * (mc.num_hidden_layers * (attention + 2 * hidden) + hidden)


def estimate(config, devices: int, index_rows: int, mc: RealmConfig | None = None, *,
             platform: str) -> dict:
  """Bytes per device of a run of `config` over `devices` devices of `platform` ("cpu", "gpu",
  "tpu") and an index of `index_rows`."""
  from realm_jax import sharding
  from realm_jax.train.init import make_models, param_shapes, retriever_model_config
  mc = mc or model_config(config)
  models = make_models(config, mc)
  shapes = param_shapes(models, mc)  # (traced once for both counts)
  counts = count_params(config, mc, shapes=shapes)
  axes = sharding.mesh_axes(config.get("mesh", sharding.DEFAULT_MESH), devices, "--config.mesh")
  # Per device: the parameters as config.mesh splits them (all of them with data parallelism).
  p = sum(count_params(config, mc, per_device=axes, shapes=shapes).values())
  b = -(-config.batch_size // (axes["data"] * axes["fsdp"]))  # examples per device
  micro = config.get("microbatch", 0) or b  # examples alive at once (the step's pieces)
  k, act = config.num_candidates, 2 if config.dtype == "bfloat16" else 4
  rc = retriever_model_config(config, mc)  # the retriever may keep fewer layers
  # The three BERT passes of a step: (tokens alive at once, sequence length, model config) of the
  # query tower, the candidates re-embedded by the document tower, and the joint encoder.
  towers = ((micro * config.query_length, config.query_length, rc),
            (micro * k * config.doc_length, config.doc_length, rc),
            (micro * k * config.joint_length, config.joint_length, mc))
  activations = (sum(_bert_activations(n, length, m, act) for n, length, m in towers)
                 + 2 * micro * k * config.max_masked * mc.vocab_size * 4) / axes["tensor"]
  # Dropout's masks with layers recomputed (the step draws dropout unless config.dropout is off).
  masks = (sum(_dropout_masks(n, length, m) for n, length, m in towers) / axes["tensor"]
           if config.dropout and mc.remat else 0)
  shard_rows = -(-index_rows // devices)
  # Mean pooling (MiniLM, or config.pooling="mean" of random models) embeds to the hidden size.
  mean = models.retriever.pooling == "mean"
  dim = mc.hidden_size if mean else mc.retriever_proj_size
  index_bytes = 2 if config.index.dtype == "bfloat16" else 4
  config_checks.one_of(config, {"index.searcher": SEARCHERS})
  on_device = SEARCHERS[config.index.searcher].on_device  # else the index is in host memory
  parts = {
      "parameters": 4 * p, "optimizer state": 8 * p, **update_buffers(platform, p),
      "activations": activations, **({"dropout masks": masks} if masks else {}),
      "index shard": on_device * shard_rows * dim * index_bytes,
      "search scratch": on_device * min(min(SEARCH_QUERY_BATCH, config.batch_size) * shard_rows * 4,
                                        MAX_SCORE_BYTES),
  }
  return {"parts": parts, "total": sum(parts.values()), "params": counts, "devices": devices,
          "examples_per_device": b, "index_rows": index_rows, "shard_rows": shard_rows,
          "dim": dim}


def retro_estimate(config, devices: int, mc, *, platform: str) -> dict:
  """Bytes per device of a RETRO run (realm_jax/configs/retro.py): the RETRO decoder's parameters
  (from shapes only) with AdamW's moments for the trained ones only (a RETROfit's frozen decoder
  has none), under fsdp the trained weights gathered whole, and the activations of its sequences,
  neighbour tokens and logits; the chunk index lives on the host (not counted). `mc`: the
  run's RetroConfig, as the trainer builds it (lm_step.model_config; without a database,
  compile/steps.retro_model_config); on the CPU and GPU, a float32 gradient and an update buffer
  of the trained ones (`update_buffers`)."""
  from realm_jax import sharding
  from realm_jax.checkpoints import decoder
  from realm_jax.models.retro import RetroModel
  db = config.db
  axes = sharding.mesh_axes(config.get("mesh", sharding.DEFAULT_MESH), devices, "--config.mesh")
  rules = sharding.config_rules(config)
  length, m, k = mc.chunk_length * db.seq_chunks, mc.chunk_length, mc.num_neighbours
  tokens = jax.ShapeDtypeStruct((1, length), jax.numpy.int32)
  neighbours = jax.ShapeDtypeStruct((1, db.seq_chunks, k, 2 * m), jax.numpy.int32)
  shapes = jax.eval_shape(lambda t, n: RetroModel(mc).init(jax.random.key(0), t, n), tokens,
                          neighbours)
  p_all = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  # Per device: the parameters (and the trained ones' gradients and moments) as the mesh splits
  # them (realm_jax/sharding.py; all of them with data parallelism).
  p = sharding.elements_per_device(shapes, axes, rules)
  is_trained = lambda path: not (config.freeze_decoder and decoder.is_decoder_param(path))
  trained = sharding.elements_per_device(shapes, axes, rules, keep=is_trained)
  vocab_size = mc.vocab_size
  b = -(-config.batch_size // (axes["data"] * axes["fsdp"]))
  act = 2 if mc.dtype == "bfloat16" else 4

  def layers(n_tokens, width, heads, seq, count, remat=mc.remat, scores=True):
    """Bytes kept by `count` layers: every layer's working set, or (recomputed, or with no
    gradient through them) each layer's input and one layer's working set at a time. `scores`:
    the attention forms its [heads, seq] probabilities per token; flash attention does not (one
    fused kernel keeps a few numbers per token and head: not counted)."""
    per = (34 * width + (5 * heads * seq if scores else 0)) * act / 2
    if remat:
      return n_tokens * (count * width * act + per)
    return n_tokens * count * per

  neighbour_tokens = b * length * 2 * k
  dense = mc.attention != "flash"  # the decoder's self-attention (not CCA, not the encoder)
  if mc.cca_memory == "decoder":
    # The neighbours run through the frozen decoder's layers up to the last CCA layer, with no
    # gradient through them: kept are the states each CCA layer reads (its keys' and values'
    # inputs), plus one layer's working set at a time (dense attention, flash or not:
    # models/retro.py).
    neighbour = layers(neighbour_tokens, mc.hidden_size, mc.num_heads, 2 * m,
                       len(mc.cca_layers), remat=True)
  else:
    neighbour = layers(neighbour_tokens, mc.encoder_width, mc.num_heads, 2 * m, mc.encoder_layers)
  # A frozen decoder's layers below the first CCA layer have nothing trained at or before them:
  # no gradient reaches them, so they keep no activations for the backward pass.
  below = min(mc.cca_layers) - 1 if config.freeze_decoder and mc.cca_layers else 0
  activations = (layers(b * length, mc.hidden_size, mc.num_heads, length, mc.num_layers - below,
                        scores=dense)
                 + neighbour + 2 * b * length * vocab_size * 4)  # float32 logits and their gradient
  activations /= axes["tensor"]  # heads, feed-forward width and vocabulary split over "tensor"
  # What the TPU compiler holds besides (docs/tpu.md, 2026-11-29): no whole float32 gradient or
  # update buffer (UPDATE_BUFFERS: counting them put the estimate at 1.34-1.58x the compiler's
  # with data parallelism, 0.97-1.10x without); split over fsdp, the trained weights gathered
  # whole in the compute dtype (`paper_7.5b`: 0.60x without them, 0.96x with).
  gathered = act * sharding.elements_per_device(
      shapes, {**axes, "fsdp": 1}, rules, keep=is_trained) if axes["fsdp"] > 1 else 0
  parts = {"parameters": 4 * p, "optimizer state": 8 * trained,
           **update_buffers(platform, trained), "gathered weights": gathered,
           "activations": activations}
  return {"parts": parts, "total": sum(parts.values()), "params": {"decoder": p_all},
          "devices": devices, "examples_per_device": b, "sequence": length}


def format_retro_estimate(est: dict, capacity_gib: float = 0.0, title: str = "") -> str:
  """`format_estimate` of a RETRO run's estimate (`retro_estimate`)."""
  head = (f"  {est['devices']} devices, {est['examples_per_device']} sequences of "
          f"{est['sequence']} tokens each; {est['params']['decoder'] / 1e6:.1f}M parameters")
  advice = ("set config.model.remat, lower the batch per device, or split the parameters and "
            "optimizer state over devices (config.mesh with fsdp and tensor axes)")
  return _table(est, head, capacity_gib, title, advice)


def format_estimate(est: dict, capacity_gib: float = 0.0, title: str = "") -> str:
  """A small table of the estimate, with a verdict when the device memory is known."""
  head = (f"  {est['devices']} devices, {est['examples_per_device']} examples each; "
          f"{est['params']['retriever'] / 1e6:.1f}M retriever + "
          f"{est['params']['encoder'] / 1e6:.1f}M encoder parameters; index "
          f"{est['index_rows']:,} x {est['dim']} ({est['shard_rows']:,} rows per device)")
  advice = "set config.remat, lower the batch per device, or use more devices"
  return _table(est, head, capacity_gib, title, advice)


def _table(est: dict, head: str, capacity_gib: float, title: str, advice: str) -> str:
  lines = [title or "Memory per device (estimate)", head]
  for name, value in est["parts"].items():
    lines.append(f"  {name:<16} {value / GIB:8.3f} GiB")
  lines.append(f"  {'total':<16} {est['total'] / GIB:8.3f} GiB")
  if capacity_gib:
    share = est["total"] / (capacity_gib * GIB)
    verdict = "fits" if fits(est, capacity_gib * GIB) else f"does NOT fit: {advice}"
    lines.append(f"  of {capacity_gib:g} GiB per device: {100 * share:.0f}% (x {MARGIN} margin: "
                 f"{100 * share * MARGIN:.0f}%) -> {verdict}")
  return "\n".join(lines)


def index_rows_for(config, corpus_len: int | None = None) -> int:
  """The index size to plan for: the corpus's when known, else full Wikipedia's for that source."""
  if corpus_len is not None:
    return corpus_len
  if config.corpus.source == "tfds_wikipedia":
    return WIKIPEDIA_BLOCKS
  raise ValueError("The number of index rows is unknown before the corpus is built: pass "
                   "--index_rows, or build the corpus first.")


def fits(est: dict, capacity_bytes: float) -> bool:
  """Whether the estimate, with its MARGIN, fits in `capacity_bytes` per device."""
  return est["total"] * MARGIN <= capacity_bytes


def host_ram_bytes() -> int | None:
  """This machine's RAM, or its container's memory limit when lower (cgroup v2 or v1); None where
  the system does not say."""
  try:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):  # not a POSIX system
    return None
  for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(limit_file) as f:
        ram = min(ram, int(f.read().strip()))  # "max" (no limit) does not parse: skipped
    except (OSError, ValueError):
      pass
  return ram


def device_memory() -> tuple[int, str] | None:
  """(bytes, what they are) that one device of this process can hold: an accelerator's own memory
  (what XLA may allocate on it), or on the CPU the host's RAM shared by its local devices. None
  where the platform does not say."""
  device = jax.local_devices()[0]
  limit = (device.memory_stats() or {}).get("bytes_limit")
  if limit:
    return int(limit), f"{device.device_kind} memory"
  ram = host_ram_bytes() if device.platform == "cpu" else None
  if ram is None:
    return None
  n = jax.local_device_count()
  return ram // n, "host RAM" if n == 1 else f"host RAM shared by {n} CPU devices"


def memory_warning(est: dict, capacity: tuple[int, str] | None) -> str | None:
  """What to log when the estimate, with its MARGIN, is more than a device holds (`capacity` as
  `device_memory` returns it); None when it fits or the capacity is unknown."""
  if capacity is None or fits(est, capacity[0]):
    return None
  limit, what = capacity
  return (f"This run may not fit in memory: the estimate is {est['total'] / GIB:.2f} GiB per "
          f"device ({MARGIN}x that, {est['total'] * MARGIN / GIB:.2f} GiB, is what it may take), "
          f"the device has {limit / GIB:.2f} GiB ({what}). Lower --config.batch_size or "
          "--config.num_candidates, set --config.remat=True, or use more devices.")


def device_peak_bytes() -> int | None:
  """The most memory this process's first device has held (None where the platform does not
  report it, as on the CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")


def compiled_step_bytes(compiled) -> dict[str, int]:
  """XLA's buffer assignment of a compiled step, per device: arguments (state + batch), outputs,
  outputs that reuse (donated) argument buffers, and temporaries (activations, gradients, ...)."""
  m = compiled.memory_analysis()
  return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
          "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
          "total": m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes}

