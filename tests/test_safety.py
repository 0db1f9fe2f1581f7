"""Files users share (routing traces, checkpoints) can never run code when the plugin reads them.

- Static: every ``torch.load`` in the package and the examples passes ``weights_only=True``; nothing calls
  ``pickle.load``/``pickle.loads``/``pickle.Unpickler`` or passes ``weights_only=False``.
- Dynamic: a trace shard whose unpickling would create a file is refused by every command that reads traces
  (balance, cache-sim, perf simulate, perf roofline, bench placement) with a message naming the file, and the
  file is not created; truncated and garbage shards get the same clear refusal.
"""
import ast
import os
import pathlib

import pytest
import torch

from megamoe_plugin import cli
from megamoe_plugin.stats import TRACE_SCHEMA, TraceError, TraceRecorder, load_trace

REPO = pathlib.Path(__file__).resolve().parents[1]


def _python_files():
    for root in ("megamoe_plugin", "examples"):
        yield from sorted((REPO / root).rglob("*.py"))


def _unsafe_calls(path: pathlib.Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "weights_only":
            if not (isinstance(node.value, ast.Constant) and node.value.value is True):
                yield node.value.lineno, "weights_only is not the constant True"
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name in ("pickle.load", "pickle.loads", "pickle.Unpickler", "dill.load", "dill.loads", "marshal.load",
                    "marshal.loads", "yaml.unsafe_load"):
            yield node.lineno, name
        if name == "torch.load" and not any(k.arg == "weights_only" for k in node.keywords):
            yield node.lineno, "torch.load without weights_only=True"


def test_no_code_executing_loads_in_the_package():
    found = [f"{p.relative_to(REPO)}:{line}: {what}" for p in _python_files() for line, what in _unsafe_calls(p)]
    assert not found, "\n".join(found)


def test_the_static_check_catches_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch, pickle\ntorch.load('x')\ntorch.load('y', weights_only=False)\npickle.loads(b'')\n"
                   "import functools\nf = functools.partial(torch.load, weights_only=False)\n")
    assert sorted(line for line, _ in _unsafe_calls(bad)) == [2, 3, 4, 6]


class _Payload:
    """Unpickling this calls pathlib.Path.touch(marker): what a crafted shared file would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _good_trace(prefix: str, world: int = 1):
    for r in range(world):
        rec = TraceRecorder(prefix, rank=r, world_size=world, num_experts=4, top_k=2)
        for step in range(1, 5):
            rec.next_step(step)
            rec._rows[step][1] = torch.tensor([3, 1, 2, 2], dtype=torch.int32)
        rec.flush()


def _poisoned_trace(prefix: str, marker: str):
    torch.save({"schema": TRACE_SCHEMA, "rank": 0, "world_size": 1, "num_experts": 4, "top_k": 2, "layers": [1],
                "steps": torch.arange(1, 5), "counts": torch.ones(4, 1, 4, dtype=torch.int32),
                "note": _Payload(marker)}, prefix + ".rank0")


COMMANDS = [
    ["balance", "--trace", "{t}", "--devices", "2", "--out", "{d}/p.json"],
    ["cache-sim", "--trace", "{t}", "--devices", "2", "--out", "{d}/sim"],
    ["perf", "simulate", "{t}", "--profile", "johnny", "--world-size", "1"],
    ["perf", "roofline", "--trace", "{t}", "--profile", "johnny"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c[:2]) for c in COMMANDS])
def test_a_trace_carrying_code_is_refused_without_running_it(argv, tmp_path, capsys):
    marker = tmp_path / "pwned"
    prefix = str(tmp_path / "evil")
    _poisoned_trace(prefix, str(marker))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([a.format(t=prefix, d=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "evil.rank0" in err and "weights_only" in err, err
    assert not marker.exists()


def test_good_truncated_and_garbage_shards(tmp_path):
    prefix = str(tmp_path / "t")
    _good_trace(prefix, world=2)
    t = load_trace(prefix)
    assert tuple(t["counts"].shape) == (4, 1, 2, 4) and int(t["counts"].sum()) == 4 * 2 * 8
    data = open(prefix + ".rank1", "rb").read()
    open(prefix + ".rank1", "wb").write(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"t\.rank1: not a readable routing trace"):
        load_trace(prefix)
    open(prefix + ".rank1", "wb").write(os.urandom(300))
    with pytest.raises(TraceError, match=r"t\.rank1"):
        load_trace(prefix)
    torch.save({"schema": TRACE_SCHEMA, "rank": 1, "world_size": 2, "num_experts": 4, "top_k": 2, "layers": [1],
                "steps": torch.arange(1, 5), "counts": torch.ones(4, 1, 4)}, prefix + ".rank1")   # float counts
    with pytest.raises(TraceError, match="malformed field.*counts"):
        load_trace(prefix)
    torch.save([1, 2, 3], prefix + ".rank1")
    with pytest.raises(TraceError, match="not a megamoe-trace/1 trace shard"):
        load_trace(prefix)
