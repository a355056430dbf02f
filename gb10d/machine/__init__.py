"""The machine gb10d runs on: its devices and their policy, the kernel's log, /dev/shm, its processes (procs: the one walk of /proc), whether the service user
can reach a path (access, pathcheck, mountcheck), the systemd unit (service), the journal and sd_notify, the listening sockets systemd passes
(listenfds), and the memory ledger the instances of the machine share.

May import gb10d.core, gb10d.vllm and gb10d.base; none of the daemon: what a reading or a follower finds goes back
through callbacks.
"""
