"""`gb10d front` refuses a config it cannot serve, with file, line, key and fix, exit 78 and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from gb10d.cmdline.cli import main


def write_instance(directory: Path, name: str, port: int, served: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.toml").write_text(f'[vllm]\nvenv = "/opt/vllm"\nmodel = "m"\nserved_model_name = "{served}"\nport = {port}\n')


def front(tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str) -> tuple[int, str]:
    config = tmp_path / "gb10d.toml"
    config.write_text("[front]\n" + table)
    status = main(["--config", str(config), "front"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return status, captured.out + captured.err


def test_a_bad_front_key_is_named_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, said = front(tmp_path, capsys, 'listen = "8000"\nqueue_limit = 0\n')
    assert status == 78
    assert f"{tmp_path / 'gb10d.toml'}:2: front.listen: must be \"HOST:PORT\"" in said and ":3: front.queue_limit: must be >= 1" in said


def test_an_instance_on_the_fronts_port_or_a_model_served_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_instance(tmp_path / "instances", "a", 8000, "qwen")
    write_instance(tmp_path / "instances", "b", 8102, "qwen")
    status, said = front(tmp_path, capsys, f'instances_dir = "{tmp_path / "instances"}"\n')
    assert status == 78
    assert "a.toml:5: vllm.port: is 8000, the front's own port (front.listen)" in said
    assert "b.toml:4: vllm.served_model_name: serves 'qwen', which instance a serves too" in said


def test_no_instance_at_all_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, said = front(tmp_path, capsys, f'instances_dir = "{tmp_path / "none"}"\n')
    assert status == 78 and "the front has nothing to serve" in said


def test_short_api_keys_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, said = front(tmp_path, capsys, 'api_keys = ["Kq7fZp2x"]\n')
    assert status == 78 and "front.api_keys: each key must be at least 16 characters" in said and "Kq7fZp2x" not in said


def test_a_bad_entry_of_the_api_keys_file_is_named_by_its_line_and_never_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_instance(tmp_path / "instances", "a", 8101, "qwen")
    keys = tmp_path / "front.keys"
    keys.write_text("# one key a line\nfront-key-0123456789 qwen\n\nKq7fZp2x qwen\n")
    status, said = front(tmp_path, capsys, f'instances_dir = "{tmp_path / "instances"}"\napi_keys_file = "{keys}"\n')
    assert status == 78 and f"{keys}:4: each key must be at least 16 characters" in said
    assert "Kq7fZp2x" not in said and "front-key-0123456789" not in said


def test_an_unreadable_api_keys_file_is_refused_with_the_way_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_instance(tmp_path / "instances", "a", 8101, "qwen")
    status, said = front(tmp_path, capsys, f'instances_dir = "{tmp_path / "instances"}"\napi_keys_file = "{tmp_path / "missing.keys"}"\n')
    assert status == 78 and f"{tmp_path / 'missing.keys'}: front.api_keys_file: cannot be read (No such file or directory)" in said
    assert "root:gb10d, mode 0640" in said


def test_a_socket_unit_on_another_port_than_front_listen_is_named() -> None:
    from gb10d.base.frontconfig import FrontSection, socket_differs

    front = FrontSection(listen="0.0.0.0:8001")
    assert socket_differs(front, []) is None
    assert socket_differs(FrontSection(listen="0.0.0.0:8000"), ["[::]:8000"]) is None
    warning = socket_differs(front, ["[::]:8000"])
    assert warning is not None and "gb10d-front.socket listens on [::]:8000" in warning and "systemctl edit gb10d-front.socket" in warning
