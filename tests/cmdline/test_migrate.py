"""import-script's second step: what the service will do differently from the script, and what it reuses."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gb10d.cmdline.migrate import Surroundings, for_the_service, merge
from gb10d.machine.access import WayOut
from gb10d.vllm.importscript import Imported
from hub_support import populate_hub

MODEL = "Qwen/Qwen3.6-27B-FP8"
HUB = "/home/alice/.cache/huggingface/hub"


def found(**changes: object) -> Surroundings:
    values: dict[str, object] = dict(operator="alice", home="/home/alice", hub=HUB, model_cached=True,
                                     compile_cache="/home/alice/.cache/vllm", compile_cache_exists=True)
    values.update(changes)
    return Surroundings(**values)  # type: ignore[arg-type]


def test_a_model_already_downloaded_is_read_where_it_is_offline_and_not_copied() -> None:
    adapted = for_the_service({"model": MODEL, "venv": "/home/alice/vllm-pip-env"}, found())
    assert adapted.data == {"vllm": {"env": {"HF_HUB_CACHE": HUB, "HF_HUB_OFFLINE": "1"}}}
    assert any(n.startswith(f"{MODEL} is already in alice's Hugging Face cache {HUB}") and "nothing is copied" in n for n in adapted.notes)


def test_a_model_not_downloaded_yet_is_left_to_the_services_own_cache() -> None:
    adapted = for_the_service({"model": MODEL}, found(model_cached=False))
    assert adapted.data == {}
    assert any("the service downloads it at its first start, into /var/cache/gb10d/huggingface" in n for n in adapted.notes)


def test_a_cache_the_script_chose_itself_is_kept() -> None:
    adapted = for_the_service({"model": MODEL, "env": {"HF_HOME": "/data/hf"}}, found(hub="/data/hf/hub"))
    assert adapted.data == {}
    assert any(n.startswith("the script's HF_HOME=/data/hf is kept") for n in adapted.notes)


def test_the_notes_say_who_runs_vllm_and_where_the_compile_caches_are() -> None:
    notes = for_the_service({"model": "/srv/models/q"}, found()).notes
    assert notes[0] == ("the service runs vLLM as the system user gb10d, not as alice who ran this script; "
                        "to run it as alice, with alice's caches: sudo gb10d service-user alice")
    assert any(n.startswith("vLLM's compile caches start cold once, in /var/cache/gb10d/vllm") and "/home/alice/.cache/vllm is not shared" in n
               for n in notes)


def test_what_the_service_user_cannot_reach_is_a_warning_with_both_ways_out() -> None:
    ways = [WayOut("run the service as alice", "sudo gb10d service-user alice"), WayOut("let gb10d in", "sudo usermod -aG alice gb10d")]
    warnings = for_the_service({"model": MODEL}, found(blocked=["/home/alice is mode 0750 and the service user gb10d may not enter it"], ways=ways)).warnings
    assert warnings == [
        "as things are, the service user gb10d cannot use this: /home/alice is mode 0750 and the service user gb10d may not enter it",
        "two ways out:",
        "run the service as alice: sudo gb10d service-user alice",
        "or let gb10d in: sudo usermod -aG alice gb10d",
    ]


@pytest.mark.slow
def test_import_script_points_the_config_at_the_model_in_the_authors_cache(tmp_path: Path) -> None:
    home = tmp_path / "home"
    populate_hub(home / ".cache" / "huggingface" / "hub", MODEL)
    script = tmp_path / "start.sh"
    script.write_text(f'source /opt/vllm/bin/activate\nnohup vllm serve {MODEL} --port 8000 > "$HOME/vllm.log" 2>&1 &\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "XDG_", "SUDO_"))}
    done = subprocess.run([sys.executable, "-m", "gb10d", "import-script", str(script)], capture_output=True, text=True,
                          env={**env, "HOME": str(home)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["vllm"]["env"] == {"HF_HUB_CACHE": f"{home}/.cache/huggingface/hub", "HF_HUB_OFFLINE": "1"}
    assert "# note: the service runs vLLM as the system user gb10d" in done.stdout


@pytest.mark.slow
def test_import_script_reads_tilde_as_the_home_of_whoever_runs_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    script = tmp_path / "start.sh"
    script.write_text("source ~/vllm-pip-env/bin/activate\nvllm serve /srv/models/q --port 8000\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUDO_")}
    done = subprocess.run([sys.executable, "-m", "gb10d", "import-script", str(script)], capture_output=True, text=True,
                          env={**env, "HOME": str(home)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["vllm"]["venv"] == f"{home}/vllm-pip-env"
    assert f"# note: read ~ as {home}, as when" in done.stdout
    assert "relative to the directory" not in done.stdout and "is not set in the script" not in done.stdout


IMAGE = {"model": MODEL, "image": "nvcr.io/nvidia/vllm:26.05-py3"}


def test_an_image_reads_the_authors_cache_through_the_scripts_mount_offline() -> None:
    adapted = for_the_service(IMAGE, found(), {"mounts": ["/home/alice/.cache/huggingface:/root/.cache/huggingface"]})
    assert adapted.data == {"vllm": {"env": {"HF_HUB_CACHE": "/root/.cache/huggingface/hub", "HF_HUB_OFFLINE": "1"}}}
    assert adapted.warnings == []
    assert not any("compile caches" in n or "service-user" in n for n in adapted.notes)
    assert any("reads it as /root/.cache/huggingface/hub through the script's mount" in n for n in adapted.notes)


def test_an_image_without_a_cache_mount_gets_the_authors_cache_read_only_where_the_env_points() -> None:
    adapted = for_the_service(IMAGE, found(), {"mounts": ["/srv/models:/models:ro"]})
    assert adapted.data == {"vllm": {"env": {"HF_HUB_CACHE": HUB, "HF_HUB_OFFLINE": "1"}}, "container": {"mounts": [f"{HUB}:{HUB}:ro"]}}
    merged = merge(Imported({"vllm": dict(IMAGE), "container": {"mounts": ["/srv/models:/models:ro"]}}, [], []), adapted)
    assert merged.data["container"]["mounts"] == ["/srv/models:/models:ro", f"{HUB}:{HUB}:ro"]


@pytest.mark.slow
def test_the_playbooks_command_imports_to_a_config_check_config_passes_and_the_old_import_fails(tmp_path: Path) -> None:
    home = tmp_path / "home"
    populate_hub(home / ".cache" / "huggingface" / "hub", "Qwen/Qwen2.5-Math-1.5B-Instruct")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "XDG_", "SUDO_"))}
    env["HOME"] = str(home)
    script = Path(__file__).parent.parent / "fixtures" / "scripts" / "playbook.sh"
    done = subprocess.run([sys.executable, "-m", "gb10d", "import-script", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "# warning:" not in done.stdout
    config = tmp_path / "gb10d.toml"
    config.write_text(done.stdout)
    checked = subprocess.run([sys.executable, "-m", "gb10d", "check-config", "--config", str(config)], capture_output=True, text=True, env=env, timeout=60)
    assert checked.returncode == 0, checked.stderr
    # What the import used to write: the host's cache path in the env, and no mount that shows it.
    old = tmp_path / "old.toml"
    old.write_text(f'[vllm]\nmodel = "Qwen/Qwen2.5-Math-1.5B-Instruct"\nimage = "nvcr.io/nvidia/vllm:26.05-py3"\n\n'
                   f'[vllm.env]\nHF_HUB_CACHE = "{home}/.cache/huggingface/hub"\nHF_HUB_OFFLINE = "1"\n')
    checked = subprocess.run([sys.executable, "-m", "gb10d", "check-config", "--config", str(old)], capture_output=True, text=True, env=env, timeout=60)
    assert checked.returncode == 78
    assert f"{old}:6: vllm.env.HF_HUB_CACHE: vLLM looks for Qwen/Qwen2.5-Math-1.5B-Instruct in {home}/.cache/huggingface/hub inside the container" in checked.stderr
    assert "it will not find the model" in checked.stderr
