"""The `gb10d` command: argument parsing and dispatch only.

Each subcommand is a small function taking the parsed arguments and returning
an exit status; the work itself lives in the modules named after it. Any
`Gb10dError` reaching `main` is printed as `gb10d: ...` and turned into its
exit status, so no user input ever produces a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from . import __version__
from .command import build_argv, build_env, shell_line
from .config import CONFIG_ENV, DEFAULT_CONFIG_PATH, Config, default_config_path, load_config
from .errors import EXIT_OK, Gb10dError

Handler = Callable[[argparse.Namespace], int]


def _config_path(args: argparse.Namespace) -> Path:
    return Path(args.config) if args.config else default_config_path()


def _load(args: argparse.Namespace) -> Config:
    return load_config(_config_path(args))


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate the config; print OK and a summary."""
    config = _load(args)
    v = config.vllm
    print("OK")
    print(
        f"{_config_path(args)}: serve {v.model} as {', '.join(v.served_names)} on {v.host}:{v.port} "
        f"with gpu_memory_utilization {v.gpu_memory_utilization:g} using {v.program}"
    )
    return EXIT_OK


def cmd_print_command(args: argparse.Namespace) -> int:
    """Print the exact vLLM command line, secrets masked."""
    config = _load(args)
    env = build_env(config.vllm, base={}) if args.env else None
    print(shell_line(build_argv(config.vllm), env))
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """Run the supervisor in the foreground (what the systemd unit starts)."""
    from .supervisor import run_daemon

    return run_daemon(_config_path(args))


def build_parser() -> argparse.ArgumentParser:
    """The whole command-line interface, so --help lists everything."""
    parser = argparse.ArgumentParser(
        prog="gb10d",
        description="Supervise vLLM on NVIDIA GB10 machines: start it from /etc/gb10d.toml, "
        "tell systemd when it really serves, and recover from known failures.",
        epilog=f"The config file is {DEFAULT_CONFIG_PATH} unless --config or ${CONFIG_ENV} says otherwise. "
        "See gb10d(8) and journalctl -u gb10d.",
    )
    parser.add_argument("--version", action="version", version=f"gb10d {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", metavar="PATH", help=f"config file (default: ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH})")
        p.set_defaults(handler=handler)
        return p

    add("check-config", cmd_check_config, "validate the config and print a one-line summary (exit 78 if invalid)")
    p = add("print-command", cmd_print_command, "print the vLLM command gb10d would run, as one shell line")
    p.add_argument("--env", action="store_true", help="also show the environment variables gb10d sets for vLLM")
    add("run", cmd_run, "run the supervisor in the foreground (the systemd unit's ExecStart)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except Gb10dError as exc:
        print(f"gb10d: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
