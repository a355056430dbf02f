"""What can be checked without starting vLLM: every path the config names, as the service user will meet it.

`gb10d check-config` (the unit's ExecStartPre, or the operator after an
edit) and `gb10d run` (before its first start) check the vLLM program (and
the interpreter its `#!` line names), the Ray program of a `[cluster]`,
`env_file`, a local model directory, and where vLLM keeps the model and
its compile cache: the Hugging Face cache (it must hold the model when
HF_HUB_OFFLINE is set, be readable when it holds it, and writable when vLLM
will download into it) and VLLM_CACHE_ROOT and TRITON_CACHE_DIR (written
while vLLM compiles). Each is checked for the user the unit runs as,
from stat data (gb10d.machine.access), so a venv in a 0750 home is reported as
exactly that, with the ways out, and not as a missing file. For an image
the paths are inside the container, and gb10d.machine.mountcheck looks them up
through its mounts instead.

The findings are ConfigProblems located at the key that names the path, so
the operator sees `FILE:LINE: KEY: ...` as for any other config error.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..base.command import env_additions, read_env_file
from ..base.configload import LoadedConfig
from ..base.errors import ConfigError, ConfigProblem
from ..base.hfcache import cached_snapshot, hub_cache, hub_cache_source, is_repo_id, offline, repo_folder, weight_files
from ..core.cluster import ray_program
from .access import Denial, Principal, Walked, Want, WayOut, advice, reach, walk, ways_out
from .memory import read_meminfo, share_warning_for
from .mountcheck import unseen_in_container
from .service import ServiceContext, ipc_warning, lingering, logind_texts, remove_ipc


@dataclass
class PathReport:
    """The problems found (each located at its key), the ways out of the access ones, and warnings."""

    problems: list[ConfigProblem] = field(default_factory=list)
    ways_out: list[WayOut] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def deny(self, problem: ConfigProblem, denial: Denial, unit: str) -> None:
        self.problems.append(problem)
        for way in ways_out(denial, unit):
            if way not in self.ways_out:
                self.ways_out.append(way)

    def advice(self) -> list[str]:
        """The lines that follow the problems: each way out with its exact command."""
        return advice(self.ways_out)


class PathsUnreachable(ConfigError):
    """Paths the config names cannot be used by the service user (or do not exist)."""

    def __init__(self, report: PathReport) -> None:
        super().__init__(report.problems)
        self.advice = report.advice()


class _Checker:
    """One check of a loaded config against one service context."""

    def __init__(self, loaded: LoadedConfig, context: ServiceContext) -> None:
        self.loaded = loaded
        self.context = context
        self.who: Principal = context.user
        self.report = PathReport()
        # Looking as the very user we check for: a place we cannot look into is one the service cannot enter.
        self.is_self = context.user.uid == os.geteuid()

    def problem(self, key: str, message: str) -> ConfigProblem:
        return self.loaded.problem(key, message)

    def denial(self, walked: Walked, want: Want) -> Denial | None:
        """The denial on the way to a walked path; for a walk this process could not finish, only if it is the service user."""
        if walked.hidden is not None:
            return reach(walked.chain, self.who, Want.EXEC) if self.is_self else None
        return reach(walked.chain, self.who, want)

    def check(self, key: str, path: Path, want: Want, what: str, missing_hint: str, lead: str | None = None) -> bool:
        """Check one path for `want`; record a problem and return False when the service cannot use it."""
        text = str(path)
        if not self.context.sandbox.allows_read(text):
            self.report.problems.append(self.problem(key, f"{text} is hidden from the service by {self.context.sandbox.why_read_only(text)}; "
                                                     "put it outside /home, or override that setting in a drop-in (sudo systemctl edit gb10d)"))
            return False
        walked = walk(text)
        if walked.missing is not None and walked.hidden is None:
            self.report.problems.append(self.problem(key, f"{text} does not exist; {missing_hint}"))
            return False
        target = walked.chain[-1] if walked.hidden is None else None
        if target is not None and want & Want.EXEC and not target.is_dir and not target.mode & 0o111:
            self.report.problems.append(self.problem(key, f"{text} is not executable; chmod +x it or fix the path"))
            return False
        if target is not None and want & Want.EXEC and target.is_dir:
            self.report.problems.append(self.problem(key, f"{text} is a directory, not a program; {missing_hint}"))
            return False
        denial = self.denial(walked, want)
        if denial is not None:
            at = lead if lead is not None else "" if denial.node.path == text else f"{what} {text} exists, but "
            self.report.deny(self.problem(key, f"{at}{denial.cause()}"), denial, self.context.unit)
            return False
        if walked.hidden is not None:
            self.report.warnings.append(
                f"{key}: could not check {text} as {self.who.name}: this process may not look into {walked.hidden}; "
                "run the check as root: sudo gb10d check-config"
            )
        return True

    def program(self, key: str, program: Path, name: str) -> None:
        """A program the service runs: reachable and executable by the service user, and so is its `#!` interpreter."""
        hint = f"is {name} installed in that venv?" if key == "vllm.venv" else f"is that the path of the {program.name} program?"
        if not self.check(key, program, Want.EXEC, "the program", hint):
            return
        try:
            with open(program, "rb") as file:
                head = file.read(256)
        except OSError:
            return  # not readable here: the check above has said what it could
        if not head.startswith(b"#!"):
            return
        # The interpreter reads the script, so it needs r as well; and the interpreter itself must run.
        if not self.check(key, program, Want.EXEC | Want.READ, "the program", hint):
            return
        words = head[2:].split(b"\n", 1)[0].split()
        if words and words[0].startswith(b"/"):
            interpreter = Path(words[0].decode(errors="replace"))
            self.check(key, interpreter, Want.EXEC, f"{program}'s interpreter", f"{program} starts with #!{interpreter}; recreate the venv")

    def env_file(self) -> None:
        path = self.loaded.config.vllm.env_file
        if path is None or not self.check("vllm.env_file", path, Want.READ, "the file", "create it, or remove vllm.env_file"):
            return
        try:
            read_env_file(path)
        except ConfigError as exc:
            # A bad line is blamed on that line of the env file; an unreadable file on the key naming it.
            self.report.problems += [p if p.line is not None else self.problem("vllm.env_file", f"{p.path}: {p.message}") for p in exc.problems]

    def local_model(self, model: str) -> None:
        """A local model directory: listable, and its config and weights readable."""
        directory = Path(model)
        hint = "vLLM would take it for a Hugging Face repository id and fail; fix vllm.model"
        if not self.check("vllm.model", directory, Want.READ, "the model directory", hint):
            return
        for file in [directory / "config.json", *weight_files(directory)[:1]]:
            if file.exists() and not self.check("vllm.model", file, Want.READ, "the model file", hint):
                return

    def container(self) -> None:
        """What vLLM in the container will not find through its mounts: a problem when the start cannot succeed, else a warning."""
        try:
            env = env_additions(self.loaded.config.vllm)
        except ConfigError:
            return  # env_file unreadable: already reported by env_file()
        for unseen in unseen_in_container(self.loaded.config, env):
            if unseen.fatal:
                self.report.problems.append(self.problem(unseen.key, unseen.message))
            else:
                self.report.warnings.append(f"{unseen.key}: {unseen.message}")

    def share(self) -> None:
        """A warning when the share cannot hold the weights on disk plus one max_model_len sequence's KV cache."""
        config = self.loaded.config
        try:
            mem = read_meminfo(config.memory.meminfo_path)
            env = {"HOME": self.context.home, **self.context.environment, **env_additions(config.vllm)}
        except (OSError, ValueError, ConfigError):
            return  # no meminfo to compare with, or an env_file already reported
        if config.vllm.image is not None:
            env = env_additions(config.vllm)
        warning = share_warning_for(config, env, config.vllm.gpu_memory_utilization, mem.total)
        if warning is not None:
            self.report.warnings.append(f"vllm.gpu_memory_utilization: {warning}")

    def caches(self) -> None:
        """Where vLLM keeps the model and its compile caches in the service's environment."""
        vllm = self.loaded.config.vllm
        env = dict(self.context.environment)
        env.setdefault("HOME", self.context.home)
        try:
            env.update(env_additions(vllm))
        except ConfigError:
            return  # env_file unreadable: already reported by env_file()
        home = env["HOME"]
        if is_repo_id(vllm.model) and vllm.arg("download-dir") is None:
            self.hub(vllm.model, env, home)
        vllm_cache = env.get("VLLM_CACHE_ROOT") or posixpath.join(env.get("XDG_CACHE_HOME") or posixpath.join(home, ".cache"), "vllm")
        self.writable(self.cache_key("VLLM_CACHE_ROOT"), vllm_cache, f"vLLM writes its compile cache in {vllm_cache}")
        triton = env.get("TRITON_CACHE_DIR") or posixpath.join(home, ".triton", "cache")
        self.writable(self.cache_key("TRITON_CACHE_DIR"), triton, f"Triton writes its kernel cache in {triton}")

    def cache_key(self, name: str) -> str:
        """The key that sets a cache variable: vllm.env.NAME when the config sets it, else the model (the unit's default)."""
        return f"vllm.env.{name}" if name in self.loaded.config.vllm.env else "vllm.model"

    def origin(self, env: Mapping[str, str]) -> str:
        name = hub_cache_source(env)
        if not name:
            return f"{self.who.name}'s home"
        return f"{name} from [vllm.env]" if name in self.loaded.config.vllm.env else f"{name} from {self.context.unit}"

    def hub(self, model: str, env: Mapping[str, str], home: str) -> None:
        """The Hugging Face cache: holds the model (readable), or may receive it (writable), or offline mode fails."""
        hub = hub_cache(env, home)
        key = self.cache_key(hub_cache_source(env)) if hub_cache_source(env) in self.loaded.config.vllm.env else "vllm.model"
        snapshot = cached_snapshot(hub, model)
        where = f"the Hugging Face cache {hub} ({self.origin(env)})"
        if snapshot is not None:
            for file in [snapshot / "config.json", *weight_files(snapshot)[:1]]:
                if not self.check(key, file, Want.READ, "", "the cache is damaged; download the model again", lead=f"{model} is in {where}, but "):
                    return
            return
        repo = Path(hub) / repo_folder(model)
        if walk(str(repo)).hidden is not None:
            # Whether the model is there cannot be seen from here: say what is in the way, not that it is missing.
            self.check(key, repo / "refs" / "main", Want.READ, "", "", lead=f"{model} may be in {where}, but ")
            return
        if offline(env):
            self.report.problems.append(self.problem(key, (
                f"{model} is not in {where}, and HF_HUB_OFFLINE=1 keeps vLLM from downloading it; "
                "download it there first, or point HF_HUB_CACHE at the cache that has it")))
            return
        self.writable(key, hub, f"vLLM will download {model} into {where}")

    def writable(self, key: str, directory: str, what: str) -> None:
        """A directory the service writes in: created by systemd for the unit, or writable in the sandbox and by the user."""
        sandbox = self.context.sandbox
        if any(directory == d or directory.startswith(d.rstrip("/") + "/") for d in sandbox.owned):
            return
        if not sandbox.allows_write(directory):
            self.report.problems.append(self.problem(key, (
                f"{what}, but {sandbox.why_read_only(directory)} makes it read-only for the service; "
                "let it write there with ReadWritePaths= in a drop-in (sudo systemctl edit gb10d), or use another directory")))
            return
        existing = directory
        while not os.path.lexists(existing) and existing != "/":
            existing = os.path.dirname(existing)
        walked = walk(existing)
        denial = self.denial(walked, Want.WRITE if existing == directory or walked.hidden else Want.WRITE | Want.EXEC)
        if denial is not None:
            self.report.deny(self.problem(key, f"{what}, but {denial.cause()}"), denial, self.context.unit)

    def remove_ipc(self) -> None:
        warning = ipc_warning(self.who, remove_ipc(logind_texts()), lingering(self.who.name), self.context.unit)
        if warning is not None:
            self.report.warnings.append(warning)


def check_paths(loaded: LoadedConfig, context: ServiceContext, caches: bool = True) -> PathReport:
    """Check every path of the config as `context`'s user meets it.

    `caches`: also the model and compile caches and logind's RemoveIPC=,
    which check-config reports; `gb10d run` checks only what would stop
    vLLM from starting at all.
    """
    checker = _Checker(loaded, context)
    vllm = loaded.config.vllm
    key = "vllm.executable" if vllm.executable is not None else "vllm.venv"
    if vllm.image is None:  # an image's vllm is the container engine's to find (container.engine_problems)
        checker.program(key, vllm.program, "vLLM")
    cluster = loaded.config.cluster
    if cluster is not None:
        checker.program("cluster.ray" if cluster.ray else key, ray_program(cluster, vllm), "Ray")
    checker.env_file()
    if vllm.image is not None:
        if caches:
            checker.container()
    elif not is_repo_id(vllm.model) and (caches or os.path.lexists(vllm.model)):
        checker.local_model(vllm.model)
    if caches and vllm.image is None:  # in a container, vLLM's caches are container.cache_dir, mounted for it
        checker.caches()
        checker.remove_ipc()
    if caches:
        checker.share()
    return checker.report
