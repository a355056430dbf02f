"""The record of vLLM programs: the good one, a candidate, a rejected one (pure decisions and the file)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from config_support import make_config
from gb10d.core import programs
from gb10d.core.programs import Program, Programs, Rejected
from gb10d.machine import programsfile

config = partial(make_config, {"vllm": {"model": "m", "venv": "/opt/vllm-new"}})


GOOD = Program("/opt/vllm-old", "venv", "0.33.0", "abc")


def test_only_another_program_than_the_good_one_is_a_candidate() -> None:
    assert programs.is_candidate(config(), Programs(GOOD))
    assert not programs.is_candidate(config(vllm={"venv": "/opt/vllm-old"}), Programs(GOOD))
    assert not programs.is_candidate(config(), Programs()), "nothing served yet: nothing to go back to"


def test_serving_makes_a_program_the_good_one_and_forgets_its_own_rejection_only() -> None:
    new = Program("/opt/vllm-new", "venv", "0.34.0")
    rejected = programs.reject(Programs(GOOD), new, "ModuleNotFoundError: No module named 'vllm'", "t1")
    assert programs.is_rejected(config(), rejected)
    assert programs.served(rejected, new, "t2") == Programs(new, "t2", None)
    other = Rejected(Program("/opt/vllm-x"), "crash", "t0")
    assert programs.served(Programs(GOOD, "t0", other), new, "t2").rejected == other


def test_falling_back_puts_the_good_program_in_place_of_any_kind() -> None:
    assert programs.fall_back(config(), GOOD).vllm.venv == Path("/opt/vllm-old")
    image = Program("nvcr.io/nvidia/vllm:26.05-py3", "image")
    back = programs.fall_back(config(), image).vllm
    assert (back.image, back.venv, back.executable) == ("nvcr.io/nvidia/vllm:26.05-py3", None, None)
    assert programs.fall_back(config(vllm={"image": "nvcr.io/nvidia/vllm:26.06-py3"}), GOOD).vllm.image is None


def test_the_record_survives_a_round_trip_and_a_damaged_one_is_empty(tmp_path: Path) -> None:
    path = programs.programs_file(tmp_path / "lib" / "state.toml")
    assert path == tmp_path / "lib" / "state.programs.toml"
    assert programsfile.load(path) == Programs()
    record = Programs(GOOD, "t0", Rejected(Program("/opt/vllm-new", "venv", None), "crash", "t1"))
    programsfile.save(path, record)
    assert programsfile.load(path) == record
    assert path.stat().st_mode & 0o777 == 0o644, "readable by the operators gb10d status shows it to"
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary left beside it"
    path.write_text("[good\n")
    assert programsfile.load(path) == Programs()


def test_a_venvs_packages_hash_changes_with_what_is_installed(tmp_path: Path) -> None:
    site = tmp_path / "lib" / "python3.12" / "site-packages"
    assert programsfile.packages_hash(tmp_path) is None
    (site / "vllm-0.33.0.dist-info").mkdir(parents=True)
    before = programsfile.packages_hash(tmp_path)
    (site / "vllm-0.33.0.dist-info").rename(site / "vllm-0.34.0.dist-info")
    assert before is not None and programsfile.packages_hash(tmp_path) not in (None, before)
