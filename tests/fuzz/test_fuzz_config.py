"""Fuzzing the config: TOML generated from the schema, then mutated (wrong types, values out of range, unknown keys,
duplicate tables, odd encodings, drop-ins). A load succeeds or raises ConfigError whose every problem names its
file (and its line and key where it has them); `gb10d check-config` exits 0 or 78 and prints `gb10d: ` lines,
never a traceback."""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import shutil
import subprocess
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Iterator

import annotated_types
import pytest
import tomli_w
from hypothesis import event, given
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from fuzz_support import budget, mutated_bytes
from gb10d.base.config import PROGRAM_KEYS, Config, VllmSection
from gb10d.base.configfile import dropin_dir_for
from gb10d.base.configload import load_config_explained
from gb10d.base.errors import EXIT_CONFIG, ConfigError
from gb10d.cmdline.cli import main

# Values worth trying for the keys whose strings are checked: the valid ones first, then mistakes.
_SAMPLES: dict[str, tuple[list[Any], list[Any]]] = {
    "model": (["Qwen/Qwen3.6-27B-FP8", "/srv/models/llama"], [" ", "", "../model", "~/m"]),
    "image": (["nvcr.io/nvidia/vllm:26.05-py3", "vllm/vllm-openai:latest"], ["Bad Image", "", "a@sha256:00", "x:" + "9" * 200]),
    "host": (["0.0.0.0", "127.0.0.1", "::1", "localhost"], ["", "a b"]),
    "listen": (["127.0.0.1:9400", "", "[::1]:9400"], ["9400", ":80", "h:0", "h:99999", "h:x"]),
    "metrics_listen": (["127.0.0.1:9500", ""], ["h:0"]),
    "url": (["https://ntfy.sh/gb10", "http://x"], ["ftp://x", "", "https://"]),
    "kernel_log": (["journal", "kmsg", "none", "/var/log/kern.log"], ["file", ""]),
    "ledger_dir": ([""], ["/run/gb10d-ledger-fuzz", "relative"]),
    "name": (["gb10d", "ok.name_1"], ["-x", "a" * 200, ""]),
    "shm_size": (["16g", "512m"], ["0", "16 g", "g"]),
    "interface": (["enp1s0f0np0"], ["a/b", "x" * 16, ""]),
    "head_address": (["10.0.0.1"], ["10.0.0", "::1", "256.1.1.1", ""]),
    "served_model_name": (["qwen", ["a", "b"]], [[], [""], " "]),
    "mounts": ([["/srv/models:/models:ro"]], [["a:b"], ["/a"], ["/a:/b:ro:x"]]),
    "run_args": ([["--ulimit=memlock=-1"]], [["--gpus=all"], ["--device=nvidia.com/gpu=0"], ["--name=x"]]),
    "ray_args": ([["--num-cpus=8"]], [["--head"], ["--address=1.2.3.4"]]),
    "extra_args": ([["--disable-log-stats"], ["--trust-remote-code"]], [["--port=1"], ["--max-model-len", "1024"], ["--enforce-eager"]]),
    "gpu_memory_utilization": ([0.9, 0.5, 1.0, 0.31], [0, 1.5, -0.1, 1e300]),
    "api_keys": ([["k" * 20], ["k" * 20 + " qwen"]], [["short"]]),
    "instances_dir": (["/etc/gb10d"], ["etc"]),
}
_FLAGS = (["max-model-len", "enforce-eager", "kv-cache-dtype", "max_num_seqs"], ["max_model_len", "tensor-parallel-size", "port", "api-key", "BAD FLAG", ""])
_ENV_NAMES = (["CUDA_VISIBLE_DEVICES", "HF_TOKEN", "VLLM_API_KEY"], ["1BAD", "A-B", ""])
_PATHS = (["/opt/vllm-env", "/usr/bin/vllm", "/nonexistent/\u00e9", "/tmp/x y"], ["relative/path", "", "/"])
_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
_WORD = st.from_regex(r"[a-z][a-z0-9._-]{0,10}", fullmatch=True)


def _pick(choices: tuple[list[Any], list[Any]], clean: bool) -> st.SearchStrategy[Any]:
    return st.sampled_from(choices[0] if clean else choices[0] + choices[1])


def _bounds(info: FieldInfo) -> tuple[float | None, bool, float | None]:
    low = high = None
    exclusive = False
    for meta in info.metadata:
        if isinstance(meta, (annotated_types.Ge, annotated_types.Gt)):
            exclusive = isinstance(meta, annotated_types.Gt)
            low = float(meta.gt if isinstance(meta, annotated_types.Gt) else meta.ge)
        if isinstance(meta, (annotated_types.Le, annotated_types.Lt)):
            high = float(meta.le if isinstance(meta, annotated_types.Le) else meta.lt)
    return low, exclusive, high


def _value(name: str, annotation: Any, info: FieldInfo, clean: bool) -> st.SearchStrategy[Any]:
    """Values of the schema's type for this key: valid ones when `clean`, else some mistakes too."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if name in _SAMPLES:
        return _pick(_SAMPLES[name], clean)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_value(name, a, info, clean) for a in args if a is not type(None)])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return table(annotation, clean)
    if annotation is bool:
        return st.booleans()
    if annotation in (int, float):
        low, exclusive, high = _bounds(info)
        low = low if low is not None else 0.0
        high = high if high is not None else max(low * 10, 3600.0 if clean else 1e9)
        if annotation is int:
            return st.integers(int(low) + exclusive, int(high))
        return st.floats(low, high, exclude_min=exclusive, allow_nan=False)
    if annotation is Path:
        return _pick(_PATHS, clean)
    if annotation is str:
        return _WORD if clean else _TEXT
    if origin is list:
        return st.lists(_value(name, args[0], info, clean), max_size=3)
    if origin is dict and args[1] is str:
        return st.dictionaries(_pick(_ENV_NAMES, clean) | (st.nothing() if clean else _TEXT), _WORD if clean else _TEXT, max_size=3)
    if origin is dict:
        scalar = st.integers(1, 1 << 20) | st.booleans() | _WORD
        if not clean:
            scalar = scalar | st.integers(-5, 0) | _TEXT | st.floats(allow_nan=False, allow_infinity=False)
        values = scalar | st.lists(scalar, max_size=2) | (st.nothing() if clean else st.dictionaries(_TEXT, scalar, max_size=2))
        return st.dictionaries(_pick(_FLAGS, clean), values, max_size=4)
    return st.sampled_from(["10.0.0.1"] if clean else ["10.0.0.1", "x"])  # IPv4Address


def table(model: type[BaseModel], clean: bool, leave_out: tuple[str, ...] = ()) -> st.SearchStrategy[dict[str, Any]]:
    """A table of `model`: its required keys, and any of the others."""
    fields = {name: _value(name, info.annotation, info, clean) for name, info in model.model_fields.items() if name not in leave_out}
    required = {n: s for n, s in fields.items() if model.model_fields[n].is_required()}
    return st.fixed_dictionaries(required, optional={n: s for n, s in fields.items() if n not in required})


@st.composite
def configs(draw: st.DrawFn, program: str | None = None, images: bool = True) -> dict[str, Any]:
    """A config as a dict: [vllm] with one program (sometimes none or two), and some other tables of the schema.

    `program`: a venv, which `venv` names and `executable` names the `vllm` of.

    Half of them are made of valid values, so that the loads that succeed are fuzzed too; then mutations.
    """
    clean = draw(st.booleans())
    vllm = draw(table(VllmSection, clean, leave_out=PROGRAM_KEYS))
    keys = PROGRAM_KEYS if images else tuple(k for k in PROGRAM_KEYS if k != "image")
    count = 1 if clean else draw(st.sampled_from([1, 1, 1, 1, 0, 2]))
    for key in draw(st.lists(st.sampled_from(keys), min_size=count, max_size=count, unique=True)):
        info = VllmSection.model_fields[key]
        if program is not None and key != "image":
            vllm[key] = program if key == "venv" else f"{program}/bin/vllm"
        else:
            vllm[key] = draw(_value(key, info.annotation, info, clean))
    if clean:
        vllm.pop("env_file", None)  # a file that is not there fails check-config, as it should
    config: dict[str, Any] = {"vllm": vllm}
    for name, info in Config.model_fields.items():
        if clean and name == "container" and "image" not in vllm:
            continue
        if name != "vllm" and draw(st.integers(0, 3)) == 0:
            config[name] = draw(_value(name, info.annotation, info, clean))
    # Samples are shared between examples: mutate a copy.
    return draw(_mutated(copy.deepcopy(config))) if not clean or draw(st.integers(0, 3)) == 0 else config


_WRONG = st.sampled_from([0, -1, 1.5, float("inf"), float("nan"), True, "", "8000", [], [1, "a"], {}, {"x": 1},
                          datetime.datetime(2026, 1, 1, 0, 0), datetime.date(2026, 1, 1), datetime.time(1, 2), 10**30])
_CLOSE_KEYS = st.sampled_from(["prot", "model_name", "gpu-memory-utilization", "max_model_len", "venvs", "Port", "", " ", "a.b", "é", "vllm"])


def _leaves(data: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in data.items():
        yield path + (key,)
        if isinstance(value, dict):
            yield from _leaves(value, path + (key,))


@st.composite
def _mutated(draw: st.DrawFn, data: dict[str, Any]) -> dict[str, Any]:
    """Some keys' values replaced by values of the wrong type or range, and unknown keys added."""
    for _ in range(draw(st.integers(0, 3))):
        paths = list(_leaves(data))
        where = draw(st.sampled_from(paths))
        parent = data
        for part in where[:-1]:
            parent = parent[part]
        if draw(st.booleans()):
            parent[where[-1]] = copy.deepcopy(draw(_WRONG))
        else:
            holder = parent if draw(st.booleans()) else data
            holder[draw(_CLOSE_KEYS | _TEXT)] = copy.deepcopy(draw(_WRONG))
    return data


@st.composite
def _text_of(draw: st.DrawFn, data: dict[str, Any]) -> bytes:
    """The TOML of `data`, then sometimes damaged as text: a table or key twice, another encoding, bytes mutated."""
    text = tomli_w.dumps(data)
    damage = draw(st.sampled_from(["none"] * 6 + ["dup_table", "dup_key", "bom", "utf16", "crlf", "bytes", "inline"]))
    if damage == "dup_table":
        text += "\n[vllm]\nport = 1\n"
    elif damage == "dup_key" and "\n" in text:
        first = next((line for line in text.splitlines() if "=" in line), "a = 1")
        text += first + "\n"
    elif damage == "inline":
        text = text.replace("[vllm]\n", "vllm = { port = 1 }\n[vllm]\n", 1)
    elif damage == "crlf":
        text = text.replace("\n", "\r\n")
    raw = text.encode("utf-8")
    if damage == "bom":
        raw = b"\xef\xbb\xbf" + raw
    elif damage == "utf16":
        raw = text.encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32"])))
    elif damage == "bytes":
        raw = draw(mutated_bytes(raw, max_mutations=2))
    return raw


@st.composite
def config_files(draw: st.DrawFn, program: str | None = None, images: bool = True) -> list[tuple[str, bytes]]:
    """The main file's bytes, then drop-ins (name, bytes): the generated config split between them, some damaged."""
    data = draw(configs(program, images))
    files: list[tuple[str, bytes]] = []
    for index in range(draw(st.integers(0, 2))):
        if not data:
            break
        table_name = draw(st.sampled_from(sorted(data)))
        overlay: dict[str, Any] = {}
        if isinstance(data[table_name], dict) and data[table_name]:
            key = draw(st.sampled_from(sorted(data[table_name])))
            overlay = {table_name: {key: data[table_name].pop(key)}}
        else:
            overlay = {table_name: data.pop(table_name)}
        name = draw(st.sampled_from([f"{index}0-fuzz.toml", f".{index}hidden.toml", f"{index}.conf", f"{index}\u00e9.toml"]))
        files.append((name, draw(_text_of(overlay))))
    return [("gb10d.toml", draw(_text_of(data))), *files]


def _write(directory: Path, files: list[tuple[str, bytes]]) -> Path:
    main_file = directory / files[0][0]
    main_file.write_bytes(files[0][1])
    dropins = dropin_dir_for(main_file)
    for name, raw in files[1:]:
        dropins.mkdir(exist_ok=True)
        (dropins / name).write_bytes(raw)
    return main_file


_FILE_LEVEL = ("TOML syntax error", "not UTF-8", "is UTF-16", "is UTF-32", "contains NUL", "is empty", "file not found", "is a directory", "cannot read",
               "permission denied", "is not a directory", "cannot list")


def _assert_located(exc: ConfigError, directory: Path) -> None:
    """Every problem names one of our files (and for a value, its key), on a line that file has; one line each."""
    assert exc.problems, "a ConfigError without problems tells the operator nothing"
    for problem in exc.problems:
        shown = str(problem)
        assert "\n" not in shown, f"a problem must be one journal line: {shown!r}"
        path = Path(problem.path)
        assert path == directory / "gb10d.toml" or path.parent == directory / "gb10d.d", shown
        if problem.key == "":
            assert problem.message.startswith(_FILE_LEVEL), f"a problem of a value must name its key: {shown}"
        if problem.line is not None:
            lines = path.read_bytes().count(b"\n") + 1
            assert 1 <= problem.line <= lines, f"line {problem.line} of a file of {lines} lines: {shown}"


@given(files=config_files())
@budget(ci=80, long=3000)
def test_a_config_loads_or_raises_config_error_naming_file_line_and_key(files: list[tuple[str, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        try:
            loaded = load_config_explained(_write(directory, files))
        except ConfigError as exc:
            event("ConfigError")
            _assert_located(exc, directory)
            return
        event("loaded")
        # What --explain prints must come from somewhere: a file we wrote, or a default.
        for key, _, source in loaded.explain():
            assert source == "default" or source.startswith(tmp) or "derived" in source or source, key


@pytest.fixture(scope="module")
def fake_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv whose `vllm` exists and runs (gb10d.sim's), so check-config can succeed."""
    venv = tmp_path_factory.mktemp("fuzz") / "vllm-env"
    subprocess.run([sys.executable, "-m", "gb10d.sim", "make-venv", str(venv)], check=True, timeout=120, capture_output=True)
    yield venv
    shutil.rmtree(venv, ignore_errors=True)


def check_config(config: Path, *extra: str) -> tuple[int, str, str]:
    """`gb10d check-config` run in this process, as the console script runs it, with its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["check-config", "--config", str(config), *extra])
    return status, out.getvalue(), err.getvalue()


@given(data=st.data())
@budget(ci=60, long=1500)
def test_check_config_exits_0_or_78_with_gb10d_lines_never_a_traceback(fake_venv: Path, data: st.DataObject) -> None:
    # Container images are left out: checking one asks the engine's daemon, which is the engine tests' business.
    files = data.draw(config_files(program=str(fake_venv), images=False))
    explain = data.draw(st.sampled_from([(), ("--explain",)]))
    with tempfile.TemporaryDirectory() as tmp:
        status, out, err = check_config(_write(Path(tmp), files), *explain)
    event(f"exit {status}")
    assert status in (0, EXIT_CONFIG), (status, out, err)
    assert "Traceback" not in out + err
    if status == 0:
        assert out.startswith("OK\n"), out
        assert all(line.startswith("gb10d: warning: ") for line in err.splitlines()), err
    else:
        assert err and all(line.startswith("gb10d: ") for line in err.splitlines()), err
