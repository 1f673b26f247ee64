"""The ``flashtree`` command line (``flashtree.cli.main``)."""

from flashtree.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
