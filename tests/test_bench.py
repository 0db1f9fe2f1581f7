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
    for name in ("expert floor", "argsort + loop", "ours dropless", "ours dropless, BLAS GEMMs", "ours capacity CF=1", "ours capacity CF=2",
                 "megatron-core MoELayer", "gshard einsum CF=1", "gshard einsum CF=2", "dense MLP (same FLOPs)"):
        assert name in impls and name in out
    assert all(r["time"] > 0 for r in rows) and all(r["faults"] >= 0 for r in rows)
    assert "page faults / step" in out
    assert "floor ratio" in out and "vs megatron" in out
    for name in ("ours dropless, deepseek-v3 router", "megatron-core MoELayer, deepseek-v3 router",
                 "part: our gate, softmax router", "part: our gate, deepseek-v3 router"):
        assert name in impls and name in out       # (the megatron-core peer was checked to compute ours)
    assert "deepseek-v3 router / softmax top-k" in out and "vs megatron with the deepseek-v3 router" in out
    c = bench.CONFIGS["tiny"]
    C = math.ceil(1.0 * c["T"] * c["k"] / c["E"])
    gshard = next(r for r in rows if r["impl"] == "gshard einsum CF=1")
    assert gshard["bytes"] == 2 * c["T"] * c["E"] * C * 4 + 2 * c["E"] * C * c["H"] * 4


def test_interleaved_timer_counts_the_page_faults_of_fresh_buffers():
    """A call that maps and touches 16 MiB of fresh anonymous memory faults once per page (4,096 times at 4 KiB);
    one that rewrites a buffer it already holds faults not at all."""
    import mmap
    size = 16 << 20
    held = torch.ones(size // 4)
    page = b"x" * mmap.PAGESIZE

    def fresh():
        m = mmap.mmap(-1, size)
        for _ in range(size // mmap.PAGESIZE):
            m.write(page)
        m.close()

    def reused():
        held.add_(1.0)

    faults = {}
    times = bench.time_interleaved({"fresh": fresh, "reused": reused}, 3, faults=faults)
    assert set(times) == {"fresh", "reused"} == set(faults)
    pages = size / mmap.PAGESIZE
    assert faults["fresh"] >= 0.9 * pages
    assert faults["reused"] < 0.1 * pages


@pytest.mark.parametrize("onednn", [False, True], ids=["blas", "onednn"])
def test_expert_floor_is_the_experts_forward_and_backward(onednn):
    """The hand-written floor (on BLAS, and with oneDNN's linear kernel as the layer's CPU kernel uses it)
    computes what autograd computes for fc1 -> gelu -> fc2 per expert group (outputs and every gradient), so it
    times the real work; empty experts are skipped."""
    if onednn and not bench.onednn_floor_available():
        pytest.skip("this torch build has no oneDNN linear kernel")
    torch.manual_seed(0)
    E, H, F_ = 4, 8, 16
    counts = [3, 0, 5, 2]
    xs, w1, w2 = torch.randn(10, H), torch.randn(E, H, F_), torch.randn(E, F_, H)
    floor = bench.ExpertFloor(xs, counts, w1, w2, onednn=onednn)
    floor()
    xr, w1r, w2r = (t.clone().requires_grad_() for t in (xs, w1, w2))
    y = torch.cat([torch.nn.functional.gelu(part @ w1r[e]) @ w2r[e] for e, part in enumerate(xr.split(counts))])
    y.backward(torch.ones_like(y))
    for got, want in ((floor.y, y), (floor.dx, xr.grad), (floor.dw1, w1r.grad), (floor.dw2, w2r.grad)):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert float(floor.dw1[1].abs().sum()) == 0.0 == float(w1r.grad[1].abs().sum())


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_implementations_compute_the_same_function(routing):
    c = bench.CONFIGS["tiny"]
    x, wg, w1, w2 = bench.make_inputs(c["H"], c["F"], c["E"], c["k"], c["T"], routing)
    _, _, layer = bench.ours(x, wg, w1, w2, c["k"])
    _, _, einsum_forward = bench.gshard_einsum(x, wg, w1, w2, c["k"], cf=c["E"])   # capacity never binds
    _, _, loop_forward = bench.argsort_loop(x, wg, w1, w2, c["k"])
    with torch.no_grad():
        y = layer(x)
        assert torch.allclose(y, einsum_forward(x), atol=1e-5, rtol=1e-4)
        assert torch.allclose(y, loop_forward(x), atol=1e-5, rtol=1e-4)
    ids, _ = bench.route(x, wg, c["k"])
    counts = torch.bincount(ids.reshape(-1), minlength=c["E"]).float()
    skew = float(counts.max() / counts.mean())
    assert (skew > 2.0) if routing == "skewed" else (skew < 1.6)


# --- `megamoe bench placement`, measured part: real training on 2 gloo processes -----------------------------------
def test_placement_gate_is_skewed_deterministic_and_drifts():
    from megamoe_plugin import MoEConfig
    from megamoe_plugin.bench.placement_measured import ZipfDriftGate, zipf_popularity
    cfg = MoEConfig(num_experts=4, top_k=2, gate="bench_zipf_drift")
    a, b = ZipfDriftGate(cfg, 8), ZipfDriftGate(cfg, 8)
    logits = torch.zeros(2000, 4)
    ids_a, kept = a.select(logits, logits.softmax(-1))
    ids_b, _ = b.select(logits, logits.softmax(-1))
    assert torch.equal(ids_a, ids_b) and bool(kept.all())                 # the same routing in every strategy
    assert bool((ids_a[:, 0] != ids_a[:, 1]).all())                       # top-2 distinct experts
    load = torch.bincount(ids_a.reshape(-1), minlength=4).double()
    ranks = load.view(2, 2).sum(1)
    assert float(ranks.max() * 2 / ranks.sum()) > 1.4                     # rank 0's experts are the hot ones
    assert a.calls == 1                                                   # training calls advance the step
    p0, p60 = zipf_popularity(4, 0, 0, 2.0, 0.02), zipf_popularity(4, 60, 0, 2.0, 0.02)
    assert int(p0.argmax()) == 0 and int(p60.argmax()) == 1               # 1.2 positions of drift later: expert 1


def test_placement_bench_measured_tiny(tmp_path, capsys):
    from megamoe_plugin.bench import main as bench_main
    from megamoe_plugin.perfmodel.profiles import get_profile
    slow = get_profile("flexmoe-a100")
    slow.gemm_tflops = 1e-6              # compute dominates in the planners' model: moves and shadows pay off
    slow.save(str(tmp_path / "slow.json"))
    res = bench_main(["placement", "--targets", "none", "--measure-procs", "2", "--measure-steps", "3",
                      "--measure-warmup", "1", "--measure-hidden", "16", "--measure-ffn", "32",
                      "--measure-tokens", "64", "--measure-threads", "1", "--threshold", "1.05",
                      "--measure-profile", str(tmp_path / "slow.json"), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert list(res) == [] and "MODEL PREDICTIONS" not in out             # modeled part skipped
    m = res.measured
    rows = {r["strategy"]: r for r in m["rows"]}
    assert list(rows) == ["static EP", "shadow", "flexmoe"]
    for name, r in rows.items():
        assert f"| {name} |" in out
        assert all(math.isfinite(t) and t > 0 for t in r["times"]) and len(r["times"]) == 4
        assert math.isfinite(r["mean_s"]) and r["mean_s"] > 0 and r["median_s"] > 0 and r["speedup"] > 0
        assert len(r["losses"]) == 4 and r["loss_max_rel_diff"] <= 1e-4, (name, r["losses"])
    assert rows["static EP"]["losses"] == pytest.approx(rows["flexmoe"]["losses"], rel=1e-4)
    assert rows["flexmoe"]["moves"] > 0 and rows["flexmoe"]["bytes_moved"] > 0
    assert rows["flexmoe"]["balance_mean"] < rows["static EP"]["balance_mean"]
    assert rows["shadow"]["shadowed_steps"] > 0 and rows["shadow"]["moves"] == 0
    assert rows["static EP"]["moves"] == 0 and rows["static EP"]["shadowed_steps"] == 0
    assert "measured here (CPU, gloo, 2 procs)" in out and "same math" in out and ": OK" in out
    assert "1.70x" in out and "1.30x" in out and "1.97x" in out          # the anchors, beside ours
    assert m["profile"]["kind"].startswith("given")


def test_device_benchmark_code_path_on_a_cpu_stand_in(monkeypatch):
    """`megamoe bench layer --device cuda` runs only on a GPU; its code (implementations, megatron-core peers,
    output check, table, targets) is exercised here on the CPU with CUDA's synchronize and device name stubbed.
    The times are CPU times, not a GPU number."""
    import torch
    from megamoe_plugin.bench import layer_device as ld
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    rows = ld.run_config("tiny", "balanced", 1, torch.float32, torch.device("cpu"))
    got = {r["impl"]: r for r in rows}
    assert got["ours dropless"]["time"] > 0 and got["grouped GEMM floor"]["time"] > 0
    assert got["ours dropless"]["share"] == got["ours dropless"]["tflops"] / 989.0
    seq = got["megatron-core SequentialMLP"]
    assert seq["time"] > 0 and float(seq["note"].split()[-1]) < 1e-4     # same function as ours
    assert "vs SequentialMLP" in "\n".join(ld.targets(rows))
    assert "| tiny | balanced | ours dropless |" in ld.format_table(rows)


def test_bench_capacity_summary_and_domination():
    """`megamoe bench capacity`'s per-config summary over seeds, by hand: means, sample standard deviations, and a
    dynamic policy dominated only by a static factor that is faster AND drops less beyond one deviation of both."""
    from megamoe_plugin.bench.capacity import main, summarise

    def run(seed, step, kept, loss):
        return {"seed": seed, "step_seconds": step, "token_efficiency": kept, "link_bytes_per_step": 1e6,
                "final_valid_loss": loss}
    rows = {"CF=1.0": [run(0, 1.0, 0.80, 3.0), run(1, 1.2, 0.84, 3.2)],       # fast, drops 18 +- 2.8 %
            "CF=2.0": [run(0, 2.0, 0.99, 2.9), run(1, 2.0, 0.99, 2.9)],       # slow, drops 1 %
            "dynamic": [run(0, 1.5, 0.70, 2.9), run(1, 1.5, 0.70, 2.9)],      # drops more than CF=1.0, slower
            "dynamic q=0.9": [run(0, 1.5, 0.95, 2.9), run(1, 1.5, 0.95, 2.9)]}  # between the two: on the frontier
    s = summarise(rows)
    assert s["CF=1.0"]["step_seconds"][0] == pytest.approx(1.1)
    assert s["CF=1.0"]["step_seconds"][1] == pytest.approx(0.1414213, rel=1e-5)       # sample sd of 1.0, 1.2
    assert s["CF=1.0"]["dropped"][0] == pytest.approx(0.18)
    assert s["dynamic"]["dominated_by"] == ["CF=1.0"]
    assert s["dynamic q=0.9"]["dominated_by"] == []
    assert "dominated_by" not in s["CF=2.0"]
    rows["dropless"] = [run(0, 1.3, 1.0, 2.8), run(1, 1.3, 1.0, 2.8)]    # no drops, faster than both dynamics
    s = summarise(rows)
    assert s["dynamic"]["dominated_by"] == ["CF=1.0", "dropless"] and s["dynamic q=0.9"]["dominated_by"] == ["dropless"]
    with pytest.raises(SystemExit, match="--configs CF=3: unknown"):
        main(["--configs", "CF=3"])
    with pytest.raises(SystemExit, match="--seeds"):
        main(["--seeds", "x"])


def test_bench_capacity_reads_the_cache_and_compares_the_steps_it_was_on(tmp_path):
    """`bench capacity`'s caching rows by hand: the logged intervals of a metrics.json (512 tokens per rank x 4
    ranks per step at batch 2), caching on through an interval only when on at both its ends, and the ratio
    against dynamic over the same intervals only."""
    import json
    from megamoe_plugin.bench.capacity import cache_comparison, logged_intervals

    def line(step, tps, on):
        return {"step": step, "tokens_per_s": tps, "dynamic": {"cache_on": on, "cached_calls": 0.0}}
    metrics = {"history": [line(4, 512.0, 0.0), line(8, 1024.0, 1.0), line(12, 1024.0, 1.0), line(16, 512.0, 1.0)],
               "dynamic": {"cache_on": 1.0, "cached_calls": 14.0},
               "cache_history": [[1, None, False], [2, 0.5, False], [3, 0.97, True]]}
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    got = logged_intervals(str(tmp_path), 2)
    assert got["intervals"] == [(1, 4, 1.0, False), (5, 8, 0.5, False), (9, 12, 0.5, True), (13, 16, 1.0, True)]
    assert got["cache_on_epoch"] == 4 and got["cached_calls"] == 14.0

    def base(seed, times, step):
        return {"seed": seed, "step_seconds": step,
                "intervals": [(1 + 4 * i, 4 + 4 * i, t, False) for i, t in enumerate(times)]}
    cached = dict(got, seed=0, step_seconds=0.8)
    never = {"seed": 1, "step_seconds": 1.0, "intervals": [(1, 4, 1.0, False)], "cache_on_epoch": None}
    c = cache_comparison({"dynamic": [base(0, [1.2, 0.6, 0.6, 0.9], 0.9), base(1, [1.0], 1.1)],
                          "dynamic+cache": [cached, never]})
    first, second = c["per_seed"]
    assert first["steps_on"] == 8 and first["on_step_seconds"] == pytest.approx(0.75)      # median of 0.5, 1.0
    assert first["dynamic_step_seconds"] == pytest.approx(0.75) and first["ratio"] == pytest.approx(1.0)
    assert first["whole_run_ratio"] == pytest.approx(0.9 / 0.8)
    assert first["off_ratio"] == pytest.approx(0.9 / 0.75)           # intervals 1-8: dynamic 1.2, 0.6; cached 1.0, 0.5
    assert "ratio" not in second and second["whole_run_ratio"] == pytest.approx(1.1)
    assert c["seeds_on"] == 1 and c["ratio"] == (pytest.approx(1.0), 0.0)
    assert cache_comparison({"dynamic": []}) is None


def test_bench_gates_configs_carry_gate_options():
    from megamoe_plugin.bench.gates import _flags, config_flags
    assert config_flags("gshard") == ["--moe-gate", "gshard", "--moe-gate-sync", "auto"]
    # presets: the aux-loss-free family's flags, booleans as --moe-X / --no-moe-X, options after a preset
    assert config_flags("ta_moe_bias+router-bias-update-rate=0.01") == [
        "--moe-gate", "ta_moe", "--moe-gate-sync", "auto", "--moe-score-function", "sigmoid",
        "--moe-router-expert-bias", "--moe-load-balancing-type", "none", "--moe-router-bias-update-rate", "0.01"]
    assert config_flags("topk+router-expert-bias=false")[-1] == "--no-moe-router-expert-bias"
    assert config_flags("node_limited_sender")[:6] == ["--moe-gate", "node_limited_sender", "--moe-gate-sync",
                                                       "auto", "--moe-group-topk", "1"]
    assert config_flags("ta_moe:average:50+jitter-eps=0.01+z-loss-coeff=0.001") == [
        "--moe-gate", "ta_moe", "--moe-gate-sync", "average:50", "--moe-jitter-eps", "0.01",
        "--moe-z-loss-coeff", "0.001"]
    with pytest.raises(SystemExit, match="exchange-mb"):
        config_flags("ta_moe:local+exchange-mb")
    # --train-args come after the bench's model, so argparse keeps theirs
    flags = _flags("hir", 4, 10, "/tmp/x", ["--batch-size", "16", "--seed", "2"])
    from megamoe_plugin.train import build_parser
    args = build_parser().parse_args(flags[2:])
    assert (args.batch_size, args.seed, args.moe_gate) == (16, 2, "hir")


def test_bench_gates_prediction_prices_the_saved_inter_node_bytes_on_the_uplinks():
    from megamoe_plugin.bench.gates import predicted_step
    base = {"step_seconds": 0.7, "moe_inter_bytes_per_step": 30e6}
    # 20 MB fewer across nodes, half on each of 2 uplinks at 100 MB/s: 0.1 s less
    assert predicted_step(base, {"moe_inter_bytes_per_step": 10e6}, 2, 100e6) == pytest.approx(0.6)
    assert predicted_step(base, base, 2, 100e6) == pytest.approx(0.7)


def test_bench_gates_seed_summary_compares_each_seed_with_its_own_baseline():
    from megamoe_plugin.bench.gates import load_imbalance, seed_summary
    runs = []
    for seed, (alf_t, bias_t) in enumerate([(100.0, 80.0), (90.0, 60.0), (120.0, 100.0)]):
        runs.append({"topology": "2x2", "config": "alf", "seed": seed, "off_node_share": 0.5, "load_imbalance": 1.2,
                     "step_seconds": 1.0, "speedup_vs_alf": 1.0, "step_ratio_vs_alf": 1.0, "loss_vs_alf": 0.0})
        runs.append({"topology": "2x2", "config": "ta_moe_bias", "seed": seed, "off_node_share": 0.28,
                     "load_imbalance": 1.3, "step_seconds": 0.9, "speedup_vs_alf": alf_t / bias_t,
                     "step_ratio_vs_alf": 1 / 0.9, "loss_vs_alf": 0.001 * seed})
    rows = {r["config"]: r for r in seed_summary(runs)}
    assert rows["ta_moe_bias"]["speedup_vs_alf"] == pytest.approx(1.25)          # median of 1.25, 1.5, 1.2
    assert rows["ta_moe_bias"]["speedup_vs_alf_seeds"] == pytest.approx([1.25, 1.5, 1.2])
    assert rows["ta_moe_bias"]["loss_vs_alf"] == pytest.approx(0.001)
    assert rows["alf"]["speedup_vs_alf"] == 1.0
    # busiest expert over the mean: [S, L, P, E] counts, all senders together
    counts = torch.zeros(4, 1, 2, 4)
    counts[:, 0, 0] = torch.tensor([3.0, 1.0, 0.0, 0.0])
    counts[:, 0, 1] = torch.tensor([1.0, 1.0, 1.0, 1.0])
    assert load_imbalance(counts) == pytest.approx(4.0 / 2.0)


def test_topology_gates_page_shows_the_shipped_bench_gates_summary():
    """docs/topology-gates.md's table is what `megamoe bench gates --report` writes from the shipped results."""
    import os
    from megamoe_plugin.bench.gates import report_summary, summary_markdown
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = os.path.join(root, "docs", "data", "bench_gates_bias")
    paths = [os.path.join(data, t, "results.json") for t in ("2x2", "3asym")]
    page = open(os.path.join(root, "docs", "topology-gates.md")).read()
    begin, end = "<!-- bench-gates-summary:begin -->\n", "\n<!-- bench-gates-summary:end -->"
    shown = page[page.index(begin) + len(begin):page.index(end)]
    table = summary_markdown({"summary": report_summary(paths)})
    assert shown == table
    assert table in open(os.path.join(root, "BENCHMARKS.md")).read()      # the same table, not a copy by hand
