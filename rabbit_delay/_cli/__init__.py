"""The `rabbit-delay` command line (typer)."""

from rabbit_delay._cli.app import app, main

__all__ = ["app", "main"]
