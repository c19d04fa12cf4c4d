"""Logical axis names of every parameter of realm_jax's models: what each dimension of each array
is ("embed", "heads", "mlp", "vocab", ...), so that a rule table (realm_jax/sharding.py) can map
them to mesh axes, as MaxText and t5x do.

    logical_axes(params)   # {"h_3/attn/q_proj/kernel": ("embed", "heads"), ...}

The names are given by a parameter's path, in one table for all models (BERT towers, the
knowledge-augmented encoder, the reader, RETRO's GPT-2 and Llama decoders, the neighbour encoder
and the CCA layers), instead of inside each module: the modules, their checkpoint converters and
every saved file keep plain arrays. A parameter no rule names is an error (tests run the table over
every trainer's parameters).

Activations: `batch_split(x)` tells XLA that a layer's output stays split along its batch over
"data" and "fsdp" (MaxText's activation constraints). Without it, XLA's propagation can keep the
weights split and gather the activations instead (every device then holds the whole batch's:
RETRO paper_1.5b over fsdp 16 needed 20.7 GiB of temporaries per device). It acts only when the
step is traced under the run's mesh (`sharding.traced_on`), else it returns `x` unchanged.

Kernels are [in, out] (flax's Dense): a projection into attention heads is ("embed", "heads"),
out of them ("heads", "embed"); the feed-forward block's ("embed", "mlp") and ("mlp", "embed").
"""

from __future__ import annotations

import re

import jax
from jax.sharding import PartitionSpec

# The mesh axes a batch is split over (realm_jax/sharding.py's mesh: data, fsdp, tensor).
BATCH_AXES = ("data", "fsdp")

# Every logical name a parameter's dimension can have; None: a dimension that is never split.
LOGICAL_AXES = ("vocab", "embed", "heads", "mlp")

_HEADS_IN = r"(query|key|value|q_proj|k_proj|v_proj|key_value|c_attn)"
_HEADS_OUT = r"(attention/output/dense|o_proj|attn/c_proj|attn/out|cross_attn/out|self_attn/out)"
_MLP_IN = r"(intermediate/dense|gate_proj|up_proj|c_fc)"
_MLP_OUT = r"(layer_\d+/output/dense|down_proj|mlp/c_proj)"

# (pattern searched in the path "a/b/c", names of its dimensions): the first match names it.
RULES = (
    (r"(word_embeddings|wte)/embedding$", ("vocab", "embed")),
    (r"(position_embeddings|token_type_embeddings|wpe)/embedding$", (None, "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    (r"predictions/bias$", ("vocab",)),
    (_HEADS_IN + r"/kernel$", ("embed", "heads")),
    (_HEADS_IN + r"/bias$", ("heads",)),
    (_HEADS_OUT + r"/kernel$", ("heads", "embed")),
    (_MLP_IN + r"/kernel$", ("embed", "mlp")),
    (_MLP_IN + r"/bias$", ("mlp",)),
    (_MLP_OUT + r"/kernel$", ("mlp", "embed")),
    (r"kernel$", ("embed", None)),              # pooler, projections, MLM transform, span scorer
    (r"(bias|scale)$", (None,)),                 # norms and the remaining biases
    (r"table$", (None, None)),                   # RETRO's relative position biases
)


def path_name(path) -> str:
  """A tree path as "a/b/c" (dict keys, attribute names, sequence indices)."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def axes_of(name: str, ndim: int) -> tuple:
  """The logical names of the dimensions of the parameter at path `name` with `ndim` dimensions;
  ValueError when no rule names it."""
  for pattern, axes in RULES:
    if re.search(pattern, name) and len(axes) == ndim:
      return axes
  raise ValueError(f"No logical axes for parameter {name} ({ndim} dimensions): add a rule to "
                   "realm_jax/models/partitioning.py RULES.")


def logical_axes(params) -> dict[str, tuple]:
  """{path "a/b/c": its dimensions' logical names (None: never split)} of every array of `params`
  (arrays or ShapeDtypeStructs)."""
  return {path_name(path): axes_of(path_name(path), len(x.shape))
          for path, x in jax.tree_util.tree_leaves_with_path(params)}


def batch_split(x):
  """`x` [B, ...] constrained to stay split along B over the batch axes, when traced under a mesh
  that has them (jax.sharding.use_abstract_mesh: sharding.traced_on); else `x`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
    return x
  return jax.lax.with_sharding_constraint(x, PartitionSpec(BATCH_AXES))
