"""``megamoe doctor``: does the plugin work with the Megatron installed here? One command a user on a new release runs.

Each check prints ``ok``, ``FAIL`` (with the error's last line) or ``--`` (not applicable), and the exit status is 1
when any check failed:

1. what is installed: Python, torch, megatron-core (version and location), Transformer Engine / Apex;
2. the differences ``compat`` detects (mlp spec style, grad-norm collector);
3. one tiny plugin MoE layer built from megatron-core's own GPT layer spec through ``moe_plugin_spec``, run forward
   and backward in one process (a 1-rank gloo group, the CPU shims without CUDA), its output compared with the
   framework-agnostic core layer holding the same weights, and the same spec built inside a ``TransformerLayer``
   (the path ``GPTModel`` takes);
4. with ``--megatron-lm DIR``: everything above against that checkout's ``megatron`` package (first on
   ``sys.path``, as ``PYTHONPATH`` puts it for ``pretrain_gpt.py``), and its training code imports, the hooks install
   (``install_megatron_lm_hooks``), the launcher finds where to put the plugin's layers (``wrap_gpt_builders``),
   and which file of ``patches/`` applies to its ``pretrain_gpt.py`` (when ``patches/`` is beside the package, as
   in a source checkout).
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import traceback
from typing import Callable, List, Optional, Tuple

H, F, E = 32, 64, 4


class Doctor:
    def __init__(self, out=sys.stdout):
        self.out = out
        self.failed: List[str] = []

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def check(self, label: str, fn: Callable[[], Optional[str]]) -> bool:
        """Run ``fn``; it returns a detail string (or None). An exception is a failure, reported by its last line."""
        try:
            detail = fn()
        except Exception as e:        # the point of the command is to report whatever breaks
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            self.say(f"  FAIL  {label}: {last}")
            self.failed.append(label)
            return False
        self.say(f"  ok    {label}" + (f": {detail}" if detail else ""))
        return True

    def skip(self, label: str, why: str) -> None:
        self.say(f"  --    {label}: {why}")


def _versions() -> str:
    import torch
    import megatron.core as mc
    cuda = "CUDA build" if torch.version.cuda else "CPU build"
    gpu = f", {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else ", no GPU"
    extras = [name for name, mod in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
              if _importable(mod)]
    return (f"Python {sys.version.split()[0]}, torch {torch.__version__} ({cuda}{gpu}), megatron-core "
            f"{getattr(mc, '__version__', '?')} at {os.path.dirname(mc.__file__)}"
            + (f", with {' and '.join(extras)}" if extras else ", without Transformer Engine / Apex"))


def _importable(name: str) -> bool:
    from .compat import has_module
    return has_module(name)


def _tiny_config(ep: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=2, hidden_size=H, ffn_hidden_size=F, num_attention_heads=4,
                             num_moe_experts=E, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                             expert_model_parallel_size=ep, use_cpu_initialization=True, add_bias_linear=False,
                             bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                             masked_softmax_fusion=False, persist_layer_norm=False)


def _layer_spec_and_cfg() -> Tuple[object, object, object]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from .args import config_from_megatron
    from .spec import moe_plugin_spec
    tc = _tiny_config()
    cfg = config_from_megatron(tc, world_size=1, gate="gshard", second_expert_policy="all")
    return tc, cfg, moe_plugin_spec(get_gpt_layer_local_spec(num_experts=E), cfg)


def _spec_style() -> str:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from .compat import spec_parts
    cls, _, _, style = spec_parts(get_gpt_layer_local_spec(num_experts=E).submodules.mlp)
    return {"spec": "ModuleSpec(module=MoELayer, ...) (megatron-core <= 0.16)",
            "partial": "functools.partial(MoELayer, ...) (megatron-core >= 0.17)"}.get(style, style) \
        + f"; the MoE class is {cls.__module__}.{cls.__name__}"


def _grad_norm() -> str:
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from .compat import GRAD_NORM_METHODS
    found = [m for m in GRAD_NORM_METHODS if hasattr(MegatronOptimizer, m)]
    if not found:
        raise RuntimeError(f"MegatronOptimizer has none of {GRAD_NORM_METHODS}: placement's replica-aware gradient "
                           "norm and --moe-plugin-gate-sync cannot attach")
    return f"MegatronOptimizer.{found[0]}"


def core_twin(layer, cfg):
    """The framework-agnostic core ``MoELayer`` holding ``layer``'s (a ``PluginMoELayer``, one rank) router and
    expert weights: the reference the plugin layer inside Megatron must match."""
    import torch
    from ..layer import MoELayer
    bank = layer.experts.bank
    core = MoELayer(cfg, bank.hidden_size, bank.ffn_hidden_size)
    with torch.no_grad():
        core.gate.weight.copy_(layer.router.gate.weight)
        core.experts.w1.copy_(bank.w1)
        core.experts.w2.copy_(bank.w2)
    return core


def _layer_forward_backward() -> str:
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from .compat import build_mlp
    from .layer import PluginMoELayer
    tc, cfg, spec = _layer_spec_and_cfg()
    torch.manual_seed(0)
    layer = build_mlp(spec.submodules.mlp, tc)
    layer.set_layer_number(1)
    if not isinstance(layer, PluginMoELayer):
        raise TypeError(f"the substituted spec built {type(layer).__name__}, not PluginMoELayer")
    core = core_twin(layer, cfg)
    x = torch.randn(8, 2, H)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    out, bias = layer(x.clone().requires_grad_())
    ref = core(x.clone())
    ref = ref[0] if isinstance(ref, tuple) else ref
    diff = float((out.detach() - ref.detach()).abs().max())
    if not diff <= 1e-5:
        raise AssertionError(f"plugin layer in Megatron differs from the core layer by {diff:.3g}")
    out.float().pow(2).mean().backward()
    grads = [layer.router.gate.weight.grad, layer.experts.bank.w1.grad, layer.experts.bank.w2.grad]
    if any(g is None or not bool(torch.isfinite(g).all()) for g in grads):
        raise AssertionError("router / expert gradients missing or not finite after backward")
    return f"PluginMoELayer, output = the core layer's (max |diff| {diff:.1e}), router and expert grads finite"


def _inside_transformer_layer() -> str:
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from .layer import PluginMoELayer
    tc, _, spec = _layer_spec_and_cfg()
    layer = TransformerLayer(tc, spec.submodules, layer_number=1)
    if not isinstance(layer.mlp, PluginMoELayer):
        raise TypeError(f"TransformerLayer built mlp = {type(layer.mlp).__name__}, not PluginMoELayer")
    return "TransformerLayer(config, plugin spec).mlp is PluginMoELayer"


def _patches_dir() -> Optional[str]:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    d = os.path.join(here, "patches")
    return d if os.path.isdir(d) else None


def _check_checkout(doc: Doctor, root: str) -> None:
    root = os.path.abspath(root)
    if not os.path.isfile(os.path.join(root, "pretrain_gpt.py")):
        doc.check(f"Megatron-LM checkout {root}", lambda: (_ for _ in ()).throw(
            FileNotFoundError(f"no pretrain_gpt.py in {root}")))
        return
    patches = _patches_dir()
    if patches is None:
        doc.skip("pretrain_gpt.py patch", "patches/ is not beside this installation (a source checkout has it); "
                                          "use the launcher, which needs no patch")
    else:
        def which_patch():
            fits = [os.path.basename(p) for p in sorted(glob.glob(os.path.join(patches, "pretrain_gpt.py.*.patch")))
                    if subprocess.run(["git", "apply", "--check", p], cwd=root, capture_output=True).returncode == 0]
            if not fits:
                raise RuntimeError("no file of patches/ applies to this pretrain_gpt.py (already patched, or a new "
                                   "tag: see patches/README.md to regenerate one; the launcher needs none)")
            return fits[0]
        doc.check("pretrain_gpt.py patch that applies", which_patch)

    def hooks():
        from .megatron_lm import install_megatron_lm_hooks
        return ", ".join(install_megatron_lm_hooks())

    def builders():
        from .megatron_lm import wrap_gpt_builders
        return "the launcher wraps " + " and ".join(wrap_gpt_builders())

    if doc.check("Megatron-LM training code imports and the hooks install", hooks):
        doc.check("where the plugin's MoE layers go in pretrain_gpt.py", builders)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="megamoe doctor", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-lm", metavar="DIR", help="a Megatron-LM checkout to check as well (pretrain_gpt.py's "
                                                        "hooks, model-build path and patch)")
    args = p.parse_args(argv)
    if args.megatron_lm:
        # the checkout's megatron package (core and training) first, as PYTHONPATH puts it for pretrain_gpt.py
        sys.path.insert(0, os.path.abspath(args.megatron_lm))
    doc = Doctor()
    import megamoe_plugin
    doc.say(f"megamoe doctor: megamoe-plugin {megamoe_plugin.__version__} against the Megatron installed here")
    if not doc.check("installed", _versions):
        doc.say("megatron-core does not import: pip install -e '.[megatron]' (megatron-core 0.16.1 on Python 3.11, "
                "0.19.x on Python 3.12; docs/megatron.md lists what is tested)")
        return 1
    from .peer import ensure_megatron_parallel_state
    if not doc.check("a 1-rank process group and the CPU shims (without CUDA)",
                     lambda: ensure_megatron_parallel_state() or None):
        return 1
    doc.check("mlp spec style", _spec_style)
    doc.check("grad-norm collector", _grad_norm)
    doc.check("plugin MoE layer from Megatron's GPT layer spec, forward and backward", _layer_forward_backward)
    doc.check("the plugin spec inside a TransformerLayer", _inside_transformer_layer)
    if args.megatron_lm:
        _check_checkout(doc, args.megatron_lm)
    else:
        doc.skip("Megatron-LM checkout", "not given (--megatron-lm DIR also checks pretrain_gpt.py's hooks and patch)")
    if doc.failed:
        doc.say(f"{len(doc.failed)} check(s) failed: {', '.join(doc.failed)}. Report them with this output; "
                "docs/megatron.md lists the tested versions.")
        return 1
    doc.say("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
