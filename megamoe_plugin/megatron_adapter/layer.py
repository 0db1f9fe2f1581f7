"""The plugin inside Megatron's MoE layers: our router, our token dispatcher and our experts in megatron-core.

``PluginMoELayer`` subclasses megatron-core's ``MoELayer``: Megatron builds it from the layer spec (the spec builder
in ``spec.py`` swaps it in), hands it the process-group collection (EP and TP groups) and treats it like its own
layer (``isinstance(m, MoELayer)`` holds, shared experts, recompute, layer numbers, checkpoints). Inside it:

- ``PluginRouter`` (the spec's ``router``) wraps a core gate (``gates/``): switch, gshard, naive, hir, ta_moe.
- The layer's forward is the core's one call sequence, ``DispatchPlan.forward`` (dropless dynamic gating or
  GShard capacity, all-to-all-v over Megatron's EP group), with Megatron's aux losses attached by its
  ``after_experts`` hook. ``PluginTokenDispatcher`` stands where Megatron keeps its token dispatcher (built in
  ``MoELayer.__init__``, no spec hook), so Megatron code that drives the six-step dispatcher protocol itself gets
  the same DispatchPlan.
- ``PluginExperts`` (the spec's ``experts``) wraps a core ``ExpertBank`` of ``slots_per_rank`` vExpert slots (this
  rank's experts + ``--moe-plugin-placement-spare-slots`` free ones for replicas); its parameters carry
  ``allreduce=False`` so Megatron's DDP reduces them over the expert-data-parallel group, and its
  ``sharded_state_dict`` stores experts (and, through Megatron's optimizer, their Adam state) by global (logical)
  id, sharded over EP, whatever the placement: a distributed checkpoint loads under another EP size and placement.
- Dynamic placement (``--moe-plugin-placement flexmoe|shadow``): the layer's ``DispatchPlan`` owns a
  ``PlacementRuntime`` (tokens of logical experts go to vExpert slots, replica gradients are all-reduced, shadow
  copies broadcast) that the bank computes with; the after-step hook (hooks.py) runs the policy between steps.

Aux losses enter Megatron's loss through ``MoEAuxLossAutoScaler`` (attached to the combine weights, scaled by the
schedule like Megatron's own router losses) and are logged with ``save_to_aux_losses_tracker`` under Megatron's
names (``load_balancing_loss``, ``z_loss``). Per-layer loads go to the shared ``StatsSink`` (``metrics.py``).

With TP > 1 (sequence parallel, required), each tensor-parallel rank routes its own sequence shard: experts are
replicated over TP (expert-tensor-parallel size 1) and their gradients are summed over the expert-data-parallel
group, which contains the TP ranks; the router weight carries ``sequence_parallel`` so Megatron all-reduces its
gradient over TP like a layernorm's.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker

from ..config import MoEConfig
from ..dispatch.plan import DispatchPlan
from ..experts import ExpertBank, check_input_dtype
from ..gates import build_gate
from ..gates.base import Routing
from ..parallel import ExpertParallel
from ..stats import StatsSink

# core aux-loss name -> (Megatron tracker name, MoEConfig coefficient that scaled it)
AUX_LOSS_NAMES = {"balance": ("load_balancing_loss", "aux_loss_coeff"), "z": ("z_loss", "z_loss_coeff")}

_STATS = StatsSink()


def plugin_stats() -> StatsSink:
    """The StatsSink every PluginMoELayer of this process records into (keyed by Megatron layer number)."""
    return _STATS


def _layer_seed() -> int:
    """A seed drawn from the global CPU RNG, which Megatron seeds identically on every rank of a pipeline stage:
    the same on all TP/EP/DP ranks, whatever the layout, so weights do not depend on the parallel layout."""
    return int(torch.randint(0, 2**62, (1,)).item())


@torch.no_grad()
def _seeded_normal_(t: torch.Tensor, std: float, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed % (2**63))
    t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).mul_(std).to(t.dtype))


def _device(config):
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class PluginRouter(MegatronModule):
    """Megatron router slot holding a core gate; ``forward(tokens [T, H], capacity) -> Routing``."""

    def __init__(self, config, pg_collection=None, plugin_config: Optional[MoEConfig] = None, **unused):
        super().__init__(config)
        if plugin_config is None:
            raise ValueError("PluginRouter needs plugin_config (build the spec with megamoe_plugin's spec builder)")
        cfg = plugin_config
        topology = cfg.build_topology() if (cfg.gate in ("hir", "ta_moe") or cfg.topology) else None
        self.gate = build_gate(cfg, config.hidden_size, ep=ExpertParallel(pg_collection.ep), topology=topology)
        _seeded_normal_(self.gate.weight, config.init_method_std, _layer_seed())
        self.gate.to(_device(config))
        self.gate.weight.sequence_parallel = bool(config.sequence_parallel)
        self.layer_number = None

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, tokens: torch.Tensor, capacity=None, assigned=None) -> Routing:
        return self.gate(tokens, capacity=capacity, assigned=assigned)


class PluginExperts(MegatronModule):
    """Megatron experts slot holding a core ExpertBank: ``forward(x, tokens_per_expert, probs) -> (y, None)``."""

    def __init__(self, num_local_experts: int, config, pg_collection=None,
                 plugin_config: Optional[MoEConfig] = None, **unused):
        super().__init__(config)
        cfg = plugin_config
        if cfg is None:
            raise ValueError("PluginExperts needs plugin_config (build the spec with megamoe_plugin's spec builder)")
        self.ep_group = pg_collection.ep
        self.ep = ExpertParallel(pg_collection.ep)
        self.expt_dp_group = getattr(pg_collection, "expt_dp", None)
        if cfg.num_local_experts != num_local_experts:
            raise ValueError(f"megamoe-plugin: Megatron gives this rank {num_local_experts} experts but the plugin "
                             f"config has {cfg.num_experts} experts over expert-parallel size "
                             f"{cfg.expert_parallel_size} ({cfg.num_local_experts} per rank)")
        self.num_local_experts = num_local_experts
        self.plugin_config = cfg
        # the bank has cfg.slots_per_rank vExpert slots: this rank's experts, then spare slots for replicas (free,
        # zeros). Built without touching the global RNG (every slot is overwritten below), so the rest of the
        # model's init does not depend on the number of slots.
        with torch.random.fork_rng(devices=[]):
            self.bank = ExpertBank(cfg.slots_per_rank, config.hidden_size, cfg.expert_ffn_hidden_size or
                                   config.moe_ffn_hidden_size or config.ffn_hidden_size, cfg.activation,
                                   cfg.expert_bias, config.init_method_std, dtype=config.params_dtype,
                                   device=torch.device("cpu"), cpu_lanes=cfg.cpu_expert_lanes, cpu_gemm=cfg.cpu_gemm,
                                   kernel=cfg.expert_kernel)
        with torch.no_grad():
            for p in self.bank.parameters():
                p[num_local_experts:].zero_()
        # init by global expert id: the same experts whatever the expert-parallel size
        base = _layer_seed()
        out_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)   # Megatron's scaled output init
        first = self.ep.rank * num_local_experts
        for slot in range(num_local_experts):
            _seeded_normal_(self.bank.w1[slot], config.init_method_std, base + 2 * (first + slot))
            _seeded_normal_(self.bank.w2[slot], out_std, base + 2 * (first + slot) + 1)
        self.bank.to(_device(config))

    def forward(self, x: torch.Tensor, tokens_per_expert, permuted_probs=None, **unused):
        return self.bank(x, tokens_per_expert), None

    def backward_dw(self, *args, **kwargs):
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Experts by global (logical) id: every bank tensor is saved as [num_experts, ...], dim 0 sharded over the
        expert-parallel group, so a distributed checkpoint loads under another expert-parallel size.

        Without spare vExpert slots the rows are always this rank's contiguous block of experts (nothing can move):
        one ShardedTensor per parameter. With spare slots (dynamic placement) a ``ShardedTensorFactory`` per
        parameter: its build_fn makes one [1, ...] ShardedTensor per occupied slot at its logical expert's row
        (the owner replica is the main one; free slots are not saved), and its merge_fn puts the loaded rows back
        into [slots, ...] under the placement current at load time (zeros for free slots). Megatron's optimizer
        ``sharded_state_dict`` replaces the factory's data with each optimizer-state tensor (Adam moments, fp32
        master weights), so they are saved and loaded by logical id the same way; the distributed optimizer does so
        in its ``fully_reshardable`` format (whole parameter-shaped tensors gathered over data-parallel ranks)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        import torch.distributed as dist

        expt_dp_rank = dist.get_rank(self.expt_dp_group) if (self.expt_dp_group is not None and
                                                             dist.is_initialized()) else 0
        axis = len(sharded_offsets)
        out = {}
        runtime = getattr(self.bank, "placement", None)
        if runtime is None or self.bank.w1.shape[0] == self.num_local_experts:
            for name, p in self.bank.named_parameters():
                key = f"{prefix}bank.{name}"
                out[key] = ShardedTensor.from_rank_offsets(
                    key, p, *sharded_offsets, (axis, self.ep.rank, self.ep.size),
                    replica_id=(0, 0, expt_dp_rank), prepend_axis_num=axis)
            return out

        num_experts = runtime.num_experts
        held = [(i, e) for i, e in enumerate(runtime.slot_experts()) if e is not None]
        owner = {e: runtime.owner(e)[0] == self.ep.rank for _, e in held}

        def build_fn(key, data, replica_id, flattened_range):
            if flattened_range is not None:
                raise NotImplementedError("megamoe-plugin: experts with spare vExpert slots are checkpointed by "
                                          "logical id; the distributed optimizer's flat per-rank shards cannot be "
                                          "(use --dist-ckpt-optim-fully-reshardable)")
            return {f"slot{i}": ShardedTensor.from_rank_offsets(
                        key, data.detach()[i:i + 1], *sharded_offsets, (axis, e, num_experts),
                        replica_id=(replica_id[0], replica_id[1] if owner[e] else 1, replica_id[2]),
                        prepend_axis_num=axis)
                    for i, e in held}

        def merger(shape, dtype, device):
            def merge_fn(loaded):
                rows = [(int(k[len("slot"):]), v) for k, v in loaded.items()]
                ref = rows[0][1] if rows else None
                full = torch.zeros(shape, dtype=ref.dtype if ref is not None else dtype,
                                   device=ref.device if ref is not None else device)
                for i, v in rows:
                    full[i:i + 1].copy_(v)
                return full
            return merge_fn

        for name, p in self.bank.named_parameters():
            key = f"{prefix}bank.{name}"
            out[key] = ShardedTensorFactory(key, p, build_fn, merger(tuple(p.shape), p.dtype, p.device),
                                            replica_id=(0, 0, expt_dp_rank))
        return out


class PluginTokenDispatcher:
    """Megatron's six-step token-dispatcher protocol over the core DispatchPlan, for Megatron code that drives a
    layer's dispatcher itself (the layer's own forward calls ``DispatchPlan.forward``)."""

    def __init__(self, plan: DispatchPlan):
        self.plan = plan
        self._shape = self._routing = self._handle = None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing: Routing, probs=None):
        self._shape, self._routing = hidden_states.shape, routing
        return hidden_states.reshape(-1, hidden_states.shape[-1]), probs

    def token_dispatch(self, tokens: torch.Tensor, probs, capacity=None, training: bool = True):
        expert_in, tokens_per_expert, self._handle = self.plan.dispatch(tokens, self._routing, capacity, training)
        return (expert_in, tokens_per_expert), probs

    def dispatch_postprocess(self, dispatched, probs):
        expert_in, tokens_per_expert = dispatched
        return expert_in, tokens_per_expert, None

    def combine_preprocess(self, expert_output: torch.Tensor) -> torch.Tensor:
        return expert_output

    def token_combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        y = self.plan.combine(expert_output, self._handle, self._routing)
        self._handle = None
        return y

    def combine_postprocess(self, output: torch.Tensor) -> torch.Tensor:
        shape, self._shape, self._routing = self._shape, None, None
        return output.view(shape)


class PluginMoELayer(MegatronMoELayer):
    """Megatron's MoELayer with the plugin's router, dispatcher and experts (see the module docstring)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 plugin_config: Optional[MoEConfig] = None, **kwargs):
        if plugin_config is None:
            raise ValueError("PluginMoELayer needs plugin_config (build the spec with megamoe_plugin's spec builder)")
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        self.plugin_config = plugin_config
        if not isinstance(self.router, PluginRouter) or not isinstance(self.experts, PluginExperts):
            raise TypeError("PluginMoELayer needs PluginRouter and PluginExperts in its MoESubmodules")
        # the expert-data-parallel group sums the placement policy's counts, so every expert-parallel group of
        # the job plans the same placement (their slots are reduced together by Megatron's DDP)
        self.plan = DispatchPlan(plugin_config, ExpertParallel(self.ep_group), edp_group=self.experts.expt_dp_group)
        if self.plan.placement is not None and self.plan.placement.slots_per_rank != self.experts.bank.w1.shape[0]:
            raise ValueError(f"megamoe-plugin: the placement has {self.plan.placement.slots_per_rank} slots per rank "
                             f"but the expert bank {self.experts.bank.w1.shape[0]}")
        self.experts.bank.placement = self.plan.placement     # logical experts -> vExpert slots (placement/)
        self.token_dispatcher = PluginTokenDispatcher(self.plan)
        self.stats = plugin_stats()
        self.aux_losses = {}
        self.last_routing: Optional[Routing] = None

    # --- capacity (DynaMoE changes it between steps) ------------------------------------------------------------
    def set_expert_capacity(self, capacity) -> None:
        self.plan.set_expert_capacity(capacity)

    def capacity_for(self, num_tokens: int):
        return self.plan.capacity_for(num_tokens, self.training)

    @property
    def experts_bank(self) -> ExpertBank:
        return self.experts.bank

    @property
    def layer_id(self):
        """Megatron's layer number (set when the block is built): the id traces and placement files use."""
        return self.layer_number

    # --- forward -----------------------------------------------------------------------------------------------
    def _attach_aux_losses(self, routing: Routing, num_tokens: int) -> None:
        if not routing.aux_losses:
            return
        total = routing.aux_loss()
        if self.config.calculate_per_token_loss:
            total = total * num_tokens      # the schedule divides the whole loss by the token count later
        routing.weights = MoEAuxLossAutoScaler.apply(routing.weights, total)
        num_layers = self.config.num_layers + (getattr(self.config, "mtp_num_layers", None) or 0)
        for name, value in routing.aux_losses.items():
            tracker_name, coeff_name = AUX_LOSS_NAMES.get(name, (f"moe_plugin_{name}_loss", "aux_loss_coeff"))
            coeff = getattr(self.plugin_config, coeff_name) or 1.0
            save_to_aux_losses_tracker(tracker_name, value.detach() / coeff, self.layer_number, num_layers,
                                       avg_group=self.attn_tp_group)

    def _routed(self, hidden_states: torch.Tensor) -> torch.Tensor:
        check_input_dtype(hidden_states, self.experts.bank, f"MoE layer {self.layer_number}")
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])

        def aux_losses(routing):               # after the experts: a cached routing's gate ran alongside them
            if self.training:
                routing.join()
                self._attach_aux_losses(routing, tokens.shape[0])

        # the core's one call sequence (DispatchPlan.forward), Megatron's aux losses attached by the hook
        out, routing = self.plan.forward(self.router, tokens, self.training, self.experts.bank,
                                         tuple(hidden_states.shape[:-1]), after_experts=aux_losses)
        out = out.view(hidden_states.shape)
        self.aux_losses = {k: v.detach() for k, v in routing.aux_losses.items()}
        self.last_routing = routing
        self.stats.record(self.layer_number if self.layer_number is not None else 0, routing)
        return out

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        """[S, B, H] -> ([S, B, H], None). ``padding_mask`` is accepted; padded tokens are routed like others."""
        if intermediate_tensors is not None:
            raise NotImplementedError("megamoe-plugin: partial CUDA-graph capture of the MoE layer is not supported")
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError("megamoe-plugin: MoE with tensor parallelism needs --sequence-parallel")

        def custom_forward(hidden):
            shared = self.shared_experts(hidden) if self.use_shared_expert else None
            out = self._routed(hidden)
            return out + shared if shared is not None else out

        if self.moe_layer_recompute:
            output = tensor_parallel.checkpoint(custom_forward, False, hidden_states)
        else:
            output = custom_forward(hidden_states)
        return output, None
