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

import functools
import math
from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from ..config import MoEConfig
from ..dispatch.plan import DispatchPlan
from ..experts import ExpertBank, check_input_dtype
from ..experts.activations import is_gated
from ..gates import build_gate
from ..gates.base import Routing, TokenBatch, jitter
from ..parallel import ExpertParallel
from ..stats import StatsSink

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
    """Megatron router slot holding a core gate; ``forward(tokens [T, H], capacity, assigned, batch) -> Routing``.

    Its checkpoint keys are megatron-core's router's (``router.weight``, ``router.bias``, ``router.expert_bias``);
    the core gate's balancing buffers carry megatron-core's names, so ``finalize_model_grads`` updates the expert
    bias (and resets the global aux loss's counts) of the plugin's layers as it does for its own."""

    def __init__(self, config, pg_collection=None, plugin_config: Optional[MoEConfig] = None,
                 is_mtp_layer: bool = False, **unused):
        super().__init__(config)
        if plugin_config is None:
            raise ValueError("PluginRouter needs plugin_config (build the spec with megamoe_plugin's spec builder)")
        cfg = plugin_config
        topology = cfg.build_topology() if (cfg.gate in ("hir", "ta_moe") or cfg.topology) else None
        self.gate = build_gate(cfg, config.hidden_size, ep=ExpertParallel(pg_collection.ep), topology=topology)
        seed = _layer_seed()
        _seeded_normal_(self.gate.weight, config.init_method_std, seed)
        if self.gate.bias is not None:
            _seeded_normal_(self.gate.bias, config.init_method_std, seed + 1)
        self.gate.to(_device(config))
        self.tp_cp_group = getattr(pg_collection, "tp_cp", None)
        self.tp_dp_cp_group = getattr(pg_collection, "tp_dp_cp", None)
        self.gate.set_reduction_groups(seq_group=self.tp_cp_group, batch_group=self.tp_dp_cp_group)
        for p in self.gate.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        self.is_mtp_layer = is_mtp_layer
        self.layer_number = None

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, tokens: torch.Tensor, capacity=None, assigned=None, batch=None) -> Routing:
        if not self.training and self.config.moe_input_jitter_eps:
            tokens = jitter(tokens, self.config.moe_input_jitter_eps)    # megatron-core jitters in evaluation too
        return self.gate(tokens, capacity=capacity, assigned=assigned, batch=batch)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """megatron-core's router keys: the core gate's tensors without the ``gate.`` level."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for value in out.values():
            value.key = value.key.replace(f"{prefix}gate.", prefix, 1)
        return out


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
            self.bank = ExpertBank.from_config(cfg, config.hidden_size, cfg.expert_ffn_hidden_size or
                                               config.moe_ffn_hidden_size or config.ffn_hidden_size,
                                               config.init_method_std, dtype=config.params_dtype,
                                               device=torch.device("cpu"))
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
        """The experts in megatron-core's checkpoint layout, by global (logical) expert id, so that a distributed
        checkpoint of a native megatron-core MoE layer (SequentialMLP, or the grouped-GEMM experts, which share its
        layout) loads into this layer and this layer's into a native one, at any expert-parallel size.

        megatron-core stores ``{prefix}experts.linear_fc1.weight`` as [E, F', H] (Linear's [out, in]; a gated
        activation's two halves as two chunks of dim 1), ``linear_fc2.weight`` as [E, H, F] and the biases as
        [E, F'] / [E, H]; the bank keeps [slots, H, F'] / [slots, F, H]. One ``ShardedTensorFactory`` per bank
        tensor: its build_fn makes, per occupied slot, the slot's tensor in megatron-core's orientation at its
        logical expert's index (a replica is not the main copy; free slots are not saved), and its merge_fn puts
        the loaded experts back into the bank under the placement current at load time (zeros for free slots).
        Megatron's optimizer ``sharded_state_dict`` replaces the factory's data with each optimizer-state tensor
        (Adam moments, fp32 master weights), so they are saved and loaded the same way; the distributed optimizer
        does so in its ``fully_reshardable`` format (whole parameter-shaped tensors)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
        import torch.distributed as dist

        expt_dp_rank = dist.get_rank(self.expt_dp_group) if (self.expt_dp_group is not None and
                                                             dist.is_initialized()) else 0
        axis = len(sharded_offsets)
        runtime = getattr(self.bank, "placement", None)
        num_experts = self.ep.size * self.num_local_experts
        if runtime is None:
            held = [(i, self.ep.rank * self.num_local_experts + i) for i in range(self.num_local_experts)]
            owner = {e: True for _, e in held}
        else:
            held = [(i, e) for i, e in enumerate(runtime.state.slots_of(runtime.ep.rank)) if e is not None]
            owner = {e: runtime.state.owner(e)[0] == self.ep.rank for _, e in held}
        gated = is_gated(self.bank.activation)

        def builder(name):
            transpose = name in ("w1", "w2")
            chunks = 2 if gated and name in ("w1", "b1") else 1

            def build_fn(key, data, replica_id, flattened_range):
                if flattened_range is not None:
                    raise NotImplementedError("megamoe-plugin: the plugin's experts are checkpointed in megatron-core's "
                                              "expert layout by logical id; the distributed optimizer's flat per-rank "
                                              "shards cannot be (use --dist-ckpt-optim-fully-reshardable)")
                out = {}
                for i, e in held:
                    piece = data.detach()[i]
                    piece = piece.t() if transpose else piece
                    rid = (replica_id[0], replica_id[1] if owner[e] else 1, replica_id[2])
                    for c, part in enumerate(piece.chunk(chunks, dim=0)):
                        out[f"slot{i}.{c}"] = ShardedTensor.from_rank_offsets(
                            key, part.contiguous(), *sharded_offsets, (axis, e, num_experts),
                            *([(axis + 1, c, chunks)] if chunks > 1 else []), replica_id=rid,
                            prepend_axis_num=axis + 1)
                return out

            def merge_fn(loaded):
                full = None
                for i, _ in held:
                    piece = torch.cat([loaded[f"slot{i}.{c}"] for c in range(chunks)], dim=0)
                    piece = piece.t() if transpose else piece
                    if full is None:
                        full = piece.new_zeros((self.bank.w1.shape[0],) + tuple(piece.shape))
                    full[i].copy_(piece)
                return full
            return build_fn, merge_fn

        out = {}
        native = {"w1": "linear_fc1.weight", "w2": "linear_fc2.weight", "b1": "linear_fc1.bias",
                  "b2": "linear_fc2.bias"}
        for name, p in self.bank.named_parameters():
            build_fn, merge_fn = builder(name)
            out[f"{prefix}bank.{name}"] = ShardedTensorFactory(f"{prefix}experts.{native[name]}", p, build_fn,
                                                               merge_fn, replica_id=(0, 0, expt_dp_rank))
        # megatron-core's local linear layers save an (empty) extra state per expert; a native run loads them
        for i, e in held:
            for fc in ("linear_fc1", "linear_fc2"):
                out[f"{prefix}_extra_state/{fc}/{i}"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{fc}._extra_state", (*sharded_offsets, (axis, e, num_experts)),
                    replica_id=(0, 0 if owner[e] else 1, expt_dp_rank))
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for key in [k for k in state_dict if k.startswith(f"{prefix}_extra_state/")]:
            state_dict.pop(key)          # megatron-core's empty extra states (sharded_state_dict), nothing of ours
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


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


# core aux-loss name -> (megatron-core's tracker name, the loss type whose coefficient scaled it)
AUX_LOSS_NAMES = {"balance": ("load_balancing_loss", "aux_loss"),
                  "seq_balance": ("seq_load_balancing_loss", "seq_aux_loss"),
                  "global_balance": ("global_load_balancing_loss", "global_aux_loss"),
                  "z": ("z_loss", None)}


@functools.lru_cache(maxsize=None)
def _metrics_recorder():
    """Megatron's MoE metrics tracker's ``record`` (``save_to_aux_losses_tracker`` on releases without a tracker
    object), looked up once."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

        def record(name, value, layer_number, num_layers, reduce_group=None, avg_group=None, needs_dp_avg=True):
            save_to_aux_losses_tracker(name, value, layer_number, num_layers, reduce_group=reduce_group,
                                       avg_group=avg_group, reduce_group_has_dp=not needs_dp_avg)
        return record
    return lambda *a, **kw: get_moe_metrics_tracker().record(*a, **kw)


def _record_metric(name: str, value: torch.Tensor, layer_number: int, num_layers: int, reduce_group=None,
                   avg_group=None, needs_dp_avg: bool = True) -> None:
    _metrics_recorder()(name, value, layer_number, num_layers, reduce_group=reduce_group, avg_group=avg_group,
                        needs_dp_avg=needs_dp_avg)


class PluginMoELayer(MegatronMoELayer):
    """Megatron's MoELayer with the plugin's router, dispatcher and experts (see the module docstring)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 plugin_config: Optional[MoEConfig] = None, **kwargs):
        if plugin_config is None:
            raise ValueError("PluginMoELayer needs plugin_config (build the spec with megamoe_plugin's spec builder)")
        # Megatron builds its own token dispatcher in MoELayer.__init__; the plugin's replaces it, so the flex
        # dispatcher (DeepEP / HybridEP, GPU only) is not built: an all-gather one stands in until replaced
        dispatcher_type = config.moe_token_dispatcher_type
        if dispatcher_type == "flex":
            config.moe_token_dispatcher_type = "allgather"
        try:
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             pg_collection=pg_collection, **kwargs)
        finally:
            config.moe_token_dispatcher_type = dispatcher_type
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
        self._per_sequence = plugin_config.balance_coeff("seq_aux_loss") > 0

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
        """Megatron's layer number (set when the block is built): the id traces, metrics and placement files use.
        A multi-token-prediction layer counts its own layers from 1; it comes after the decoder's, as in
        megatron-core's metrics."""
        if self.layer_number is not None and self.router.is_mtp_layer:
            return self.layer_number + self.config.num_layers
        return self.layer_number

    # --- forward -----------------------------------------------------------------------------------------------
    def _attach_aux_losses(self, output: torch.Tensor, routing: Routing) -> torch.Tensor:
        """megatron-core's scaling of the router's losses (per-token loss, repeated MTP layers) entering the loss
        through ``MoEAuxLossAutoScaler``, and its metrics under its names and reduction groups."""
        config, router, cfg = self.config, self.router, self.plugin_config
        tp_cp = router.tp_cp_group.size() if router.tp_cp_group is not None else 1
        mtp_layers = getattr(config, "mtp_num_layers", None)
        repeated = router.is_mtp_layer and getattr(config, "mtp_use_repeated_layer", False) and mtp_layers
        total = routing.aux_loss()
        if repeated:
            total = total / mtp_layers
        if config.calculate_per_token_loss:
            total = total * routing.valid_tokens * tp_cp
        output = MoEAuxLossAutoScaler.apply(output, total)
        num_layers = config.num_layers + (mtp_layers or 0)
        layer = self.layer_id
        for name, value in routing.aux_losses.items():
            tracker_name, kind = AUX_LOSS_NAMES.get(name, (f"moe_plugin_{name}_loss", "aux_loss"))
            coeff = cfg.z_loss_coeff / tp_cp if kind is None else cfg.balance_coeff(kind)
            value = value.detach() / (mtp_layers if repeated else 1) / (coeff or 1.0)
            if kind is None:
                _record_metric(tracker_name, value, layer, num_layers, avg_group=router.tp_dp_cp_group)
            elif kind == "global_aux_loss":
                _record_metric(tracker_name, value, layer, num_layers, reduce_group=router.tp_dp_cp_group,
                               needs_dp_avg=False)
            else:
                _record_metric(tracker_name, value, layer, num_layers, reduce_group=router.tp_cp_group)
        return output

    def _routed(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
        check_input_dtype(hidden_states, self.experts.bank, f"MoE layer {self.layer_number}")
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        keys_shape = tuple(hidden_states.shape[:-1])
        batch = None
        if padding_mask is not None or self._per_sequence:
            padding = None if padding_mask is None else padding_mask.reshape(-1)
            batch = TokenBatch.from_shape(keys_shape, "sb", padding, device=tokens.device)
        # the core's one call sequence (DispatchPlan.forward)
        out, routing = self.plan.forward(self.router, tokens, self.training, self.experts.bank, keys_shape,
                                         batch=batch)
        out = out.view(hidden_states.shape)
        if self.training and routing.aux_losses:
            out = self._attach_aux_losses(out, routing)
        self.aux_losses = {k: v.detach() for k, v in routing.aux_losses.items()}
        self.last_routing = routing
        self.stats.record(self.layer_id if self.layer_id is not None else 0, routing)
        return out

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        """[S, B, H] -> ([S, B, H], None). ``padding_mask`` [B, S] (megatron-core's: True marks a padding token)
        keeps padding tokens out of the router's losses and the expert bias's counts; they are routed."""
        if intermediate_tensors is not None:
            raise NotImplementedError("megamoe-plugin: partial CUDA-graph capture of the MoE layer is not supported")
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError("megamoe-plugin: MoE with tensor parallelism needs --sequence-parallel")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def custom_forward(hidden, padding):
            shared = self.shared_experts(hidden) if self.use_shared_expert else None
            out = self._routed(hidden, padding)
            return out + shared if shared is not None else out

        if self.moe_layer_recompute and self.training:
            output = tensor_parallel.checkpoint(custom_forward, False, hidden_states, padding_mask)
        else:
            output = custom_forward(hidden_states, padding_mask)
        return output, None
