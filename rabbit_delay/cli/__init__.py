"""The `rabbit-delay` command line (typer)."""

from rabbit_delay.cli._app import app, main

__all__ = ["app", "main"]
