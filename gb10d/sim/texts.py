"""vLLM's failure texts and tracebacks, character for character (REFERENCE §3).

Only pure functions returning strings: the processes decide when to print
them. Paths in tracebacks are those of the recorded installation
(`/opt/vllm/...`), so that a traceback looks exactly like a real one.
"""

from __future__ import annotations

from typing import Sequence

GIB = 2**30
SITE = "/opt/vllm/lib/python3.12/site-packages"
VLLM = f"{SITE}/vllm"
PYLIB = "/usr/lib/python3.12"
CONSERVING_MEMORY = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"

Frame = tuple[str, int, str, str]  # file, line, function, source line


def format_gib(num_bytes: float) -> str:
    """vLLM's format_gib: round to two decimals, no padding (`80.0`, `103.45`)."""
    return f"{round(num_bytes / GIB, 2)}"


def free_memory_error(free_bytes: int, total_bytes: int, utilization: float, requested_bytes: int, device: str = "cuda:0") -> str:
    """The ValueError of v1/worker/utils.py request_memory()."""
    return (
        f"Free memory on device {device} ({format_gib(free_bytes)}/{format_gib(total_bytes)} GiB) on startup "
        f"is less than desired GPU memory utilization ({utilization}, {format_gib(requested_bytes)} GiB). "
        "Decrease GPU memory utilization or reduce GPU memory used by other processes."
    )


def kv_memory_hint(minor: int, extensible: bool, utilization: float) -> str:
    """0.34's `_more_kv_cache_memory_hint` (before warm-up), which ends its KV failures; older releases word it in place."""
    if not extensible:
        return ("Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory "
                "reservation on the CPU backend, despite its name).")
    used_by = "the model and its activations"
    if utilization < 1.0:
        return (f"The KV cache gets what is left after {used_by} within `gpu_memory_utilization`={utilization}; increase it "
                "(with the extensible KV cache it defaults to 1.0) or decrease `max_model_len` or `max_num_seqs`.")
    return (f"The extensible KV cache already takes all device memory left after {used_by}; decrease `max_model_len` or "
            "`max_num_seqs`, or the model needs a device with more memory.")


def kv_insufficient_error(max_model_len: int, needed_gib: float, available_gib: float, estimated_max_len: int, minor: int = 23, hint: str = "") -> str:
    """check_enough_kv_cache_memory()'s ValueError: 0.23-0.33's tail, or 0.34's `hint` and its own."""
    estimated = (
        f"Based on the available memory, the estimated maximum model length is {estimated_max_len}. "
        if estimated_max_len > 0
        else ""
    )
    head = (
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({needed_gib:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
        f"({available_gib:.2f} GiB). {estimated}"
    )
    if minor >= 34:
        return f"{head}{hint} Decreasing `max_model_len` also reduces what is needed. See {CONSERVING_MEMORY} for more details."
    return (
        f"{head}Try increasing `gpu_memory_utilization` (which also controls "
        "CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
        f"See {CONSERVING_MEMORY} for more details."
    )


# vLLM 0.34's QueueOverflowError (--max-num-queued-reqs), answered with 503.
QUEUE_FULL = "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."

NO_KV_BLOCKS = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
    "engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). "
    f"See {CONSERVING_MEMORY} for more details."
)


def no_kv_blocks(minor: int, hint: str) -> str:
    """`No available memory for the cache blocks.`: 0.23-0.33's fixed advice, 0.34's `hint`."""
    if minor >= 34:
        return f"No available memory for the cache blocks. {hint} See {CONSERVING_MEMORY} for more details."
    return NO_KV_BLOCKS


def cuda_oom_message(tried_gib: float, total_gib: float, free_gib: float, in_use_gib: float) -> str:
    """PyTorch's CUDA OOM text as 2.11 words it."""
    return (
        f"CUDA out of memory. Tried to allocate {tried_gib:.2f} GiB. GPU 0 has a total capacity of {total_gib:.2f} GiB "
        f"of which {free_gib:.2f} GiB is free. Including non-PyTorch memory, this process has {in_use_gib:.2f} GiB "
        f"memory in use. Of the allocated memory {in_use_gib - 0.42:.2f} GiB is allocated by PyTorch, and "
        "112.50 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
        "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def load_oom_error(original: str) -> str:
    """The V1 runner's ERROR line when weights do not fit."""
    return (
        "Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to free memory for "
        "weights, increasing --tensor-parallel-size, or using --quantization. "
        f"See {CONSERVING_MEMORY} for more tips. (original error: {original})"
    )


def engine_init_failed() -> str:
    """The API server's last line when the EngineCore did not start (as 0.23.0 prints it)."""
    return "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"


def frame_lines(frames: Sequence[Frame]) -> list[str]:
    """The `  File ...` and source lines of a traceback's frames."""
    lines = []
    for file, line, function, source in frames:
        lines.append(f'  File "{file}", line {line}, in {function}')
        if source:
            lines.append(f"    {source}")
    return lines


def traceback_text(frames: Sequence[Frame], final: str) -> str:
    """A Python traceback, without trailing newline."""
    return "\n".join(["Traceback (most recent call last):", *frame_lines(frames), final])


# --- GB10's own failures (REFERENCE §12) ------------------------------------------

TRITON = f"{SITE}/triton"
BUNDLED_PTXAS = f"{TRITON}/backends/nvidia/bin/ptxas"
GB10_ARCH = "sm_121a"
PTXAS_UNKNOWN_ARCH = f"ptxas fatal   : Value '{GB10_ARCH}' is not defined for option 'gpu-name'"
# A few lines of the module Triton gave ptxas; Triton prints all of it.
PTX_SOURCE = (
    "//\n// Generated by LLVM NVPTX Back-End\n//\n\n.version 8.7\n.target sm_121a\n.address_size 64\n\n"
    "\t// .globl\ttriton_poi_fused_add_0\n.visible .entry triton_poi_fused_add_0(\n\t.param .u64 .ptr .global .align 1 "
    "triton_poi_fused_add_0_param_0,\n\t.param .u32 triton_poi_fused_add_0_param_1\n)\n{\n\tret;\n\n}"
)


def ptxas_error(ptx_file: str) -> str:
    """The message of Triton's PTXASError when its bundled ptxas is older than the GPU (make_cubin, exit status 255)."""
    return (
        "Internal Triton PTX codegen error\n"
        f"`ptxas` stderr:\n{PTXAS_UNKNOWN_ARCH}\n\n"
        f"Repro command: {BUNDLED_PTXAS} -lineinfo -v --gpu-name={GB10_ARCH} {ptx_file} -o {ptx_file}.o\n"
    )


def triton_reproducer(error: str) -> str:
    """What make_cubin prints on stdout before it raises PTXASError."""
    bar = "=" * 64
    return f"\n\n{bar}\n{error}\n\n{PTX_SOURCE}\n{bar}\nplease share the reproducer above with Triton project.\n"


def ptxas_final(error: str, compiling: bool) -> str:
    """The traceback's last lines: Inductor wraps the PTXASError while torch.compile runs; vLLM's own kernels raise it as it is."""
    if compiling:
        return (
            f"torch._inductor.exc.InductorError: PTXASError: PTXAS error: {error}\n"
            'Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace (please do this especially if you\'re reporting a bug to '
            'PyTorch). For even more developer context, set TORCH_LOGS="+dynamo"\n'
        )
    return f"triton.runtime.errors.PTXASError: PTXAS error: {error}"


NO_KERNEL_IMAGE = (
    "torch.AcceleratorError: CUDA error: no kernel image is available for execution on the device\n"
    "Search for `cudaErrorNoKernelImageForDevice' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html "
    "for more information.\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

# The EngineCore is started with multiprocessing's spawn: a semaphore removed before the child unpickles it.
SEMAPHORE_GONE = traceback_text(
    [
        ("<string>", 1, "<module>", ""),
        (f"{PYLIB}/multiprocessing/spawn.py", 122, "spawn_main", "exitcode = _main(fd, parent_sentinel)"),
        (f"{PYLIB}/multiprocessing/spawn.py", 132, "_main", "self = reduction.pickle.load(from_parent)"),
        (f"{PYLIB}/multiprocessing/synchronize.py", 115, "__setstate__", "self._semlock = _multiprocessing.SemLock._rebuild(*state)"),
    ],
    "FileNotFoundError: [Errno 2] No such file or directory",
)


# --- frames -------------------------------------------------------------------

_ENGINE_START: list[Frame] = [
    (f"{VLLM}/v1/engine/core.py", 1011, "run_engine_core", "engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)"),
    (f"{VLLM}/v1/engine/core.py", 773, "__init__", "super().__init__("),
]
_EXECUTOR: list[Frame] = [
    (f"{VLLM}/v1/engine/core.py", 104, "__init__", "self.model_executor = executor_class(vllm_config)"),
    (f"{VLLM}/v1/executor/abstract.py", 101, "__init__", "self._init_executor()"),
]
_KV_INIT: list[Frame] = [
    (f"{VLLM}/v1/engine/core.py", 115, "__init__", "num_gpu_blocks, num_cpu_blocks, kv_cache_config = self._initialize_kv_caches("),
]
# Frames many failures pass through: the engine handing the KV cache config to the workers, and torch's device dispatch.
_INITIALIZE_FROM_CONFIG: Frame = (f"{VLLM}/v1/engine/core.py", 259, "_initialize_kv_caches", "self.model_executor.initialize_from_config(kv_cache_configs)")
_TORCH_FUNCTION: Frame = (f"{SITE}/torch/utils/_device.py", 109, "__torch_function__", "return func(*args, **kwargs)")

# What a GPU worker runs, below the executor: the same frames under
# UniProcExecutor (in the EngineCore) and under a Ray actor's execute_method.
WORKER_FRAMES: dict[str, list[Frame]] = {
    "free_memory": [
        (f"{VLLM}/v1/worker/worker_base.py", 326, "init_device", "self.worker.init_device()  # type: ignore"),
        (f"{VLLM}/v1/worker/gpu_worker.py", 264, "init_device", "self.requested_memory = request_memory(init_snapshot, self.cache_config)"),
        (f"{VLLM}/v1/worker/utils.py", 402, "request_memory", "raise ValueError("),
    ],
    "load": [
        (f"{VLLM}/v1/worker/gpu_worker.py", 318, "load_model", "self.model_runner.load_model(eep_scale_up=eep_scale_up)"),
        (f"{VLLM}/v1/worker/gpu/model_runner.py", 305, "load_model", "self.model = model_loader.load_model("),
        (f"{VLLM}/model_executor/model_loader/base_loader.py", 58, "load_model", "self.load_weights(model, model_config)"),
        (f"{VLLM}/model_executor/model_loader/default_loader.py", 301, "load_weights", "loaded_weights = model.load_weights(self.get_all_weights(model_config, model))"),
        _TORCH_FUNCTION,
    ],
}
# After the weights, the loader's first kernels (a build without kernels for this GPU fails here).
WORKER_FRAMES["post_load"] = WORKER_FRAMES["load"][:4] + [
    (f"{VLLM}/model_executor/model_loader/base_loader.py", 60, "load_model", "process_weights_after_loading(model, model_config, target_device)"),
    (f"{VLLM}/model_executor/model_loader/utils.py", 109, "process_weights_after_loading", "quant_method.process_weights_after_loading(module)"),
    (f"{VLLM}/model_executor/layers/quantization/fp8.py", 512, "process_weights_after_loading", "weight_scale = layer.weight_scale.max()"),
]
_TRITON_COMPILE: list[Frame] = [
    (f"{TRITON}/runtime/jit.py", 419, "<lambda>", "return lambda *args, **kwargs: self.run(grid=grid, warmup=False, *args, **kwargs)"),
    (f"{TRITON}/runtime/jit.py", 733, "run", "kernel = self._do_compile(key, signature, device, constexprs, options, attrs, warmup)"),
    (f"{TRITON}/compiler/compiler.py", 319, "compile", "next_module = compile_ir(module, metadata)"),
    (f"{TRITON}/backends/nvidia/compiler.py", 520, "<lambda>", 'stages["cubin"] = lambda src, metadata: self.make_cubin(src, metadata, options, self.target.arch)'),
    (f"{TRITON}/backends/nvidia/compiler.py", 503, "make_cubin", "raise PTXASError(error)"),
]
ENGINE_FRAMES: dict[str, list[Frame]] = {
    "free_memory": _ENGINE_START + _EXECUTOR + [
        (f"{VLLM}/v1/executor/uniproc_executor.py", 47, "_init_executor", "self.driver_worker.init_device()"),
        *WORKER_FRAMES["free_memory"],
    ],
    "load": _ENGINE_START + _EXECUTOR + [
        (f"{VLLM}/v1/executor/uniproc_executor.py", 48, "_init_executor", "self.driver_worker.load_model()"),
        *WORKER_FRAMES["load"],
    ],
    "profile": _ENGINE_START + _KV_INIT + [
        (f"{VLLM}/v1/engine/core.py", 232, "_initialize_kv_caches", "available_gpu_memory = self.model_executor.determine_available_memory()"),
        (f"{VLLM}/v1/executor/abstract.py", 136, "determine_available_memory", 'return self.collective_rpc("determine_available_memory")'),
        (f"{VLLM}/v1/worker/gpu_worker.py", 437, "determine_available_memory", "self.model_runner.profile_run()"),
        (f"{VLLM}/v1/worker/gpu/model_runner.py", 402, "profile_run", "self._dummy_run(self.max_num_tokens, skip_attn=True)"),
        _TORCH_FUNCTION,
    ],
    "graphs": _ENGINE_START + _KV_INIT + [
        _INITIALIZE_FROM_CONFIG,
        (f"{VLLM}/v1/executor/abstract.py", 117, "initialize_from_config", 'self.collective_rpc("compile_or_warm_up_model")'),
        (f"{VLLM}/v1/worker/gpu_worker.py", 532, "compile_or_warm_up_model", "cuda_graph_memory_bytes = self.model_runner.capture_model()"),
        (f"{VLLM}/v1/worker/gpu/model_runner.py", 688, "capture_model", "self.cudagraph_manager.capture(self._dummy_run)"),
        (f"{SITE}/torch/cuda/graphs.py", 268, "__exit__", "self.cuda_graph.capture_end()"),
    ],
    "kv": _ENGINE_START + _KV_INIT + [
        (f"{VLLM}/v1/engine/core.py", 244, "_initialize_kv_caches", "kv_cache_configs = get_kv_cache_configs("),
        (f"{VLLM}/v1/core/kv_cache_utils.py", 1460, "get_kv_cache_configs", "check_enough_kv_cache_memory("),
        (f"{VLLM}/v1/core/kv_cache_utils.py", 704, "check_enough_kv_cache_memory", "raise ValueError("),
    ],
    "post_load": _ENGINE_START + _EXECUTOR + [
        (f"{VLLM}/v1/executor/uniproc_executor.py", 48, "_init_executor", "self.driver_worker.load_model()"),
        *WORKER_FRAMES["post_load"],
    ],
    # Allocating the KV cache tensors (inferred): memory another process took since the profile run is not there.
    "kv_alloc": _ENGINE_START + _KV_INIT + [
        _INITIALIZE_FROM_CONFIG,
        (f"{VLLM}/v1/executor/abstract.py", 116, "initialize_from_config", 'self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))'),
        (f"{VLLM}/v1/worker/gpu_worker.py", 489, "initialize_from_config", "self.model_runner.initialize_kv_cache(kv_cache_config)"),
        (f"{VLLM}/v1/worker/gpu/model_runner.py", 371, "initialize_kv_cache", "kv_caches = init_kv_cache("),
        _TORCH_FUNCTION,
    ],
    # torch.compile's Inductor compiling the model's Triton kernels.
    "compile": _ENGINE_START + _KV_INIT + [
        (f"{VLLM}/v1/engine/core.py", 232, "_initialize_kv_caches", "available_gpu_memory = self.model_executor.determine_available_memory()"),
        (f"{VLLM}/v1/worker/gpu_worker.py", 437, "determine_available_memory", "self.model_runner.profile_run()"),
        (f"{VLLM}/compilation/backends.py", 1148, "__call__", "self.split_gm, self.piecewise_graphs = split_graph("),
        (f"{SITE}/torch/_inductor/compile_fx.py", 2451, "compile_fx", "return compile_fx_inner(gm, example_inputs)"),
        *_TRITON_COMPILE,
    ],
    # The V2 runner's warm-up, which JIT-compiles vLLM's own Triton kernels.
    "warmup": _ENGINE_START + _KV_INIT + [
        _INITIALIZE_FROM_CONFIG,
        (f"{VLLM}/v1/executor/abstract.py", 117, "initialize_from_config", 'self.collective_rpc("compile_or_warm_up_model")'),
        (f"{VLLM}/v1/worker/gpu_worker.py", 861, "compile_or_warm_up_model", "warmup_kernels(self.model_runner, self.execute_model, self.sample_tokens)"),
        (f"{VLLM}/v1/worker/gpu/warmup.py", 41, "warmup_kernels", "execute_model(dummy_scheduler_output)"),
        *_TRITON_COMPILE,
    ],
    "no_blocks": _ENGINE_START + _KV_INIT + [
        (f"{VLLM}/v1/engine/core.py", 244, "_initialize_kv_caches", "kv_cache_configs = get_kv_cache_configs("),
        (f"{VLLM}/v1/core/kv_cache_utils.py", 1460, "get_kv_cache_configs", "check_enough_kv_cache_memory("),
        (f"{VLLM}/v1/core/kv_cache_utils.py", 684, "check_enough_kv_cache_memory", "raise ValueError("),
    ],
}

# --- Ray (--distributed-executor-backend ray) ---------------------------------

RAY_WORKER_CLASS = "vllm.v1.executor.ray_utils.RayWorkerWrapper"
RAY_PG_WAIT_TIMEOUT_S = 1800  # ray_utils.PG_WAIT_TIMEOUT
RAY_NOT_ENOUGH_GPUS = "ValueError: The number of required GPUs exceeds the total number of available GPUs in the placement group."
RAY_NO_PLACEMENT_GROUP = "No current placement group found. Creating a new placement group."

_RAY_CLUSTER: list[Frame] = _ENGINE_START + _EXECUTOR + [
    (f"{VLLM}/v1/executor/ray_executor.py", 97, "_init_executor", "initialize_ray_cluster(self.parallel_config)"),
]

# Frames down to the point of failure; a failure inside Ray itself (ray.init,
# ray.get) continues with the real frames of the installed Ray.
RAY_ENGINE_FRAMES: dict[str, list[Frame]] = {
    "import": _RAY_CLUSTER + [
        (f"{VLLM}/v1/executor/ray_utils.py", 308, "initialize_ray_cluster", "assert_ray_available()"),
        (f"{VLLM}/v1/executor/ray_utils.py", 67, "assert_ray_available", "raise ValueError("),
    ],
    "connect": _RAY_CLUSTER + [
        (f"{VLLM}/v1/executor/ray_utils.py", 345, "initialize_ray_cluster", "ray.init(address=ray_address)"),
    ],
    "gpus": _RAY_CLUSTER + [
        (f"{VLLM}/v1/executor/ray_utils.py", 361, "initialize_ray_cluster", "raise ValueError("),
    ],
    "placement": _RAY_CLUSTER + [
        (f"{VLLM}/v1/executor/ray_utils.py", 393, "initialize_ray_cluster", "_wait_until_pg_ready(current_placement_group)"),
        (f"{VLLM}/v1/executor/ray_utils.py", 247, "_wait_until_pg_ready", "raise ValueError("),
    ],
}


def ray_rpc_frames(method: str) -> list[Frame]:
    """The EngineCore's frames down to the ray.get of a collective_rpc(method) sent to all workers."""
    return _ENGINE_START + _EXECUTOR + [
        (f"{VLLM}/v1/executor/ray_executor.py", 104, "_init_executor", "self._init_workers_ray(placement_group)"),
        (f"{VLLM}/v1/executor/ray_executor.py", 356, "_init_workers_ray", f'self.collective_rpc("{method}")'),
        (f"{VLLM}/v1/executor/ray_executor.py", 498, "collective_rpc", "return ray.get(ray_worker_outputs, timeout=timeout)"),
    ]


RAY_BUSY_LOOP_FRAMES: list[Frame] = [
    (f"{VLLM}/v1/engine/core.py", 1014, "run_engine_core", "engine_core.run_busy_loop()"),
    (f"{VLLM}/v1/engine/core.py", 1045, "run_busy_loop", "self._process_engine_step()"),
    (f"{VLLM}/v1/engine/core.py", 1078, "_process_engine_step", "outputs, model_executed = self.step_fn()"),
    (f"{VLLM}/v1/engine/core.py", 338, "step", "model_output = self.model_executor.execute_model(scheduler_output)"),
    (f"{VLLM}/v1/executor/ray_executor.py", 441, "execute_model", "return ray.get(refs[0])"),
]

# A worker method as the Ray actor runs it: WorkerWrapperBase.execute_method.
_WORKER_RPC: list[Frame] = [
    (f"{VLLM}/v1/worker/worker_base.py", 354, "execute_method", "return run_method(self, method, args, kwargs)"),
    (f"{VLLM}/v1/serial_utils.py", 479, "run_method", "return func(*args, **kwargs)"),
]
RAY_WORKER_ERROR_SRC = "v1/worker/worker_base.py:362"


def ray_import_failed(error: str) -> str:
    """assert_ray_available()'s ValueError (sic: no space after the first period)."""
    return f"ValueError: Failed to import Ray: {error}.Please install Ray with `pip install ray`."


def ray_env_copy_lines(names: Sequence[str], config_root: str) -> list[tuple[str, str]]:
    """What get_env_vars_to_copy() logs before the workers are started: (source, message) pairs."""
    return [
        ("ray/ray_env.py:65", "RAY_NON_CARRY_OVER_ENV_VARS from config: set()"),
        ("ray/ray_env.py:67", f"Copying the following environment variables to workers: {list(names)}"),
        ("ray/ray_env.py:72", f"If certain env vars should NOT be copied, add them to {config_root}/ray_non_carry_over_env_vars.json file"),
    ]


def placement_group_waiting(seconds: int, specs: Sequence[dict[str, float]]) -> str:
    """_wait_until_pg_ready()'s message while the cluster cannot place every bundle."""
    return (
        f"Waiting for creating a placement group of specs for {seconds} seconds. specs={list(specs)}. Check "
        "`ray status` and `ray list nodes` to see if you have enough resources, and make sure the IP addresses "
        "used by ray cluster are the same as VLLM_HOST_IP environment variable specified in each node if you "
        "are running on a multi-node."
    )


def placement_group_timeout(specs: Sequence[dict[str, float]]) -> str:
    """_wait_until_pg_ready()'s ValueError once PG_WAIT_TIMEOUT has passed."""
    return (
        f"ValueError: Cannot provide a placement group of placement_group_specs={list(specs)} within "
        f"{RAY_PG_WAIT_TIMEOUT_S} seconds. See `ray status` and `ray list nodes` to make sure the cluster has "
        "enough resources."
    )


def ray_worker_error(method: str, kind: str, final: str) -> str:
    """The worker's logger.exception() in execute_method: the message, then the traceback down to the failure."""
    return (
        f"Error executing method {method!r}. This might cause deadlock in distributed execution.\n"
        + traceback_text(_WORKER_RPC + WORKER_FRAMES[kind], final)
    )


def ray_task_error(kind: str, final: str, pid: int, ip: str, actor_id: str, address: int) -> str:
    """How a worker's exception ends the driver's traceback once ray.get re-raises it.

    Ray writes the `ray::Class.method()` part between cyan escapes whatever
    the output is; the frames are the worker's, from the re-raise in
    execute_method down to the failure; the cause's line closes it.
    """
    cause = final.partition(":")[0].rsplit(".", 1)[-1]
    header = (
        f"ray.exceptions.RayTaskError({cause}): \x1b[36mray::RayWorkerWrapper.execute_method()\x1b[39m "
        f"(pid={pid}, ip={ip}, actor_id={actor_id}, repr=<{RAY_WORKER_CLASS} object at {address:#x}>)"
    )
    reraise = (f"{VLLM}/v1/worker/worker_base.py", 363, "execute_method", "raise e")
    return "\n".join([header, *frame_lines([reraise, *_WORKER_RPC, *WORKER_FRAMES[kind]]), final])


PROCESS_FRAMES: list[Frame] = [
    (f"{PYLIB}/multiprocessing/process.py", 314, "_bootstrap", "self.run()"),
    (f"{PYLIB}/multiprocessing/process.py", 108, "run", "self._target(*self._args, **self._kwargs)"),
]

_API_MAIN: list[Frame] = [
    ("/opt/vllm/bin/vllm", 10, "<module>", "sys.exit(main())"),
    (f"{VLLM}/entrypoints/cli/main.py", 75, "main", "args.dispatch_function(args)"),
    (f"{VLLM}/entrypoints/cli/serve.py", 118, "cmd", "uvloop.run(run_server(args))"),
    (f"{SITE}/uvloop/__init__.py", 96, "run", "return __asyncio.run("),
    (f"{PYLIB}/asyncio/runners.py", 195, "run", "return runner.run(main)"),
    (f"{PYLIB}/asyncio/runners.py", 118, "run", "return self._loop.run_until_complete(task)"),
    ("uvloop/loop.pyx", 1518, "uvloop.loop.Loop.run_until_complete", ""),
    (f"{SITE}/uvloop/__init__.py", 48, "wrapper", "return await main"),
]
_API_ENGINE_CLIENT: list[Frame] = _API_MAIN + [
    (f"{VLLM}/entrypoints/openai/api_server.py", 1245, "run_server", "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)"),
    (f"{VLLM}/entrypoints/openai/api_server.py", 1264, "run_server_worker", "async with build_async_engine_client("),
    (f"{PYLIB}/contextlib.py", 210, "__aenter__", "return await anext(self.gen)"),
    (f"{VLLM}/entrypoints/openai/api_server.py", 171, "build_async_engine_client", "async with build_async_engine_client_from_engine_args("),
    (f"{PYLIB}/contextlib.py", 210, "__aenter__", "return await anext(self.gen)"),
]
_API_WAIT: list[Frame] = _API_ENGINE_CLIENT + [
    (f"{VLLM}/entrypoints/openai/api_server.py", 212, "build_async_engine_client_from_engine_args", "async_llm = AsyncLLM.from_vllm_config("),
    (f"{VLLM}/v1/engine/async_llm.py", 240, "from_vllm_config", "return cls("),
    (f"{VLLM}/v1/engine/async_llm.py", 146, "__init__", "self.engine_core = EngineCoreClient.make_async_mp_client("),
    (f"{VLLM}/v1/engine/core_client.py", 124, "make_async_mp_client", "return AsyncMPClient(*client_args)"),
    (f"{VLLM}/v1/engine/core_client.py", 835, "__init__", "super().__init__("),
    (f"{VLLM}/v1/engine/core_client.py", 490, "__init__", "with launch_core_engines(vllm_config, executor_class, log_stats) as ("),
    (f"{PYLIB}/contextlib.py", 144, "__exit__", "next(self.gen)"),
    (f"{VLLM}/v1/engine/utils.py", 1040, "launch_core_engines", "wait_for_engine_startup("),
]

API_FRAMES: dict[str, list[Frame]] = {
    "engine_failed": _API_WAIT + [(f"{VLLM}/v1/engine/utils.py", 1131, "wait_for_engine_startup", "raise RuntimeError(")],
    "terminated": _API_WAIT + [
        (f"{VLLM}/v1/engine/utils.py", 1094, "wait_for_engine_startup", "events = poller.poll(STARTUP_POLL_PERIOD_MS)"),
        (f"{VLLM}/entrypoints/cli/serve.py", 92, "signal_handler", 'raise KeyboardInterrupt("terminated")'),
    ],
    "port_in_use": _API_MAIN + [
        (f"{VLLM}/entrypoints/openai/api_server.py", 1244, "run_server", "listen_address, sock = setup_server(args)"),
        (f"{VLLM}/entrypoints/openai/api_server.py", 1209, "setup_server", "sock = create_server_socket(sock_addr)"),
        (f"{VLLM}/entrypoints/openai/api_server.py", 1150, "create_server_socket", "sock.bind(addr)"),
    ],
    "serve_args": _API_MAIN[:2] + [
        (f"{VLLM}/entrypoints/cli/serve.py", 104, "cmd", "raise ValueError("),
    ],
    "bad_parser": _API_MAIN + [
        (f"{VLLM}/entrypoints/openai/api_server.py", 1244, "run_server", "listen_address, sock = setup_server(args)"),
        (f"{VLLM}/entrypoints/openai/api_server.py", 1187, "setup_server", "validate_api_server_args(args)"),
    ],
    "model_config": _API_ENGINE_CLIENT + [
        (f"{VLLM}/entrypoints/openai/api_server.py", 197, "build_async_engine_client_from_engine_args", "vllm_config = engine_args.create_engine_config(usage_context=usage_context)"),
        (f"{VLLM}/engine/arg_utils.py", 1392, "create_engine_config", "model_config = self.create_model_config()"),
        (f"{VLLM}/engine/arg_utils.py", 1246, "create_model_config", "return ModelConfig("),
        (f"{SITE}/pydantic/_internal/_dataclasses.py", 121, "__init__", "s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)"),
        (f"{VLLM}/config/model.py", 467, "__post_init__", "hf_config = get_config("),
        (f"{VLLM}/transformers_utils/config.py", 602, "get_config", "raise ValueError("),
    ],
}

TOOL_PARSERS = (
    "deepseek_v3", "deepseek_v31", "ernie45", "glm45", "granite-20b-fc", "granite", "hermes", "hunyuan_a13b",
    "internlm", "jamba", "kimi_k2", "llama3_json", "llama4_json", "llama4_pythonic", "longcat", "minimax_m2",
    "minimax", "mistral", "olmo3", "openai", "phi4_mini_json", "pythonic", "qwen3_coder", "qwen3_xml",
    "seed_oss", "step3", "xlam",
)
REASONING_PARSERS = (
    "deepseek_r1", "deepseek_v3", "ernie45", "glm45", "gpt_oss", "granite", "hunyuan_a13b", "minimax_m2",
    "minimax_m2_append_think", "mistral", "olmo3", "qwen3", "seed_oss", "step3",
)


def bad_tool_parser(name: str) -> str:
    """The KeyError for an unknown --tool-call-parser."""
    return f"KeyError: 'invalid tool call parser: {name} (chose from {{ {','.join(TOOL_PARSERS)} }})'"


def bad_reasoning_parser(name: str) -> str:
    """The KeyError for an unknown --reasoning-parser."""
    return f"KeyError: 'invalid reasoning parser: {name} (chose from {{ {','.join(REASONING_PARSERS)} }})'"


MODEL_NOT_POSITIONAL = (
    "ValueError: `model` should be provided as the first positional argument when using `vllm serve`. "
    "i.e. `vllm serve <model> --<arg> <value>`."
)

AUTO_TOOL_CHOICE_NEEDS_PARSER = "TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser"

PORT_IN_USE = "OSError: [Errno 98] Address already in use"


def model_not_found(model: str) -> str:
    """transformers' OSError, then vLLM's ValueError raised from it."""
    hub = [
        (f"{SITE}/transformers/utils/hub.py", 479, "cached_files", "raise OSError("),
    ]
    first = traceback_text(
        [(f"{VLLM}/transformers_utils/config.py", 581, "get_config", "config_dict, _ = PretrainedConfig.get_config_dict("), *hub],
        f"OSError: {model} is not a local folder and is not a valid model identifier listed on 'https://huggingface.co/models'\n"
        "If this is a private repository, make sure to pass a token having permission to this repo either by logging "
        "in with `hf auth login` or by passing `token=<your_token>`",
    )
    second = traceback_text(
        API_FRAMES["model_config"],
        f"ValueError: Invalid repository ID or local directory specified: '{model}'.\n"
        "Please verify the following requirements:\n"
        "1. Provide a valid Hugging Face repository ID.\n"
        "2. Specify a local directory that contains a recognized configuration file.\n"
        "   - For Hugging Face models: ensure the presence of a 'config.json'.\n"
        "   - For Mistral models: ensure the presence of a 'params.json'.",
    )
    return f"{first}\n\nThe above exception was the direct cause of the following exception:\n\n{second}"


def not_found_body(model: str, served: Sequence[str], minor: int) -> str:
    """The 404 body for a request naming a model that is not served."""
    aliases = f" Valid aliases: {', '.join(served)}." if minor >= 32 else ""
    return (
        '{"error":{"message":"The model `' + model + "` does not exist." + aliases
        + '","type":"NotFoundError","param":"model","code":404}}'
    )


ENGINE_DEAD_TRACEBACK = traceback_text(
    [
        (f"{VLLM}/v1/engine/async_llm.py", 660, "output_handler", "outputs = await engine_core.get_output_async()\n" + " " * 14 + "^" * 36),
        (f"{VLLM}/v1/engine/core_client.py", 1046, "get_output_async", "raise self._format_exception(outputs) from None"),
    ],
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
)
