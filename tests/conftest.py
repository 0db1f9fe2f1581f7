"""Shared test helpers: a naive per-token reference of the MoE layer and a gloo multi-process launcher; the order
pytest-xdist hands test files to its workers.

With ``-n N --dist loadfile`` (the README's test command) a worker takes a whole file at a time, and pytest-xdist
hands them out by their number of tests, most first: the files of a few long multi-process tests (Megatron-LM's
pretrain_gpt.py runs) came last and ran alone at the end while the other worker sat idle. Here the files go out
longest first instead, by their seconds in tests/file_durations.json (measured on a 2-core machine, per Python
version; a file it does not list counts 0 and keeps pytest-xdist's place). ``--record-file-durations`` writes that
table from a run.
"""
import compileall
import json
import os
import sys
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the subprocesses the tests start skip their final garbage collections at exit (tests/fast_exit/sitecustomize.py)
_FAST_EXIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_exit")
if _FAST_EXIT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join([_FAST_EXIT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
_LAUNCH_RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "launch_ranks.py")


def ranks_command(nproc) -> list:
    """The command prefix that starts ``nproc`` ranks of a Python program as ``torchrun --standalone`` would,
    without torchrun's own process (tests/helpers/launch_ranks.py); the program and its arguments follow."""
    return [sys.executable, _LAUNCH_RANKS, str(nproc)]


@pytest.fixture
def single_process(monkeypatch):
    """An in-process trainer run as a single process: no launcher variables, the torch thread count restored."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def reference_moe(x2d, routing, bank):
    """Each token through each of its kept experts in a Python loop, weighted by the gate weights."""
    out = []
    for t in range(x2d.shape[0]):
        acc = torch.zeros_like(x2d[t])
        for j in range(routing.top_k):
            if bool(routing.kept[t, j]):
                e = int(routing.expert_ids[t, j])
                h = x2d[t] @ bank.w1[e] + (bank.b1[e] if bank.b1 is not None else 0)
                if bank.activation == "swiglu":
                    g, u = h.chunk(2)
                    a = F.silu(g) * u
                else:
                    a = F.gelu(h) if bank.activation == "gelu" else F.relu(h)
                acc = acc + routing.weights[t, j] * (a @ bank.w2[e] + (bank.b2[e] if bank.b2 is not None else 0))
        out.append(acc)
    return torch.stack(out) if out else x2d[:0] * 0


# the launcher's variables, which it sets in each child before the test's function runs
_LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _as_the_test_process(rank, world_size, parent, env, fn, *args):
    """In a forkserver's child: the test process's environment as it was at the call, less the launcher's
    variables, and its standard output and error (a child inherits the server's; ``capfd`` reads the test's),
    appended to; then fn."""
    launcher = {k: os.environ[k] for k in _LAUNCHER_VARS if k in os.environ}
    os.environ.clear()
    os.environ.update({k: v for k, v in env.items() if k not in _LAUNCHER_VARS}, **launcher)
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:                 # a socket cannot be reopened: the server's stays
            continue
        os.dup2(target, fd)
        os.close(target)
    fn(rank, world_size, *args)


def run_distributed(fn, world_size, *args):
    """Run fn(rank, world_size, *args) in `world_size` real gloo processes (the package's launcher); any failure
    fails the test. fn must be a module-level function. The children come from a forkserver that has imported
    torch and the package once: clean processes, like spawned ones (a test process may hold state a fork should not
    inherit), without importing torch again for each child. Where there is no /proc to reach the test's output
    through, they are spawned."""
    import multiprocessing

    from megamoe_plugin.launch import run_processes
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        run_processes(fn, world_size, *args, start_method="spawn")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "megamoe_plugin.train"])  # at start
    try:
        run_processes(_as_the_test_process, world_size, os.getpid(), dict(os.environ), fn, *args,
                      start_method="forkserver")
    finally:
        for fd in (1, 2):               # past what the children appended (a pipe or a terminal has no position)
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError:
                pass


DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_durations.json")
PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
_FILE_SECONDS = defaultdict(float)        # this run's seconds per test file (setup, call and teardown reports)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a multi-process test that takes tens of seconds (few, but real)")
    if not hasattr(config, "workerinput"):
        # every process the tests start imports the plugin from this checkout; where PYTHONDONTWRITEBYTECODE is set
        # (as on this project's machines) none of them writes its bytecode, so each compiled the plugin again
        compileall.compile_dir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                            "megamoe_plugin"), quiet=1)


def pytest_addoption(parser):
    parser.addoption("--record-file-durations", action="store_true",
                     help="add this run's seconds per test file (setup, call, teardown) to tests/file_durations.json, "
                          "under this Python version: the order the README's two-worker run hands files out in")


def _durations_table():
    """tests/file_durations.json: {Python version: {test file: seconds}} ({} when missing or unreadable)."""
    try:
        with open(DURATIONS) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with the longest files first (module docstring)."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling
    seconds = _durations_table().get(PYTHON, {})

    class LongestFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            queue = self.workqueue                  # pytest-xdist 3.x: an OrderedDict of file -> its tests
            if queue and hasattr(queue, "move_to_end"):     # else (another layout) pytest-xdist's own order
                longest = max(queue, key=lambda path: seconds.get(path, 0.0))  # ties: pytest-xdist's order
                queue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


def pytest_runtest_logreport(report):
    _FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session):
    config = session.config
    if not config.getoption("record_file_durations") or hasattr(config, "workerinput"):
        return                                   # (a pytest-xdist worker: its controller writes the table)
    table = _durations_table()
    table.setdefault(PYTHON, {}).update({path: round(s, 1) for path, s in _FILE_SECONDS.items()})
    with open(DURATIONS, "w") as f:
        json.dump({v: dict(sorted(t.items())) for v, t in sorted(table.items())}, f, indent=1)
        f.write("\n")

