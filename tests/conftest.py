"""Shared test helpers: a naive per-token reference of the MoE layer and a gloo multi-process launcher."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def run_distributed(fn, world_size, *args):
    """Run fn(rank, world_size, *args) in `world_size` real gloo processes (the package's launcher, spawned: a
    test process may hold state a fork should not inherit); any failure fails the test."""
    from megamoe_plugin.launch import run_processes
    run_processes(fn, world_size, *args, start_method="spawn")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a multi-process test that takes tens of seconds (few, but real)")

