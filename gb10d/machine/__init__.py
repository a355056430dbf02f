"""The machine gb10d runs on: its devices and their policy, the kernel's log, /dev/shm, its processes (procs: the one walk of /proc), whether the service user
can reach a path (access, pathcheck, mountcheck), the systemd unit (service), the journal and sd_notify, the listening
sockets systemd passes (listenfds), the memory ledger the instances of the machine share, and what the decisions are
handed: the host's facts (host), meminfo and the model's files (memory), the state file (statefile), the record of
vLLM programs (programsfile), each written atomically (files).

May import gb10d.core, gb10d.vllm and gb10d.base; none of the daemon: what a reading or a follower finds goes back
through callbacks.
"""
