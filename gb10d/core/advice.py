"""What the operator should do about each failure: one text per cause, for the supervisor's journal lines and for `gb10d diagnose`.

Pure. Each function takes the few values its text needs and returns the
text in the journal's style (lower case, no final full stop); `diagnose`
capitalises it. The GB10 platform failures take their fixes from the
known-issues table (`known.ISSUES`) and the Xid catalog (`kernel`).
"""

from __future__ import annotations

from ..vllm.events import Failure, GpuXid, IpcRemoved
from ..vllm.kernel import xid_meaning
from ..vllm.known import issue_for

ENV_FILE_KEY = "vllm.env_file"  # where secrets such as HF_TOKEN belong (not [vllm.env], which print-command shows)
_LARGEST = "`ps -eo pid,rss,comm --sort=-rss | head` lists the largest processes"


def port_in_use(port: int) -> str:
    """The API port is taken by another program."""
    return (
        f"port {port} is already in use by another program (`ss -ltnp 'sport = :{port}'` shows it); "
        "stop it or set vllm.port to a free port"
    )


def internal_port_in_use(port: int | None, address: str) -> str:
    """A port of vLLM's internal sockets (ZMQ, torch.distributed) is taken; vllm.port is not the one."""
    where = address or (f"port {port}" if port else "an internal port")
    look = f" (`ss -ltnp 'sport = :{port}'` shows who has it)" if port else ""
    return (
        f"vLLM could not bind its internal socket {where}{look}: another vLLM, or what is left of one, holds it; "
        "stop it (`pgrep -af VLLM` lists vLLM's processes) and start again; vllm.port is not involved"
    )


def model_gated(model: str) -> str:
    """The repository is gated and the token, if any, has no access."""
    return (
        f"the model {model} is gated on Hugging Face and the token has no access; accept its licence on the "
        f"model page and put HF_TOKEN=... in the file named by {ENV_FILE_KEY}"
    )


def model_not_found(model: str, unreachable: bool = False) -> str:
    """The model is neither a local directory nor a reachable repository."""
    if unreachable:
        return (
            f"the model {model!r} is not in the local Hugging Face cache and huggingface.co could not be reached; "
            "check the network (or HTTPS_PROXY in [vllm.env]), or download the model first and set vllm.model to "
            "its local directory"
        )
    return (
        f"the model {model!r} is neither a local directory nor a Hugging Face repository gb10d can reach; "
        f"check vllm.model (spelling, organisation) and, for private repositories, HF_TOKEN in {ENV_FILE_KEY}"
    )


def bad_argument(message: str, flag: str | None = None, value: str | None = None) -> str:
    """vLLM refused a flag or its value."""
    which = f"{flag} (now {value!r})" if flag and value is not None else flag or "the flag"
    return (
        f"vLLM rejected its command line: {message}; fix {which} in vllm.args or vllm.extra_args "
        "(gb10d print-command shows the line)"
    )


def served_name(detail: str) -> str:
    """vLLM serves under other names than the ones clients use."""
    return f"{detail}; set vllm.served_model_name to the name clients use"


def kv_cache_too_small(max_model_len: int, needed_gib: float | None, available_gib: float | None, estimate: int | None) -> str:
    """The KV cache cannot hold one request of max_model_len."""
    numbers = (
        f" needs {needed_gib:g} GiB of KV cache but only {available_gib:g} GiB is available"
        if needed_gib is not None and available_gib is not None else " does not fit in the KV cache"
    )
    hint = f"set vllm.args.max_model_len = {estimate}, " if estimate else "lower vllm.args.max_model_len, "
    return (
        f"max_model_len {max_model_len}{numbers}; {hint}raise vllm.gpu_memory_utilization, "
        "or set startup.allow_max_model_len_reduction = true"
    )


def extensible_kv_too_small(flag: str) -> str:
    """vLLM 0.34's extensible KV cache, sized from the memory free after the load, came out too small."""
    return (
        "vLLM sized its extensible KV cache from the memory free after loading the model, where GB10 counts the page "
        f"cache as used; restarting with {flag}, so that the KV cache comes out of gpu_memory_utilization, which vLLM "
        "checks at the start"
    )


def no_kv_memory() -> str:
    """The weights left no memory for the KV cache."""
    return (
        "no memory is left for the KV cache after loading the model; raise vllm.gpu_memory_utilization "
        "or use a smaller or more quantized model"
    )


def utilization_below_minimum(why: str, new: float, minimum: float, machine: str | None = None) -> str:
    """Lowering the utilization would go below memory.min_gpu_memory_utilization: something else holds the memory."""
    where = f"the machine {machine}" if machine else "this machine"
    return (
        f"{why}; the next gpu_memory_utilization would be {new:g}, below memory.min_gpu_memory_utilization "
        f"{minimum:g}. Free memory on {where} (stop what uses it: {_LARGEST}; reboot if a crashed vLLM left it "
        "taken), or lower memory.min_gpu_memory_utilization"
    )


def utilization_that_fits(utilization: float) -> str:
    """The utilization gb10d restarts with after a memory failure, for an operator who would rather start with it."""
    return (
        f"after this failure gb10d restarts by itself with gpu_memory_utilization {utilization:g}, the value that fits now; to start "
        f"with it from the first attempt, set vllm.gpu_memory_utilization = {utilization:g} in gb10d.toml"
    )


def what_holds_memory(held_gib: float, total_gib: float) -> str:
    """Much of the memory is held before vLLM starts: finding the holder comes before settling for a lower share."""
    return (
        f"{held_gib:.1f} of {total_gib:g} GiB are held before vLLM starts; find what holds them first: a vLLM or "
        "EngineCore left from a nohup or shell run (`pgrep -af 'vllm|EngineCore'`), another model "
        "(`nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv`), or the page cache "
        "(`grep -E 'MemAvailable|^Cached' /proc/meminfo`; `sync; echo 3 | sudo tee /proc/sys/vm/drop_caches` frees it). "
        "Once it is stopped, the utilization as set fits again"
    )


def share_too_small(utilization: float, share_gib: float, weights_gib: float, weights_from: str,
                    max_model_len: int | None) -> str | None:
    """A warning when the share that fits leaves little or nothing beside the weights; None when it leaves plenty."""
    left = share_gib - weights_gib
    at = f"at {utilization:g} vLLM gets {share_gib:.1f} GiB"
    if left <= 0:
        return (f"warning: {at}, less than the model's {weights_gib:.1f} GiB of weights ({weights_from}): "
                "it cannot load at that value; free the memory instead")
    if left >= weights_gib:
        return None
    kv = f"the KV cache of max_model_len {max_model_len}" if max_model_len else "the KV cache"
    return (f"warning: {at}; the weights take {weights_gib:.1f} GiB ({weights_from}), leaving {left:.1f} GiB for "
            f"activations and {kv}, which may not hold it (vLLM then stops with no memory for the KV cache); "
            "free the memory, or lower vllm.args.max_model_len")


def image_without_vllm(image: str, program: str | None, reason: str, engine: str) -> str:
    """The container started, but its init could not run vLLM's program: the image is not a vLLM image.

    `engine` is container.engine; for "auto" the init's words tell: docker's
    (tini) names the program, podman's (catatonit) does not.
    """
    what = f"run {program}" if program else "run vllm"
    client = engine if engine != "auto" else "docker" if program else "podman"
    return (
        f"the image {image} cannot {what} ({reason}): it has no vllm program on its PATH; set vllm.image to a vLLM "
        f"image (NVIDIA's is nvcr.io/nvidia/vllm:TAG); {client} run --rm IMAGE vllm --version checks one"
    )


def ptxas_in_image(image: str) -> str:
    """Triton's ptxas in a container image does not know sm_121a; the host's CUDA toolkit is not the container's."""
    return (
        f"Triton in the image {image} cannot compile for sm_121a; use an image built for DGX Spark (NVIDIA's "
        "nvcr.io/nvidia/vllm has one), or set vllm.env.TRITON_PTXAS_PATH to the ptxas of a CUDA 12.9 or later "
        "toolkit inside the image; not retrying"
    )


def status_of_give_up(reason: str, limit: int) -> str:
    """STATUS= when gb10d gives up: the cause, short enough for `systemctl status`, and where the fix is.

    The cause is the reason up to its advice (the first "; "); cut at a word
    when still too long, never mid-word, and marked with "..." (STATUS= is
    plain ASCII, so an ellipsis character would show as "?"). The whole
    reason is in the journal.
    """
    tail = "; the journal says how to fix it"
    cause = reason.split("; ", 1)[0]
    room = limit - len("failed: ") - len(tail)
    if len(cause) > room:
        cut = cause[: room - 3]
        cause = (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "..."
    return f"failed: {cause}{tail}"


def gave_up(attempts: int, last: str) -> str:
    """The restart budget is spent."""
    return f"giving up after {attempts} failed starts (last: {last}); fix the cause, then: systemctl restart gb10d"


def platform(event: Failure) -> str:
    """The fix for a GB10 platform failure, from the known-issues table (an Xid: from its number's meaning)."""
    if isinstance(event, GpuXid):
        meaning = xid_meaning(event.xid)
        return f"Xid {event.xid} ({meaning.name}): {meaning.meaning}; {meaning.action}"
    issue = issue_for(event)
    if issue is None:
        raise ValueError(f"{type(event).__name__} is not a known platform failure")
    if isinstance(event, IpcRemoved) and not event.confirmed:
        return f"if no process hangs or compiles for that long, {issue.fix}"
    return issue.fix
