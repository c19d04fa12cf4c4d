"""REALM's pre-training step: re-embed the query and its K candidates with the current weights,
score them, and maximise the marginal log-likelihood of the masked tokens.

The (stale) index only chose which K - 1 blocks are candidates (plus the null document at 0);
p(z|x) here comes from fresh embeddings, so the gradient reaches both retriever towers.

A batch (numpy on the host, sharded along B on device):
  query       {input_ids, attention_mask, token_type_ids}  [B, Lq]   [CLS] x [SEP]
  candidates  {input_ids, attention_mask, token_type_ids}  [B, K, Ld] [CLS] title [SEP] body [SEP]
  joint       {input_ids, attention_mask, token_type_ids}  [B, K, Le] [CLS] x [SEP] body [SEP]
  candidate_mask [B, K] (1 = a real candidate; the null document at 0 always is)
  mlm_positions, mlm_targets [B, M] int32 and mlm_weights [B, M] float32
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from realm_jax.models.dropout import Rows
from realm_jax.models.encoder import KnowledgeAugEncoder, marginal_mlm_loss
from realm_jax.models.retriever import NEG_INF, RealmRetriever, relevance_scores

Array = jax.Array


class TrainState(train_state.TrainState):
  """step, params {"retriever", "encoder"}, tx and opt_state (apply_fn unused)."""


@dataclasses.dataclass(frozen=True)
class RealmModels:
  """The two modules of REALM pre-training and how their scores combine.

  score_scale multiplies the relevance scores before the softmax over candidates: 1 for REALM's
  projected [CLS] embeddings; ~20 for L2-normalised embeddings (cosine scores in [-1, 1] would
  give a nearly uniform p(z|x)).
  train_retriever=False stops the gradient at the retriever's parameters (config
  retriever_learning_rate=0: a frozen retriever, an ablation); p(z|x) still weighs the candidates.
  """
  retriever: RealmRetriever
  encoder: KnowledgeAugEncoder
  score_scale: float = 1.0
  train_retriever: bool = True


def _inputs(d):
  return d["input_ids"], d["attention_mask"], d["token_type_ids"]


def retriever_logits(params, batch, models: RealmModels, rngs=None,
                     rows: Rows | None = None) -> Array:
  """Fresh relevance scores [B, K] of every candidate; masked candidates get -1e9."""
  det = rngs is None
  retriever = params["retriever"]
  if not models.train_retriever:
    retriever = jax.lax.stop_gradient(retriever)
  apply = lambda method, d, r: models.retriever.apply(
      {"params": retriever}, *_inputs(d), det, rows, method=method, rngs=r)
  q = apply("embed_queries", batch["query"], None if det else {"dropout": rngs[0]})     # [B, D]
  z = apply("embed_documents", batch["candidates"], None if det else {"dropout": rngs[1]})  # [B, K, D]
  logits = models.score_scale * relevance_scores(q, z)
  return jnp.where(batch["candidate_mask"] > 0, logits, NEG_INF)


def realm_loss(params, batch, models: RealmModels, dropout_rng: Array | None = None,
               rows: Rows | None = None, per_example: bool = False):
  """The marginal MLM loss and its statistics; dropout only when `dropout_rng` is given.

  `rows`: the batch's examples are these rows of a larger batch (their dropout masks are theirs
  there: realm_jax/models/dropout.py).

  Returns:
    (loss [], metrics) with metrics as sums over the batch (so that they average correctly over
    devices and steps): see `summarize`. per_example=True adds metrics["per_example"]: [B] arrays
    `tokens` (masked tokens), `correct`, `null_correct` (of them), `utility` (summed over them)
    and `span_found`.
  """
  rngs = None if dropout_rng is None else jax.random.split(dropout_rng, 3)
  logits = retriever_logits(params, batch, models, None if rngs is None else rngs[:2], rows)
  mlm_logits = models.encoder.apply(
      {"params": params["encoder"]}, *_inputs(batch["joint"]), batch["mlm_positions"],
      rngs is None, rows, rngs=None if rngs is None else {"dropout": rngs[2]})    # [B, K, M, V]
  weights = batch["mlm_weights"].astype(jnp.float32)
  loss, aux = marginal_mlm_loss(mlm_logits, batch["mlm_targets"], weights, logits)
  return loss, _statistics(mlm_logits, batch, weights, aux, per_example)


def _statistics(mlm_logits, batch, weights, aux, per_example: bool = False) -> dict[str, Array]:
  retr_logp = aux["retrieval_log_probs"]                                       # [B, K]
  vocab_logp = jax.nn.log_softmax(mlm_logits.astype(jnp.float32), axis=-1)     # [B, K, M, V]
  marginal_vocab = jax.nn.logsumexp(retr_logp[:, :, None, None] + vocab_logp, axis=1)  # [B, M, V]
  targets = batch["mlm_targets"]
  correct = (jnp.argmax(marginal_vocab, -1) == targets).astype(jnp.float32)
  null_correct = (jnp.argmax(mlm_logits[:, 0], -1) == targets).astype(jnp.float32)
  utility = aux["marginal_log_probs"] - aux["candidate_log_probs"][:, 0]      # [B, M]
  p = jnp.exp(retr_logp)
  entropy = -jnp.sum(jnp.where(p > 0, p * retr_logp, 0.0), axis=-1)           # [B]
  # Token counts and sums of the per-token metrics over the tokens that `w` weighs.
  token_sums = lambda w: {"tokens": jnp.sum(w), "correct": jnp.sum(correct * w),
                          "null_correct": jnp.sum(null_correct * w),
                          "utility_sum": jnp.sum(utility * w)}
  stats = {
      **token_sums(weights),
      "loss_sum": -jnp.sum(aux["marginal_log_probs"] * weights),
      "entropy_sum": jnp.sum(entropy),
      "null_prob_sum": jnp.sum(p[:, 0]),
      "examples": jnp.asarray(targets.shape[0], jnp.float32),
  }
  # Per-example sums, for standard errors over examples (a sentence's masked tokens are not
  # independent of each other): utility and accuracy gain over the null document.
  n_e = jnp.sum(weights, -1)                                                   # [B]
  for name, per_token in (("utility", utility), ("gain", correct - null_correct)):
    x_e = jnp.sum(per_token * weights, -1)
    stats[f"{name}_sq"] = jnp.sum(x_e * x_e)
    stats[f"{name}_x_tokens"] = jnp.sum(x_e * n_e)
  stats["tokens_sq"] = jnp.sum(n_e * n_e)
  if "span_found" in batch:  # laid out on the host by CandidateBuilder
    found = batch["span_found"].astype(jnp.float32)                            # [B]
    stats["span_found"] = jnp.sum(found)
    # The same sums on the examples whose masked span is in a retrieved block: where the evidence
    # is there to copy.
    stats.update({f"found_{k}": v for k, v in token_sums(weights * found[:, None]).items()})
  if per_example:
    stats["per_example"] = {
        "tokens": n_e, "correct": jnp.sum(correct * weights, -1),
        "null_correct": jnp.sum(null_correct * weights, -1),
        "utility": jnp.sum(utility * weights, -1),
        "span_found": batch.get("span_found", jnp.zeros_like(n_e)).astype(jnp.float32)}
  return stats


def summarize(sums: dict) -> dict[str, float]:
  """Averages from summed statistics (one step's, or several added together).

  `retrieval_utility_se` and `accuracy_gain_se` are the standard errors of the retrieval utility
  and of accuracy minus null accuracy, over examples (per-token averages are ratios of sums over
  examples: the delta method, with E / (E - 1) for E examples). With `span_found` in the batches
  also `span_in_candidates` (the fraction of examples whose masked span occurs in a retrieved
  block) and, over those examples' masked tokens, `found_accuracy`, `found_null_accuracy` and
  `found_retrieval_utility`.
  """
  tokens, examples = max(float(sums["tokens"]), 1.0), max(float(sums["examples"]), 1.0)
  rates = lambda prefix, n: {f"{prefix}accuracy": float(sums[f"{prefix}correct"]) / n,
                             f"{prefix}null_accuracy": float(sums[f"{prefix}null_correct"]) / n,
                             f"{prefix}retrieval_utility": float(sums[f"{prefix}utility_sum"]) / n}
  out = {
      "loss": float(sums["loss_sum"]) / tokens,
      **rates("", tokens),
      "retrieval_entropy": float(sums["entropy_sum"]) / examples,
      "null_doc_prob": float(sums["null_prob_sum"]) / examples,
  }
  if "tokens_sq" in sums and float(sums["tokens"]) > 0 and float(sums["examples"]) >= 2:
    out["retrieval_utility_se"] = _ratio_se(sums["utility_sum"], sums["utility_sq"],
                                            sums["utility_x_tokens"], sums)
    out["accuracy_gain_se"] = _ratio_se(float(sums["correct"]) - float(sums["null_correct"]),
                                        sums["gain_sq"], sums["gain_x_tokens"], sums)
  if "span_found" in sums:
    out["span_in_candidates"] = float(sums["span_found"]) / examples
  if float(sums.get("found_tokens", 0.0)) > 0:  # none in this window: no such metrics
    out.update(rates("found_", float(sums["found_tokens"])))
  for k in ("grad_norm", "learning_rate", "skipped"):
    if k in sums:
      out[k] = float(sums[k])
  return out


def _ratio_se(total, sq, x_tokens, sums) -> float:
  """Standard error of the per-token mean total / tokens, from per-example sums x_e (sum of x_e^2,
  of x_e n_e) and token counts n_e: sqrt(E / (E - 1) * sum (x_e - r n_e)^2) / sum n_e."""
  tokens, examples = float(sums["tokens"]), float(sums["examples"])  # > 0 and >= 2
  r = float(total) / tokens
  spread = float(sq) - 2 * r * float(x_tokens) + r * r * float(sums["tokens_sq"])
  return math.sqrt(max(spread, 0.0) * examples / (examples - 1)) / tokens


def realm_loss_and_grads(params, batch, models: RealmModels, dropout_rng: Array | None = None,
                         pieces: int = 1):
  """((loss, sums), gradient) of `realm_loss`, the batch's examples run `pieces` at a time
  (`piecewise_grads`: each piece's loss is its share of the mean over the whole batch's masked
  tokens)."""
  if pieces == 1:
    return jax.value_and_grad(realm_loss, has_aux=True)(params, batch, models, dropout_rng)
  tokens = jnp.maximum(jnp.sum(batch["mlm_weights"].astype(jnp.float32)), 1.0)

  def piece_loss(p, part, rng, rows):
    stats = realm_loss(p, part, models, rng, rows)[1]
    return stats["loss_sum"] / tokens, stats

  return piecewise_grads(piece_loss, params, batch, pieces, dropout_rng)


def train_step(state: TrainState, batch: dict, rng: Array, *,
               models: RealmModels, dropout: bool = True,
               pieces: int = 1) -> tuple[TrainState, dict]:
  """One AdamW update on the marginal MLM loss; pure, so it jits with the state donated.

  `pieces` > 1: the batch's examples go through the step that many at a time
  (`realm_loss_and_grads`). A step whose loss or gradient is not finite changes no parameter or
  optimiser moment (the step counter still advances, so the data moves on) and reports
  `skipped` = 1.
  """
  return grads_step(state, lambda p, r: realm_loss_and_grads(p, batch, models, r, pieces), rng,
                    dropout)


def split_pieces(tree, pieces: int):
  """[B, ...] arrays -> [pieces, B / pieces, ...]: piece p holds examples p, p + pieces, ...

  Strided, so that a batch sharded along B over devices keeps its sharding in every piece (each
  device's examples split evenly into the pieces when B / devices is a multiple of `pieces`).
  """
  def split(x):
    if x.shape[0] % pieces:
      raise ValueError(f"A batch of {x.shape[0]} does not split into {pieces} pieces.")
    return x.reshape(x.shape[0] // pieces, pieces, *x.shape[1:]).swapaxes(0, 1)
  return jax.tree.map(split, tree)


def join_pieces(x: Array) -> Array:
  """The inverse of `split_pieces` for one array [pieces, B / pieces, ...] -> [B, ...]."""
  return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def piecewise_grads(piece_loss, params, batch: dict, pieces: int,
                    dropout_rng: Array | None = None):
  """((loss, sums), gradient) of a loss that is the sum of its pieces' losses, computed a piece
  at a time: only one piece's activations are alive, and the gradients add up.

  `piece_loss(params, piece, dropout_rng, rows) -> (loss, sums)`, with `rows` (models/dropout.py)
  naming the piece's examples in the whole batch, so that dropout drops what it would drop in the
  whole batch's call: pieces change the result only by the order of the sums.
  """
  b = jax.tree.leaves(batch)[0].shape[0]
  xs = split_pieces((batch, jnp.arange(b, dtype=jnp.int32)), pieces)
  grad_fn = jax.value_and_grad(piece_loss, has_aux=True)

  def one(acc, x):
    part, ids = x
    out = grad_fn(params, part, dropout_rng, Rows(ids, b))
    return jax.tree.map(jnp.add, acc, out), None

  first = jax.tree.map(lambda x: x[0], xs)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
      grad_fn, params, first[0], dropout_rng, Rows(first[1], b)))
  return jax.lax.scan(one, zeros, xs)[0]


def loss_step(state: TrainState, loss_fn, rng: Array, dropout: bool = True):
  """The update shared by every trainer: `loss_fn(params, dropout_rng) -> (loss, stats)` is
  differentiated, the step's dropout key is `rng` folded with the step (None without dropout),
  and `guarded_update` applies the gradient. Returns (state, {**stats, grad_norm, skipped})."""
  return grads_step(state, jax.value_and_grad(loss_fn, has_aux=True), rng, dropout)


def grads_step(state: TrainState, grads_fn, rng: Array, dropout: bool = True):
  """`loss_step` for a loss whose gradient is computed by `grads_fn(params, dropout_rng) ->
  ((loss, stats), grads)` (e.g. accumulated over pieces of the batch)."""
  dropout_rng = jax.random.fold_in(rng, state.step) if dropout else None
  (loss, stats), grads = grads_fn(state.params, dropout_rng)
  state, update_stats = guarded_update(state, loss, grads)
  return state, {**stats, **update_stats}


def guarded_update(state: TrainState, loss: Array, grads) -> tuple[TrainState, dict]:
  """Applies `grads` unless the loss or gradient is not finite; the step counter advances anyway.

  A skipped step keeps the parameters and Adam's moments and count, but the learning-rate
  schedules' counts advance with the step (as a PyTorch scheduler does when the optimizer step is
  skipped), so the rate in use stays schedule(step), the one logged, and reaches 0 at the end.
  Returns (state, {"grad_norm", "skipped"}) with skipped = 1.0 for a step that changed nothing.
  """
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
  keep_opt = lambda new, old: new if is_schedule(old) else keep(new, old)
  state = state.replace(step=state.step + 1, params=keep(params, state.params),
                        opt_state=jax.tree.map(keep_opt, opt_state, state.opt_state,
                                               is_leaf=is_schedule))
  return state, {"grad_norm": grad_norm, "skipped": 1.0 - finite.astype(jnp.float32)}


def eval_step(params, batch: dict, *, models: RealmModels) -> dict:
  """Summed statistics without dropout or update (held-out evaluation), and their per-example
  parts under "per_example" (`realm_loss`)."""
  return realm_loss(params, batch, models, per_example=True)[1]
