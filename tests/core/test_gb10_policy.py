"""GB10's own failures in the decision core: what gb10d does about each, from the facts alone."""

from __future__ import annotations

from functools import partial

import pytest

from config_support import make_config
from gb10d.base.command import Tunables, build_argv, build_env
from gb10d.base.errors import EXIT_CONFIG, EXIT_MEMORY_NOT_RETURNED
from gb10d.core import host
from gb10d.core.facts import Parsed
from gb10d.core.host import HostFacts, cma, driver_version, ptxas_candidates, ptxas_release, warnings
from gb10d.core.lifecycle import Finish, XidSeen, begin, step
from gb10d.core.outcome import Cause, Failed
from gb10d.core.policy import GiveUp, History, Retry, classify, failure_line, next_attempt
from gb10d.machine.kernellog import source_argv
from gb10d.machine.shm import Segment, describe, leftovers
from gb10d.vllm.events import DriverOutOfMemory, GpuXid, HiddenInitFailure, IpcRemoved, PtxasArchUnsupported, RdmaRegistrationFailed, UnsupportedBuild

PTXAS = "/usr/local/cuda/bin/ptxas"
HOST = HostFacts("6.17.0-1008-nvidia", "580.95.05", 1048576, 1040000, PTXAS)


config = partial(make_config, {"vllm": {"gpu_memory_utilization": 0.8}})


@pytest.mark.parametrize(
    ("failures", "cause"),
    [
        ([PtxasArchUnsupported("sm_121a")], Cause.PTXAS),
        ([UnsupportedBuild(detail="CUDA error: no kernel image is available for execution on the device")], Cause.UNSUPPORTED_BUILD),
        ([RdmaRegistrationFailed(detail="ibv_reg_mr_iova2 failed with error Cannot allocate memory")], Cause.NCCL_KHO),
        ([IpcRemoved(True)], Cause.IPC_REMOVED),
        ([HiddenInitFailure()], Cause.HIDDEN_INIT),
    ],
)
def test_each_gb10_failure_has_its_own_cause(failures: list, cause: Cause) -> None:
    assert classify(failures, 1, False).cause is cause


# --- Triton's ptxas ----------------------------------------------------------------


def test_ptxas_failure_restarts_once_with_the_toolkits_ptxas() -> None:
    outcome = Failed(cause=Cause.PTXAS, failure=PtxasArchUnsupported("sm_121a"))
    decision = next_attempt(outcome, Tunables(0.8), History(1), config(), HOST)
    assert isinstance(decision, Retry) and decision.delay_s == 0
    assert decision.tunables == Tunables(0.8, env=(("TRITON_PTXAS_PATH", PTXAS),))
    assert failure_line(outcome, decision, History(1), config()) == (
        "the ptxas that Triton bundles is older than GB10's GPU (sm_121a) and cannot compile kernels for it; "
        "restarting with TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas, the CUDA toolkit's ptxas (attempt 2/5)"
    )


def test_ptxas_failure_without_a_toolkit_says_what_to_install_and_does_not_retry() -> None:
    decision = next_attempt(Failed(cause=Cause.PTXAS), Tunables(0.8), History(1), config(), HostFacts("6.17.0"))
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_CONFIG
    assert "install the CUDA 13 toolkit" in decision.message and "vllm.env.TRITON_PTXAS_PATH" in decision.message


@pytest.mark.parametrize("where", ["tunables", "config"])
def test_ptxas_failure_with_the_variable_already_set_gives_up(where: str) -> None:
    used = Tunables(0.8, env=(("TRITON_PTXAS_PATH", PTXAS),)) if where == "tunables" else Tunables(0.8)
    cfg = config(vllm={"env": {"TRITON_PTXAS_PATH": PTXAS}}) if where == "config" else config()
    decision = next_attempt(Failed(cause=Cause.PTXAS), used, History(2), cfg, HOST)
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_CONFIG
    assert decision.message.startswith(f"Triton still fails to compile for sm_121a with TRITON_PTXAS_PATH={PTXAS}")


# --- a build without kernels for this GPU, and KHO -----------------------------------------


@pytest.mark.parametrize(
    ("cause", "failure", "fix"),
    [
        (Cause.UNSUPPORTED_BUILD, UnsupportedBuild(detail="no kernel image"), "CUDA 13 on aarch64"),
        (Cause.NCCL_KHO, RdmaRegistrationFailed(detail="ibv_reg_mr"), "kho=off"),
    ],
)
def test_a_failure_no_retry_can_help_gives_up_at_once_as_a_config_error(cause: Cause, failure: object, fix: str) -> None:
    outcome = Failed(cause=cause, failure=failure)  # type: ignore[arg-type]
    decision = next_attempt(outcome, Tunables(0.8), History(1), config(), HOST)
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_CONFIG
    assert fix in decision.message
    assert failure_line(outcome, decision, History(1), config()) == decision.message


# --- the driver's out-of-memory --------------------------------------------------------------


def test_driver_out_of_memory_restarts_lower_with_the_workaround() -> None:
    outcome = Failed(cause=Cause.DRIVER_OOM, failure=DriverOutOfMemory(detail="NV_ERR_NO_MEMORY"), was_ready=True)
    decision = next_attempt(outcome, Tunables(0.8), History(1), config(vllm={"args": {"enable_flashinfer_autotune": True}}), HOST)
    assert isinstance(decision, Retry) and decision.delay_s == 0
    assert decision.tunables == Tunables(0.75, env=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),), without=("enable-flashinfer-autotune",))
    assert decision.message == (
        "restarting with gpu_memory_utilization 0.75, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False and without --enable-flashinfer-autotune"
    )


def test_driver_out_of_memory_again_with_the_workaround_gives_up_with_the_memory_status() -> None:
    used = Tunables(0.75, env=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),), without=("enable-flashinfer-autotune",))
    decision = next_attempt(Failed(cause=Cause.DRIVER_OOM, failure=DriverOutOfMemory()), used, History(2), config(), HOST)
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_MEMORY_NOT_RETURNED
    assert decision.message.startswith("the NVIDIA driver ran out of memory again with gpu_memory_utilization 0.75")


def test_driver_out_of_memory_at_the_minimum_gives_up_with_the_memory_status() -> None:
    decision = next_attempt(Failed(cause=Cause.DRIVER_OOM, failure=DriverOutOfMemory()), Tunables(0.32), History(1), config(), HOST)
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_MEMORY_NOT_RETURNED


def test_the_workaround_drops_the_flag_and_adds_the_variable_where_the_config_sets_none() -> None:
    tunables = Tunables(0.75, env=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),), without=("enable-flashinfer-autotune",))
    for cfg in (config(vllm={"args": {"enable_flashinfer_autotune": True}}), config(vllm={"extra_args": ["--enable-flashinfer-autotune", "--enforce-eager"]})):
        argv = build_argv(cfg.vllm, tunables)
        assert "--enable-flashinfer-autotune" not in argv
        assert "--gpu-memory-utilization" in argv
    assert "--enforce-eager" in build_argv(config(vllm={"extra_args": ["--enable-flashinfer-autotune", "--enforce-eager"]}).vllm, tunables)
    cfg = config()
    assert build_env(cfg.vllm, base={}, added=tunables.env)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    own = config(vllm={"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}})
    assert build_env(own.vllm, base={}, added=tunables.env)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_an_xid_is_told_with_its_meaning_and_counted_but_stops_nothing() -> None:
    state, _ = begin(1, Tunables(0.8), 100.0, config())
    _, actions = step(state, Parsed(1, GpuXid(xid=79, pci="PCI:0000:01:00")), 120.0, config())
    assert actions[0].message.startswith("NVIDIA Xid 79 on PCI:0000:01:00, GPU has fallen off the bus")  # type: ignore[union-attr]
    assert XidSeen(79) in actions
    assert not any(isinstance(a, Finish) for a in actions)


# --- removed IPC and vLLM 0.23's hidden init failure: a retry may help, and the fix is told ------------


@pytest.mark.parametrize(
    ("cause", "failure", "fix"),
    [(Cause.IPC_REMOVED, IpcRemoved(True), "RemoveIPC=no"), (Cause.HIDDEN_INIT, HiddenInitFailure(), "upgrade vLLM to 0.24")],
)
def test_a_failure_a_retry_may_pass_restarts_and_names_the_lasting_fix(cause: Cause, failure: object, fix: str) -> None:
    outcome = Failed(cause=cause, failure=failure)  # type: ignore[arg-type]
    decision = next_attempt(outcome, Tunables(0.8), History(1), config(), HOST)
    assert isinstance(decision, Retry) and decision.delay_s > 0
    line = failure_line(outcome, decision, History(1), config())
    assert fix in line and line.endswith("restarting with the same settings in 5 s (attempt 2/5)")


def test_the_hidden_init_failure_says_which_version_shows_the_cause() -> None:
    outcome = classify([HiddenInitFailure()], 1, False)
    line = failure_line(outcome, next_attempt(outcome, Tunables(0.8), History(1), config()), History(1), config())
    assert line.startswith("vLLM 0.23 ended the engine's start without printing why (vLLM 0.24 and later print the root cause)")


# --- this machine -----------------------------------------------------------------------


def test_host_facts_are_read_from_the_drivers_version_file_and_meminfo() -> None:
    assert driver_version("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.95.05  Release Build  (dvs-builder@U16)\n") == "580.95.05"
    assert driver_version("") is None
    assert cma("MemTotal: 1 kB\nCmaTotal:      1048576 kB\nCmaFree:        1040000 kB\n") == (1048576, 1040000)
    assert cma("MemTotal: 1 kB\n") == (None, None)
    assert ptxas_release("ptxas: NVIDIA (R) Ptx optimizing assembler\nCuda compilation tools, release 13.0, V13.0.48\n") == (13, 0)
    assert HOST.summary() == (
        "kernel 6.17.0-1008-nvidia, NVIDIA driver 580.95.05, CMA 1024 MiB total, 1015 MiB free, ptxas /usr/local/cuda/bin/ptxas"
    )


def test_the_toolkits_ptxas_is_looked_for_in_cuda_home_first() -> None:
    found = [str(p) for p in ptxas_candidates({"CUDA_HOME": "/opt/cuda-13.0", "PATH": "/venv/bin:/usr/bin"})]
    assert found == ["/opt/cuda-13.0/bin/ptxas", "/usr/local/cuda/bin/ptxas", "/venv/bin/ptxas", "/usr/bin/ptxas"]


@pytest.mark.parametrize(
    ("kernel", "total", "free", "warned"),
    [("7.0.0-1004-nvidia", 1048576, 1048577, True), ("7.0.0-1004-nvidia", 1048576, 1000, False), ("6.17.0-1008-nvidia", 10, 20, False)],
)
def test_the_kexec_handover_regression_is_warned_about_with_its_fix(kernel: str, total: int, free: int, warned: bool) -> None:
    found = warnings(HostFacts(kernel, "580.95.05", total, free))
    assert bool(found) is warned
    if warned:
        assert "kho=off" in found[0]


@pytest.mark.parametrize(
    ("version_file", "open_modules"),
    [
        ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.95.05  Release Build  (dvs-builder@U16)  Thu Sep 18", True),
        ("NVRM version: NVIDIA UNIX aarch64 Kernel Module  580.95.05  Release Build  (dvs-builder@U16)  Thu Sep 18", False),
        ("", None),
    ],
)
def test_the_proprietary_kernel_modules_are_named_with_their_fix(version_file: str, open_modules: bool | None) -> None:
    assert host.open_modules(version_file) is open_modules
    facts = HostFacts("6.17.0-1008-nvidia", host.driver_version(version_file), open_modules=open_modules)
    found = warnings(facts)
    assert bool(found) is (open_modules is False)
    if found:
        assert "Xid 169" in found[0] and "open kernel modules" in found[0]
        assert "(proprietary kernel modules)" in facts.summary()


# --- leaked shared memory ----------------------------------------------------------------


def test_only_this_users_unused_segments_with_vllms_names_are_leftovers() -> None:
    mine, other = 1000, 1001
    segments = [
        Segment("psm_1a2b3c", mine, 1 << 20, (1, 1)),
        Segment("sem.mp-x7y8", mine, 32, (1, 2)),
        Segment("psm_inuse", mine, 1 << 20, (1, 3)),
        Segment("psm_theirs", other, 1 << 20, (1, 4)),
        Segment("my-own-cache", mine, 1 << 20, (1, 5)),
        Segment("vllm_offload_0.mmap", mine, 1 << 30, (1, 6)),
    ]
    found = leftovers(segments, mine, used={(1, 3)})
    assert [s.name for s in found] == ["psm_1a2b3c", "sem.mp-x7y8", "vllm_offload_0.mmap"]
    assert describe(found) == (
        "removed 3 shared memory segments (1.00 GiB) that dead vLLM processes left in /dev/shm: "
        "psm_1a2b3c, sem.mp-x7y8, vllm_offload_0.mmap"
    )


# --- where kernel messages come from --------------------------------------------------------------


def test_kernel_message_sources() -> None:
    assert source_argv("journal") == ["journalctl", "--dmesg", "--follow", "--since=now", "--output=cat", "--no-pager", "--quiet"]
    assert source_argv("kmsg") == ["dmesg", "--follow-new", "--notime"]
    assert source_argv("/var/log/kern.log") == ["tail", "--follow=name", "--retry", "--lines=0", "/var/log/kern.log"]
    assert source_argv("none") is None
