"""gb10d.toml: what is accepted, how drop-ins merge, and how every broken file is explained.

The broken-file cases run the real `gb10d check-config` as a subprocess, so
they also show that the operator sees `gb10d: FILE:LINE: KEY: problem` lines,
a last line saying how to check again, exit 78, and never a traceback.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gb10d.base.config import Config
from gb10d.base.configfile import dropin_dir_for
from gb10d.base.configload import load_config, load_config_explained
from gb10d.base.errors import EXIT_CONFIG, ConfigError
from gb10d.base.flags import normalize_flag


@pytest.fixture
def vllm_exe(tmp_path: Path) -> Path:
    """A stand-in `vllm` program: check-config only needs it to exist and be executable."""
    exe = tmp_path / "venv" / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return exe


def check_config(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run the real CLI the way an operator (or the unit's ExecStartPre) does."""
    env = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "gb10d", "check-config", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@dataclass(frozen=True)
class Broken:
    """One kind of broken file and what its error must say."""

    name: str
    body: str | bytes
    key: str
    problem: str
    line: int | None = None


GOOD_HEAD = '[vllm]\nexecutable = "{exe}"\nmodel = "Qwen/Qwen3.6-27B-FP8"\n'
IMAGE_HEAD = '[vllm]\nimage = "nvcr.io/nvidia/vllm:26.05-py3"\nmodel = "Qwen/Qwen3.6-27B-FP8"\n'

BROKEN = [
    Broken("utilization_too_high", GOOD_HEAD + "gpu_memory_utilization = 1.5\n", "vllm.gpu_memory_utilization", "must be > 0 and <= 1 (got 1.5)", 4),
    Broken("utilization_zero", GOOD_HEAD + "gpu_memory_utilization = 0\n", "vllm.gpu_memory_utilization", "must be > 0 and <= 1 (got 0", 4),
    Broken("port_as_string", GOOD_HEAD + 'port = "8000"\n', "vllm.port", "must be an integer (got '8000')", 4),
    Broken("port_out_of_range", GOOD_HEAD + "port = 70000\n", "vllm.port", "must be <= 65535 (got 70000)", 4),
    Broken("warmup_not_bool", GOOD_HEAD + '[startup]\nwarmup = "yes"\n', "startup.warmup", "must be true or false (got 'yes')", 5),
    Broken("missing_model", '[vllm]\nexecutable = "{exe}"\n', "vllm.model", "is required", 1),
    Broken("missing_vllm_table", "[startup]\nwarmup = false\n", "vllm", "the [vllm] table is missing"),
    Broken("both_executable_and_venv", GOOD_HEAD + 'venv = "/opt/vllm-env"\n', "vllm", "set only one of vllm.executable and vllm.venv", 1),
    Broken("neither_executable_nor_venv", '[vllm]\nmodel = "m"\n', "vllm", "set one of vllm.executable (path of the vllm program), vllm.venv (a virtualenv with vLLM) or vllm.image", 1),
    Broken("relative_venv", '[vllm]\nvenv = "venv"\nmodel = "m"\n', "vllm.venv", "must be an absolute path (got 'venv')", 2),
    Broken("empty_model", '[vllm]\nexecutable = "{exe}"\nmodel = " "\n', "vllm.model", "must name a Hugging Face repository", 3),
    Broken("served_name_wrong_type", GOOD_HEAD + "served_model_name = 5\n", "vllm.served_model_name", "must be a string or a list (got 5)", 4),
    Broken("vllm_not_a_table", "vllm = 3\n", "vllm", "must be a table (got 3)", 1),
    Broken("empty_served_name_list", GOOD_HEAD + "served_model_name = []\n", "vllm.served_model_name", "must list at least one name", 4),
    Broken("unknown_key_did_you_mean", GOOD_HEAD + "[startup]\nstall_timout_s = 10\n", "startup.stall_timout_s", "unknown key; did you mean startup.stall_timeout_s?", 5),
    Broken("unknown_table", GOOD_HEAD + '[metric]\nlisten = ""\n', "metric", "unknown table [metric]", 4),
    Broken("metrics_listen_without_port", GOOD_HEAD + '[metrics]\nlisten = "9400"\n', "metrics.listen", 'must be "HOST:PORT"', 5),
    Broken("arg_duplicates_first_class_key", GOOD_HEAD + "[vllm.args]\nport = 9000\n", "vllm.args.port", "is set with vllm.port, not in vllm.args", 5),
    Broken("arg_given_in_two_spellings", GOOD_HEAD + "[vllm.args]\nmax_model_len = 1\nmax-model-len = 2\n", "vllm.args.max-model-len", "set twice", 6),
    Broken("extra_args_overrides_port", GOOD_HEAD + 'extra_args = ["--port", "9000"]\n', "vllm.extra_args.0", "'--port' must be set with vllm.port", 4),
    Broken("bad_env_name", GOOD_HEAD + '[vllm.env]\n"BAD-NAME" = "1"\n', "vllm.env.BAD-NAME", "is not an environment variable name", 5),
    Broken("env_value_table", GOOD_HEAD + "[vllm.env]\nX = {{ a = 1 }}\n", "vllm.env.X", "must be a string", 5),
    Broken("env_file_relative", GOOD_HEAD + 'env_file = "secrets.env"\n', "vllm.env_file", "must be an absolute path", 4),
    Broken("env_file_missing", GOOD_HEAD + 'env_file = "{tmp}/nope.env"\n', "vllm.env_file", "nope.env does not exist; create it, or remove vllm.env_file", 4),
    Broken("max_attempts_zero", GOOD_HEAD + "[restart]\nmax_attempts = 0\n", "restart.max_attempts", "must be >= 1 (got 0)", 5),
    Broken("backoff_order", GOOD_HEAD + "[restart]\nbackoff_initial_s = 10\nbackoff_max_s = 1\n", "restart", "backoff_max_s (1.0) must be >= backoff_initial_s (10.0)", 4),
    Broken("unknown_load_strategy", GOOD_HEAD + '[startup]\nload_strategy_ladder = ["fast"]\n', "startup.load_strategy_ladder.0", "must be one of", 5),
    Broken("bad_log_level", GOOD_HEAD + '[daemon]\nlog_level = "verbose"\n', "daemon.log_level", "must be one of", 5),
    Broken("toml_syntax_error", GOOD_HEAD + "port = \n", "", "TOML syntax error", 4),
    Broken("toml_duplicate_key", GOOD_HEAD + 'model = "other"\n', "", "TOML syntax error", 4),
    Broken("empty_file", "", "", "is empty"),
    Broken("binary_garbage", b"\x7fELF\x02\x01\x01\x00\xff\xfe\x00garbage", "", "not UTF-8 text"),
    Broken("nul_bytes", "[vllm]\n\x00\x00", "", "contains NUL bytes", 2),
    Broken("executable_missing", '[vllm]\nexecutable = "{tmp}/no/bin/vllm"\nmodel = "m"\n', "vllm.executable", "does not exist", 2),
    Broken("venv_without_vllm", '[vllm]\nvenv = "{tmp}"\nmodel = "m"\n', "vllm.venv", "bin/vllm does not exist; is vLLM installed in that venv?", 2),
    Broken("image_uppercase", IMAGE_HEAD.replace("nvidia/vllm", "NVIDIA/vllm"), "vllm.image", "the repository name must be lowercase (got 'nvcr.io/NVIDIA/vllm:26.05-py3')", 2),
    Broken("image_with_blank", IMAGE_HEAD.replace("26.05-py3", "26.05 py3"), "vllm.image", "it contains blanks", 2),
    Broken("image_and_venv", IMAGE_HEAD + 'venv = "/opt/vllm-env"\n', "vllm", "set only one of vllm.venv and vllm.image, not both", 1),
    Broken("container_without_image", GOOD_HEAD + '[container]\nengine = "docker"\n', "container", "applies only to vLLM from a container image: set vllm.image", 4),
    Broken("container_engine_unknown", IMAGE_HEAD + '[container]\nengine = "dokcer"\n', "container.engine", "must be one of 'auto', 'docker' or 'podman' (got 'dokcer')", 5),
    Broken("container_gpu_unknown", IMAGE_HEAD + '[container]\ngpu = "all"\n', "container.gpu", "must be one of 'auto', 'toolkit', 'cdi' or 'none'", 5),
    Broken("container_mount_relative", IMAGE_HEAD + '[container]\nmounts = ["models:/models"]\n', "container.mounts.0", "both paths must be absolute", 5),
    Broken("container_mount_one_path", IMAGE_HEAD + '[container]\nmounts = ["/srv/models"]\n', "container.mounts.0", 'must be "HOST:CONTAINER"', 5),
    Broken("container_shm_size", IMAGE_HEAD + '[container]\nshm_size = "lots"\n', "container.shm_size", 'must be a size such as "16g"', 5),
    Broken("container_run_args_rm", IMAGE_HEAD + '[container]\nrun_args = ["--rm"]\n', "container.run_args.0", "--rm is gb10d's to decide: gb10d removes the container itself", 5),
    Broken("container_run_args_publish", IMAGE_HEAD + '[container]\nrun_args = ["-p", "8000:8000"]\n', "container.run_args.0", "vllm.port is already the host's port", 5),
    Broken("container_run_args_name", IMAGE_HEAD + '[container]\nrun_args = ["--name=x"]\n', "container.run_args.0", "--name is gb10d's to decide", 5),
    Broken("container_name", IMAGE_HEAD + '[container]\nname = "my model"\n', "container.name", "must be a container name", 5),
    Broken("container_cache_relative", IMAGE_HEAD + '[container]\ncache_dir = "cache"\n', "container.cache_dir", "must be an absolute path", 5),
    Broken("container_pull_unknown", IMAGE_HEAD + '[container]\npull = "if-newer"\n', "container.pull", "must be one of 'never', 'missing' or 'always'", 5),
    Broken("alerts_webhook_format", GOOD_HEAD + '[alerts]\nwebhooks = [{{ url = "https://ntfy.sh/gb10", format = "teams" }}]\n', "alerts.webhooks.0.format",
           "must be one of 'json', 'ntfy' or 'slack' (got 'teams')", 5),
    Broken("alerts_webhook_url", GOOD_HEAD + '[alerts]\nwebhooks = [{{ url = "ntfy.sh/gb10" }}]\n', "alerts.webhooks.0.url",
           'must be an http:// or https:// URL such as "https://ntfy.sh/my-gb10"', 5),
    Broken("image_on_a_pair", IMAGE_HEAD + '[cluster]\nrole = "head"\nhead_address = "10.0.0.1"\n', "vllm.image",
           "vLLM from a container image is not supported on a two-machine pair ([cluster]); use vllm.venv or vllm.executable on both machines", 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", BROKEN, ids=[c.name for c in BROKEN])
def test_broken_file_is_explained_with_file_line_key_and_exit_78(case: Broken, tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    if isinstance(case.body, bytes):
        config.write_bytes(case.body)
    else:
        config.write_text(case.body.format(exe=vllm_exe, tmp=tmp_path))
    result = check_config(config)
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("gb10d: ") for line in lines), result.stderr
    assert lines[-1] == f"gb10d: fix the file, then check again with: gb10d check-config --config {config}"
    located = f"{config}:{case.line}:" if case.line else f"{config}"
    matching = [line for line in lines if located in line and case.key in line and case.problem in line]
    assert matching, f"expected {located} {case.key}: {case.problem} in:\n{result.stderr}"


@pytest.mark.slow
def test_exact_message_for_out_of_range_utilization(tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe) + "gpu_memory_utilization = 1.5\n")
    result = check_config(config)
    assert result.stderr.splitlines()[0] == f"gb10d: {config}:4: vllm.gpu_memory_utilization: must be > 0 and <= 1 (got 1.5)"


@pytest.mark.slow
def test_every_problem_gets_its_own_prefixed_line(tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe) + 'port = "x"\ngpu_memory_utilization = 2.0\n[startup]\nwarmup = 1\n')
    lines = check_config(config).stderr.splitlines()
    assert [line.split(": ")[2] for line in lines[:-1]] == ["vllm.port", "vllm.gpu_memory_utilization", "startup.warmup"]


@pytest.mark.slow
def test_toml_syntax_error_gives_line_and_column(tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe) + "port = = 1\n")
    first = check_config(config).stderr.splitlines()[0]
    assert first.startswith(f"gb10d: {config}:4:8: TOML syntax error")


@pytest.mark.slow
def test_missing_file_says_how_to_point_at_another(tmp_path: Path) -> None:
    result = check_config(tmp_path / "absent.toml")
    assert result.returncode == EXIT_CONFIG
    assert f"gb10d: {tmp_path / 'absent.toml'}: file not found" in result.stderr
    assert "--config" in result.stderr


@pytest.mark.slow
def test_directory_instead_of_file_is_explained(tmp_path: Path) -> None:
    result = check_config(tmp_path)
    assert result.returncode == EXIT_CONFIG
    assert f"gb10d: {tmp_path}: is a directory, not a TOML file" in result.stderr


@pytest.mark.slow
def test_unreadable_file_is_explained(tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe))
    config.chmod(0)
    if os.geteuid() != 0:
        result = check_config(config)
    else:
        # Permission bits do not stop root, so run the check as nobody, which is what a
        # mis-owned file does to the gb10d service user.
        try:
            usable = subprocess.run([sys.executable, "-c", "import gb10d.cmdline.cli"], user=65534, capture_output=True, timeout=60).returncode == 0
        except OSError:
            usable = False
        if not usable:
            pytest.skip("running as root and the test interpreter is not usable as nobody, so no user is denied the file")
        tmp_path.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}
        result = subprocess.run(
            [sys.executable, "-m", "gb10d", "check-config", "--config", str(config)],
            capture_output=True, text=True, user=65534, env=env, timeout=120,
        )
    assert result.returncode == EXIT_CONFIG
    assert f"gb10d: {config}: permission denied; make it readable by the user running gb10d" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_executable_without_exec_bit_is_reported(tmp_path: Path) -> None:
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o644)
    config = tmp_path / "gb10d.toml"
    config.write_text(f'[vllm]\nexecutable = "{exe}"\nmodel = "m"\n')
    result = check_config(config)
    assert result.returncode == EXIT_CONFIG
    assert f"gb10d: {config}:2: vllm.executable: {exe} is not executable" in result.stderr


@pytest.mark.slow
def test_env_file_with_a_bad_line_names_that_file_and_line(tmp_path: Path, vllm_exe: Path) -> None:
    secrets = tmp_path / "secrets.env"
    secrets.write_text("# tokens\nHF_TOKEN=hf_x\nthis is not an assignment\n")
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe) + f'env_file = "{secrets}"\n')
    result = check_config(config)
    assert result.returncode == EXIT_CONFIG
    assert f"gb10d: {secrets}:3: not a KEY=value line" in result.stderr
    assert "hf_x" not in result.stderr


@pytest.mark.slow
def test_valid_file_prints_ok_and_a_summary(tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe) + 'served_model_name = "agent"\ngpu_memory_utilization = 0.80\n')
    result = check_config(config)
    assert result.returncode == 0, result.stderr
    ok, summary = result.stdout.splitlines()[:2]
    assert ok == "OK"
    assert "serve Qwen/Qwen3.6-27B-FP8 as agent on 0.0.0.0:8000 with gpu_memory_utilization 0.8" in summary


def test_defaults_fill_every_table() -> None:
    config = Config.model_validate({"vllm": {"venv": "/opt/vllm-env", "model": "m"}})
    assert config.vllm.program == Path("/opt/vllm-env/bin/vllm")
    assert config.metrics.address == ("127.0.0.1", 9400)
    assert config.memory.meminfo_path == Path("/proc/meminfo")
    assert config.vllm.served_names == ["m"]


def test_empty_metrics_listen_disables_the_listener() -> None:
    config = Config.model_validate({"vllm": {"venv": "/v", "model": "m"}, "metrics": {"listen": ""}})
    assert config.metrics.address is None


def test_integer_env_values_become_strings() -> None:
    config = Config.model_validate({"vllm": {"venv": "/v", "model": "m", "env": {"CUDA_VISIBLE_DEVICES": 0}}})
    assert config.vllm.env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_api_key_is_found_in_args_extra_args_or_env() -> None:
    def key(**vllm: object) -> str | None:
        return Config.model_validate({"vllm": {"venv": "/v", "model": "m", **vllm}}).vllm.api_key

    assert key(args={"api_key": "a"}) == "a"
    assert key(extra_args=["--api-key=b"]) == "b"
    assert key(extra_args=["--api-key", "c"]) == "c"
    assert key(env={"VLLM_API_KEY": "d"}) == "d"
    assert key() is None


def test_flag_spellings_name_the_same_flag_but_json_field_names_keep_underscores() -> None:
    assert normalize_flag("max_model_len") == normalize_flag("--max-model-len") == "max-model-len"
    assert normalize_flag("speculative_config.num_speculative_tokens") == "speculative-config.num_speculative_tokens"


def test_dropin_directory_sits_next_to_the_config() -> None:
    assert dropin_dir_for(Path("/etc/gb10d.toml")) == Path("/etc/gb10d.d")
    assert dropin_dir_for(Path("/etc/gb10d/foo.toml")) == Path("/etc/gb10d/foo.d")
    assert dropin_dir_for(Path("/srv/gb10d.conf")) == Path("/srv/gb10d.conf.d")


def write_main_with_dropins(tmp_path: Path, main: str, dropins: dict[str, str]) -> Path:
    config = tmp_path / "gb10d.toml"
    config.write_text(main)
    directory = tmp_path / "gb10d.d"
    directory.mkdir()
    for name, text in dropins.items():
        (directory / name).write_text(text)
    return config


MAIN = '[vllm]\nvenv = "/opt/vllm-env"\nmodel = "m"\nport = 8000\n\n[vllm.args]\nmax_model_len = 131072\nkv-cache-dtype = "fp8"\n'


def test_dropins_merge_in_name_order_and_explain_names_each_source(tmp_path: Path) -> None:
    config = write_main_with_dropins(
        tmp_path,
        MAIN,
        {
            "20-later.toml": "[vllm]\nport = 9002\n",
            "10-first.toml": "[vllm]\nport = 9001\n\n[vllm.args]\nmax-model-len = 65536\n",
            "notes.txt": "[vllm]\nport = 1\n",
        },
    )
    loaded = load_config_explained(config)
    assert loaded.config.vllm.port == 9002
    assert loaded.config.vllm.args == {"kv-cache-dtype": "fp8", "max-model-len": 65536}
    assert loaded.files == (config, tmp_path / "gb10d.d" / "10-first.toml", tmp_path / "gb10d.d" / "20-later.toml")
    assert loaded.source_of("vllm.port") == f"{tmp_path / 'gb10d.d' / '20-later.toml'}:2"
    assert loaded.source_of("vllm.args.max-model-len") == f"{tmp_path / 'gb10d.d' / '10-first.toml'}:5"
    assert loaded.source_of("vllm.args.kv-cache-dtype") == f"{config}:8"
    assert loaded.source_of("startup.stall_timeout_s") == "default"


def test_dropin_tables_merge_key_by_key_and_arrays_are_replaced(tmp_path: Path) -> None:
    config = write_main_with_dropins(
        tmp_path,
        MAIN + '[vllm.env]\nA = "1"\nB = "2"\n[startup]\nload_strategy_ladder = ["eager", "lazy"]\nwarmup = false\n',
        {"50.toml": '[vllm.env]\nB = "3"\n[startup]\nload_strategy_ladder = ["prefetch"]\n'},
    )
    config_value = load_config(config)
    assert config_value.vllm.env == {"A": "1", "B": "3"}
    assert config_value.startup.load_strategy_ladder == ["prefetch"]
    assert config_value.startup.warmup is False


def test_dropin_choosing_executable_replaces_the_main_files_venv(tmp_path: Path) -> None:
    config = write_main_with_dropins(tmp_path, MAIN, {"10.toml": '[vllm]\nexecutable = "/usr/local/bin/vllm"\n'})
    vllm = load_config(config).vllm
    assert vllm.venv is None
    assert vllm.program == Path("/usr/local/bin/vllm")


@pytest.mark.slow
def test_error_in_a_dropin_names_the_dropin_file_and_line(tmp_path: Path, vllm_exe: Path) -> None:
    config = write_main_with_dropins(
        tmp_path,
        GOOD_HEAD.format(exe=vllm_exe),
        {"10-ok.toml": "[vllm]\nport = 9000\n", "20-bad.toml": "# too much\n[vllm]\ngpu_memory_utilization = 1.5\n"},
    )
    result = check_config(config)
    assert result.returncode == EXIT_CONFIG
    dropin = tmp_path / "gb10d.d" / "20-bad.toml"
    assert f"gb10d: {dropin}:3: vllm.gpu_memory_utilization: must be > 0 and <= 1 (got 1.5)" in result.stderr


def test_syntax_errors_in_several_dropins_are_reported_together(tmp_path: Path, vllm_exe: Path) -> None:
    config = write_main_with_dropins(
        tmp_path, GOOD_HEAD.format(exe=vllm_exe), {"10.toml": "[vllm\n", "20.toml": "x = \n"}
    )
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert [p.path for p in caught.value.problems] == [str(tmp_path / "gb10d.d" / "10.toml"), str(tmp_path / "gb10d.d" / "20.toml")]
    assert all(p.line == 1 for p in caught.value.problems)


@pytest.mark.slow
def test_dropin_path_that_is_a_file_is_an_error(tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe))
    (tmp_path / "gb10d.d").write_text("oops")
    result = check_config(config)
    assert result.returncode == EXIT_CONFIG
    assert f"gb10d: {tmp_path / 'gb10d.d'}: is not a directory" in result.stderr


def test_empty_dropin_changes_nothing(tmp_path: Path) -> None:
    config = write_main_with_dropins(tmp_path, MAIN, {"10-empty.toml": "# nothing yet\n"})
    assert load_config(config).vllm.port == 8000


def test_unreadable_dropin_directory_entries_are_skipped_when_hidden(tmp_path: Path) -> None:
    config = write_main_with_dropins(tmp_path, MAIN, {".10-editor-backup.toml": "[vllm]\nport = 1\n"})
    assert load_config(config).vllm.port == 8000


@pytest.mark.slow
def test_shipped_example_is_a_valid_config_apart_from_the_venv(tmp_path: Path, vllm_exe: Path) -> None:
    shipped = Path(__file__).parents[2] / "etc" / "gb10d.toml"
    copy = tmp_path / "gb10d.toml"
    shutil.copy(shipped, copy)
    text = copy.read_text().replace('venv = "/opt/vllm-env"', f'venv = "{vllm_exe.parent.parent}"')
    copy.write_text(text)
    result = check_config(copy)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(vllm_exe.stat().st_mode) & 0o111


@pytest.mark.slow
def test_file_that_cannot_be_read_for_another_reason_is_explained(tmp_path: Path) -> None:
    # A symlink loop fails to open for root too, so this case runs on every machine.
    config = tmp_path / "gb10d.toml"
    config.symlink_to(config)
    result = check_config(config)
    assert result.returncode == EXIT_CONFIG
    assert f"gb10d: {config}: cannot read: Too many levels of symbolic links" in result.stderr
    assert "Traceback" not in result.stderr


# --- paths the service user cannot reach ----------------------------------------------

LOCKED_UID = 1000  # a login user's files, in a home of mode 0750 as Ubuntu 24.04 makes them


@pytest.fixture
def locked(tmp_path: Path) -> Path:
    """A directory every user may enter holding `home` (mode 0750, a login user's) and `open` (writable by all)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="gb10d-paths-", dir="/tmp"))
    base.chmod(0o755)
    (base / "open").mkdir(mode=0o777)
    (base / "open").chmod(0o1777)
    home = base / "home"
    for program in ("venv/bin/vllm", "venv/bin/ray"):
        path = home / program
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    (home / "secrets.env").write_text("HF_TOKEN=hf_x\n")
    (home / "model").mkdir()
    (home / "model" / "config.json").write_text("{}")
    for path in [home, *home.rglob("*")]:
        os.chown(path, LOCKED_UID, LOCKED_UID)
    home.chmod(0o750)
    yield base
    shutil.rmtree(base)


def unreachable_config(base: Path, vllm: str, tail: str = "") -> str:
    """A config whose caches are in a directory open to all, so only the path under test is out of reach."""
    return (
        f'[vllm]\n{vllm}\n[vllm.env]\nHF_HOME = "{base}/open/hf"\nVLLM_CACHE_ROOT = "{base}/open/vllm"\n'
        f'TRITON_CACHE_DIR = "{base}/open/triton"\n{tail}'
    )


PATH_KEYS = {
    "venv": ('venv = "{base}/home/venv"\nmodel = "Qwen/Qwen3.6-27B-FP8"', "", 2, "vllm.venv", "the program {base}/home/venv/bin/vllm"),
    "executable": ('executable = "{base}/home/venv/bin/vllm"\nmodel = "Qwen/Qwen3.6-27B-FP8"', "", 2, "vllm.executable", "the program {base}/home/venv/bin/vllm"),
    "env_file": ('executable = "{exe}"\nmodel = "Qwen/Qwen3.6-27B-FP8"\nenv_file = "{base}/home/secrets.env"', "", 4, "vllm.env_file", "the file {base}/home/secrets.env"),
    "model_directory": ('executable = "{exe}"\nmodel = "{base}/home/model"', "", 3, "vllm.model", "the model directory {base}/home/model"),
    "cluster_ray": ('executable = "{exe}"\nmodel = "Qwen/Qwen3.6-27B-FP8"', '[cluster]\nrole = "worker"\nhead_address = "10.0.0.1"\nray = "{base}/home/venv/bin/ray"\n',
                    11, "cluster.ray", "the program {base}/home/venv/bin/ray"),
}


@pytest.mark.slow
@pytest.mark.parametrize("key", list(PATH_KEYS))
def test_a_path_the_service_user_cannot_reach_is_named_as_such_with_the_ways_out(key: str, locked: Path, vllm_exe: Path) -> None:
    vllm, tail, line, dotted, what = PATH_KEYS[key]
    (vllm_exe.parent / "ray").write_text("#!/bin/sh\n")
    (vllm_exe.parent / "ray").chmod(0o755)
    shutil.copytree(vllm_exe.parent.parent, locked / "open" / "venv")
    exe = locked / "open" / "venv" / "bin" / "vllm"
    config = locked / "open" / "gb10d.toml"
    config.write_text(unreachable_config(locked, vllm.format(base=locked, exe=exe), tail.format(base=locked)))
    result = check_config(config, "--user", "nobody")
    assert result.returncode == EXIT_CONFIG, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    cause = f"{what.format(base=locked)} exists, but {locked}/home is mode 0750 and the service user nobody may not enter it"
    assert lines[0] == f"gb10d: {config}:{line}: {dotted}: {cause}", result.stderr
    assert "does not exist" not in result.stderr and "Traceback" not in result.stderr
    # The way out that keeps the service user: let it in through the home's group.
    assert f"gb10d:   or keep the user nobody and let it enter {locked}/home as a member of the group" in result.stderr or \
        f"gb10d:   keep the user nobody and let it enter {locked}/home as a member of the group" in result.stderr, result.stderr
    assert "sudo usermod -aG" in result.stderr and lines[-1] == f"gb10d: then check again with: sudo gb10d check-config --config {config}"


@pytest.mark.slow
def test_the_same_paths_are_fine_for_their_owner(locked: Path) -> None:
    config = locked / "open" / "gb10d.toml"
    config.write_text(unreachable_config(locked, f'venv = "{locked}/home/venv"\nmodel = "{locked}/home/model"\nenv_file = "{locked}/home/secrets.env"'))
    owner = subprocess.run(["getent", "passwd", str(LOCKED_UID)], capture_output=True, text=True).stdout.split(":")[0]
    if not owner:
        pytest.skip(f"no user with uid {LOCKED_UID} on this machine")
    result = check_config(config, "--user", owner)
    assert result.returncode == 0, result.stderr
    assert f"paths checked as {owner} (--user)" in result.stdout


@pytest.mark.slow
def test_a_cache_the_service_must_write_in_but_cannot_is_named_with_its_variable(locked: Path, vllm_exe: Path) -> None:
    config = locked / "open" / "gb10d.toml"
    config.write_text(f'[vllm]\nexecutable = "{vllm_exe}"\nmodel = "Qwen/Qwen3.6-27B-FP8"\n[vllm.env]\nHF_HOME = "{locked}/open/hf"\n'
                      f'VLLM_CACHE_ROOT = "{locked}/home/.cache/vllm"\nTRITON_CACHE_DIR = "{locked}/open/triton"\n')
    shutil.copytree(vllm_exe.parent.parent, locked / "open" / "venv")
    config.write_text(config.read_text().replace(str(vllm_exe), str(locked / "open" / "venv" / "bin" / "vllm")))
    result = check_config(config, "--user", "nobody")
    assert result.returncode == EXIT_CONFIG
    assert (f"gb10d: {config}:6: vllm.env.VLLM_CACHE_ROOT: vLLM writes its compile cache in {locked}/home/.cache/vllm, "
            f"but {locked}/home is mode 0750 and the service user nobody may not enter it") in result.stderr, result.stderr


@pytest.mark.slow
def test_offline_without_the_model_in_the_cache_is_a_config_error(tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe) + f'[vllm.env]\nHF_HUB_CACHE = "{tmp_path}/hub"\nHF_HUB_OFFLINE = "1"\n')
    result = check_config(config)
    assert result.returncode == EXIT_CONFIG
    assert (f"vllm.env.HF_HUB_CACHE: Qwen/Qwen3.6-27B-FP8 is not in the Hugging Face cache {tmp_path}/hub (HF_HUB_CACHE from [vllm.env]), "
            "and HF_HUB_OFFLINE=1 keeps vLLM from downloading it") in result.stderr, result.stderr


def test_dropin_choosing_an_image_replaces_the_main_files_venv(tmp_path: Path) -> None:
    config = write_main_with_dropins(tmp_path, MAIN, {"10.toml": '[vllm]\nimage = "nvcr.io/nvidia/vllm:26.05-py3"\n[container]\npull = "never"\n'})
    loaded = load_config_explained(config)
    assert loaded.config.vllm.venv is None and loaded.config.vllm.image == "nvcr.io/nvidia/vllm:26.05-py3"
    assert loaded.config.container.pull == "never"
    assert loaded.source_of("container.pull") == f"{tmp_path / 'gb10d.d' / '10.toml'}:4"


def test_container_settings_are_listed_only_for_an_image() -> None:
    venv = Config.model_validate({"vllm": {"venv": "/v", "model": "m"}})
    image = Config.model_validate({"vllm": {"image": "nvcr.io/nvidia/vllm:26.05-py3", "model": "m"}})
    assert "container" not in dict(venv.tables())
    assert dict(image.tables())["container"] == image.container
    assert image.container.engine == "auto" and image.container.pull == "missing" and image.container.cache_dir == Path("/var/cache/gb10d")


@pytest.mark.parametrize(("body", "shown"), [
    ('"" = 0\n', '"": unknown key'),
    ('"a\\nb" = 0\n', '"a\\nb": unknown key'),
    ('[vllm.env]\n"NAME WITH SPACE" = "x"\n', 'vllm.env."NAME WITH SPACE": is not an environment variable name'),
])
def test_a_key_that_is_empty_or_holds_a_space_or_newline_is_named_quoted_on_one_line(tmp_path: Path, vllm_exe: Path, body: str, shown: str) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe) + body)
    with pytest.raises(ConfigError) as raised:
        load_config(config)
    [problem] = [str(p) for p in raised.value.problems]
    assert shown in problem and "\n" not in problem


def test_a_config_saved_with_a_utf8_byte_order_mark_loads(tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_bytes(b"\xef\xbb\xbf" + GOOD_HEAD.format(exe=vllm_exe).encode() + b"port = 9000\n")
    loaded = load_config_explained(config)
    assert loaded.config.vllm.port == 9000 and loaded.source_of("vllm.port") == f"{config}:4"


@pytest.mark.parametrize(("encoding", "named"), [("utf-16", "UTF-16"), ("utf-32", "UTF-32")])
def test_a_config_saved_as_utf16_or_utf32_is_named_as_such_with_the_fix(tmp_path: Path, vllm_exe: Path, encoding: str, named: str) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_bytes(GOOD_HEAD.format(exe=vllm_exe).encode(encoding))
    with pytest.raises(ConfigError) as raised:
        load_config(config)
    assert [str(p) for p in raised.value.problems] == [f"{config}:1: is {named} text (it starts with a {named} byte-order mark); save it as UTF-8"]


def test_an_unknown_key_written_with_an_escape_is_found_on_its_line(tmp_path: Path, vllm_exe: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text(GOOD_HEAD.format(exe=vllm_exe) + '"tab\\there" = 1\n')
    with pytest.raises(ConfigError) as raised:
        load_config(config)
    assert [str(p) for p in raised.value.problems] == [f'{config}:4: vllm."tab\\there": unknown key; remove it']
