"""The gb10d command line: help, where the config comes from, print-command, --explain, import-script."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, get_args

import pytest

from config_support import write_config
from containers import dead_socket, engine_or_skip, ensure_sim_image, sim_image_tag
from gb10d.base.command import Engine, build_argv, container_argv, env_additions
from gb10d.base.config import Config
from gb10d.base.configload import load_config, load_config_explained
from gb10d.base.errors import EXIT_CONFIG, EXIT_GAVE_UP
from gb10d.cmdline.cli import main

ROOT = Path(__file__).parents[2]
SHIPPED = ROOT / "etc" / "gb10d.toml"
REFERENCE_SCRIPT = ROOT / "tests" / "fixtures" / "scripts" / "reference.sh"


@pytest.fixture(autouse=True)
def no_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GB10D_CONFIG", raising=False)


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    """A venv whose `vllm` is gb10d.sim: it exists and is executable, which is what check-config verifies."""
    venv = tmp_path / "vllm-env"
    subprocess.run([sys.executable, "-m", "gb10d.sim", "make-venv", str(venv)], check=True, timeout=120)
    return venv


@pytest.fixture
def shipped_copy(tmp_path: Path, fake_venv: Path) -> Path:
    """etc/gb10d.toml with its venv pointed at the fake one."""
    copy = tmp_path / "gb10d.toml"
    copy.write_text(SHIPPED.read_text().replace('venv = "/opt/vllm-env"', f'venv = "{fake_venv}"'))
    return copy


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_help_lists_the_subcommands_exit_codes_and_config_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in ("check-config", "print-command", "import-script", "run", "cleanup"):
        assert name in text
    assert "$GB10D_CONFIG" in text and "/etc/gb10d.toml" in text and "78 config error" in text


@pytest.mark.parametrize("name", ["check-config", "print-command", "import-script", "run", "cleanup"])
def test_every_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: gb10d {name}")


def test_check_config_reads_the_file_named_by_gb10d_config(
    shipped_copy: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GB10D_CONFIG", str(shipped_copy))
    status, out, _ = run(capsys, "check-config")
    assert status == 0
    assert out.splitlines()[0] == "OK"
    assert f"{shipped_copy}: serve Qwen/Qwen3.6-27B-FP8 as Qwen3.6-27B-FP8-Agent on 0.0.0.0:8000" in out


def test_config_option_works_before_and_after_the_subcommand(shipped_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "--config", str(shipped_copy), "check-config")[0] == 0
    assert run(capsys, "check-config", "--config", str(shipped_copy))[0] == 0


def test_shipped_config_without_its_venv_fails_check_config_naming_vllm_venv(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "check-config", "--config", str(SHIPPED))
    if Path("/opt/vllm-env/bin/vllm").exists():
        pytest.skip("this machine has a real /opt/vllm-env")
    assert status == EXIT_CONFIG
    assert f"gb10d: {SHIPPED}:" in err and "vllm.venv: /opt/vllm-env/bin/vllm does not exist" in err


def test_print_command_does_not_need_vllm_installed(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "print-command", "--config", str(SHIPPED))
    assert status == 0
    shipped = load_config(SHIPPED)
    assert shlex.split(out) == build_argv(shipped.vllm, stop_timeout_s=shipped.daemon.stop_timeout_s)


def test_print_command_is_one_pasteable_line_of_the_exact_argv(shipped_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "print-command", "--config", str(shipped_copy))
    assert out.count("\n") == 1
    copied = load_config(shipped_copy)
    assert shlex.split(out) == build_argv(copied.vllm, stop_timeout_s=copied.daemon.stop_timeout_s)


def test_print_command_env_shows_what_gb10d_sets_with_secrets_masked(
    tmp_path: Path, fake_venv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secrets = tmp_path / "secrets.env"
    secrets.write_text("HF_TOKEN=hf_very_secret\n")
    config = tmp_path / "gb10d.toml"
    config.write_text(
        f'[vllm]\nvenv = "{fake_venv}"\nmodel = "m"\nenv_file = "{secrets}"\n'
        'extra_args = ["--api-key", "sk-1"]\n[vllm.env]\nCUDA_VISIBLE_DEVICES = "0"\n'
    )
    _, out, _ = run(capsys, "print-command", "--env", "--config", str(config))
    assert "hf_very_secret" not in out and "sk-1" not in out
    assert out.startswith(f'PATH={fake_venv}/bin:"$PATH" ')
    words = shlex.split(out.replace('"$PATH"', "x"))
    assert "HF_TOKEN=***" in words and "CUDA_VISIBLE_DEVICES=0" in words and f"VIRTUAL_ENV={fake_venv}" in words
    assert words[words.index("--api-key") + 1] == "***"


def test_explain_names_the_dropin_that_set_a_value(shipped_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dropins = shipped_copy.with_suffix(".d")
    dropins.mkdir()
    (dropins / "50-context.toml").write_text("[vllm.args]\nmax_model_len = 65536\n")
    status, out, _ = run(capsys, "print-command", "--explain", "--config", str(shipped_copy))
    assert status == 0
    assert "--max-model-len 65536" in out.splitlines()[0]
    line = next(x for x in out.splitlines() if x.startswith("vllm.args.max_model_len"))
    assert line.endswith(f"# {dropins / '50-context.toml'}:2")
    port = next(x for x in out.splitlines() if x.startswith("vllm.port"))
    port_line = next(n for n, x in enumerate(shipped_copy.read_text().splitlines(), 1) if x.startswith("port = "))
    assert port.endswith(f"# {shipped_copy}:{port_line}")


def test_check_config_explain_lists_defaults_and_hides_secrets(tmp_path: Path, fake_venv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(f'[vllm]\nvenv = "{fake_venv}"\nmodel = "m"\n[vllm.env]\nHF_TOKEN = "hf_x"\n')
    status, out, _ = run(capsys, "check-config", "--explain", "--config", str(config))
    assert status == 0
    assert "hf_x" not in out
    assert any(x.startswith("vllm.env.HF_TOKEN = ***") and x.endswith(f"# {config}:5") for x in out.splitlines())
    assert any(x.startswith("restart.max_attempts = 5") and x.endswith("# default") for x in out.splitlines())


def test_check_config_explain_of_a_cluster_head_shows_its_head_address(tmp_path: Path, fake_venv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(f'[vllm]\nvenv = "{fake_venv}"\nmodel = "m"\n[cluster]\nrole = "head"\nhead_address = "10.0.0.1"\n')
    status, out, err = run(capsys, "check-config", "--explain", "--config", str(config))
    assert status == 0, err
    assert any(x.startswith('cluster.head_address = "10.0.0.1"') and x.endswith(f"# {config}:6") for x in out.splitlines())


def test_explain_shows_where_webhooks_go_but_not_their_tokens(tmp_path: Path, fake_venv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(
        f'[vllm]\nvenv = "{fake_venv}"\nmodel = "m"\n[alerts]\n'
        'webhooks = [{ url = "https://hooks.slack.com/services/T0/B0/s3cret", format = "slack", headers = { Authorization = "Bearer t0k" } }]\n'
    )
    status, out, _ = run(capsys, "check-config", "--explain", "--config", str(config))
    assert status == 0
    assert "s3cret" not in out and "t0k" not in out
    assert 'alerts.webhooks = [{ url = "https://hooks.slack.com/…", format = "slack", headers = { Authorization = *** } }]' in out


def test_shipped_config_mentions_every_key_of_every_table() -> None:
    text = SHIPPED.read_text()
    for table, section in Config.model_fields.items():
        assert f"[{table}]" in text, table
        # An optional table ([cluster]) is annotated `Table | None`.
        model = next(k for k in (get_args(section.annotation) or (section.annotation,)) if k is not type(None))
        for key in model.model_fields:
            forms = (f"\n{key} = ", f"\n# {key} = ", f"\n[{table}.{key}]\n")
            assert any(form in text for form in forms), f"{table}.{key} is neither set nor commented in etc/gb10d.toml"


def test_import_script_writes_toml_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "import-script", str(REFERENCE_SCRIPT))
    assert status == 0
    assert tomllib.loads(out)["vllm"]["venv"] == "/home/hayashi/vllm-pip-env"


def test_import_script_of_a_missing_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "import-script", str(tmp_path / "start.sh"))
    assert status == EXIT_CONFIG and out == ""
    assert err == f"gb10d: {tmp_path / 'start.sh'}: cannot read: No such file or directory\n"


def test_under_systemd_an_error_line_carries_its_priority_for_the_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(tmp_path / "stderr", "w+") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        monkeypatch.setattr(sys, "stderr", stream)
        assert main(["import-script", str(tmp_path / "start.sh")]) == EXIT_CONFIG
        stream.seek(0)
        assert stream.read() == f"<3>gb10d: {tmp_path / 'start.sh'}: cannot read: No such file or directory\n"


@pytest.mark.slow
def test_import_then_print_command_through_the_real_cli(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}
    imported = subprocess.run(
        [sys.executable, "-m", "gb10d", "import-script", "-"],
        input=REFERENCE_SCRIPT.read_text(), capture_output=True, text=True, env=env, timeout=120,
    )
    assert imported.returncode == 0, imported.stderr
    config = tmp_path / "gb10d.toml"
    config.write_text(imported.stdout)
    printed = subprocess.run(
        [sys.executable, "-m", "gb10d", "print-command", "--config", str(config)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert printed.returncode == 0, printed.stderr
    assert shlex.split(printed.stdout)[:3] == ["/home/hayashi/vllm-pip-env/bin/vllm", "serve", "Qwen/Qwen3.6-27B-FP8"]
    assert "Traceback" not in imported.stderr + printed.stderr


def test_service_user_print_shows_the_drop_in_and_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service-user", "nobody", "--print"]) == 0
    text = capsys.readouterr().out
    assert "User=nobody\n" in text and "UnsetEnvironment=HF_HOME " in text and "ReadWritePaths=-" in text


@pytest.mark.parametrize(("user", "message"), [("root", "gb10d does not run vLLM as root"), ("no-such-user-x", "no user no-such-user-x on this machine")])
def test_service_user_refuses_root_and_unknown_users(user: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service-user", user]) == EXIT_CONFIG
    assert message in capsys.readouterr().err


@pytest.mark.skipif(Path("/run/systemd/system").is_dir(), reason="systemd runs here: the drop-in would be read")
def test_service_user_without_systemd_writes_nothing_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    dropin = Path("/etc/systemd/system/gb10d.service.d/50-service-user.conf")
    before = dropin.exists()
    assert main(["service-user", "nobody"]) == 1
    assert dropin.exists() == before
    err = capsys.readouterr().err
    assert "systemd is not running on this machine" in err and "nothing was written" in err


def test_check_config_says_whom_it_checked_the_paths_as(tmp_path: Path, fake_venv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(f'[vllm]\nvenv = "{fake_venv}"\nmodel = "m"\n')
    assert main(["check-config", "--config", str(config), "--user", "root"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "paths checked as root (--user)"


def test_check_config_user_that_does_not_exist_is_a_clear_error(tmp_path: Path, fake_venv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(f'[vllm]\nvenv = "{fake_venv}"\nmodel = "m"\n')
    assert main(["check-config", "--config", str(config), "--user", "no-such-user-x"]) == EXIT_CONFIG
    assert "gb10d: no user no-such-user-x on this machine: check the name with getent passwd" in capsys.readouterr().err


# --- vLLM from a container image ------------------------------------------------------------------------


def cli(*argv: str, user: int | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real gb10d command, as an operator runs it (as another user where `user` is given)."""
    base = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}
    return subprocess.run([sys.executable, "-m", "gb10d", *argv], capture_output=True, text=True, env={**base, **(env or {})}, user=user, timeout=120)


def image_config(config: Path, image: str, **container: str) -> Path:
    """A gb10d.toml at config that runs vLLM in image, with these [container] keys."""
    return write_config(config, vllm={"image": image}, container=container)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["docker", "podman"])
def test_check_config_of_an_image_names_the_engine_that_runs_it(kind: Any, tmp_path: Path) -> None:
    engine = engine_or_skip(kind)
    config = tmp_path / "gb10d.toml"
    image_config(config, ensure_sim_image(engine), engine=kind, gpu="none", pull="never")
    result = cli("check-config", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].endswith(f"with gpu_memory_utilization 0.9 from the image {sim_image_tag()} with {kind}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["docker", "podman"])
def test_check_config_with_pull_never_and_no_image_says_how_to_load_it(kind: Any, tmp_path: Path) -> None:
    engine_or_skip(kind)
    config = tmp_path / "gb10d.toml"
    image_config(config, "localhost/gb10d-test/absent:1", engine=kind, gpu="none", pull="never")
    result = cli("check-config", "--config", str(config))
    assert result.returncode == EXIT_CONFIG
    assert (f'gb10d: {config}:8: container.pull: the image localhost/gb10d-test/absent:1 is not present in {kind} and container.pull is "never"; '
            f"load it ({kind} pull localhost/gb10d-test/absent:1") in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "advice"),
    [
        ("docker", "docker's daemon is not running (nothing answers on {sock}); start it: sudo systemctl enable --now docker"),
        ("podman", "podman's API service is not running (nothing answers on {sock}); start it: sudo systemctl enable --now podman.socket"),
    ],
)
def test_check_config_says_how_to_start_an_engine_that_does_not_answer(kind: str, advice: str, tmp_path: Path) -> None:
    if shutil.which(kind) is None:
        pytest.skip(f"the {kind} client is not installed")
    sock = dead_socket(tmp_path / f"{kind}.sock")
    config = tmp_path / "gb10d.toml"
    image_config(config, "nvcr.io/nvidia/vllm:26.05-py3", engine=kind, socket=str(sock))
    result = cli("check-config", "--config", str(config))
    assert result.returncode == EXIT_CONFIG
    problem = result.stderr.splitlines()[0]
    assert problem.startswith(f"gb10d: {config}:7: container.socket: {kind} ") and problem.endswith("; " + advice.format(sock=sock)), problem


@pytest.mark.parametrize("kind", ["docker", "podman"])
def test_a_container_socket_that_is_not_there_is_reported_on_its_line(kind: str, tmp_path: Path) -> None:
    if shutil.which(kind) is None:
        pytest.skip(f"the {kind} client is not installed")
    sock = tmp_path / "absent.sock"
    config = tmp_path / "gb10d.toml"
    image_config(config, "nvcr.io/nvidia/vllm:26.05-py3", engine=kind, socket=str(sock))
    result = cli("check-config", "--config", str(config))
    assert result.returncode == EXIT_CONFIG
    assert result.stderr.splitlines()[0] == (
        f"gb10d: {config}:7: container.socket: there is no socket {sock}: no engine can answer there; set container.socket to the "
        "engine's API socket (docker: /var/run/docker.sock, podman: /run/podman/podman.sock), or remove it to use the engine's default")


@pytest.mark.slow
def test_check_config_as_a_user_outside_the_docker_group_says_to_add_it_and_what_that_means(tmp_path: Path) -> None:
    engine_or_skip("docker")
    if os.geteuid() != 0:
        pytest.skip("needs root to run check-config as another user")
    tmp_path.chmod(0o755)
    config = tmp_path / "gb10d.toml"
    image_config(config, "nvcr.io/nvidia/vllm:26.05-py3", engine="docker")
    config.chmod(0o644)
    try:
        result = cli("check-config", "--config", str(config), user=65534, env={"HOME": str(tmp_path)})
    except PermissionError:
        result = None
    if result is None or "No module named" in result.stderr:
        pytest.skip("the test interpreter is not usable as nobody")
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert ("may not use docker's socket /var/run/docker.sock; add it to the docker group (sudo usermod -aG docker nobody, then restart gb10d). "
            "Membership of the docker group is as good as root on this machine") in result.stderr


@pytest.mark.slow
def test_check_config_of_podman_without_a_cdi_description_of_the_gpu_says_how_to_make_one(tmp_path: Path) -> None:
    engine_or_skip("podman")
    if any(Path(d, "nvidia.yaml").exists() for d in ("/etc/cdi", "/var/run/cdi")):
        pytest.skip("this machine has a CDI description of its GPU")
    config = tmp_path / "gb10d.toml"
    image_config(config, "nvcr.io/nvidia/vllm:26.05-py3", engine="podman")
    result = cli("check-config", "--config", str(config))
    assert result.returncode == EXIT_CONFIG
    assert "container.gpu: podman gives the GPU through CDI, but there is no /etc/cdi/nvidia.yaml" in result.stderr
    assert "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml" in result.stderr


@pytest.mark.slow
def test_print_command_of_an_image_is_the_exact_run_line_and_names_the_pull_first(tmp_path: Path) -> None:
    engine_or_skip("docker")
    config = tmp_path / "gb10d.toml"
    config.write_text('[vllm]\nimage = "nvcr.io/nvidia/vllm:26.05-py3"\nmodel = "Qwen/Qwen3.6-27B-FP8"\n[vllm.env]\nHF_TOKEN = "hf_live"\n[container]\nengine = "docker"\n')
    result = cli("print-command", "--config", str(config), "--env")
    assert result.returncode == 0, result.stderr
    loaded = load_config_explained(config)
    expected = container_argv(loaded.config, config, Engine("docker", ("docker",)), build_argv(loaded.config.vllm, stop_timeout_s=loaded.config.daemon.stop_timeout_s), env_additions(loaded.config.vllm))
    assert shlex.split(result.stdout) == ["HF_TOKEN=***", *expected]
    assert "hf_live" not in result.stdout + result.stderr
    assert result.stderr == 'gb10d: gb10d pulls the image when it is missing (container.pull = "missing"): docker pull nvcr.io/nvidia/vllm:26.05-py3\n'


def test_cleanup_of_vllm_from_a_venv_has_nothing_to_do(tmp_path: Path) -> None:
    # The unit runs it after every stop: for a venv it must not need an engine, nor say anything.
    config = tmp_path / "gb10d.toml"
    config.write_text('[vllm]\nvenv = "/opt/vllm"\nmodel = "Qwen/Qwen3.6-27B-FP8"\n')
    result = cli("cleanup", "--config", str(config))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_cleanup_through_an_engine_that_is_not_running_says_how_to_start_it(tmp_path: Path) -> None:
    config = tmp_path / "gb10d.toml"
    image_config(config, "nvcr.io/nvidia/vllm:26.05-py3", engine="docker", socket=str(dead_socket(tmp_path / "docker.sock")))
    result = cli("cleanup", "--config", str(config))
    assert result.returncode == EXIT_GAVE_UP and result.stdout == ""
    assert result.stderr.startswith("gb10d: docker version failed: ") and "start it: sudo systemctl enable --now docker" in result.stderr


def test_cleanup_with_an_unreadable_state_file_removes_nothing_and_says_why(tmp_path: Path) -> None:
    # Whether gb10d still runs with the container is unknown: removing it could cut a serving vLLM.
    state = tmp_path / "state.json"
    state.mkdir()
    config = tmp_path / "gb10d.toml"
    config.write_text(f'[vllm]\nimage = "nvcr.io/nvidia/vllm:26.05-py3"\nmodel = "Qwen/Qwen3.6-27B-FP8"\n[daemon]\nstate_file = "{state}"\n')
    result = cli("cleanup", "--config", str(config))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(f"gb10d: cannot read the state file {state} (")
    assert "is unknown and no container of it is removed" in result.stderr and "Traceback" not in result.stderr


def test_cleanup_of_a_config_that_does_not_load_says_so_once(tmp_path: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text('[vllm]\nimage = "nvcr.io/NVIDIA/vllm:26.05"\nmodel = "Qwen/Qwen3.6-27B-FP8"\n')
    result = cli("cleanup", "--config", str(config))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"gb10d: {config} does not load, so no container of it is removed; gb10d check-config says what to fix\n"
