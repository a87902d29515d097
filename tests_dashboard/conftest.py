"""The tiny model of the main suite (tests/conftest.py), for the page's live server."""

from tests.conftest import tiny_model_dir  # noqa: F401 - a fixture, found by name
