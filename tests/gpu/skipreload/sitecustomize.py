"""A fault for tests/gpu/real_vllm_sleep.py, made in vLLM's own process: while the file named by
GB10D_SKIP_RELOAD_FLAG exists, the worker's `reload_weights` does nothing and answers as if it had reloaded.

gb10d has no switch to skip the reload of a wake, by design; this is how a wake whose weights never came back
is made on a real vLLM. On the PYTHONPATH of one instance's vLLM (its [vllm] env), Python imports this module at
every start, in the API server and in the EngineCore alike; it patches the class right after vLLM imports it.
gb10d.sim's SleepMode is patched the same way, so the driver's dry run goes through the same fault.
"""

import importlib.abc
import importlib.util
import os
import sys

FLAG = os.environ.get("GB10D_SKIP_RELOAD_FLAG", "")
# module -> the class whose reload_weights collective_rpc("reload_weights") ends in (vLLM 0.26.0: gpu_worker.Worker)
TARGETS = {"vllm.v1.worker.gpu_worker": "Worker", "gb10d.sim.sleep": "SleepMode"}


def _patch(module):
    cls = getattr(module, TARGETS[module.__name__])
    original = cls.reload_weights

    def reload_weights(self, *args, **kwargs):
        if os.path.exists(FLAG):
            print(f"skipreload: reload_weights skipped, {FLAG} exists", file=sys.stderr, flush=True)
            return None
        return original(self, *args, **kwargs)

    cls.reload_weights = reload_weights


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = patched
        return spec


if FLAG:
    sys.meta_path.insert(0, _Finder())
