"""What every pdxfer command shares: help that shows defaults, `--log-level`, and the exit codes
(docs/launch.md, "Exit codes")."""

from __future__ import annotations

import argparse
import logging
import socket

EXIT_OK = 0
EXIT_FAILURE = 1  # the command ran and failed (a child died, a check did not pass)
EXIT_USAGE = 2  # the command line is wrong (argparse uses 2 too)
EXIT_UNREACHABLE = 3  # a service the command needs (master, instance, peer) does not answer
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM, the shell's 128 + SIGINT

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions kept as written, "(default: X)" after every option that has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        # No "(default: None)" / "(default: [])": an option that is off by default says nothing.
        if action.default in (None, [], False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action) or ""


def add_log_level(p: argparse.ArgumentParser, default: str = "INFO") -> None:
    """``default=argparse.SUPPRESS`` on a subcommand keeps a value given before it."""
    p.add_argument("--log-level", default=default, type=str.upper, choices=LOG_LEVELS,
                   help="Python logging level of this command")


def apply_log_level(level: str) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)


def tcp_reachable(host_port: str, timeout: float = 3.0) -> bool:
    """Whether HOST:PORT accepts a TCP connection within ``timeout`` seconds."""
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False
