"""GB10's own failures, end to end: `gb10d run` against gb10d.sim failing with each text as vLLM and Triton print it.

The kernel's messages reach gb10d through the interface it uses in
production, a source it follows line by line (`daemon.kernel_log`); here
the source is a file the test appends the driver's lines to.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import stat
import time
import uuid
from pathlib import Path

import httpx
import pytest

from gb10d.base.errors import EXIT_CONFIG, EXIT_MEMORY_NOT_RETURNED
from gb10d.base.units import GIB
from gb10d.launch.process import group_alive
from gb10d.machine.memory import read_meminfo
from gb10d.machine.statefile import read_state
from gb10d.sim.memory import adjust
from harness import Daemon, NotifySocket, Setup, free_port, vllm_groups, wait_until

pytestmark = pytest.mark.slow

NVRM_OOM = (
    "NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from "
    "_memdescAllocInternal(pMemDesc) @ mem_desc.c:1359"
)


def run(setup: Setup, notify: NotifySocket, daemons: list[Daemon]) -> Daemon:
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    return daemon


def ready(notify: NotifySocket, since: int = 0) -> None:
    notify.wait_for(lambda m: m.get("READY") == "1", 90, since=since)


def starts(daemon: Daemon) -> list[str]:
    return [line for line in daemon.own_lines() if "started vLLM as pid" in line]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def cuda_toolkit(root: Path) -> Path:
    """A CUDA toolkit's bin/ptxas that knows sm_121a: a program that answers --version as CUDA 13's does."""
    ptxas = root / "cuda" / "bin" / "ptxas"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text("#!/bin/sh\necho 'ptxas: NVIDIA (R) Ptx optimizing assembler'\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    ptxas.chmod(0o755)
    return ptxas


def test_triton_ptxas_failure_restarts_once_with_the_toolkits_ptxas_and_learns_it(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    ptxas = cuda_toolkit(tmp_path)
    setup = Setup(tmp_path, scenario="ptxas", extra={"vllm.env.CUDA_HOME": str(ptxas.parent.parent)})
    daemon = run(setup, notify, daemons)
    ready(notify)
    line = daemon.wait_line(r"gb10d: the ptxas that Triton bundles")
    assert line.string.endswith(
        "gb10d: the ptxas that Triton bundles is older than GB10's GPU (sm_121a) and cannot compile kernels for it; "
        f"restarting with TRITON_PTXAS_PATH={ptxas}, the CUDA toolkit's ptxas (attempt 2/3)"
    ), line.string
    _, second = (int(re.search(r"as pid (\d+)", s).group(1)) for s in starts(daemon))  # type: ignore[union-attr]
    assert environ(second)["TRITON_PTXAS_PATH"] == str(ptxas)
    assert daemon.stop() == 0

    # The next time gb10d starts, vLLM has the variable from the first start on.
    again = run(setup, notify, daemons)
    ready(notify, since=len(notify.messages))
    assert len(starts(again)) == 1
    assert any("starting from the settings learned for this config" in line and f"TRITON_PTXAS_PATH={ptxas}" in line for line in again.own_lines())
    assert environ(next(vllm_groups(again.lines)))["TRITON_PTXAS_PATH"] == str(ptxas)
    assert again.stop() == 0


def test_a_build_without_kernels_for_this_gpu_is_not_retried(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    daemon = run(Setup(tmp_path, scenario="no_kernel_image"), notify, daemons)
    assert daemon.wait_exit(90) == EXIT_CONFIG
    assert len(starts(daemon)) == 1
    line = daemon.wait_line(r"gb10d: this vLLM or PyTorch build has no kernels")
    assert line.string.endswith(
        "gb10d: this vLLM or PyTorch build has no kernels for GB10's GPU (sm_121); no retry can help; install builds made "
        "for CUDA 13 on aarch64 (pip install torch --index-url https://download.pytorch.org/whl/cu130, then vllm) in the "
        "venv vllm.venv names, or run NVIDIA's vLLM image (nvcr.io/nvidia/vllm)"
    ), line.string
    assert notify.wait_for(lambda m: m.get("STATUS", "").startswith("failed: this vLLM or PyTorch build"))


def driver_lines(kernel_log: Path, count: int) -> None:
    """The NVIDIA driver's out-of-memory line, `count` times at once, as the kernel logs a burst."""
    with kernel_log.open("a") as log:
        log.write((NVRM_OOM + "\n") * count)


def metric(port: int, text: str) -> bool:
    return text in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def test_one_driver_out_of_memory_line_during_a_healthy_load_ends_ready_with_a_warning(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    # Healthy starts on GB10 log exactly one such line: it is told and counted, and the start goes on.
    kernel_log = tmp_path / "kern.log"
    kernel_log.write_text("")
    port = free_port()
    setup = Setup(tmp_path, scenario="slow_shards=200", extra={"daemon.kernel_log": str(kernel_log), "metrics.listen": f"127.0.0.1:{port}"})
    daemon = run(setup, notify, daemons)
    daemon.wait_line(r"Loading safetensors checkpoint shards:")
    driver_lines(kernel_log, 1)
    line = daemon.wait_line(r"gb10d: the NVIDIA driver ran out of memory")
    assert line.string.startswith("<4>") and line.string.endswith(
        "the load progressing: no sign of trouble with it, vLLM keeps running (it is stopped for a burst of "
        "memory.driver_oom_burst lines, MemAvailable below memory.headroom_gib, a stalled load or an engine that stops answering)"
    ), line.string
    assert "1 such line within 60 s, MemAvailable " in line.string
    ready(notify)
    assert len(starts(daemon)) == 1
    wait_until(lambda: metric(port, 'gb10d_driver_oom_lines_total{evidence="none"} 1.0'), 30, "the line counted")
    assert daemon.stop() == 0


def test_a_burst_of_driver_lines_at_rest_is_told_and_one_at_the_rate_stops_vllm_and_the_next_start_is_lower(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    kernel_log = tmp_path / "kern.log"
    kernel_log.write_text("")
    setup = Setup(tmp_path, extra={"daemon.kernel_log": str(kernel_log), "vllm.args": {"max_model_len": 2048, "enable_flashinfer_autotune": True}})
    daemon = run(setup, notify, daemons)
    ready(notify)
    first = next(vllm_groups(daemon.lines))
    # Sixteen in one second, as a host at rest logged them: told, and vLLM serves on.
    since = len(daemon.lines)
    driver_lines(kernel_log, 16)
    daemon.wait_line(r"gb10d: the NVIDIA driver ran out of memory .*16 such lines within 60 s", since=since)
    assert group_alive(first) and len(starts(daemon)) == 1
    assert not any("stopping vLLM" in line for line in daemon.own_lines())

    # Fifty within the minute are the burst that stops it, named in the journal.
    since, notified = len(daemon.lines), len(notify.messages)
    driver_lines(kernel_log, 34)
    written = time.monotonic()
    line = daemon.wait_line(r"gb10d: the NVIDIA driver ran out of memory .*with evidence: ", since=since)
    assert line.string.startswith("<3>") and line.string.endswith(
        "with evidence: a burst of 50 such lines within 60 s (memory.driver_oom_burst 50 within memory.driver_oom_window_s); "
        "a freeze of the whole machine can follow: stopping vLLM"
    ), line.string
    wait_until(lambda: not group_alive(first), 10, "vLLM's process group killed")
    assert time.monotonic() - written < 1.0
    line = daemon.wait_line(r"gb10d: the NVIDIA driver in the kernel ran out of memory", since=since)
    assert line.string.endswith(
        "restarting with gpu_memory_utilization 0.75, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False and without "
        "--enable-flashinfer-autotune (attempt 2/3)"
    ), line.string
    ready(notify, since=notified)
    second = starts(daemon)[1]
    assert "--gpu-memory-utilization 0.75" in second and "--enable-flashinfer-autotune" not in second
    assert environ(list(vllm_groups(daemon.lines))[1])["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"

    # Again, with the workaround in place: not the same failure a third time.
    driver_lines(kernel_log, 50)
    assert daemon.wait_exit(60) == EXIT_MEMORY_NOT_RETURNED
    daemon.wait_line(r"gb10d: .*the NVIDIA driver ran out of memory again with gpu_memory_utilization 0.75")


def test_a_driver_line_with_memavailable_below_the_headroom_stops_vllm_and_names_it(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    kernel_log = tmp_path / "kern.log"
    kernel_log.write_text("")
    daemon = run(Setup(tmp_path, extra={"daemon.kernel_log": str(kernel_log)}), notify, daemons)
    ready(notify)
    first = next(vllm_groups(daemon.lines))
    # Another process takes all but half a GiB of what is left, as the pressure before a freeze does.
    taken = read_meminfo(daemon.setup.meminfo).available - GIB // 2
    adjust(daemon.setup.meminfo, -taken)
    since = len(daemon.lines)
    driver_lines(kernel_log, 1)
    line = daemon.wait_line(r"gb10d: the NVIDIA driver ran out of memory .*with evidence: ", since=since)
    assert "with evidence: MemAvailable 0.50 GiB is below memory.headroom_gib 1; a freeze of the whole machine can follow" in line.string
    wait_until(lambda: not group_alive(first), 10, "vLLM's process group killed")
    adjust(daemon.setup.meminfo, taken)
    daemon.stop()


def test_an_xid_in_the_kernel_log_is_told_and_counted(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    kernel_log = tmp_path / "kern.log"
    kernel_log.write_text("")
    port = free_port()
    setup = Setup(tmp_path, extra={"daemon.kernel_log": str(kernel_log), "metrics.listen": f"127.0.0.1:{port}"})
    daemon = run(setup, notify, daemons)
    ready(notify)
    with kernel_log.open("a") as log:
        log.write("[ 8123.456789] NVRM: Xid (PCI:0000:01:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x404600=0x80000004\n")
    line = daemon.wait_line(r"gb10d: NVIDIA Xid 13")
    assert "graphics engine exception" in line.string

    wait_until(lambda: metric(port, 'gb10d_gpu_xid_total{xid="13"} 1.0'), 30, "the Xid counted")
    assert daemon.proc.poll() is None and len(starts(daemon)) == 1
    assert daemon.stop() == 0



def test_a_kernel_log_source_that_ends_is_told_in_the_journal_and_vllm_serves_on(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # A dmesg that may not read the kernel's buffer (dmesg_restrict) and exits.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    dmesg = bin_dir / "dmesg"
    dmesg.write_text("#!/bin/sh\necho 'dmesg: read kernel buffer failed: Operation not permitted' >&2\nexit 1\n")
    dmesg.chmod(0o755)
    setup = Setup(tmp_path, extra={"daemon.kernel_log": "kmsg"})
    daemon = Daemon(setup, notify, env={"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}"})
    daemons.append(daemon)
    line = daemon.wait_line(r"^<4>gb10d: the kernel log source \(dmesg --follow-new --notime\) exited with status 1")
    assert "daemon.kernel_log picks the source" in line.string
    ready(notify)
    assert daemon.stop() == 0

def test_vllm_023s_hidden_init_failure_says_which_version_shows_the_cause(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path, scenario="hidden_init_failure", sim_env={"GB10D_SIM_VERSION": "0.23.0"}, extra={"restart.max_attempts": 2})
    daemon = run(setup, notify, daemons)
    line = daemon.wait_line(r"gb10d: vLLM 0.23 ended the engine's start without printing why")
    assert "(vLLM 0.24 and later print the root cause)" in line.string
    assert "upgrade vLLM to 0.24 or later" in line.string
    assert daemon.wait_exit(90) != 0


def test_leaked_shared_memory_is_removed_before_a_start_and_nothing_else(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to give gb10d a /dev/shm of its own and make a segment of another user")
    # gb10d sees a /dev/shm of its own (this directory, bound over it in a mount namespace of its own): any
    # other gb10d on the machine would remove a dead segment of the real one just the same, before this one.
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = shm / "psm_1a2b3c4d"
    dead.write_bytes(b"\0" * (1 << 20))
    theirs = shm / "psm_5e6f7a8b"
    theirs.write_bytes(b"\0" * 4096)
    nobody = pwd.getpwnam("nobody")
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    used = shm / "psm_9c0d1e2f"
    used.write_bytes(b"\0" * 4096)
    unrelated = shm / "gb10dtest-cache"
    unrelated.write_bytes(b"\0" * 4096)
    # The wrapper opens `used` through /dev/shm on fd 3 and execs gb10d, which keeps it: a living process has it open.
    private_shm = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec",
                   'mount --bind "$0" /dev/shm; exec 3</dev/shm/psm_9c0d1e2f; exec "$@"', str(shm)]
    daemon = Daemon(Setup(tmp_path), notify, wrapper=private_shm)
    daemons.append(daemon)
    ready(notify)
    line = daemon.wait_line(r"gb10d: removed \d+ shared memory segments? ")
    assert "removed 1 shared memory segment " in line.string and dead.name in line.string
    assert not dead.exists()
    assert theirs.exists() and stat.S_ISREG(theirs.stat().st_mode)
    assert used.exists() and unrelated.exists()
    assert daemon.stop() == 0


def test_this_machines_facts_are_in_the_journal_and_in_status(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path)
    setup.meminfo.write_text(setup.meminfo.read_text() + "CmaTotal:        1048576 kB\nCmaFree:         1040000 kB\n")
    daemon = run(setup, notify, daemons)
    ready(notify)
    line = daemon.wait_line(r"gb10d: this machine: kernel ")
    assert f"kernel {os.uname().release}" in line.string and "CMA 1024 MiB total, 1015 MiB free" in line.string
    record = read_state(setup.state_file)
    assert record is not None and record.host is not None and record.host.startswith(f"kernel {os.uname().release}")
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0


def test_a_real_kernel_message_reaches_gb10d_through_the_kernels_own_log(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # The real mechanism: a line in the kernel's ring buffer (/dev/kmsg), read back with dmesg --follow-new.
    if os.geteuid() != 0 or not os.access("/dev/kmsg", os.W_OK):
        pytest.skip("needs root to write to the kernel's log")
    daemon = run(Setup(tmp_path, extra={"daemon.kernel_log": "kmsg"}), notify, daemons)
    ready(notify)
    name = f"gb10dtest{uuid.uuid4().hex[:8]}"
    # dmesg starts following a moment after READY; the line is written until gb10d reports it.
    deadline = time.monotonic() + 30
    while True:
        with open("/dev/kmsg", "w") as kmsg:
            kmsg.write(f"<4>NVRM: Xid (PCI:0000:01:00): 43, pid=4242, name={name}, Ch 00000008\n")
        try:
            line = daemon.wait_line(rf"gb10d: NVIDIA Xid 43 .*name={name}", timeout=2)
            break
        except AssertionError:
            assert time.monotonic() < deadline, daemon.tail()
    assert "GPU stopped processing" in line.string
    assert daemon.stop() == 0


# A machine without the CUDA toolkit: /usr/local/cuda hidden in a mount namespace of gb10d's own, and a PATH without ptxas.
WITHOUT_CUDA = ["unshare", "--mount", "--", "sh", "-c", "mount -t tmpfs tmpfs /usr/local/cuda 2>/dev/null; exec \"$@\"", "sh"]


def test_triton_ptxas_failure_without_a_toolkit_ptxas_says_what_to_install_and_is_not_retried(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to hide /usr/local/cuda in a mount namespace")
    setup = Setup(tmp_path, scenario="ptxas")
    setup.extra["vllm.env.PATH"] = f"{setup.venv / 'bin'}:/usr/bin:/bin"
    setup.write_config()
    daemon = Daemon(setup, notify, wrapper=WITHOUT_CUDA)
    daemons.append(daemon)
    assert daemon.wait_exit(90) == EXIT_CONFIG
    assert len(starts(daemon)) == 1
    line = daemon.wait_line(r"gb10d: .*: no CUDA toolkit ptxas that knows sm_121a was found")
    assert line.string.endswith(
        ": no CUDA toolkit ptxas that knows sm_121a was found (looked at $CUDA_HOME/bin/ptxas, /usr/local/cuda/bin/ptxas "
        "and vLLM's PATH); install the CUDA 13 toolkit (sudo apt install cuda-toolkit-13-0 puts it in /usr/local/cuda) "
        "or set vllm.env.TRITON_PTXAS_PATH to the ptxas of a CUDA 12.9 or later toolkit; not retrying"
    ), line.string
    assert any("no CUDA toolkit ptxas found" in line for line in daemon.own_lines())
