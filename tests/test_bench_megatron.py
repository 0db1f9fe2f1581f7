"""`megamoe bench megatron` runs end to end on the tiny config: both transformer layers (ours = megatron's local
GPT layer spec with the plugin substituted, megatron = the spec unchanged) compute the same function on the same
weights and inputs (the benchmark raises otherwise), and the table has both rows for both routings.

No timing assertions: speed targets are reported by the benchmark itself."""
import math

import pytest

pytest.importorskip("megatron.core")

from megamoe_plugin.bench import megatron as bench   # noqa: E402


def test_tiny_megatron_layer_benchmark(capsys):
    rows = bench.main(["--configs", "tiny", "--repeat", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert {(r["routing"], r["impl"]) for r in rows} == {(ro, im) for ro in ("balanced", "skewed")
                                                         for im in ("ours", "megatron")}
    for routing in ("balanced", "skewed"):
        assert f"| {routing} | ours |" in out and f"| {routing} | megatron |" in out
    assert out.count("outputs agree: yes") == 2 and "outputs agree: NO" not in out
    for r in rows:
        assert r["agree"]
        assert r["out_diff"] < 1e-4 and r["xgrad_diff"] < 1e-4
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0
        assert math.isfinite(r["time"]) and r["time"] > 0
        assert r["counts"] == next(o["counts"] for o in rows if o["routing"] == r["routing"] and o is not r)
    load = {r["routing"]: r["load"] for r in rows}
    assert load["skewed"] > 2.0 and load["balanced"] < 1.6     # the routing control took effect
    assert "vs megatron" in out


def test_unknown_config_is_rejected():
    with pytest.raises(SystemExit):
        bench.main(["--configs", "nope"])
