"""The `rabbit-delay` command line (typer): a module per command, their shared options in
options.py, the app that registers them in app.py."""

from rabbit_delay._cli.app import app, main

__all__ = ["app", "main"]
