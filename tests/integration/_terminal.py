"""Run the CLI in a pseudo-terminal: what a person at a terminal sees (a prompt, a
progress bar, `status --watch`), which CliRunner cannot show (its stdin and stdout are
not terminals)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable

CLI = [sys.executable, "-c", "from rabbit_delay._cli.app import main; main()"]


class Terminal:
    """`rabbit-delay ARGS` with stdin, stdout and stderr on one pseudo-terminal."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        master, slave = pty.openpty()
        # A width for rich; the default of a fresh pty is 0 x 0.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        environ = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "200", **(env or {})}
        environ.pop("NO_COLOR", None)
        self.proc = subprocess.Popen(
            [*CLI, *args], stdin=slave, stdout=slave, stderr=slave, env=environ, close_fds=True
        )
        os.close(slave)
        self.master = master
        self._open = True
        self._raw = b""

    @property
    def output(self) -> str:
        return self._raw.decode("utf-8", errors="replace")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the process closed the terminal
            return False
        if not chunk:
            return False
        self._raw += chunk
        return True

    def read_until(self, done: Callable[[str], bool], timeout: float, what: str) -> str:
        """Read until `done(output so far)`; fail naming `what` at the deadline."""
        deadline = time.monotonic() + timeout
        while not done(self.output):
            if time.monotonic() > deadline or not self._read(0.1):
                if done(self.output):
                    break
                raise AssertionError(f"no {what} within {timeout}s; output:\n{self.output}")
        return self.output

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def wait(self, timeout: float = 30) -> int:
        """The exit code, once the process ended (reading what it still prints)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.1)
        while self._read(0.05):
            if not select.select([self.master], [], [], 0)[0]:
                break
        try:
            return self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            os.close(self.master)

    def kill(self) -> None:
        """Stop the process if it still runs (cleanup after a failed test)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()
