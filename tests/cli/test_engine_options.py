"""The engine's options on a command line (tokenflow/cli/engine_options.py)."""

import argparse

from tokenflow.cli.engine_options import add_default_rate_argument
from tokenflow.core.consumption import DEFAULT_READER_RATE_TPS


def test_the_default_rate_flag_defaults_to_the_default_reading_rate():
    parser = argparse.ArgumentParser()
    add_default_rate_argument(parser)
    assert parser.parse_args([]).default_rate_tps == DEFAULT_READER_RATE_TPS == 4.0
    assert parser.parse_args(["--default-rate", "6"]).default_rate_tps == 6.0
