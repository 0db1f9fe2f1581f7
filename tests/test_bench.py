"""`megamoe bench layer` runs end to end on a tiny config: every implementation computes, the table prints.

No timing assertions (speed targets live in the benchmark's own output); this checks that the benchmark runs,
that megatron-core's layer and ours agree on the same inputs (the benchmark raises otherwise), and that the
implementations compute the same function."""
import math

import pytest
import torch

from megamoe_plugin.bench import layer as bench


def test_tiny_benchmark_prints_every_implementation(capsys):
    rows = bench.main(["--configs", "tiny", "--routing", "skewed", "--repeat", "1", "--threads", "1"])
    out = capsys.readouterr().out
    impls = {r["impl"] for r in rows}
    for name in ("GEMM floor", "ours dropless", "ours dropless, BLAS GEMMs", "ours capacity CF=1", "ours capacity CF=2",
                 "megatron-core MoELayer", "gshard einsum CF=1", "gshard einsum CF=2", "dense MLP (same FLOPs)"):
        assert name in impls and name in out
    assert all(r["time"] > 0 for r in rows)
    assert "floor ratio" in out and "vs megatron" in out
    c = bench.CONFIGS["tiny"]
    C = math.ceil(1.0 * c["T"] * c["k"] / c["E"])
    gshard = next(r for r in rows if r["impl"] == "gshard einsum CF=1")
    assert gshard["bytes"] == 2 * c["T"] * c["E"] * C * 4 + 2 * c["E"] * C * c["H"] * 4


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_implementations_compute_the_same_function(routing):
    c = bench.CONFIGS["tiny"]
    x, wg, w1, w2 = bench.make_inputs(c["H"], c["F"], c["E"], c["k"], c["T"], routing)
    _, _, layer = bench.ours(x, wg, w1, w2, c["k"])
    _, _, einsum_forward = bench.gshard_einsum(x, wg, w1, w2, c["k"], cf=c["E"])   # capacity never binds
    with torch.no_grad():
        y = layer(x)
        assert torch.allclose(y, einsum_forward(x), atol=1e-5, rtol=1e-4)
    ids, _ = bench.route(x, wg, c["k"])
    counts = torch.bincount(ids.reshape(-1), minlength=c["E"]).float()
    skew = float(counts.max() / counts.mean())
    assert (skew > 2.0) if routing == "skewed" else (skew < 1.6)
