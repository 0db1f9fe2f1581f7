"""Under --moe-plugin, megatron-core's router flags mean what they mean in megatron-core: per row of a table of
today's recipes (tests/helpers/megatron_parity.py), the plugin's layer and megatron-core's own MoELayer, built from
one TransformerConfig with the same weights and tokens, agree to 1e-6 (fp32) in the output, the input and every
parameter gradient, every aux loss megatron-core's metrics tracker records, the expert bias's token counts and its
once-per-global-batch update (megatron-core's finalize_model_grads function on both, and the core's own), and for
quantile balancing its bias update and the step routed by it. The expected values are megatron-core's; the test
computes none. One process, then EP=2 and TP=2 with sequence parallelism over gloo."""
import json
import os

import pytest

from conftest import run_distributed
from helpers import megatron_parity as mp

TOL = 1e-6
LOSSES = {"mixtral": {"load_balancing_loss"}, "qwen3_top8_global_aux": {"global_load_balancing_loss"},
          "deepseek_v3": {"seq_load_balancing_loss"}, "gpt_oss": {"load_balancing_loss", "z_loss"},
          "aux_list_with_z_and_per_token_loss": {"load_balancing_loss", "seq_load_balancing_loss", "z_loss"},
          "padding_mask": {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
                           "z_loss"}}


def _skip_unless_supported(row):
    pytest.importorskip("megatron.core")
    if row in mp.NEEDS_019 and not mp.megatron_release_019():
        pytest.skip(f"{row}: megatron-core 0.16 has no such option or computes it as 0.17+ no longer does; the "
                    "plugin follows megatron-core 0.19 (tests/run_megatron_py312.sh runs this row)")


def _check(row, diffs, where=""):
    label = f"{row}{where}"
    assert diffs.pop("routed") < 0, f"{label}: nothing was routed"
    for key in [k for k in diffs if k.endswith("moved")]:
        assert diffs.pop(key) < 0, f"{label}: {key[:-6]} did not move, so its comparison proves nothing"
    tracked = {k[len("tracked "):] for k in diffs if k.startswith("tracked ")}
    assert LOSSES.get(row, tracked) <= tracked, f"{label}: megatron-core recorded {tracked}"
    bad = {k: v for k, v in diffs.items() if not v <= TOL}
    assert not bad, f"{label}: plugin != megatron-core: {bad}"


@pytest.mark.parametrize("row", sorted(mp.ROWS))
def test_plugin_layer_equals_megatron_core_one_process(row):
    _skip_unless_supported(row)
    from megamoe_plugin.megatron_adapter.cpu_compat import install_cpu_shims
    from megamoe_plugin.megatron_adapter.peer import ensure_megatron_parallel_state
    install_cpu_shims()
    ensure_megatron_parallel_state()
    _check(row, mp.compare(row))


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)], ids=["EP2", "TP2_SP"])
def test_plugin_layer_equals_megatron_core_two_ranks(tp, ep, tmp_path):
    pytest.importorskip("megatron.core")
    rows = [r for r in sorted(mp.ROWS) if r not in mp.NEEDS_019 or mp.megatron_release_019()]
    run_distributed(mp.worker, 2, rows, tp, ep, str(tmp_path))
    for rank in range(2):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            for row, diffs in json.load(f).items():
                _check(row, diffs, f" (rank {rank}, TP={tp}, EP={ep})")
