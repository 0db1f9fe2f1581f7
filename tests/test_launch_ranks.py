"""tests/helpers/launch_ranks.py, the tests' stand-in for torchrun's process: the ranks get torchrun's variables, a
failing rank stops the others whichever rank it is, and no rank outlives the launcher."""
import os
import signal
import subprocess
import time

from conftest import ranks_command

SHOW_ENV = ("import os; print(' '.join(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
            "'LOCAL_WORLD_SIZE', 'MASTER_ADDR')), int(os.environ['MASTER_PORT']) > 0)")


def test_every_rank_gets_torchruns_variables():
    p = subprocess.run(ranks_command(3) + ["-c", SHOW_ENV], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.split("\n")[:-1]) == [f"{r} {r} 3 3 127.0.0.1 True" for r in range(3)], p.stdout


def test_a_failing_rank_stops_the_others_whichever_it_is():
    for failing in (0, 2):      # the first rank, and one after a rank that is still running
        program = (f"import os, sys, time; r = int(os.environ['RANK']); time.sleep(0.5 if r == {failing} else 120); "
                   f"sys.exit(5 if r == {failing} else 0)")
        start = time.monotonic()
        p = subprocess.run(ranks_command(3) + ["-c", program], capture_output=True, text=True, timeout=90)
        assert p.returncode == 1 and f"rank {failing} exited with 5" in p.stderr, (p.returncode, p.stderr)
        assert time.monotonic() - start < 60, "the other ranks ran on"


def test_no_rank_outlives_a_killed_launcher(tmp_path):
    marker = tmp_path / "pids"
    program = (f"import os, time; open({str(marker)!r} + os.environ['RANK'], 'w').write(str(os.getpid())); "
               "time.sleep(120)")
    launcher = subprocess.Popen(ranks_command(2) + ["-c", program])
    deadline = time.monotonic() + 30
    while not all(os.path.exists(f"{marker}{r}") and open(f"{marker}{r}").read() for r in range(2)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    pids = [int(open(f"{marker}{r}").read()) for r in range(2)]
    launcher.send_signal(signal.SIGKILL)          # what subprocess.run's timeout does to it
    launcher.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in pids if _running(pid)]
    assert not alive, f"ranks {alive} outlived their launcher"


def _running(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
