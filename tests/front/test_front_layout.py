"""The front's layout on the command line: /etc/gb10d.toml with [front] alone, the instances in [front] instances_dir.

check-config checks the front's keys and every instance config, and warns when the front is open to anyone;
status shows the instances behind the front and its queues; run, and the other commands of one instance, say in
one line that `gb10d front` runs such a config.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gb10d.cmdline.cli import main
from gb10d.cmdline.status import front_state_file
from gb10d.core.statefile import DaemonState, StateRecord
from gb10d.front.snapshot import FrontSnapshot, ModelQueue, write
from gb10d.machine.statefile import write_state


@pytest.fixture(autouse=True)
def no_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GB10D_CONFIG", raising=False)


def instance(root: Path, name: str, port: int, served: str, extra: str = "") -> Path:
    """An instance config in root/instances, its state file in root/run-NAME, the ledger off (the state files tell)."""
    path = root / "instances" / f"{name}.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        f'[vllm]\nvenv = "/opt/vllm"\nmodel = "m-{name}"\nserved_model_name = {served}\nhost = "127.0.0.1"\nport = {port}\n'
        f'[daemon]\nstate_file = "{root / f"run-{name}" / "state.json"}"\n[memory]\nledger_dir = ""\n{extra}'
    )
    return path


def front_config(root: Path, table: str = 'listen = "127.0.0.1:8000"\n') -> Path:
    config = root / "gb10d.toml"
    config.write_text(f'[front]\ninstances_dir = "{root / "instances"}"\nstate_file = "{root / "front.json"}"\n{table}')
    return config


def gb10d(capsys: pytest.CaptureFixture[str], config: Path, *argv: str) -> tuple[int, list[str], list[str]]:
    """The exit status and the stdout and stderr lines of `gb10d --config CONFIG ARGV...`, which never shows a traceback."""
    status = main(["--config", str(config), *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out.splitlines(), err.splitlines()


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    instance(tmp_path, "qwen", 8101, '["qwen", "qwen-fast"]')
    instance(tmp_path, "llama", 8102, '"llama"', "[on_demand]\nidle_timeout_s = 300.0\n")
    return front_config(tmp_path)


# --- check-config ----------------------------------------------------------------


def test_check_config_of_the_fronts_config_says_ok_with_the_address_and_each_instance(layout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = gb10d(capsys, layout, "check-config")
    instances = layout.parent / "instances"
    assert (status, err) == (0, [])
    assert out == [
        "OK",
        f"{layout}: the front's config: listen on 127.0.0.1:8000 (no API key) before 2 instances from {instances}:",
        f"  llama: llama on 127.0.0.1:8102, parked after 300 s idle ({instances / 'llama.toml'})",
        f"  qwen: qwen, qwen-fast on 127.0.0.1:8101 ({instances / 'qwen.toml'})",
        f"each instance's paths are checked by its own check-config: gb10d check-config --config {instances}/NAME.toml",
    ]


def test_check_config_names_every_broken_instance_config_by_its_own_file_and_line(layout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    instances = layout.parent / "instances"
    (instances / "zero.toml").write_text('[vllm]\nvenv = "/opt/vllm"\nmodel = "m"\nport = 0\n')
    (instances / "typo.toml").write_text('[vllm]\nvenv = "/opt/vllm"\nmodel = "m"\nprot = 8105\n')
    instance(layout.parent, "twin", 8000, '"qwen"')
    status, out, err = gb10d(capsys, layout, "check-config")
    assert status == 78 and out == []
    assert [line.partition(": give this instance")[0] for line in err] == [
        f"gb10d: {instances / 'typo.toml'}:4: vllm.prot: unknown key; did you mean vllm.port?",
        f"gb10d: {instances / 'zero.toml'}:4: vllm.port: must be >= 1 (got 0)",
        f"gb10d: {instances / 'twin.toml'}:6: vllm.port: is 8000, the front's own port (front.listen)",
        f"gb10d: {instances / 'twin.toml'}:4: vllm.served_model_name: serves 'qwen', which instance qwen serves too: each model name must be unique",
        f"gb10d: fix the file, then check again with: gb10d check-config --config {layout}",
    ]


def test_a_bad_front_key_and_a_table_nothing_reads_are_refused_by_check_config_and_by_the_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    instance(tmp_path, "qwen", 8101, '"qwen"')
    config = front_config(tmp_path, 'queue_limit = 0\n\n[memory]\nledger_dir = ""\n\n[fornt]\nlisten = "127.0.0.1:8000"\n')
    expected = [
        f"gb10d: {config}:4: front.queue_limit: must be >= 1 (got 0)",
        f"gb10d: {config}:6: memory: is a table of a gb10d instance, and this config ([front] and no [vllm]) is the front's: "
        "nothing reads it here; move it into the instance configs in [front] instances_dir, or remove it",
        f"gb10d: {config}:9: fornt: unknown table; the front's config has only [front]; did you mean front?",
    ]
    for command in ("check-config", "front"):
        status, out, err = gb10d(capsys, config, command)
        assert status == 78 and out == [] and err[:-1] == expected, command


def test_the_fronts_keys_in_a_drop_in_count(layout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dropins = layout.parent / "gb10d.d"
    dropins.mkdir()
    (dropins / "10-port.toml").write_text('[front]\nlisten = "127.0.0.1:8090"\napi_keys = ["front-key-0123456789 qwen"]\n')
    status, out, _ = gb10d(capsys, layout, "check-config", "--explain")
    assert status == 0
    assert out[1].startswith(f"{layout} + 1 drop-in(s): the front's config: listen on 127.0.0.1:8090 (1 API key) before 2 instances")
    assert [re.sub(" +#", " #", line) for line in out if line.startswith("front.listen")] == [f'front.listen = "127.0.0.1:8090" # {dropins / "10-port.toml"}:2']
    assert any(line.startswith("front.api_keys = [***]") for line in out) and "front-key-0123456789" not in "\n".join(out)


OPEN = "is {listen!r}, beyond loopback, and neither front.api_keys nor front.api_keys_file is set: anyone who reaches port 8000 can use every model"


@pytest.mark.parametrize("listen", ["0.0.0.0:8000", "[::]:8000", "192.168.7.2:8000", "gb10.lan:8000"])
def test_check_config_warns_when_anyone_who_reaches_the_front_may_use_every_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], listen: str) -> None:
    instance(tmp_path, "qwen", 8101, '"qwen"')
    config = front_config(tmp_path, f'listen = "{listen}"\n')
    status, out, err = gb10d(capsys, config, "check-config")
    assert status == 0 and out[0] == "OK"
    assert len(err) == 1 and err[0].startswith(f"gb10d: warning: {config}:4: front.listen: {OPEN.format(listen=listen)}; set api_keys")


@pytest.mark.parametrize("table", [
    'listen = "127.0.0.1:8000"\n', 'listen = "127.3.2.1:8000"\n', 'listen = "[::1]:8000"\n', 'listen = "localhost:8000"\n',
    'listen = "0.0.0.0:8000"\napi_keys = ["front-key-0123456789"]\n', 'listen = "0.0.0.0:8000"\napi_keys_file = "{keys}"\n',
])
def test_a_front_on_loopback_or_with_api_keys_gets_no_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str) -> None:
    instance(tmp_path, "qwen", 8101, '"qwen"')
    (tmp_path / "front.keys").write_text("front-key-0123456789\n")
    status, out, err = gb10d(capsys, front_config(tmp_path, table.format(keys=tmp_path / "front.keys")), "check-config")
    assert (status, out[0], err) == (0, "OK", [])


def test_check_config_of_an_instance_that_also_carries_an_open_front_warns_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text('[vllm]\nexecutable = "/bin/true"\nmodel = "m"\nport = 8101\n\n[front]\nlisten = "0.0.0.0:8000"\n')
    status, out, err = gb10d(capsys, config, "check-config")
    assert status == 0 and out[0] == "OK"
    assert [line for line in err if "front.listen" in line] == [
        f"gb10d: warning: {config}:7: front.listen: {OPEN.format(listen='0.0.0.0:8000')}; set api_keys (each key e.g. from "
        "`openssl rand -hex 24`), or listen on 127.0.0.1:8000 behind a proxy that authenticates"
    ]


# --- status ----------------------------------------------------------------------


def serving(root: Path, name: str) -> Path:
    """The state file of instance NAME, serving in this very process (a pid that lives)."""
    path = root / f"run-{name}" / "state.json"
    write_state(path, StateRecord(pid=os.getpid(), state=DaemonState.SERVING, model=f"m-{name}"))
    return path


def test_status_of_the_fronts_config_shows_its_instances_then_its_queues(layout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    qwen = serving(layout.parent, "qwen")
    write(layout.parent / "front.json", FrontSnapshot(os.getpid(), "127.0.0.1:8000", (
        ModelQueue("llama", "llama", "parked", 0), ModelQueue("qwen", "qwen", "serving", 0), ModelQueue("qwen-fast", "qwen", "serving", 0),
    )))
    everything = [
        'the memory ledger is off in this config (memory.ledger_dir = ""); the state files of the front\'s instances name 1 running:',
        f"  {qwen}: serving m-qwen, pid {os.getpid()}",
        f"Front on 127.0.0.1:8000 (pid {os.getpid()}), requests held per model:",
        "MODEL      INSTANCE  STATE    HELD  HELD FOR",
        "llama      llama     parked   0",
        "qwen       qwen      serving  0",
        "qwen-fast  qwen      serving  0",
    ]
    assert gb10d(capsys, layout, "status", "--all") == (0, everything, [])
    said = f"{layout} is the front's config ([front] and no [vllm]): its instances and the front, as gb10d status --all shows them"
    assert gb10d(capsys, layout, "status") == (0, [said, *everything], [])
    status, out, _ = gb10d(capsys, layout, "status", "--json")
    answer = json.loads("\n".join(out))
    assert status == 0 and [i["state_file"] for i in answer["instances"]] == [str(qwen)]
    assert answer["front"]["running"] is True and [m["model"] for m in answer["front"]["models"]] == ["llama", "qwen", "qwen-fast"]


def test_status_of_the_fronts_config_says_when_nothing_runs(layout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gb10d(capsys, layout, "status", "--all") == (3, [
        'the memory ledger is off in this config (memory.ledger_dir = ""); no state file of the front\'s instances names a running gb10d',
        f"Front: not running (no state file {layout.parent / 'front.json'}); systemctl status gb10d-front says why",
    ], [])


def test_status_of_a_named_front_config_that_does_not_load_is_the_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = front_config(tmp_path, "queue_limit = 0\n")
    status, out, err = gb10d(capsys, config, "status", "--all")
    assert status == 78 and out == [] and err[0] == f"gb10d: {config}:4: front.queue_limit: must be >= 1 (got 0)"


def test_status_with_a_broken_instance_config_still_answers_and_says_why_it_knows_less(layout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = layout.parent / "instances" / "zero.toml"
    broken.write_text('[vllm]\nvenv = "/opt/vllm"\nmodel = "m"\nport = 0\n')
    status, out, err = gb10d(capsys, layout, "status", "--all")
    assert status == 3 and out[-1].startswith("Front: not running")
    assert err == [
        f"gb10d: warning: the front's instances are not known ({broken}:4: vllm.port: must be >= 1 (got 0)), so only the memory "
        f"ledger tells which run; gb10d check-config --config {layout} says what to fix"
    ]


def test_status_all_looks_at_a_front_only_when_the_config_has_a_front_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    alone = tmp_path / "alone.toml"
    alone.write_text(f'[vllm]\nvenv = "/opt/vllm"\nmodel = "m"\n[memory]\nledger_dir = ""\n[daemon]\nstate_file = "{tmp_path / "run" / "state.json"}"\n')
    assert front_state_file(alone) is None
    status, out, _ = gb10d(capsys, alone, "status", "--all")
    assert status == 3 and not [line for line in out if "Front" in line]
    both = tmp_path / "both.toml"
    both.write_text(alone.read_text() + "[front]\n")
    assert front_state_file(both) == Path("/run/gb10d-front/state.json")
    status, out, _ = gb10d(capsys, both, "status", "--all")
    assert status == 3 and out[-1] == "Front: not running (no state file /run/gb10d-front/state.json); systemctl status gb10d-front says why"


# --- the commands of one instance ------------------------------------------------------


def test_run_of_the_fronts_config_says_in_one_line_that_gb10d_front_runs_it(layout: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}
    ran = subprocess.run([sys.executable, "-m", "gb10d", "--config", str(layout), "run"], capture_output=True, text=True, timeout=60, env=env)
    assert ran.returncode == 78 and ran.stdout == ""
    assert ran.stderr == (
        f"gb10d: {layout} is the front's config ([front] and no [vllm]): gb10d front runs it (gb10d-front.service); "
        "gb10d run needs an instance's config with a [vllm] table, such as --config /etc/gb10d/NAME.toml\n"
    )


def test_the_other_commands_of_one_instance_say_the_same_and_cleanup_has_nothing_to_do(layout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = gb10d(capsys, layout, "print-command")
    assert status == 78 and out == [] and len(err) == 1 and "gb10d print-command needs an instance's config" in err[0]
    assert gb10d(capsys, layout, "cleanup") == (0, [], [])
