#!/usr/bin/env python3
"""footprint.py - runs a command and writes its peak memory to a file.

    python3 bench/footprint.py OUT_FILE COMMAND [ARG ...]

OUT_FILE gets two numbers in kB: the kernel's peak resident set (`ru_maxrss`, what
`/usr/bin/time -f %M` prints) and the peak of resident plus swapped-out memory
(`VmRSS + VmSwap` of /proc/PID/status, read every 20 ms). On a host that swaps, the
first undercounts what the process holds; the second is what it would hold resident
on a host with enough memory, up to a peak shorter than the sampling period.
Exits with the command's status; SIGTERM and SIGINT are passed on to it.
"""
import os
import resource
import signal
import subprocess
import sys
import time


def rss_plus_swap_kb(pid):
    """VmRSS + VmSwap of `pid` in kB, or None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except (FileNotFoundError, ProcessLookupError):
        return None
    kb = lambda key: int(fields.get(key, "0 kB").split()[0])
    return kb("VmRSS") + kb("VmSwap")


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: footprint.py OUT_FILE COMMAND [ARG ...]")
    out, cmd = sys.argv[1], sys.argv[2:]
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _frame: child.send_signal(s))
    peak = 0
    while child.poll() is None:
        now = rss_plus_swap_kb(child.pid)
        peak = max(peak, now or 0)
        time.sleep(0.02)
    hwm = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with open(out, "w") as f:
        f.write(f"{hwm} {max(peak, hwm)}\n")
    sys.exit(child.returncode if child.returncode >= 0 else 128 - child.returncode)


if __name__ == "__main__":
    main()
