"""Compiling the training steps for a TPU slice on a machine without one
(experiments/compile_for.py): topology.py names slices and their chips, steps.py gives each
trainer's step with abstract state and batch, hlo.py counts the collectives of a compiled program,
aot.py compiles and reports the TPU compiler's memory, FLOPs and time estimates."""
