"""The `gb10d` command: argument parsing and dispatch only.

Each subcommand is a small function taking the parsed arguments and returning
an exit status; the work itself lives in the modules named after it. Any
`Gb10dError` reaching `main` is printed as `gb10d: ...` lines and turned into
its exit status, so no user input ever produces a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import __version__
from ..base.command import REDACTED, build_argv, container_argv, env_additions, is_secret_name, redact_setting, shell_line
from ..base.config import ClusterSection, MemorySection, VllmSection
from ..base.configfile import CONFIG_ENV, DEFAULT_CONFIG_PATH, default_config_path, dropin_dir_for
from ..base.configload import LoadedConfig, LoadedFront, front_only, load_config_explained
from ..base.errors import EXIT_INTERRUPTED, EXIT_NO_INPUT, EXIT_OK, EXIT_USAGE, ConfigError, ConfigProblem, Gb10dError, UsageError
from ..base.frontconfig import FrontSection, open_to_everyone
from ..base.instance import INSTANCE_DIR
from ..base.levels import PRIORITY_ERR, PRIORITY_WARNING
from ..core.cluster import cluster_env, ray_argv, vllm_flags
from ..machine.journal import Journal, connected_to_journal

Handler = Callable[[argparse.Namespace], int]


def _config_path(args: argparse.Namespace) -> Path:
    return Path(args.config) if getattr(args, "config", None) else default_config_path()


def _load(args: argparse.Namespace) -> LoadedConfig:
    """The instance's config; the front's own config is refused in one line that says what runs it."""
    path = _config_path(args)
    try:
        return load_config_explained(path)
    except ConfigError:
        # Asked only when the load fails: a config that loads is read once, and the daemon serves with that load.
        if front_only(path):
            raise UsageError(
                f"{path} is the front's config ([front] and no [vllm]): gb10d front runs it (gb10d-front.service); gb10d {args.command} "
                f"needs an instance's config with a [vllm] table, such as --config {INSTANCE_DIR}/NAME.toml"
            ) from None
        raise


def _toml_value(value: Any) -> str:
    """A value written the way it would be in gb10d.toml, for --explain."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == REDACTED:
        return REDACTED
    if value is None:
        return "(not set)"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Path):
        return json.dumps(str(value))
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    # A string, or a value TOML writes as one (the cluster's head_address is an IPv4Address).
    return json.dumps(value if isinstance(value, str) else str(value), ensure_ascii=False)


def _explain(loaded: LoadedConfig | LoadedFront, prefix: str | tuple[str, ...] = "") -> None:
    """Print each effective value with the file it came from; secrets stay hidden."""
    print("files: " + ", ".join(str(f) for f in loaded.files))
    rows = [r for r in loaded.explain() if r[0].startswith(prefix)]
    shown = [(f"{key} = {_toml_value(redact_setting(key, value))}", source) for key, value, source in rows]
    width = max(len(text) for text, _ in shown)
    for text, source in shown:
        print(f"{text.ljust(width)}  # {source}")


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate the config and check every path it names as the service user will meet it; print OK and a summary."""
    from ..machine.pathcheck import PathsUnreachable, check_paths
    from ..machine.service import query, unit_for_config

    if front_only(_config_path(args)):
        return _check_front(_config_path(args), args.explain)
    loaded = _load(args)
    _refuse_what_others_hold(loaded, _config_path(args))
    unit = args.unit or unit_for_config(_config_path(args))
    context = query(unit, args.user)
    report = check_paths(loaded, context)
    for warning in report.warnings:
        _say(f"warning: {warning}")
    if loaded.config.front is not None:
        _warn_if_open(loaded, loaded.config.front)
    if report.problems:
        raise PathsUnreachable(report)
    v = loaded.config.vllm
    using = f"using {v.program}"
    if v.image is not None:
        from ..launch.engine import engine_problems

        engine, problems = engine_problems(loaded)
        if problems:
            raise ConfigError(problems)
        using = f"from the image {v.image} with {engine.kind}"
    dropins = len(loaded.files) - 1
    print("OK")
    print(
        f"{loaded.files[0]}{f' + {dropins} drop-in(s)' if dropins else ''}: serve {v.model} as {', '.join(v.served_names)} "
        f"on {v.host}:{v.port} with gpu_memory_utilization {v.gpu_memory_utilization:g} {using}"
    )
    print(f"paths checked as {context.describe()}")
    if args.explain:
        _explain(loaded)
    return EXIT_OK


def _check_front(path: Path, explain: bool) -> int:
    """check-config of the front's own config: [front], every instance config it stands before (each problem at its own
    file and line) and the API keys; OK and what the front would serve. The instances' paths are checked by their own
    check-config, as the user of their own unit."""
    from ..base.configload import load_front_explained
    from ..front.instances import api_keys, discover

    loaded = load_front_explained(path)
    front = loaded.front
    problems: list[ConfigProblem] = []
    known = []
    try:
        known = discover(front, path)
    except ConfigError as exc:
        problems += exc.problems
    keys = []
    try:
        keys = api_keys(front)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems)
    _warn_if_open(loaded, front)
    dropins = len(loaded.files) - 1
    guard = f"{len(keys)} API key{'s' if len(keys) != 1 else ''}" if keys else "no API key"
    print("OK")
    print(f"{loaded.files[0]}{f' + {dropins} drop-in(s)' if dropins else ''}: the front's config: listen on {front.listen} "
          f"({guard}) before {len(known)} instance{'s' if len(known) != 1 else ''} from {front.instances_dir}:")
    for k in known:
        i = k.instance
        parked = f", parked after {k.idle_timeout_s:g} s idle" if k.idle_timeout_s is not None else ""
        print(f"  {i.name}: {', '.join(i.models)} on {i.host}:{i.port}{parked} ({front.instances_dir / f'{i.name}.toml'})")
    print(f"each instance's paths are checked by its own check-config: gb10d check-config --config {front.instances_dir}/NAME.toml")
    if explain:
        _explain(loaded)
    return EXIT_OK


def _warn_if_open(loaded: LoadedConfig | LoadedFront, front: FrontSection) -> None:
    """A warning line, located at front.listen, when anyone who reaches the front's port may use every model, and
    when gb10d-front.socket listens on another port than front.listen says."""
    from ..base.frontconfig import socket_differs
    from ..machine.service import socket_listens

    for warning in (open_to_everyone(front), socket_differs(front, socket_listens())):
        if warning is not None:
            _say(f"warning: {loaded.problem('front.listen', warning)}")


def _refuse_what_others_hold(loaded: LoadedConfig, path: Path) -> None:
    """A port or file that another living instance holds, told as a config error naming both (the ledger knows them)."""
    from ..base.instance import holds, instance_of
    from ..machine.ledger import held_elsewhere

    ledger = loaded.config.memory.ledger_path
    taken = held_elsewhere(ledger, str(path), holds(loaded.config, path)) if ledger is not None else []
    if taken:
        own = instance_of(path) is not None
        raise ConfigError([loaded.problem(clash.key, clash.describe(str(path), own)) for clash in taken])


def cmd_service_user(args: argparse.Namespace) -> int:
    """Run the unit as a login user (or, given gb10d, as the system user again): the drop-in, lingering, daemon-reload."""
    import pwd

    from ..base.instance import SYSTEM_USER
    from ..machine.access import group_name
    from ..machine.service import dropin_dir, install_user_dropin, systemd_running, unit_for_config, user_dropin

    unit = args.unit or unit_for_config(_config_path(args))
    try:
        entry = pwd.getpwnam(args.user)
    except KeyError:
        raise UsageError(f"no user {args.user} on this machine: check the name with getent passwd") from None
    if entry.pw_uid == 0:
        raise UsageError("gb10d does not run vLLM as root; name the user whose start script ran it, or gb10d for the system user")
    if args.print:
        if args.user != SYSTEM_USER:
            sys.stdout.write(user_dropin(entry.pw_name, group_name(entry.pw_gid), entry.pw_dir))
        return EXIT_OK
    if not systemd_running():
        raise Gb10dError(
            f"systemd is not running on this machine, so a drop-in for {unit} would never be read; nothing was written. "
            f"Run gb10d in the foreground as {args.user} instead (gb10d run), or see the drop-in with: gb10d service-user {args.user} --print"
        )
    if os.geteuid() != 0:
        raise Gb10dError(f"writing {dropin_dir(unit)} needs root: sudo gb10d service-user {args.user}")
    for line in install_user_dropin(unit, entry.pw_name).lines:
        print(line)
    manager = unit.removesuffix(".service")
    print(f"next: sudo gb10d check-config, then: sudo systemctl restart {manager}")
    return EXIT_OK


def cmd_print_command(args: argparse.Namespace) -> int:
    """Print the exact vLLM command line, secrets masked; the program's existence is not checked."""
    loaded = _load(args)
    vllm = loaded.config.vllm
    cluster = loaded.config.cluster
    # On a Ray head, vLLM needs the cluster's variables to find Ray and the link: always shown.
    needed = _print_ray_command(cluster, vllm) if cluster is not None else {}
    if cluster is not None and cluster.role == "worker":
        return EXIT_OK
    argv = build_argv(vllm, cluster_flags=vllm_flags(cluster) if cluster else (), stop_timeout_s=loaded.config.daemon.stop_timeout_s)
    if vllm.image is not None:
        _print_container_command(loaded, argv, args.env)
    elif args.env:
        print(shell_line(argv, {**env_additions(vllm), **needed}, path_prefix=vllm.venv / "bin" if vllm.venv else None))
    else:
        print(shell_line(argv, needed))
    if args.explain:
        _explain(loaded, prefix=("vllm.", "container."))
    return EXIT_OK


def _print_container_command(loaded: LoadedConfig, argv: list[str], with_env: bool) -> None:
    """Print the `docker run` / `podman run` line; which engine and the pull gb10d does first go to stderr."""
    from ..launch.engine import choose_engine

    config = loaded.config
    assert config.vllm.image is not None
    engine, problem = choose_engine(config.container)
    if problem is not None:
        print(f"gb10d: {problem}; showing the {engine.kind} command", file=sys.stderr)
    if config.container.pull != "never":
        when = "each time gb10d starts and at each reload that replaces the container" if config.container.pull == "always" else "when it is missing"
        print(f"gb10d: gb10d pulls the image {when} (container.pull = \"{config.container.pull}\"): "
              f"{shell_line([*engine.client, 'pull', config.vllm.image])}", file=sys.stderr)
    try:
        env = env_additions(config.vllm)
    except ConfigError as exc:
        # Only the names matter for this line; the file is often readable by root and gb10d alone.
        print(f"gb10d: {exc.problems[0]}; its variables are left out of this line", file=sys.stderr)
        env = env_additions(config.vllm.model_copy(update={"env_file": None}))
    # Secrets are passed by name (-e NAME); their values come from the environment of whoever runs the line.
    secrets = {k: v for k, v in env.items() if is_secret_name(k)} if with_env else {}
    print(shell_line(container_argv(config, loaded.files[0].absolute(), engine, argv, env), secrets))


def _print_ray_command(cluster: ClusterSection, vllm: VllmSection) -> dict[str, str]:
    """Print this machine's `ray start` with its interface variables (which interface and why to stderr); those variables."""
    from ..launch.netifs import find

    choice = find(cluster.role, cluster.head_address, cluster.interface)
    print(f"gb10d: cluster {cluster.role}: using {choice.interface.name} ({choice.address}) because {choice.reason}", file=sys.stderr)
    env = cluster_env(cluster, choice.interface.name, str(choice.address))
    print(shell_line(ray_argv(cluster, vllm, str(choice.address)), env))
    return env


def cmd_import_script(args: argparse.Namespace) -> int:
    """Translate a hand-written start script into gb10d.toml on stdout."""
    from ..vllm.importscript import import_script, read_script, render
    from .migrate import for_the_service, merge, script_owner, survey

    text, shown = read_script(args.script)
    imported = import_script(text, shown, script_owner())
    vllm = imported.data["vllm"]
    sys.stdout.write(render(merge(imported, for_the_service(vllm, survey(vllm), imported.data.get("container"))), shown))
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """Run the supervisor in the foreground (what the systemd unit starts), unless a program it needs is out of its reach."""
    from ..daemon.daemon import run_daemon
    from ..machine.pathcheck import PathsUnreachable, check_paths
    from ..machine.service import this_process, unit_for_config

    loaded = _load(args)
    report = check_paths(loaded, this_process(unit_for_config(_config_path(args))), caches=False)
    if report.problems:
        raise PathsUnreachable(report)
    return run_daemon(_config_path(args), loaded.config)


def cmd_cleanup(args: argparse.Namespace) -> int:
    """Remove the container a gb10d of this config left behind when it died (the unit's ExecStopPost=); nothing for a venv."""
    import asyncio

    from ..launch.container import ContainerLauncher
    from ..launch.engine import choose_engine
    from ..machine.procs import pid_alive
    from ..machine.statefile import read_state

    path = _config_path(args).absolute()
    if front_only(path):
        return EXIT_OK  # the front's config runs no vLLM, so no container
    try:
        config = load_config_explained(path).config
    except ConfigError:
        # Once is enough: check-config and gb10d run have said what is wrong, line by line.
        raise Gb10dError(f"{path} does not load, so no container of it is removed; gb10d check-config says what to fix") from None
    if config.vllm.image is None:
        return EXIT_OK
    try:
        state = read_state(config.daemon.state_file)
    except OSError as exc:
        raise Gb10dError(
            f"cannot read the state file {config.daemon.state_file} ({exc.strerror or exc}), so whether gb10d runs with {path} "
            "is unknown and no container of it is removed; run as root or as the gb10d user"
        ) from None
    if state is not None and state.pid is not None and state.state is not None and not state.state.final and pid_alive(state.pid):
        raise Gb10dError(f"gb10d (pid {state.pid}) is running with {path} and its container is in use; stop it first (systemctl stop gb10d)")
    engine, problem = choose_engine(config.container)
    if problem is not None:
        raise problem
    removed = asyncio.run(ContainerLauncher(config, path, engine).clear_leftovers())
    print(removed or f"no container of {path} is left")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    """Summarise the running daemon from its state file, or every instance from the memory ledger (exit 3 when not running).

    The front's own config runs no daemon, so `gb10d status` on it shows what --all shows (the instances behind the
    front, then its queues), after one line saying so: that is what the operator who asks for the status of the
    machine's main config wants to see, where "not running" would be false and a pointer to --all one more command.
    """
    from .status import front_state_file, programs_of, show_all, show_status, state_file_path, status_config

    named = bool(getattr(args, "config", None) or os.environ.get(CONFIG_ENV))
    if args.state_file and not args.all:
        config = None  # the state file is named: no config is read for it
    elif front_only(_config_path(args)):
        return _status_of_front(args, named)
    else:
        config = status_config(_config_path(args), named=named)
    state_file = state_file_path(args.state_file, config)
    if args.all:
        return show_all(config.memory if config is not None else MemorySection(), state_file, json_output=args.json,
                        out=sys.stdout, err=sys.stderr, front=front_state_file(_config_path(args)))
    return show_status(state_file, json_output=args.json, out=sys.stdout, err=sys.stderr, record=programs_of(config))


def _status_of_front(args: argparse.Namespace, named: bool) -> int:
    """`gb10d status [--all]` of the front's own config: every instance (the ledger, else the instances' own state
    files), then the front's queues or that it does not run."""
    from ..base.configload import load_front
    from ..front.instances import discover
    from .status import StateFiles, show_all

    path = _config_path(args)
    try:
        front = load_front(path)
    except ConfigError:
        if named:
            raise
        front = FrontSection()  # as for an instance's config: the front may run from an earlier, valid version
    try:
        known = discover(front, path)
    except ConfigError as exc:
        known = []
        more = f" and {len(exc.problems) - 1} more" if len(exc.problems) > 1 else ""
        _say(f"warning: the front's instances are not known ({exc.problems[0]}{more}), so only the memory ledger tells "
             f"which run; gb10d check-config{f' --config {args.config}' if getattr(args, 'config', None) else ''} says what to fix")
    if not args.all and not args.json:
        print(f"{path} is the front's config ([front] and no [vllm]): its instances and the front, as gb10d status --all shows them")
    memory = known[0].memory if known else MemorySection()
    states = StateFiles(files=tuple(dict.fromkeys(k.state_file for k in known)))
    return show_all(memory, states, json_output=args.json, out=sys.stdout, err=sys.stderr, front=front.state_file)


def cmd_forget(args: argparse.Namespace) -> int:
    """Remove the learned settings, so the next start begins from the config's values."""
    from ..daemon.learnedfile import forget, load

    path = Path(args.learned_file) if args.learned_file else _load(args).config.daemon.learned_file
    if args.candidate:
        return _forget_candidate(path)
    state = load(path)
    if not forget(path):
        print(f"nothing was learned: {path} does not exist")
        return EXIT_OK
    what = f"forgot the settings {state.entry.describe()}" if state.entry else "it held nothing gb10d could use"
    print(f"removed {path}: {what}. The next start of gb10d begins from the config's values (now: systemctl restart gb10d)")
    return EXIT_OK


def _forget_candidate(learned_file: Path) -> int:
    """Re-arm the rejected candidate program: the operator fixed it, so the config may run it again."""
    from ..core import programs
    from ..machine import programsfile

    path = programs.programs_file(learned_file)
    record = programsfile.load(path)
    if record.rejected is None:
        print(f"no candidate was rejected ({path} names none)")
        return EXIT_OK
    try:
        programsfile.save(path, programs.forget_candidate(record))
    except OSError as exc:
        raise Gb10dError(f"cannot change {path}: {exc.strerror or exc}; run as root or as the gb10d user") from None
    print(f"forgot the rejection of {record.rejected.program.describe()} ({record.rejected.failure}); "
          "the config may run it again: systemctl reload gb10d")
    return EXIT_OK


def cmd_front(args: argparse.Namespace) -> int:
    """Serve the one public endpoint before every instance (what gb10d-front.service starts)."""
    import asyncio

    from ..base.configload import load_front
    from ..front.door import serve
    from ..front.instances import api_keys, discover

    path = _config_path(args)
    settings = load_front(path)
    known = discover(settings, path)
    keys = api_keys(settings)
    return asyncio.run(serve(path, settings, known, keys))


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the real supervisor against gb10d.sim in a temporary directory."""
    from .demo import run_demo

    return run_demo(args.scenario, args.speed, args.verbose, keep=Path(args.keep) if args.keep else None)


def cmd_diagnose(args: argparse.Namespace) -> int:
    """Say what happened in a vLLM log or journal excerpt and what to change (exit 0 whatever the verdict)."""
    from ..core.diagnose import diagnose

    if args.stall_timeout <= 0:
        print(f"gb10d: --stall-timeout must be > 0 seconds (got {args.stall_timeout:g})", file=sys.stderr)
        return EXIT_USAGE
    try:
        raw = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    except OSError as exc:
        print(f"gb10d: cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NO_INPUT
    result = diagnose(raw.decode("utf-8", "replace"), args.stall_timeout)
    sys.stdout.write(json.dumps(result.to_json()) + "\n" if args.json else result.render())
    return EXIT_OK


_CONFIG_HELP = (
    f"config file (default: ${CONFIG_ENV} if set, else {DEFAULT_CONFIG_PATH}); "
    f"drop-ins are read from NAME.d/*.toml next to NAME.toml, e.g. {dropin_dir_for(DEFAULT_CONFIG_PATH)}/*.toml"
)


def build_parser() -> argparse.ArgumentParser:
    """The whole command-line interface, so --help lists everything."""
    parser = argparse.ArgumentParser(
        prog="gb10d",
        description="Supervise vLLM on NVIDIA GB10 machines: start it from /etc/gb10d.toml, "
        "tell systemd when it really serves, and recover from known failures.",
        epilog=f"The config file is {DEFAULT_CONFIG_PATH} (plus drop-ins in {dropin_dir_for(DEFAULT_CONFIG_PATH)}/*.toml) "
        f"unless --config or ${CONFIG_ENV} names another. Exit statuses: 0 ok, 78 config error, "
        "75 gave up after retries, 76 memory not returned after vLLM exited. See gb10d(8) and journalctl -u gb10d.",
    )
    parser.add_argument("--version", action="version", version=f"gb10d {__version__}")
    parser.add_argument("--config", metavar="PATH", help=_CONFIG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, handler: Handler, help_text: str, description: str = "", config: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=description or help_text[0].upper() + help_text[1:] + ".")
        if config:
            # SUPPRESS keeps `gb10d --config X check-config` working: the subcommand's default
            # would otherwise overwrite the value given before it.
            p.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help=_CONFIG_HELP)
        p.set_defaults(handler=handler)
        return p

    p = add(
        "check-config",
        cmd_check_config,
        "validate the config (exit 78 if invalid)",
        "Validate the config file and its drop-ins, then check every path it names as the user the unit runs as "
        "(asked of systemd; run as root to see everything): the vllm program and its interpreter, the Ray program, "
        "env_file, a local model directory, the Hugging Face cache and vLLM's compile caches. Print OK, a one-line summary "
        "and the user the paths were checked as (exit 0), with warnings (logind's RemoveIPC= for a login user) on stderr. "
        "Otherwise print each problem with its file, line and key, and exit 78. "
        "The systemd unit runs this as ExecStartPre. On the front's config ([front] and no [vllm]): [front], every instance "
        "config in front.instances_dir and the API keys, then OK, the front's address and each instance with its models and "
        "internal port; a warning when the front listens beyond loopback without API keys.",
    )
    p.add_argument("--explain", action="store_true", help="also list every effective value and the file it came from")
    p.add_argument("--user", metavar="NAME", help="check the paths as this user instead of the one the unit runs as "
                   "(e.g. before gb10d service-user NAME)")
    p.add_argument("--unit", metavar="UNIT", help="the unit whose user, environment and sandbox count (default: gb10d.service, "
                   "or gb10d@NAME.service for /etc/gb10d/NAME.toml)")
    p = add(
        "service-user",
        cmd_service_user,
        "run the service as a login user, or as gb10d again",
        "Run gb10d.service (and vLLM) as USER, the way a start script ran it: write the drop-in "
        "/etc/systemd/system/gb10d.service.d/50-service-user.conf (User=, Group=, the caches in USER's home, "
        "ProtectHome=read-only with only those cache directories writable), create those directories if missing, "
        "keep USER lingering (loginctl enable-linger) so logind's RemoveIPC= does not delete vLLM's semaphores "
        "at logout, and run systemctl daemon-reload. 'gb10d service-user gb10d' removes the drop-in. Needs root.",
    )
    p.add_argument("user", metavar="USER", help="the login user to run as, or gb10d for the system user")
    p.add_argument("--unit", metavar="UNIT", help="the unit to change (default: gb10d.service, or gb10d@NAME.service for /etc/gb10d/NAME.toml)")
    p.add_argument("--print", action="store_true", help="only print the drop-in; write and change nothing")
    p = add(
        "print-command",
        cmd_print_command,
        "print the vLLM command gb10d would run",
        "Print the exact vLLM command gb10d would run for the first attempt, as one shell-quoted line "
        "you can paste into a shell. Secrets (HF_TOKEN and any variable whose name contains TOKEN, KEY, "
        "SECRET or PASSWORD, --api-key and --hf-token values) are shown as ***. "
        "Unlike check-config, this does not check that the vllm program exists.",
    )
    p.add_argument(
        "--env",
        action="store_true",
        help="prefix the environment variables gb10d sets for vLLM (defaults, VIRTUAL_ENV and PATH for a venv, "
        "env_file, [vllm.env]); without it only the command is shown",
    )
    p.add_argument("--explain", action="store_true", help="also list the [vllm] values and the file each came from")
    p = add(
        "import-script",
        cmd_import_script,
        "turn a vllm serve start script into gb10d.toml",
        "Read an existing shell script that starts vllm serve and write the equivalent gb10d.toml to stdout. "
        "Variables, quoting, backslash continuations, 'source VENV/bin/activate', nohup, exec, redirections "
        "and '&' are understood, and so is 'docker run [options] IMAGE vllm serve MODEL flags' (or podman run), "
        "which becomes [vllm] image and [container]. A docker compose file is not supported as such: the answer is "
        "the config equivalent to its vLLM service. Anything else is kept as a '# warning:' comment, never dropped silently. "
        "Nothing is written to disk: redirect stdout to a new file, then run check-config on it.",
        config=False,
    )
    p.add_argument("script", metavar="FILE", type=Path, help="the shell script that runs vllm serve, or a compose file ('-' reads stdin)")
    add(
        "run",
        cmd_run,
        "run the supervisor in the foreground",
        "Start vLLM from the config and supervise it in the foreground, as the systemd unit's ExecStart does: "
        "READY=1 once vLLM serves, corrected restarts on known failures, vLLM's output on stdout for the journal. "
        "The front's config ([front] and no [vllm]) is refused with exit 78: gb10d front runs it.",
    )
    add(
        "cleanup",
        cmd_cleanup,
        "remove the container a gb10d that died left behind",
        "For vLLM in a container: remove the container of this config that a gb10d which did not stop it left "
        "behind (killed, crashed), through docker or podman, as every start does first. The unit runs it as "
        "ExecStopPost, so a container never outlives its gb10d. Refuses while a gb10d runs with this config; "
        "does nothing for vLLM from a venv. Exit 0 when nothing of the config's container is left.",
    )
    add(
        "front",
        cmd_front,
        "serve one OpenAI-compatible endpoint before every instance",
        "Listen on [front] listen (default 0.0.0.0:8000) and pass each request to the gb10d instance serving its "
        "\"model\": the main config when it runs a model, and every instance config in [front] instances_dir "
        "(default /etc/gb10d/*.toml), each on its own internal [vllm] port. A request for an instance that is starting "
        "or recovering is held until it serves (front.hold_timeout_s, front.queue_limit), then gets 503 with "
        "Retry-After. /v1/models lists every configured model with its state. gb10d-front.service runs this.",
    )
    p = add(
        "status",
        cmd_status,
        "show what the running daemon is doing",
        "Show the daemon's state, startup phase and progress, model and URL, attempt, effective "
        "gpu_memory_utilization, memory, uptime and last failure, from the state file it keeps "
        "([daemon] state_file, default /run/gb10d/state.json). Exit 0 when running, 3 when not "
        "(like systemctl status), 4 when the state file cannot be read, 78 when the config --config or "
        f"${CONFIG_ENV} names does not load. With --all: every gb10d instance of this "
        "machine from the memory ledger they share ([memory] ledger_dir, default /run/gb10d-ledger): state, phase, "
        "reservation, real use, whom a waiting one waits for, and the memory left; without a ledger, the running "
        "instances the state files beside the config's name; then, for a config with [front], the front's queue per model; "
        "exit 0 when any runs, 3 when none does, 4 when neither can be read. On the front's config ([front] and no [vllm]), "
        "with or without --all: the instances behind the front, then its queues.",
    )
    p.add_argument("--all", action="store_true", help="every gb10d instance of this machine, from the memory ledger")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.add_argument("--state-file", metavar="PATH", help="read this state file instead of the config's")
    p = add(
        "forget",
        cmd_forget,
        "clear the settings gb10d learned",
        "Remove the settings gb10d learned from corrected starts (gpu_memory_utilization, load strategy, "
        "max model length; [daemon] learned_file, default /var/lib/gb10d/state.toml) and say what they were. "
        "The next start begins from the config's values. Exit 0, also when nothing was learned; "
        "1 when the file cannot be removed (run as root or as the gb10d user).",
    )
    p.add_argument("--learned-file", metavar="PATH", help="remove this file instead of the config's learned_file")
    p.add_argument(
        "--candidate", action="store_true",
        help="instead: forget that a changed vLLM program (venv, executable, image) failed its start, so it may run again",
    )
    from .demo import SCENARIOS

    p = add(
        "demo",
        cmd_demo,
        "watch gb10d recover from a GB10 failure, with a simulated vLLM",
        "Run the real supervisor against gb10d.sim (a stand-in that prints and behaves like vLLM) in a "
        "temporary directory, printing the journal lines and the sd_notify messages systemd would get. "
        "Needs no GPU and no vLLM. Scenarios: "
        + "; ".join(f"{name}: {s.description}" for name, s in SCENARIOS.items()),
        config=False,
    )
    p.add_argument("scenario", nargs="?", default="free-memory", choices=sorted(SCENARIOS), help="what to show (default: free-memory)")
    p.add_argument("--speed", type=float, default=0.02, help="time factor of the simulated vLLM (1 = real GB10 minutes; default 0.02)")
    p.add_argument("--verbose", action="store_true", help="also show every line vLLM printed, as the journal gets them")
    p.add_argument("--keep", metavar="DIR", help="leave the simulated machine (the stand-in vLLM, its memory, the config, "
                   "what gb10d learned) in DIR, a new or empty directory, to run gb10d run --config DIR/gb10d.toml on")
    p = add(
        "diagnose",
        cmd_diagnose,
        "explain a vLLM log: what happened and what to change",
        "Read a vLLM log or journalctl -u gb10d output as pasted (journal, docker and docker compose prefixes, "
        "colours, progress bars, both vLLM log eras) and say what happened to the latest start: a verdict, the "
        "numbers found, and the gb10d.toml key to change. Exit 0 whatever the verdict; 66 if FILE cannot be read.",
        config=False,
    )
    from ..core.diagnose import VERDICT_HELP

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "verdicts:\n" + "\n".join(f"  {name:<23}{text}" for name, text in VERDICT_HELP.items())
    p.add_argument("file", metavar="FILE", nargs="?", default="-", help="the log to read ('-' or nothing reads stdin)")
    p.add_argument("--json", action="store_true", help='print one JSON object {"verdict", "facts", "advice"}')
    p.add_argument("--stall-timeout", metavar="S", type=float, default=300.0,
                   help="seconds without loading progress that count as a stall (default 300, as startup.stall_timeout_s)")
    return parser


def _say(line: str, priority: int = PRIORITY_WARNING) -> None:
    """One `gb10d: ` line on stderr; under systemd the journal files it at `priority`."""
    Journal(sys.stderr, socket_path=None, levels=connected_to_journal(sys.stderr)).say(line, priority)


def _report(exc: Gb10dError, args: argparse.Namespace) -> None:
    """Print an error as `gb10d: ` lines; config errors end with how to check again (access errors with the ways out first)."""
    lines = [str(p) for p in exc.problems] if isinstance(exc, ConfigError) else str(exc).splitlines() or [repr(exc)]
    if isinstance(exc, ConfigError) and args.command != "import-script":
        again = "gb10d check-config"
        if getattr(args, "config", None):
            again += f" --config {args.config}"
        advice = getattr(exc, "advice", [])
        lines += [*advice, f"then check again with: sudo {again}"] if advice else [f"fix the file, then check again with: {again}"]
    for line in lines:
        _say(line, PRIORITY_ERR)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        handler: Handler = args.handler
        return handler(args)
    except Gb10dError as exc:
        _report(exc, args)
        return exc.exit_status
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
