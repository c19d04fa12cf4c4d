"""benchmarks/accelerator.py: its quick mode runs on the CPU as a user runs it (one device), says on
every line that its figures are CPU figures, and writes a JSON whose FLOP counts are those worked
out here by hand from the shapes; bad flags end in one `error:` line and exit status 2."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, one_device_env

SCRIPT = os.path.join(ROOT, "benchmarks", "accelerator.py")
CPU_LABEL = "CPU (quick, not an accelerator figure)"


def load_script():
  spec = importlib.util.spec_from_file_location("accelerator", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def bert_flops(m, length):
  """Matmul FLOPs of one BERT pass over `length` positions, written out for the model `m`."""
  h, i = m["hidden_size"], m["intermediate"]
  per_layer = (length * 4 * 2 * h * h        # Q, K, V and output projections
               + length * 2 * 2 * h * i      # the two FFN matmuls
               + 2 * 2 * length * length * h)  # attention scores and context
  return m["num_layers"] * per_layer


def tower_flops(m, length):
  """One retriever tower: the BERT, the pooler (H x H) and the projection (H x P)."""
  h, p = m["hidden_size"], m["retriever_proj_size"]
  return bert_flops(m, length) + 2 * h * h + 2 * h * p


@pytest.mark.slow
def test_quick_run_on_cpu(tmp_path):
  out = tmp_path / "results" / "acc.json"  # a folder that does not exist yet
  got = subprocess.run([sys.executable, SCRIPT, "--quick", f"--out={out}"], cwd=ROOT,
                       env={**one_device_env(), "JAX_PLATFORMS": "cpu"}, capture_output=True,
                       text=True, timeout=600)
  assert got.returncode == 0, got.stderr[-5000:]
  r = json.loads(out.read_text())

  # The device, and the peak measured on it.
  assert r["platform"] == "cpu" and r["device_count"] == 1 and r["quick"] is True
  assert r["jax_version"] and r["cpu_model"]
  assert r["label"].startswith(CPU_LABEL) and r["cpu_model"] in r["label"]
  assert "CPU, peak = measured matmul" in r["peak_source"]
  side = r["cpu_matmul"]["side"]
  assert r["peak_flops"] == r["cpu_matmul"]["peak"] == max(r["cpu_matmul"]["float32"],
                                                            r["cpu_matmul"]["bfloat16"]) > 0
  assert side >= 512

  # The step: benchmarks/train_step.py's formula, by hand for this shape.
  m, st = r["model"], r["train_step"]
  s = st["shape"]
  b, k, mm = s["batch_size"], s["num_candidates"], s["num_masked"]
  h, p, v = m["hidden_size"], m["retriever_proj_size"], m["vocab_size"]
  forward = (b * tower_flops(m, s["query_length"])             # queries
             + b * k * tower_flops(m, s["doc_length"])         # candidates
             + b * k * 2 * p                                   # relevance scores
             + b * k * bert_flops(m, s["joint_length"])        # joint inputs
             + b * k * mm * (2 * h * h + 2 * h * v))           # MLM head at the masked positions
  assert st["flops"] == pytest.approx(3 * forward, rel=1e-12)
  assert st["dtype"] == "bfloat16"
  # The quick shape itself, so that a change of it is a change of this test too.
  assert (m["hidden_size"], m["num_layers"], b, k) == (64, 1, 2, 2)

  em = r["embedding"]
  assert em["shape"]["length"] == 288
  assert em["flops_per_doc"] == pytest.approx(tower_flops(m, 288), rel=1e-12)
  assert em["docs_per_s"] == pytest.approx(em["shape"]["docs"] / em["seconds"])

  se = r["search"]
  n, d, q = se["shape"]["rows"], se["shape"]["dim"], se["shape"]["queries"]
  assert (n, d, se["shape"]["k"]) == (20_000, 128, 10)
  assert se["flops"] == 2 * n * d * q
  assert se["queries_per_s"] == pytest.approx(q / se["seconds"])

  for part, fraction in ((st, "mfu"), (em, "mfu"), (se, "fraction_of_peak")):
    assert len(part["times"]) == 3 and part["seconds"] > 0
    flops = part.get("flops", em["flops_per_doc"] * em["shape"]["docs"])
    assert part["flops_per_s"] == pytest.approx(flops / part["seconds"])
    assert part[fraction] == pytest.approx(part["flops_per_s"] / r["peak_flops"])

  # Every printed figure is labelled as a CPU one; the table row starts with the label.
  lines = got.stdout.splitlines()
  numbered = [line for line in lines if any(c.isdigit() for c in line)]
  assert numbered and all("CPU" in line for line in numbered), got.stdout
  rows = [line for line in lines if line.startswith("| CPU")]
  assert len(rows) == 1 and rows[0].startswith(f"| {CPU_LABEL}")
  header = lines[lines.index(rows[0]) - 2]
  assert header.startswith("| device |") and header.count("|") == rows[0].count("|")


@pytest.mark.parametrize("argv, says", [
    (["--batch_size=x"], "--batch_size"),
    (["--repeats=0"], "--repeats=0"),
    (["--preset=huge"], "--preset"),
    (["--joint_length=600"], "limited to 512"),
    (["--quick", "--num_masked=20"], "--num_masked=20"),
    (["--search_rows=5", "--k=10"], "--k=10"),
    (["--peak_tflops=0"], "--peak_tflops"),
])
def test_bad_flags(argv, says, capsys):
  with pytest.raises(SystemExit) as e:
    load_script().parse_args(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_unwritable_out(tmp_path, capsys):
  """--out under a file: an `error:` line before anything is measured."""
  (tmp_path / "file").write_text("")
  with pytest.raises(SystemExit) as e:
    load_script().main(["--quick", f"--out={tmp_path / 'file' / 'acc.json'}"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --out="), err
