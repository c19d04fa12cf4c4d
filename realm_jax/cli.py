"""How every entry point (experiments/*.py) answers a user's mistake: one `error:` line on stderr
naming the flag, file or line and what to do, exit status 2, no traceback.

    from realm_jax import cli
    _CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/pretrain.py:<variant>).")
    ...
    if __name__ == "__main__":
      cli.run(main)

Mistakes caught: flags absl refuses (a missing or unparsable value, an unreadable --flagfile), a
config file that does not load or has no such variant, a `--config.<key>` override of a setting the
config lacks, and the errors the library raises for what the user gave it: ValueError (bad settings,
bad lines in data files, JSON that does not parse) and OSError (missing, unreadable or unwritable
files and directories). Anything else is a bug and keeps its traceback. REALM_JAX_TRACEBACK=1 shows
the traceback of a user error too.

`run` also keeps JAX from starting libtpu where no TPU is (libtpu_flags.py) and drops the lines
libraries log on every run that are no news to the user (`keep_log_record`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Callable, NoReturn

from absl import app, flags

from realm_jax import libtpu_flags

USER_ERRORS = (ValueError, OSError)


def fail(message: str) -> NoReturn:
  """Prints `error: <message>` as one line of its own and exits with status 2."""
  print(f"{_fresh_line()}error: {_one_line(message)}", file=sys.stderr)
  sys.exit(2)


def _fresh_line() -> str:
  """A line break while a progress bar is open, else "": tqdm redraws its line after a carriage
  return and ends it only when the bar closes, so an `error:` written after it would not start a
  line of its own (`grep ^error:`)."""
  tqdm = sys.modules.get("tqdm")
  open_bars = getattr(getattr(tqdm, "tqdm", None), "_instances", ())  # enabled, not closed
  return "\n" if len(open_bars) else ""


def _one_line(message: str) -> str:
  return " ".join(str(message).split())


def define_config(name: str, default: str | None, help_string: str):
  """`config_flags.DEFINE_config_file`, with an unreadable --flagfile reported as an `error:` line:
  ml_collections reads the flagfiles already here, while the flag is defined."""
  from ml_collections import config_flags
  try:
    return config_flags.DEFINE_config_file(name, default, help_string)
  except flags.Error as e:
    fail(_flag_error(e))


def _flag_error(e: flags.Error) -> str:
  text = str(e)
  if isinstance(e, flags.CantOpenFlagFileError):
    name = re.search(r"No such file or directory: '([^']*)'", text)
    if name:
      return (f"--flagfile={name.group(1)}: no such file (flagfiles are relative to the current "
              "directory: run from the repository root, or give the file's full path).")
  # A config file whose get_config raised: absl wraps its traceback; the last line is the reason.
  reason = [line.strip() for line in text.splitlines() if line.strip()]
  if "Error whilst parsing config file" in text and reason:
    flag = re.search(r"flag (--\S+?):", text)
    return f"{flag.group(1) if flag else '--config'}: {reason[-1]}"
  return text.removeprefix("ERROR:: ").strip()


def _missing_setting(e: AttributeError, argv: list[str]) -> str:
  """ml_collections' error for `--config.a.b=...` when the config has no `b`, naming the flag."""
  text = str(e).encode().decode("unicode_escape").strip("'\"")
  key = re.match(r"'?([^'\n]+)'?", text)
  key = key.group(1) if key else text
  flag = next((a.split("=")[0] for a in argv[1:]
               if re.match(rf"--\w+(\.\w+)*\.{re.escape(key)}(=|$)", a)), f"--config.{key}")
  hint = re.search(r'Did you mean "([^"]+)"', text)
  hint = f" (did you mean {hint.group(1)}?)" if hint else ""
  return f"{flag}: the config has no setting {key!r}{hint}; see the config file for its settings."


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    fail(_flag_error(e))
  except AttributeError as e:
    fail(_missing_setting(e, argv))
  except USER_ERRORS as e:
    fail(str(e))
  # ml_collections reports a config file that fails to load only when the config is first used.
  for name in flags.FLAGS:
    flag = flags.FLAGS[name]
    if type(flag).__name__ == "_ConfigFlag" and flag.present:
      try:
        flag.value.keys()
      except OSError as e:
        fail(f"--{name}={flag.config_filename}: the config file does not load "
             f"({_load_reason(str(e))}); give realm_jax/configs/<file>.py:<variant>.")
  return rest


def _load_reason(text: str) -> str:
  found = re.search(r"\[Errno \d+\] ([^\n]+)", text)
  return found.group(1).strip() if found else text.strip().splitlines()[-1].strip()


def run(main: Callable[[list[str]], None], stray_hint: str = "") -> None:
  """`absl.app.run(main)` with the user's mistakes reported as `error:` lines, status 2.
  Arguments that are not flags are refused (`stray_hint` says what the user may have meant)."""

  def guarded(argv: list[str]) -> None:
    libtpu_flags.add()  # before anything starts libtpu (a TPU run; compile_for)
    libtpu_flags.cpu_without_accelerator()  # no libtpu start, and its stderr, without a TPU
    quiet_library_logs()
    if len(argv) > 1:
      fail(f"unexpected arguments {argv[1:]}: "
           f"{stray_hint or 'every setting is a --flag=value (see --helpshort)'}.")
    try:
      main(argv)
    except USER_ERRORS as e:
      if os.environ.get("REALM_JAX_TRACEBACK"):
        raise
      fail(str(e))
    except KeyboardInterrupt:
      sys.exit(130)

  app.run(guarded, flags_parser=_parse_flags)


# Lines that libraries log on every run of realm_jax's and are no news to its user: TFDS's warnings
# that a builder of realm_jax's own datasets takes a custom config (printed whole) and that the
# version folder of a dataset not built yet has no dataset_info.json.
ROUTINE_WARNINGS = {"tensorflow_datasets": ("Using custom data configuration: %s",
                                            "Variant folder %s has no %s")}
CHATTY_LIBRARIES = ("orbax", "grain")  # dozens of INFO lines per checkpoint


def keep_log_record(record) -> bool:
  """Whether a log record is shown: not the INFO chatter of CHATTY_LIBRARIES (their warnings and
  errors show) and not ROUTINE_WARNINGS (matched by the message's format)."""

  def logged_by(lib):
    return f"{os.sep}{lib}{os.sep}" in record.pathname

  if record.levelno < logging.WARNING and any(logged_by(lib) for lib in CHATTY_LIBRARIES):
    return False
  return not any(logged_by(lib) and record.msg in formats
                 for lib, formats in ROUTINE_WARNINGS.items())


def quiet_library_logs() -> None:
  """Applies `keep_log_record` to absl's log, once per process; every entry point (`run`) does."""
  from absl import logging as absl_logging
  handler = absl_logging.get_absl_handler()
  if keep_log_record not in handler.filters:
    handler.addFilter(keep_log_record)
