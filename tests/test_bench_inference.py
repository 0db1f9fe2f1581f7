"""`megamoe bench inference` (paper 004 Figs. 9-10: static vs dynamic gating at inference) and its parts.

- The memory meter (LiveTensorBytes) on allocations of known size: new storages count, views and in-place results
  do not, freed storages come off, pre-existing tensors are not allocations, the abort limit stops a forward.
- The static baseline (GShardEinsumMoE) computes the core layer's function: dropless when nothing is dropped, the
  capacity dispatch's (same GShard drop rule) when the capacity factor drops tokens.
- The dense [T, E, C] masks make the baseline's MoE memory grow with T^2 while dynamic gating's grows with T.
- `--quick` end to end through main([...]): the printed table parses, has every (batch, implementation) point, and
  dynamic gating's measured peak is below the dense-mask baseline's at the largest batch; --json round-trips.
"""
import json
import math
import re

import pytest
import torch

from megamoe_plugin.bench import inference as bi
from megamoe_plugin.config import MoEConfig
from megamoe_plugin.layer import MoELayer


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()        # main() sets the process's torch threads
    yield
    torch.set_num_threads(threads)


# --- the memory meter ------------------------------------------------------------------------------------------
def test_live_tensor_bytes_counts_known_allocations():
    before = torch.randn(256, 256)                        # exists before the mode: never counted
    with bi.LiveTensorBytes() as m:
        a = torch.empty(1000, 1000)                       # 4,000,000 bytes
        assert m.cur == 4_000_000 and m.peak == 4_000_000
        v = a.t()[:10]                                    # a view: no new storage
        a.add_(1.0)                                       # in place: no new storage
        assert m.cur == 4_000_000
        b = a * 2                                         # 4,000,000 more
        assert m.cur == 8_000_000 and m.peak == 8_000_000
        del a, v
        assert m.cur == 4_000_000                         # a's storage was freed
        w = before.t().contiguous()                       # a copy of a pre-existing tensor: 262,144 bytes
        assert m.cur == 4_000_000 + 256 * 256 * 4
        del b, w
        assert m.cur == 0
        m.begin_segment()
        c = torch.zeros(500, 100, dtype=torch.float64)    # 400,000 bytes inside a segment
        del c
        assert m.end_segment() == 400_000
    assert m.peak == 8_000_000 + 0                        # the peak stays the largest live total


def test_live_tensor_bytes_abort_limit():
    made = []
    with pytest.raises(bi.BudgetExceeded):
        with bi.LiveTensorBytes(limit=1_000_000) as m:
            made.append(torch.empty(100, 100))            # 40 KB: fine
            made.append(torch.empty(1000, 1000))          # 4 MB: over the limit, raised after the op
    assert len(made) == 1 and m.cur == 40_000


# --- the static baseline computes the core layer's function ------------------------------------------------------
def _layer(dispatch, cf=1.0, E=8, H=32, F_=64, seed=0):
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=E, top_k=2, gate="gshard", second_expert_policy="all", dispatch=dispatch,
                    capacity_factor=cf, eval_capacity_factor=cf, min_capacity=0, aux_loss_coeff=0.0)
    layer = MoELayer(cfg, H, F_)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.5)                 # a decisive, imbalanced router
    return layer.eval()


@torch.no_grad()
def test_einsum_baseline_matches_dropless_and_capacity_dispatch():
    x = torch.randn(96, 32, generator=torch.Generator().manual_seed(1))
    dropless = _layer("dropless")
    einsum = bi.GShardEinsumMoE(dropless, bi.PAPER_CF)       # shares the weights
    assert einsum.capacity(96) >= 96 * 2 * bi.PAPER_CF / 8
    y_ref = dropless(x)
    y = einsum(x)
    assert einsum.last_dropped == 0 and einsum.last_assignments == 96 * 2
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)

    capped = _layer("capacity", cf=1.0)                       # same seed: same weights
    y_cap = capped(x)
    dropped = int(capped.last_routing.dropped)
    assert dropped > 0                                        # CF 1 with an imbalanced router drops
    einsum1 = bi.GShardEinsumMoE(dropless, 1.0)
    y1 = einsum1(x)
    assert einsum1.last_dropped == dropped
    torch.testing.assert_close(y1, y_cap, rtol=1e-5, atol=1e-6)
    assert (y1 - y_ref).abs().max() > 1e-3                    # dropping changed the output


@torch.no_grad()
def test_mask_memory_grows_quadratically_dynamic_linearly():
    layer = _layer("dropless", E=16)
    einsum = bi.GShardEinsumMoE(layer, bi.PAPER_CF)
    peaks = {}
    for name, mod in (("einsum", einsum), ("dropless", layer)):
        for T in (128, 256):
            x = torch.randn(T, 32)
            with bi.LiveTensorBytes() as m:
                mod(x)
            peaks[name, T] = m.peak
    grow_e = peaks["einsum", 256] / peaks["einsum", 128]
    grow_d = peaks["dropless", 256] / peaks["dropless", 128]
    assert grow_e > 3.2, peaks                                 # [T, E, C] with C ~ T
    assert 1.5 < grow_d < 2.5, peaks
    assert peaks["dropless", 256] * 8 < peaks["einsum", 256]
    # the masks alone: the combine tensor [T, E, C] in fp32 is a lower bound of the einsum layer's peak
    C = einsum.capacity(256)
    assert peaks["einsum", 256] >= 256 * 16 * C * 4


# --- end to end -----------------------------------------------------------------------------------------------------
ROW = re.compile(r"^\| (\d+) \| (\d+) \| ([^|]+?) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| "
                 r"([\d.]+)% \| (ok|over) \|$", re.M)


def _num(text):
    text = text.strip()
    if text == "-":
        return None
    m = re.match(r"^>?\s*([\d,.]+)", text)
    return float(m.group(1).replace(",", ""))


def test_quick_end_to_end(capsys, tmp_path):
    out_json = tmp_path / "inference.json"
    res = bi.main(["--quick", "--json", str(out_json), "--threads", "2"])
    out = capsys.readouterr().out
    assert "measured here on CPU" in out
    rows = [m.groups() for m in ROW.finditer(out)]
    impls = [i["name"] for i in res["impls"]]
    batches = bi.SETTINGS["quick"]["batches"]
    assert {(int(r[0]), r[2]) for r in rows} == {(b, n) for b in batches for n in impls}, out
    seq = bi.SETTINGS["quick"]["seq_len"]
    table = {}
    for b, tokens, impl, tps, fwd, moe, peak, moe_peak, dropped, budget in rows:
        b, tokens = int(b), int(tokens)
        assert tokens == b * seq
        table[b, impl] = dict(tps=_num(tps), fwd=_num(fwd), peak=_num(peak), moe_peak=_num(moe_peak),
                              dropped=float(dropped), over=budget == "over", aborted="aborted" in peak)
        r = table[b, impl]
        if r["tps"] is not None:                            # tokens/s is tokens over the forward time
            assert r["tps"] == pytest.approx(tokens / (r["fwd"] / 1e3), rel=0.02)
        if impl.startswith("dynamic") or "12.8" in impl:
            assert r["dropped"] == 0.0                      # dropless, or a capacity no batch fills
    largest = max(batches)
    dyn, static = res["dynamic"], res["static_baseline"]
    assert static.startswith("static einsum")
    d, s = table[largest, dyn], table[largest, static]
    assert d["peak"] < s["peak"], (d, s)                     # the masks: structural
    assert d["moe_peak"] < s["moe_peak"]
    # the dense-mask baseline's peak holds at least its combine tensor [T, E, C] of every MoE call
    E, k, T = res["setup"]["moe"]["num_experts"], res["setup"]["moe"]["top_k"], largest * seq
    C = max(math.ceil(bi.PAPER_CF * T * k / E), 1)
    assert s["peak"] * 2 ** 20 >= T * E * C * 4 * 0.99
    # dynamic gating fits the largest batch within the budget
    lb = res["largest_batch"]
    assert lb[dyn]["batch"] is not None and lb[static]["batch"] is not None
    assert lb[dyn]["batch"] > lb[static]["batch"]
    assert f"Largest batch within {bi.SETTINGS['quick']['budget_mb']:g} MiB" in out
    assert "Best throughput within the budget" in out and "6.21x" in out
    # the check line: the baseline computes dynamic gating's function when it drops nothing
    assert res["check"][static]["dropped"] == 0 and res["check"][static]["max_abs_diff"] < 1e-4
    with open(out_json) as f:
        back = json.load(f)
    assert back["static_baseline"] == static and len(back["rows"]) >= len(rows)
