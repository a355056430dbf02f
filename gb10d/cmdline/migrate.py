"""From what a start script did to what the service will do: the second step of `gb10d import-script`.

The first step reads an input form (a shell script today: gb10d.vllm.importscript)
into gb10d.toml data. This step, the same for every form, looks at the
machine the way the script found it and says what the service will do
differently: it runs vLLM as the system user gb10d, not as the person who
ran the script; the model that person already downloaded is used where it
is (`HF_HUB_CACHE` pointing at their Hugging Face cache, `HF_HUB_OFFLINE=1`
so vLLM never downloads, updates or writes there, nothing copied); vLLM's
compile caches start cold once in /var/cache/gb10d, because vLLM, Triton
and Inductor write to them while they run and the service may not write in
a home directory (running the service as that person keeps them); and when
the service user cannot reach the venv or the model (a home of mode 0750),
which command lets it.

`for_the_service` decides from `Surroundings`; `survey` is the I/O that
fills them in.
"""

from __future__ import annotations

import os
import posixpath
import pwd
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from ..base.command import CONTAINER_CACHE, CONTAINER_CACHE_ENV
from ..base.hfcache import cached_snapshot, hub_cache, is_repo_id, weight_files
from ..base.instance import MAIN_UNIT, SYSTEM_USER
from ..machine.access import Principal, Want, WayOut, advice, principal, reach, walk, ways_out
from ..vllm.importscript import Imported, ScriptOwner

_HUB_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")
# What gb10d.service sets (units/gb10d.service): where the system user keeps models and compile caches.
SERVICE_HF_HOME = "/var/cache/gb10d/huggingface"
SERVICE_VLLM_CACHE = "/var/cache/gb10d/vllm"


@dataclass(frozen=True)
class Surroundings:
    """What import-script found about the person who ran the script, and what the service user can reach of it."""

    operator: str
    home: str
    hub: str
    model_cached: bool
    compile_cache: str
    compile_cache_exists: bool
    service_user: str = SYSTEM_USER
    blocked: list[str] = field(default_factory=list)
    ways: list[WayOut] = field(default_factory=list)


def for_the_service(vllm: Mapping[str, Any], found: Surroundings, container: Mapping[str, Any] | None = None) -> Imported:
    """The [vllm.env] entries (and [container] mounts, for an image) and the notes that carry the script's setup over to the service."""
    env: dict[str, str] = {}
    if "image" in vllm:
        notes = [f"the service starts the container as the system user {found.service_user}, on the engine's socket, not as {found.operator} who ran this script"]
    else:
        run_as = f"; to run it as {found.operator}, with {found.operator}'s caches: sudo gb10d service-user {found.operator}" if found.operator != "root" else ""
        notes = [f"the service runs vLLM as the system user {found.service_user}, not as {found.operator} who ran this script{run_as}"]
    warnings: list[str] = []
    model = str(vllm.get("model", ""))
    script_env: Mapping[str, str] = vllm.get("env", {})
    set_by_script = [name for name in _HUB_VARIABLES if name in script_env]
    if set_by_script:
        notes.append(f"the script's {set_by_script[0]}={script_env[set_by_script[0]]} is kept: vLLM looks for the model in {found.hub}")
    elif is_repo_id(model) and found.model_cached and "image" in vllm:
        return _in_container(vllm, found, notes, (container or {}).get("mounts", []))
    elif is_repo_id(model) and found.model_cached:
        env["HF_HUB_CACHE"] = found.hub
        if "HF_HUB_OFFLINE" not in script_env:
            env["HF_HUB_OFFLINE"] = "1"
        notes.append(
            f"{model} is already in {found.operator}'s Hugging Face cache {found.hub}: vLLM reads it from there (HF_HUB_CACHE), "
            "offline (HF_HUB_OFFLINE=1: it never downloads, updates or writes there); nothing is copied"
        )
    elif is_repo_id(model):
        notes.append(
            f"{model} is not in {found.operator}'s Hugging Face cache {found.hub}: the service downloads it at its first start, "
            f"into {_download_home(vllm, (container or {}).get('mounts', []))}"
        )
    if found.compile_cache_exists and "image" not in vllm:
        notes.append(
            f"vLLM's compile caches start cold once, in {SERVICE_VLLM_CACHE}, and stay warm after that: {found.compile_cache} is not "
            f"shared, since vLLM, Triton and Inductor write to it while they run and the service may not write in {found.home} "
            f"(sudo gb10d service-user {found.operator} keeps using it)"
        )
    if found.blocked:
        warnings.append(f"as things are, the service user {found.service_user} cannot use this: " + "; ".join(found.blocked))
        warnings += [line.strip() for line in advice(found.ways)]
    return Imported({"vllm": {"env": env}} if env else {}, notes, warnings)


def _in_container(vllm: Mapping[str, Any], found: Surroundings, notes: list[str], mounts: list[str]) -> Imported:
    """A model in the author's cache, for an image: read through the script's mount of that cache, else through a read-only one.

    The engine mounts as root, so nothing about the home's mode applies; the
    compile caches are the container's cache directory, not the author's.
    """
    model, script_env = str(vllm["model"]), vllm.get("env", {})
    through = [(m, inside) for m in mounts for host, inside, *_ in [m.split(":")] if _holds(host, found.hub)]
    data: dict[str, Any] = {}
    if through:
        mount, inside = through[-1]
        hub_inside = posixpath.join(inside, posixpath.relpath(found.hub, mount.split(":")[0]))
        how = f"through the script's mount -v {mount}"
    else:
        hub_inside = found.hub
        mount = f"{found.hub}:{found.hub}:ro"
        data["container"] = {"mounts": [mount]}
        how = f"through a read-only mount of it at the same path (container.mounts: {mount})"
    env = {"HF_HUB_CACHE": hub_inside}
    if "HF_HUB_OFFLINE" not in script_env:
        env["HF_HUB_OFFLINE"] = "1"
    data["vllm"] = {"env": env}
    notes.append(
        f"{model} is already in {found.operator}'s Hugging Face cache {found.hub}: vLLM in the container reads it as {hub_inside} "
        f"{how} (HF_HUB_CACHE), offline (HF_HUB_OFFLINE=1: it never downloads, updates or writes there); nothing is copied"
    )
    return Imported(data, notes, [])


def _download_home(vllm: Mapping[str, Any], mounts: list[str]) -> str:
    """Where the service's vLLM downloads a model: its own cache, or for an image what the mounts show at HF_HOME inside."""
    if "image" not in vllm:
        return SERVICE_HF_HOME
    inside = CONTAINER_CACHE_ENV["HF_HOME"]
    holding = [(host, at) for m in mounts for host, at, *_ in [m.split(":")] if _holds(at, inside)]
    if not holding:
        return f"{CONTAINER_CACHE_ENV['HF_HOME'].replace(CONTAINER_CACHE, '/var/cache/gb10d', 1)} (container.cache_dir)"
    host, at = max(holding, key=lambda mount: len(mount[1]))
    return posixpath.join(host, posixpath.relpath(inside, at)).rstrip("/.") or host


def _holds(directory: str, path: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def merge(imported: Imported, adapted: Imported) -> Imported:
    """The imported tables with the service's additions, and both sets of notes and warnings."""
    data = {table: dict(values) for table, values in imported.data.items()}
    for table, values in adapted.data.items():
        for key, value in values.items():
            if isinstance(value, dict):
                data.setdefault(table, {}).setdefault(key, {}).update(value)
            elif isinstance(value, list):
                data.setdefault(table, {})[key] = [*data.get(table, {}).get(key, []), *value]
            else:
                data.setdefault(table, {})[key] = value
    return replace(imported, data=data, notes=imported.notes + adapted.notes, warnings=imported.warnings + adapted.warnings)


# --- the shell ---------------------------------------------------------------------


def _home_of(user: str) -> str | None:
    try:
        return pwd.getpwnam(user).pw_dir
    except KeyError:
        return None


def _author(environ: Mapping[str, str]) -> tuple[ScriptOwner, dict[str, str]]:
    """Who wrote the script (the user behind sudo, else this one), and the environment that is theirs."""
    sudo_user = environ.get("SUDO_USER") if os.geteuid() == 0 else None
    entry = pwd.getpwnam(sudo_user) if sudo_user else pwd.getpwuid(os.getuid())
    # Under sudo this process's environment is root's; the script's author has only their home.
    own_env = {} if sudo_user else dict(environ)
    return ScriptOwner(entry.pw_name, own_env.get("HOME") or entry.pw_dir, _home_of), own_env


def script_owner(environ: Mapping[str, str] | None = None) -> ScriptOwner:
    """Whose script import-script reads: their `~` and `$HOME` are the script's."""
    return _author(os.environ if environ is None else environ)[0]


def survey(vllm: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Surroundings:
    """Look at this machine as the script's author left it: their caches, and what the service user can reach."""
    owner, own_env = _author(os.environ if environ is None else environ)
    home = owner.home
    env = {**own_env, **vllm.get("env", {})}
    hub = hub_cache(env, home)
    model = str(vllm.get("model", ""))
    snapshot = cached_snapshot(hub, model) if is_repo_id(model) else None
    compile_cache = env.get("VLLM_CACHE_ROOT") or posixpath.join(env.get("XDG_CACHE_HOME") or posixpath.join(home, ".cache"), "vllm")
    # Before the package is installed there is no gb10d user yet: a stranger has the same rights.
    service = principal(SYSTEM_USER) or Principal(SYSTEM_USER, -1, frozenset())
    program = Path(vllm["venv"]) / "bin" / "vllm" if "venv" in vllm else Path(vllm["executable"]) if "executable" in vllm else None
    needed = [(program, Want.EXEC)] if program is not None else []
    # For an image the engine mounts as root: the home's mode is no obstacle to the container.
    if snapshot is not None and "image" not in vllm:
        needed += [(file, Want.READ) for file in [snapshot / "config.json", *weight_files(snapshot)[:1]]]
    elif model.startswith("/") and "image" not in vllm:
        needed.append((Path(model), Want.READ))
    blocked: list[str] = []
    ways: list[WayOut] = []
    for path, want in needed:
        walked = walk(str(path))
        denial = reach(walked.chain, service, want) if walked.missing is None and walked.hidden is None else None
        if denial is None:
            continue
        cause = denial.cause()
        if cause not in blocked:
            blocked.append(cause)
        ways += [way for way in ways_out(denial, MAIN_UNIT) if way not in ways]
    return Surroundings(owner.name, home, hub, snapshot is not None, compile_cache, os.path.isdir(compile_cache),
                        service.name, blocked, ways)
