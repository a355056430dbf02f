"""known: the table of GB10 platform failures, and the advice texts shared by the supervisor and diagnose."""

from __future__ import annotations

import pytest

from gb10d.core import advice
from gb10d.vllm.events import (
    BadArgument,
    DriverOutOfMemory,
    EngineDied,
    Failure,
    FreeMemoryShort,
    GpuXid,
    HiddenInitFailure,
    IpcRemoved,
    PtxasArchUnsupported,
    RdmaRegistrationFailed,
    UnsupportedBuild,
)
from gb10d.vllm.known import ISSUES, NEEDLES, by_name, issue_for, match

PTXAS = "ptxas fatal   : Value 'sm_121a' is not defined for option 'gpu-name'"


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (PTXAS, PtxasArchUnsupported("sm_121a", detail=PTXAS)),
        ("Repro command: /venv/lib/python3.12/site-packages/triton/backends/nvidia/bin/ptxas -lineinfo -v --gpu-name=sm_121a "
         "/tmp/a.ptx -o /tmp/a.ptx.o", PtxasArchUnsupported("sm_121a")),
        ("torch.AcceleratorError: CUDA error: no kernel image is available for execution on the device", UnsupportedBuild()),
        ("This kernel only supports sm120.", UnsupportedBuild()),
        ("Search for `cudaErrorUnsupportedPtxVersion' in https://docs.nvidia.com/cuda/ for more information.", UnsupportedBuild()),
        ("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}", HiddenInitFailure()),
        ("    self._semlock = _multiprocessing.SemLock._rebuild(*state)", IpcRemoved(True)),
        ("No available shared memory broadcast block found in 60 seconds. This typically happens when some processes are "
         "hanging", IpcRemoved(False)),
        ("transport/net_ib.cc:1091 NCCL WARN NET/IB : Call to ibv_reg_mr_iova2 failed with error Cannot allocate memory",
         RdmaRegistrationFailed()),
        ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051)", DriverOutOfMemory()),
        ("NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.", GpuXid(xid=79, pci="0000:01:00")),
    ],
)
def test_each_known_issue_is_recognised_in_its_text(message: str, expected: Failure) -> None:
    (found,) = match(message)
    assert type(found) is type(expected)
    assert {k: v for k, v in vars(found).items() if k != "detail"} == {k: v for k, v in vars(expected).items() if k != "detail"}
    assert issue_for(found) is not None


@pytest.mark.parametrize(
    "message",
    [
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
        "Using FLASH_ATTN attention backend; ptxas version 13.0",
        "NVRM: loading NVIDIA UNIX Open Kernel Module for aarch64  580.95.05",
        "FileNotFoundError: [Errno 2] No such file or directory: '/tmp/x'",
    ],
)
def test_similar_healthy_or_unrelated_lines_are_not_known_issues(message: str) -> None:
    assert match(message) == []


def test_every_issue_has_a_distinct_name_event_and_texts() -> None:
    assert len({i.name for i in ISSUES}) == len({i.event for i in ISSUES}) == len(ISSUES)
    for issue in ISSUES:
        assert issue.meaning and issue.fix and issue.title and issue.needles
        assert by_name(issue.name) is issue
        assert all(needle in NEEDLES for needle in issue.needles)


def test_a_retry_helps_only_where_the_same_settings_can_succeed() -> None:
    helps = {i.name for i in ISSUES if i.retry_helps}
    assert helps == {"ipc_removed", "hidden_init_failure"}


def test_generic_vllm_failures_are_not_platform_issues() -> None:
    assert issue_for(EngineDied("x")) is None and issue_for(FreeMemoryShort(1.0, 2.0, 0.9, 1.8)) is None
    with pytest.raises(KeyError):
        by_name("free_memory")


# --- advice ---------------------------------------------------------------------------


def test_gated_and_private_models_put_the_token_in_the_env_file() -> None:
    assert "HF_TOKEN=... in the file named by vllm.env_file" in advice.model_gated("meta-llama/Llama-3.3-70B-Instruct")
    assert "HF_TOKEN in vllm.env_file" in advice.model_not_found("org/private")


def test_an_unreachable_hub_says_so_instead_of_a_spelling_mistake() -> None:
    text = advice.model_not_found("google/gemma-3-27b-it", unreachable=True)
    assert "could not be reached" in text and "spelling" not in text


def test_bad_argument_advice_names_the_flag_and_its_value() -> None:
    text = advice.bad_argument("invalid int value: '8000:8000'", "--pipeline-parallel-size", "8000:8000")
    assert "fix --pipeline-parallel-size (now '8000:8000') in vllm.args or vllm.extra_args" in text


def test_an_internal_port_is_not_the_api_port() -> None:
    text = advice.internal_port_in_use(55217, "tcp://127.0.0.1:55217")
    assert "tcp://127.0.0.1:55217" in text and "ss -ltnp 'sport = :55217'" in text and "vllm.port is not involved" in text


def test_kv_advice_without_vllms_numbers_still_reads() -> None:
    assert advice.kv_cache_too_small(32768, None, None, None).startswith(
        "max_model_len 32768 does not fit in the KV cache; lower vllm.args.max_model_len, ")


def test_below_the_minimum_says_how_to_find_what_holds_the_memory() -> None:
    text = advice.utilization_below_minimum("free memory 0.49 of 79.32 GiB is low", 0.0, 0.3)
    assert "below memory.min_gpu_memory_utilization 0.3" in text and "ps -eo pid,rss,comm --sort=-rss" in text
    assert "reboot if a crashed vLLM left it taken" in text


@pytest.mark.parametrize(
    ("event", "words"),
    [
        (PtxasArchUnsupported(), 'vllm.env.TRITON_PTXAS_PATH = "/usr/local/cuda/bin/ptxas"'),
        (UnsupportedBuild(), "whl/cu130"),
        (RdmaRegistrationFailed(), "kho=off"),
        (DriverOutOfMemory(), "expandable_segments:False"),
        (IpcRemoved(True), "RemoveIPC=no"),
        (IpcRemoved(False), "if no process hangs"),
        (HiddenInitFailure(), "0.24"),
        (GpuXid(xid=79), "Xid 79 (GPU has fallen off the bus): the GPU no longer answers on its bus; reboot the machine"),
    ],
)
def test_each_platform_failure_has_its_fix(event: Failure, words: str) -> None:
    assert words in advice.platform(event)


def test_advice_for_a_generic_failure_is_not_made_up() -> None:
    with pytest.raises(ValueError):
        advice.platform(BadArgument("x"))
