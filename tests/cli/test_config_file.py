"""`serve --config FILE`: the file's options become serve's, flags win, bad keys are refused."""

import pytest

from tokenflow.cli.config_file import (
    ConfigFileError,
    apply_config_file,
    config_defaults,
    write_config,
)
from tokenflow.cli.engine_options import engine_args_from
from tokenflow.cli.main import _build_parsers, main
from tokenflow.cli.server_options import server_config_from


def parse_serve(argv: list[str]):
    parser, commands = _build_parsers()
    apply_config_file(commands["serve"], argv)
    return parser.parse_args(["serve", *argv])


def test_the_files_options_reach_the_engine(tmp_path):
    path = tmp_path / "tuned.toml"
    write_config(
        path,
        {"device-kv-tokens": 1664, "mu": 1.5, "schedule-interval": 0.25, "no-write-through": True},
        comments=["from a test"],
    )
    args = engine_args_from(parse_serve(["--config", str(path)]))
    assert args.device_kv_tokens == 1664
    assert args.tokenflow.buffer_conservativeness == 1.5
    assert args.tokenflow.schedule_interval_s == 0.25
    assert args.tokenflow.write_through is False


def test_flags_on_the_command_line_win(tmp_path):
    path = tmp_path / "tuned.toml"
    write_config(path, {"mu": 1.5, "max_stall_s": 2.0})
    args = engine_args_from(parse_serve(["--mu", "3", f"--config={path}"]))
    assert args.tokenflow.buffer_conservativeness == 3.0
    assert args.tokenflow.max_stall_s == 2.0


@pytest.mark.parametrize(
    "text, words",
    [
        ("capacity_headrom = 0.9\n", "'capacity_headrom'; did you mean 'capacity-headroom'?"),
        ("frobnicate = 1\n", "unknown key 'frobnicate'; the keys are the command's long options"),
        ("device-kv-tokens = 1.5\n", "device-kv-tokens: expected an integer"),
        ('mu = "high"\n', "mu: expected a number"),
        ('policy = "lifo"\n', "policy: 'lifo' is not one of"),
        ("[tokenflow]\nmu = 2.0\n", "tokenflow: a table"),
        ("mu = \n", "not valid TOML"),
    ],
)
def test_a_bad_file_is_one_clear_line(tmp_path, capsys, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenflow serve: error: ") and words in err
    assert err.count("\n") == 1


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigFileError, match="cannot read config"):
        parse_serve(["--config", str(tmp_path / "none.toml")])


def test_the_keys_are_checked_against_the_commands_own_options():
    _, commands = _build_parsers()
    assert config_defaults(commands["simulate"], {"critical-slack": 0.5}, "f") == {
        "critical_slack": 0.5
    }
    with pytest.raises(ConfigFileError, match="unknown key 'api-key'"):
        config_defaults(commands["simulate"], {"api-key": "x"}, "f")


@pytest.mark.parametrize("flags", [["--api-key", "cli"], ["--api-key=cli"]])
def test_a_list_flag_on_the_command_line_replaces_the_files_list(tmp_path, flags):

    path = tmp_path / "serve.toml"
    path.write_text('api-key = ["file-1", "file-2"]\napi-key-class = ["file-1=reader:6"]\n')
    args = parse_serve(["--config", str(path), *flags])
    assert args.api_keys == ["cli"]  # not the file's keys and the flag's
    assert args.api_key_classes == ["file-1=reader:6"]  # a list not given stays the file's
    assert server_config_from(args).allowed_keys == ("cli", "file-1")
    both = parse_serve(["--config", str(path), *flags, "--api-key-class", "cli=eager"])
    assert both.api_key_classes == ["cli=eager"]
    assert parse_serve(["--config", str(path)]).api_keys == ["file-1", "file-2"]
