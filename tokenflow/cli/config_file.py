"""`--config FILE`: a command's options from a TOML file; options given on the command line win.

The file is flat: one `key = value` per option, the key being the option's long name without
its dashes (`device-kv-tokens = 2048` or `device_kv_tokens = 2048`, `mu = 2.0`, `policy =
"tokenflow"`, `no-write-through = true`); a repeatable option takes a list or one string
(`api-key = ["a", "b"]`).  A repeatable option given on the command line replaces the file's
list instead of adding to it, as every other flag replaces the file's value.  `tokenflow tune`
writes such a file for `serve` (and `simulate` reads the same policy keys).  An unknown key, a
table, or a value of the wrong kind is refused with the file, the key and what was expected.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_NOT_CONFIGURABLE = frozenset({"help", "config", "command"})


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message is one line naming the file and key."""


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """The `--config FILE` option (read by `config_defaults` before the real parse)."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="read options from this TOML file (e.g. one `tokenflow tune` wrote); "
        "options given on the command line win",
    )


def config_path(argv: Sequence[str]) -> str | None:
    """The FILE of `--config FILE` or `--config=FILE` in `argv`, if any."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's top-level keys and values (ConfigFileError if unreadable or not TOML)."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise ConfigFileError(f"{path}: cannot read config: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigFileError(f"{path}: not valid TOML: {error}") from None


def config_defaults(
    parser: argparse.ArgumentParser, values: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """`values` checked against `parser`'s options: {destination: value} to set as defaults."""
    actions = _options(parser)
    defaults: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            raise ConfigFileError(f"{where}: {key}: a table; the file holds `key = value` lines")
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigFileError(f"{where}: unknown key {key!r}{_suggestion(dest, actions)}")
        defaults[action.dest] = _checked(action, value, f"{where}: {key}")
    return defaults


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """If `argv` names a `--config FILE`, make the file's values `parser`'s defaults, but for
    the repeatable options `argv` gives (their values replace the file's list, not add to it:
    argparse appends a repeated option's values to its default)."""
    path = config_path(argv)
    if path is None:
        return
    defaults = config_defaults(parser, read_config(path), str(path))
    given = _lists_given(parser, argv)
    parser.set_defaults(**{dest: v for dest, v in defaults.items() if dest not in given})


def _lists_given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset[str]:
    """The destinations of the repeatable options that `argv` gives (`--opt V`, `--opt=V`)."""
    given = set()
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of actions
        if not isinstance(action, argparse._AppendAction):  # noqa: SLF001 - a repeatable option
            continue
        names = action.option_strings
        if any(arg.split("=", 1)[0] in names for arg in argv):
            given.add(action.dest)
    return frozenset(given)


def write_config(
    path: str | os.PathLike[str], values: Mapping[str, Any], comments: Iterable[str] = ()
) -> None:
    """Write flat `values` (keys with dashes, as the options are spelled) as TOML."""
    lines = [f"# {line}" for line in comments]
    lines += [f"{key.replace('_', '-')} = {_toml_value(value)}" for key, value in values.items()]
    with open(path, "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The configurable options of `parser`, by the names a key may use."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of actions
        if not action.option_strings or action.dest in _NOT_CONFIGURABLE:
            continue
        longs = [s for s in action.option_strings if s.startswith("--")]
        for name in (action.dest, *(s[2:].replace("-", "_") for s in longs)):
            found[name] = action
    return found


def _checked(action: argparse.Action, value: Any, where: str) -> Any:
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: expected true or false, got {value!r}")
        return value if action.const is True else not value
    if isinstance(action, argparse._AppendAction) or action.nargs == "+":  # noqa: SLF001
        if isinstance(value, str):  # (a repeatable option, or one taking several values)
            return [value]  # one value of a repeatable option, e.g. api-key = "k"
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ConfigFileError(f"{where}: expected a list of strings, got {value!r}")
        return list(value)
    kind = action.type
    if kind is int and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ConfigFileError(f"{where}: expected an integer, got {value!r}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigFileError(f"{where}: expected a number, got {value!r}")
        value = float(value)
    if kind in (None, str) and not isinstance(value, str):
        raise ConfigFileError(f"{where}: expected a string, got {value!r}")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigFileError(f"{where}: {value!r} is not one of {choices}")
    return value


def _suggestion(dest: str, actions: Mapping[str, argparse.Action]) -> str:
    close = difflib.get_close_matches(dest, list(actions), n=1)
    if close:
        return f"; did you mean {close[0].replace('_', '-')!r}?"
    return "; the keys are the command's long options without their dashes"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} to a config file")
