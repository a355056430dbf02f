"""Running vLLM: the `Runtime` and `Launcher` an attempt drives (runtime), a local process group (process), vLLM in
a container through docker or podman (container; the engine's client in engine, the container's cgroup readings in
cgroup, its image inspected and pulled in image), this machine's Ray node and the node-table watcher (raynode,
raywatch, run by Ray's own Python) and the cluster's network interface (interfaces decides, netifs reads).

May import gb10d.machine, gb10d.core, gb10d.vllm and gb10d.base; none of the daemon.
"""
