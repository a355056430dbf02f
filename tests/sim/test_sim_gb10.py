"""GB10's own failures, as the stand-in prints them where vLLM and Triton print them; diagnose names each one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gb10d.core.diagnose import diagnose
from sim_support import RECORD, Sim, StartSim, messages, physical_lines

ENGINE_FAILED = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
PTXAS_FATAL = "ptxas fatal   : Value 'sm_121a' is not defined for option 'gpu-name'"


def _log(s: Sim) -> str:
    """The run's output as a paste: stdout, then stderr."""
    return (bytes(s.stdout) + bytes(s.stderr)).decode("utf-8", "replace")


def _engine_record(stdout: bytes) -> list[str]:
    """The messages of the EngineCore's `failed to start` record, in order."""
    lines = physical_lines(stdout)
    start = next(i for i, line in enumerate(lines) if line.endswith("EngineCore failed to start.\r"))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\r"))
    return [RECORD.match(line).group("msg") for line in lines[start : end + 1]]  # type: ignore[union-attr]


def _fake_ptxas(directory: Path, answer: str = "Cuda compilation tools, release 13.0, V13.0.88") -> Path:
    ptxas = directory / "ptxas"
    ptxas.write_text(f"#!/bin/sh\necho '{answer}'\n")
    ptxas.chmod(0o755)
    return ptxas


@pytest.mark.parametrize(("flags", "where"), [((), "torch.compile"), (("--enforce-eager",), "warm-up")])
def test_ptxas_that_does_not_know_sm121a_fails_the_start_as_triton_says_it(sim: StartSim, flags: tuple[str, ...], where: str) -> None:
    s = sim("m", *flags, env={"GB10D_SIM_SCENARIO": "ptxas"})
    assert s.wait_exit() == 1
    s.drain()
    record = _engine_record(bytes(s.stdout))
    final = record.index(PTXAS_FATAL)
    head = record[final - 2]
    if where == "torch.compile":
        assert head == "torch._inductor.exc.InductorError: PTXASError: PTXAS error: Internal Triton PTX codegen error"
        assert any(m.startswith("Dynamo bytecode transform time") for m in messages(bytes(s.stdout)))
    else:
        assert head == "triton.runtime.errors.PTXASError: PTXAS error: Internal Triton PTX codegen error"
        assert any(m.startswith("Available KV cache memory") for m in messages(bytes(s.stdout)))
    assert record[final - 1] == "`ptxas` stderr:"
    assert re.fullmatch(r"Repro command: \S+/triton/backends/nvidia/bin/ptxas -lineinfo -v --gpu-name=sm_121a /tmp/tmp\w+\.ptx -o /tmp/tmp\w+\.ptx\.o", record[final + 2])
    assert "please share the reproducer above with Triton project." in bytes(s.stdout).decode()
    assert physical_lines(bytes(s.stderr))[-1].endswith(ENGINE_FAILED)
    found = diagnose(_log(s))
    assert (found.verdict, found.facts["arch"]) == ("ptxas_sm121a", "sm_121a")
    assert 'TRITON_PTXAS_PATH = "/usr/local/cuda/bin/ptxas"' in found.advice


def test_triton_ptxas_path_naming_a_working_ptxas_lets_the_start_succeed(sim: StartSim, tmp_path: Path) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "ptxas", "TRITON_PTXAS_PATH": str(_fake_ptxas(tmp_path))})
    s.wait_ready()
    assert b"ptxas" not in bytes(s.stdout) + bytes(s.stderr)


@pytest.mark.parametrize("broken", ["missing", "not_a_ptxas"])
def test_a_triton_ptxas_path_triton_cannot_use_falls_back_to_the_bundled_one(sim: StartSim, tmp_path: Path, broken: str) -> None:
    path = tmp_path / "nope" if broken == "missing" else _fake_ptxas(tmp_path, "hello")
    s = sim("m", "--enforce-eager", env={"GB10D_SIM_SCENARIO": "ptxas", "TRITON_PTXAS_PATH": str(path)})
    assert s.wait_exit() == 1
    s.drain()
    assert PTXAS_FATAL in _engine_record(bytes(s.stdout))


def test_a_build_without_kernels_for_the_gpu_fails_right_after_the_weights(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "no_kernel_image"})
    assert s.wait_exit() == 1
    s.drain()
    record = _engine_record(bytes(s.stdout))
    assert "torch.AcceleratorError: CUDA error: no kernel image is available for execution on the device" in record
    assert any(m.startswith("Search for `cudaErrorNoKernelImageForDevice'") for m in record)
    found = messages(bytes(s.stdout))
    assert any(m.startswith("Loading weights took") for m in found) and not any(m.startswith("Model loading took") for m in found)
    verdict = diagnose(_log(s))
    assert verdict.verdict == "unsupported_build" and "cu130" in verdict.advice and verdict.facts["retry_helps"] is False


def test_vllm_023s_hidden_engine_failure_leaves_only_the_api_servers_empty_braces(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "hidden_init_failure", "GB10D_SIM_VERSION": "0.23.0"})
    assert s.wait_exit() == 1
    s.drain()
    assert b"EngineCore failed to start" not in bytes(s.stdout)
    assert b"Process EngineCore" not in bytes(s.stderr)
    assert physical_lines(bytes(s.stderr))[-1] == f"(APIServer pid={s.process.pid}) {ENGINE_FAILED}"
    assert s.group_pids() == []
    assert diagnose(_log(s)).verdict == "hidden_init_failure"


def test_the_hidden_engine_failure_is_refused_for_a_vllm_that_prints_the_cause(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "hidden_init_failure", "GB10D_SIM_VERSION": "0.24.0"})
    assert s.wait_exit() == 2
    s.drain()
    assert b"hidden_init_failure is vLLM 0.23's behaviour" in bytes(s.stderr)


def test_a_removed_semaphore_kills_the_spawned_engine_before_it_tags_its_lines(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "ipc_removed"})
    assert s.wait_exit() == 1
    s.drain()
    stderr = physical_lines(bytes(s.stderr))
    at = stderr.index("    self._semlock = _multiprocessing.SemLock._rebuild(*state)")
    assert stderr[at + 1] == "FileNotFoundError: [Errno 2] No such file or directory"
    assert stderr[-1].endswith(ENGINE_FAILED)
    found = diagnose(_log(s))
    assert found.verdict == "ipc_removed" and "RemoveIPC=no" in found.advice


def test_the_gb10_scenarios_are_listed_when_a_scenario_is_unknown(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "ptxas,nonsense"})
    assert s.wait_exit() == 2
    s.drain()
    text = bytes(s.stderr).decode()
    assert all(name in text for name in ("ptxas", "no_kernel_image", "hidden_init_failure", "ipc_removed"))
