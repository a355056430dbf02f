"""Config changes: which keys changed and whether vLLM must restart; edits noticed once per burst.

The diff tests are tables of configs. The watcher tests run watchdog's real
inotify observer on files in tmp_path and wait for the notification with a
deadline; the only bounded wait for absence is the quiet period after it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from config_support import make_config
from gb10d.base.config import Config
from gb10d.base.configload import load_config, parse_config
from gb10d.core import programs
from gb10d.core.reload import ConfigDiff, ConfigSnapshot, OnlyReported, ReloadRefused, diff_configs, judge_reload, tells_systemd
from gb10d.daemon.watcher import ConfigWatcher, WatchUnavailable

DEADLINE_S = 30.0
DEBOUNCE_S = 1.0
QUIET_S = 3 * DEBOUNCE_S


config = partial(make_config, {"vllm": {"model": "org/model", "executable": "/srv/vllm/bin/vllm"}})


def diff(old: Config, new: Config, old_env_file: dict[str, str] | None = None, new_env_file: dict[str, str] | None = None) -> ConfigDiff:
    return diff_configs(ConfigSnapshot(old, old_env_file or {}), ConfigSnapshot(new, new_env_file or {}))


# --- judge_reload and tells_systemd -------------------------------------------


def judge(old: Config, new: Config, requested: bool = True, record: programs.Programs = programs.NONE) -> ConfigDiff | ReloadRefused | OnlyReported:
    return judge_reload("/etc/gb10d.toml", ConfigSnapshot(old, {}), ConfigSnapshot(new, {}), record, requested)


def test_a_requested_reload_applies_the_changes() -> None:
    verdict = judge(config(), config(restart={"max_attempts": 7}))
    assert isinstance(verdict, ConfigDiff)
    assert [change.key for change in verdict.changes] == ["restart.max_attempts"]


def test_a_cluster_change_is_refused_until_a_restart() -> None:
    verdict = judge(config(), config(cluster={"role": "worker", "head_address": "10.0.0.1"}))
    assert verdict == ReloadRefused((
        "config not applied: [cluster] changed, and this machine's part in a Ray cluster changes only at a start; "
        "keeping the running configuration; apply it with: systemctl restart gb10d",
    ))


def test_a_reload_to_the_rejected_candidate_is_refused_until_it_is_forgotten() -> None:
    rejected = programs.Programs(rejected=programs.Rejected(programs.Program("/opt/vllm-new", "venv", "0.34.0"), "crash: exit status 1", "2026-12-05 10:00"))
    old = config()
    new = parse_config({"vllm": {"model": "org/model", "venv": "/opt/vllm-new"}})
    verdict = judge(old, new, record=rejected)
    assert isinstance(verdict, ReloadRefused)
    assert verdict.lines[0].startswith("config not applied: it runs the candidate /opt/vllm-new (vLLM 0.34.0), which failed its start 2026-12-05 10:00 (crash: exit status 1); keeping /srv/vllm/bin/vllm")
    assert isinstance(judge(old, new), ConfigDiff)


def test_an_edit_on_disk_without_apply_on_change_is_only_reported_with_its_changes() -> None:
    assert judge(config(), config(restart={"max_attempts": 7}), requested=False) == OnlyReported(
        "/etc/gb10d.toml changed on disk, not applied (1 key changed: restart.max_attempts 5 -> 7); apply it with: systemctl reload gb10d"
    )
    assert judge(config(), config(), requested=False) == OnlyReported("/etc/gb10d.toml changed on disk; it is valid and nothing gb10d uses differs")


def test_an_edit_on_disk_with_apply_on_change_is_applied() -> None:
    verdict = judge(config(daemon={"apply_on_change": True}), config(daemon={"apply_on_change": True}, restart={"max_attempts": 7}), requested=False)
    assert isinstance(verdict, ConfigDiff) and verdict


@pytest.mark.parametrize(
    ("serving", "requested", "apply_on_change", "told"),
    [
        (True, True, False, True),
        (True, False, True, True),
        (True, False, False, False),  # an edit only reported reloads nothing
        (False, True, True, False),  # during a start, the next READY=1 is the start's own
    ],
)
def test_systemd_hears_of_a_reload_only_while_serving_and_when_it_is_applied(serving: bool, requested: bool, apply_on_change: bool, told: bool) -> None:
    assert tells_systemd(serving, requested, apply_on_change) is told


# --- diff_configs -------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "restart_keys"),
    [
        pytest.param({"vllm": {"served_model_name": "a"}}, {"vllm": {"served_model_name": "b"}}, ("vllm.served_model_name",), id="served_name"),
        pytest.param({}, {"vllm": {"port": 8001}}, ("vllm.port",), id="port"),
        pytest.param({}, {"vllm": {"gpu_memory_utilization": 0.8}}, ("vllm.gpu_memory_utilization",), id="utilization"),
        pytest.param({}, {"vllm": {"args": {"enforce-eager": True}}}, ("vllm.args.enforce-eager",), id="flag_added"),
        pytest.param({"vllm": {"args": {"max_model_len": 8192}}}, {"vllm": {"args": {"max_model_len": 4096}}}, ("vllm.args.max-model-len",), id="arg_value"),
        pytest.param({"vllm": {"args": {"max-num-seqs": 1}}}, {"vllm": {"args": {"max-num-seqs": 1.0}}}, ("vllm.args.max-num-seqs",), id="int_to_float_changes_argv"),
        pytest.param({}, {"vllm": {"env": {"VLLM_LOGGING_LEVEL": "DEBUG"}}}, ("vllm.env.VLLM_LOGGING_LEVEL",), id="env_added"),
        pytest.param({}, {"vllm": {"extra_args": ["--enforce-eager"]}}, ("vllm.extra_args",), id="extra_args"),
    ],
)
def test_a_change_vllm_sees_needs_a_restart(old: dict[str, Any], new: dict[str, Any], restart_keys: tuple[str, ...]) -> None:
    result = diff(config(**old), config(**new))
    assert result.needs_vllm_restart
    assert result.restart_keys == restart_keys
    assert result.live_keys == ()


@pytest.mark.parametrize(
    ("new", "live_keys"),
    [
        pytest.param({"restart": {"max_attempts": 3}}, ("restart.max_attempts",), id="restart_policy"),
        pytest.param({"daemon": {"log_level": "debug", "apply_on_change": True}}, ("daemon.apply_on_change", "daemon.log_level"), id="daemon"),
        pytest.param({"startup": {"stall_timeout_s": 60.0}, "metrics": {"listen": ""}}, ("startup.stall_timeout_s", "metrics.listen"), id="timeouts_and_metrics"),
        pytest.param({"liveness": {"enabled": False}, "memory": {"headroom_gib": 2.0}}, ("memory.headroom_gib", "liveness.enabled"), id="liveness_and_memory"),
    ],
)
def test_a_change_of_gb10d_settings_only_is_applied_without_restarting_vllm(new: dict[str, Any], live_keys: tuple[str, ...]) -> None:
    result = diff(config(), config(**new))
    assert not result.needs_vllm_restart
    assert result.live_keys == live_keys
    assert result.restart_keys == ()


def test_equal_configs_give_an_empty_diff() -> None:
    result = diff(config(restart={"max_attempts": 2}), config(restart={"max_attempts": 2}), {"A": "1"}, {"A": "1"})
    assert not result
    assert result.changes == ()
    assert not result.needs_vllm_restart
    assert result.describe() == "no keys changed"


def test_respelling_an_arg_is_no_change() -> None:
    assert not diff(config(vllm={"args": {"max_model_len": 8192}}), config(vllm={"args": {"max-model-len": 8192}}))


def test_a_vllm_key_written_differently_with_the_same_command_line_needs_no_restart() -> None:
    result = diff(config(vllm={"served_model_name": "a"}), config(vllm={"served_model_name": ["a"]}))
    assert not result.needs_vllm_restart
    assert result.no_effect_keys == ("vllm.served_model_name",)


def test_an_env_file_contents_change_needs_a_restart() -> None:
    result = diff(config(), config(), {"HF_HOME": "/srv/hf"}, {"HF_HOME": "/srv/hf2"})
    assert result.needs_vllm_restart
    assert result.restart_keys == ("vllm.env_file.HF_HOME",)
    assert result.describe() == '1 key changed: vllm.env_file.HF_HOME "/srv/hf" -> "/srv/hf2"'


def test_an_env_file_value_overridden_by_vllm_env_needs_no_restart() -> None:
    both = config(vllm={"env": {"HF_HOME": "/srv/hf"}})
    result = diff(both, both, {"HF_HOME": "/a"}, {"HF_HOME": "/b"})
    assert not result.needs_vllm_restart
    assert result.no_effect_keys == ("vllm.env_file.HF_HOME",)


def test_snapshots_of_a_real_env_file_before_and_after_an_edit_differ(tmp_path: Path) -> None:
    env_file = tmp_path / "vllm.env"
    env_file.write_text("HF_HOME=/srv/hf\n")
    cfg = config(vllm={"env_file": str(env_file)})
    before = ConfigSnapshot.take(cfg)
    env_file.write_text("HF_HOME=/srv/hf\nVLLM_LOGGING_LEVEL=DEBUG\n")
    result = diff_configs(before, ConfigSnapshot.take(cfg))
    assert result.restart_keys == ("vllm.env_file.VLLM_LOGGING_LEVEL",)


def test_describe_names_each_key_old_and_new() -> None:
    old = config(vllm={"served_model_name": "a"}, restart={"max_attempts": 5})
    new = config(vllm={"served_model_name": "b", "args": {"enforce-eager": True}}, restart={"max_attempts": 3})
    assert diff(old, new).describe() == (
        '3 keys changed: vllm.served_model_name "a" -> "b", vllm.args.enforce-eager (not set) -> true, '
        "restart.max_attempts 5 -> 3"
    )


@pytest.mark.parametrize(
    ("old", "new", "old_env_file", "new_env_file", "shown"),
    [
        pytest.param({"vllm": {"env": {"HF_TOKEN": "hf_old1"}}}, {"vllm": {"env": {"HF_TOKEN": "hf_new2"}}}, {}, {},
                     "vllm.env.HF_TOKEN (secret) changed", id="env"),
        pytest.param({}, {}, {"OPENAI_API_KEY": "sk_old1"}, {"OPENAI_API_KEY": "sk_new2"},
                     "vllm.env_file.OPENAI_API_KEY (secret) changed", id="env_file"),
        pytest.param({}, {"vllm": {"args": {"api-key": "sk_new2"}}}, {}, {},
                     "vllm.args.api-key (secret) set", id="api_key_flag"),
        pytest.param({"vllm": {"extra_args": ["--api-key", "sk_old1"]}}, {"vllm": {"extra_args": ["--api-key=sk_new2"]}}, {}, {},
                     'vllm.extra_args ["--api-key", "***"] -> ["--api-key=***"]', id="extra_args"),
    ],
)
def test_secrets_are_masked_in_the_diff(
    old: dict[str, Any], new: dict[str, Any], old_env_file: dict[str, str], new_env_file: dict[str, str], shown: str
) -> None:
    result = diff(config(**old), config(**new), old_env_file, new_env_file)
    assert result.needs_vllm_restart
    assert result.describe() == f"1 key changed: {shown}"
    assert "old1" not in repr(result) and "new2" not in repr(result)


# --- ConfigWatcher ------------------------------------------------------------


class Notifications:
    """Counts on_change calls and lets a test wait for the next one, or for none."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[None] = asyncio.Queue()

    def __call__(self) -> None:
        assert threading.current_thread() is threading.main_thread(), "on_change must run in the loop's thread"
        self.queue.put_nowait(None)

    async def next(self) -> bool:
        """Whether a notification arrives within the deadline."""
        try:
            await asyncio.wait_for(self.queue.get(), DEADLINE_S)
        except asyncio.TimeoutError:
            return False
        return True

    async def quiet(self) -> bool:
        """Whether no further notification arrives within the quiet window."""
        try:
            await asyncio.wait_for(self.queue.get(), QUIET_S)
        except asyncio.TimeoutError:
            return True
        return False


Scenario = Callable[[Path, Notifications], Awaitable[None]]


def watching(tmp_path: Path, scenario: Scenario) -> None:
    """Run `scenario` with a started watcher of tmp_path/gb10d.toml; the watcher is stopped afterwards."""
    path = tmp_path / "etc" / "gb10d.toml"
    path.parent.mkdir()
    path.write_text('[vllm]\nmodel = "org/model"\nexecutable = "/srv/vllm/bin/vllm"\n')

    async def main() -> None:
        got = Notifications()
        watcher = ConfigWatcher(path, asyncio.get_running_loop(), got, debounce_s=DEBOUNCE_S)
        watcher.start()
        try:
            await scenario(path, got)
        finally:
            watcher.stop()

    asyncio.run(main())


def replace_by_rename(path: Path, text: str, temp_name: str) -> None:
    """What vim (with backupcopy=no) and sed -i do: write a temporary file, then rename it over."""
    temp = path.with_name(temp_name)
    with open(temp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


@pytest.mark.slow
def test_a_burst_of_editor_renames_gives_one_notification(tmp_path: Path) -> None:
    async def scenario(path: Path, got: Notifications) -> None:
        for n in range(5):
            replace_by_rename(path, path.read_text() + f"# edit {n}\n", f".gb10d.toml.{n}.swp")
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"

    watching(tmp_path, scenario)


@pytest.mark.slow
def test_truncate_and_write_gives_one_notification_and_each_burst_its_own(tmp_path: Path) -> None:
    async def scenario(path: Path, got: Notifications) -> None:
        text = path.read_text()
        for n in range(3):
            with open(path, "w") as f:  # truncates in place, as nano and echo > do
                f.write(text)
                f.flush()
                f.write(f"# edit {n}\n")
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"
        replace_by_rename(path, text, "sedAbC123")
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"

    watching(tmp_path, scenario)


@pytest.mark.slow
def test_a_dropin_directory_created_later_is_watched(tmp_path: Path) -> None:
    async def scenario(path: Path, got: Notifications) -> None:
        dropins = path.with_suffix(".d")
        dropins.mkdir()
        (dropins / "10-port.toml").write_text("[vllm]\nport = 8001\n")
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"
        replace_by_rename(dropins / "10-port.toml", "[vllm]\nport = 8002\n", ".10-port.toml.swp")
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"
        (dropins / "20-more.toml").write_text("[restart]\nmax_attempts = 2\n")
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"

    watching(tmp_path, scenario)


@pytest.mark.slow
def test_a_dropin_directory_removed_and_created_again_is_watched_again(tmp_path: Path) -> None:
    async def scenario(path: Path, got: Notifications) -> None:
        dropins = path.with_suffix(".d")
        dropins.mkdir()
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"
        shutil.rmtree(dropins)
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"
        dropins.mkdir()
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"
        (dropins / "10-port.toml").write_text("[vllm]\nport = 8001\n")
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"

    watching(tmp_path, scenario)


@pytest.mark.slow
def test_unrelated_files_and_reading_the_config_do_not_notify(tmp_path: Path) -> None:
    async def scenario(path: Path, got: Notifications) -> None:
        dropins = path.with_suffix(".d")
        dropins.mkdir()
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        assert await got.quiet(), "a second notification arrived for the same burst"
        load_config(path)  # what the supervisor does on every notification
        (path.parent / "hosts").write_text("127.0.0.1 localhost\n")
        (path.parent / ".gb10d.toml.swp").write_text("swap")
        (path.parent / "other.toml").write_text("[x]\n")
        (dropins / "README").write_text("drop-ins go here\n")
        (dropins / ".10-port.toml.swp").write_text("swap")
        (dropins / "10-port.toml.dpkg-dist").write_text("[vllm]\n")
        (dropins / "sub").mkdir()
        (dropins / "sub" / "x.toml").write_text("[vllm]\n")
        assert await got.quiet(), "unrelated files or reading the config notified"
        (dropins / "10-port.toml").write_text("[vllm]\nport = 8001\n")
        assert await got.next(), "an edit after the ignored files was not noticed"

    watching(tmp_path, scenario)


@pytest.mark.slow
def test_stop_ends_the_threads_and_drops_a_pending_notification(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    path = tmp_path / "gb10d.toml"
    path.write_text("")

    async def main() -> None:
        got = Notifications()
        watcher = ConfigWatcher(path, asyncio.get_running_loop(), got, debounce_s=DEBOUNCE_S)
        watcher.start()
        path.write_text("# first\n")
        assert await got.next(), f"no notification within {DEADLINE_S} s"
        path.write_text("# second, still pending when stopped\n")
        watcher.stop()
        watcher.stop()
        path.write_text("# after stop\n")
        assert await got.quiet(), "a notification arrived after stop()"

    asyncio.run(main())
    assert set(threading.enumerate()) - before == set()


@pytest.mark.slow
def test_stop_before_start_is_harmless(tmp_path: Path) -> None:
    before = set(threading.enumerate())

    async def main() -> None:
        ConfigWatcher(tmp_path / "gb10d.toml", asyncio.get_running_loop(), lambda: None).stop()

    asyncio.run(main())
    assert set(threading.enumerate()) - before == set()


@pytest.mark.slow
def test_watching_a_missing_directory_says_reload_still_works(tmp_path: Path) -> None:
    before = set(threading.enumerate())

    async def main() -> None:
        watcher = ConfigWatcher(tmp_path / "missing" / "gb10d.toml", asyncio.get_running_loop(), lambda: None)
        with pytest.raises(WatchUnavailable, match=r"cannot watch .*missing for config changes: .*systemctl reload gb10d"):
            watcher.start()
        watcher.stop()

    asyncio.run(main())
    assert set(threading.enumerate()) - before == set()
