"""What ``torchrun --standalone --nproc-per-node N`` does for a test's job, without torchrun's own process.

    python tests/helpers/launch_ranks.py N [-m module | script.py] [args...]

Starts N copies of the program on this machine as ranks 0..N-1, each with the environment torchrun gives the
workers of a standalone single-node job (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK,
ROLE_WORLD_SIZE, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the TCP store on a free port outside
the ephemeral range), writing to this process's standard output and error. As torchrun does, it stops the other
ranks (SIGTERM, then SIGKILL after ``GRACE_S``) as soon as one exits with an error, and exits 1 then. The ranks die
with it (``PR_SET_PDEATHSIG``), so a test's timeout that kills it leaves no rank behind.

torchrun imports torch and its elastic agent before it starts a rank: seconds of CPU per launch on a 2-core machine,
for a process that takes no part in the job. The tests that show a user's command line keep torchrun itself
(``test_megatron_lm``'s patched and launcher runs, the cluster's comparison with torchrun); the others launch
through this file (``ranks_command`` in tests/conftest.py).
"""
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time

GRACE_S = 30.0
POLL_S = 0.1


def _free_port() -> int:
    """A free port outside the kernel's ephemeral range: rank 0 binds it only seconds later, after its imports, and
    a port of that range may meanwhile be given to some connection's local end (gloo opens many)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    ports = list(range(10000, low)) if low > 11000 else list(range(high + 1, 65536))
    for port in random.sample(ports, min(len(ports), 200)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise SystemExit("launch_ranks.py: no free port outside the ephemeral range")


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


def main(argv) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: launch_ranks.py N [-m module | script.py] [args...]", file=sys.stderr)
        return 2
    n, program = int(argv[0]), argv[1:]
    port = _free_port()
    ranks = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                   GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(r), ROLE_WORLD_SIZE=str(n),
                   ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen([sys.executable, *program], env=env, preexec_fn=_die_with_parent))
    while True:
        codes = [p.poll() for p in ranks]                  # every rank, each time: any of them may fail first
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            break
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)
    for p in ranks:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in ranks:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    print(f"launch_ranks.py: rank {failed} exited with {ranks[failed].returncode}; the other ranks were stopped",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
