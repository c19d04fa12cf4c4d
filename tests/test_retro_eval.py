"""What retro_eval.py checks before it evaluates (realm_jax/eval/retro.py): the names of the models
it is given, and that its results can be written. The evaluation itself is tested with a trained
run in tests/test_retro_train.py."""

import logging

import pytest

from realm_jax.eval import retro as retro_eval


def test_exports_are_named_by_the_directory_above_export():
  assert retro_eval.export_names(["w/retro/export", "w/baseline/export/"]) == {
      "retro": "w/retro/export", "baseline": "w/baseline/export/"}


def test_exports_of_the_same_name_are_named_by_their_paths_and_the_log_says_so(caplog):
  """Two RETRO exports (two seeds, each 'retro') kept one of them, silently."""
  paths = ["runs/seed0/retro/export", "runs/seed1/retro/export", "other/baseline/export"]
  with caplog.at_level(logging.INFO):
    names = retro_eval.export_names(paths)
  assert names == {"seed0/retro": paths[0], "seed1/retro": paths[1], "other/baseline": paths[2]}
  assert "seed0/retro, seed1/retro, other/baseline" in caplog.text
  assert list(retro_eval.export_names(["a/retro/export", "retro/export"])) == ["a/retro", "retro"]


def test_an_export_given_twice_is_refused():
  with pytest.raises(ValueError, match=r"^--models=a/retro/export,\./a/retro/export: "
                                       r"\./a/retro/export is given twice"):
    retro_eval.export_names(["a/retro/export", "./a/retro/export"])


def test_an_output_directory_that_cannot_be_written_fails_before_the_evaluation(tmp_path):
  """--out naming a file failed only after the whole evaluation, when eval.json was written."""
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  for out, reason in ((a_file, "it is a file"), (a_file / "eval", "Not a directory")):
    with pytest.raises(OSError, match=rf"^{out} cannot be written \({reason}\); eval\.json"):
      retro_eval.evaluate_exports({"retro": "unread"}, db=None, out_dir=str(out))
  retro_eval.check_out_dir(str(tmp_path / "new" / "eval"))  # made, and left empty
  assert [p.name for p in (tmp_path / "new" / "eval").iterdir()] == []
