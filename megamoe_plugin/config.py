"""MoEConfig: the one flat, typed, validated dataclass behind every option of the plugin.

Every option has a type, a default and a help text (``field(metadata={"help": ...})``). The Megatron and fairseq
adapters render these fields into their trainers' flags (``iter_options()`` gives name, type, default, help,
choices), so nothing here may depend on a trainer. Invalid values fail at construction with a ``ConfigError``
that names the option and the value.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from .config_router import parse_balancing, validate_router
from .gate_registry import gate_class, registered_gates
from .topology import Topology


class ConfigError(ValueError):
    """An invalid MoE option; the message names the option (as a flag-style name) and the value."""


def _opt(default: Any, help: str, choices: Optional[tuple] = None):
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


# built-ins; gates.register_gate adds more
GATE_NAMES = ("topk", "naive", "switch", "gshard", "hir", "ta_moe", "node_limited", "node_limited_sender")
DISPATCH_NAMES = ("dropless", "capacity")
ACTIVATIONS = ("gelu", "relu", "swiglu", "squared_relu", "quick_geglu")
GATED_ACTIVATIONS = ("swiglu", "quick_geglu")       # fc1 has 2F outputs [gate | linear]
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
ROUTER_DTYPES = ("fp32", "fp64", "input")
DROP_POLICIES = ("probs", "position", "choice")
EXPERT_KERNELS = ("auto", "grouped_mm", "loop")
SECOND_EXPERT_POLICIES = ("all", "random")
CAPACITY_POLICIES = ("static", "dynamic", "quantile")
EXPERT_GRAPHS = ("none", "compile", "cuda-graph")
EXPERT_CACHE_POLICIES = ("lifo", "fifo", "lru", "lfu")
# built-in placement policies that move experts' rows and optimizer state between ranks, and those of them that
# replicate experts into spare vExpert slots
MOVING_PLACEMENTS = ("flexmoe", "shadow", "eplb")
REPLICA_PLACEMENTS = ("flexmoe", "eplb")
NONFINITE_ACTIONS = ("raise", "skip", "off")
INIT_STD = 0.02        # normal init of the plugin layer's gate and expert weights (trainers may re-initialise them)


@dataclass
class MoEConfig:
    # --- routing ---------------------------------------------------------------------------------------------------
    num_experts: int = _opt(8, "Total number of experts per MoE layer (over all expert-parallel ranks).")
    top_k: int = _opt(2, "Experts chosen per token (switch forces 1, gshard forces 2).")
    gate: str = _opt("topk", "Gate: topk (megatron-core's TopKRouter: every score function, group-limited routing, "
                             "expert bias, sinkhorn and quantile balancing) | naive (FastMoE's name for topk) | switch "
                             "| gshard | hir | ta_moe (TA-MoE's loss, or its target steered by a per-sender bias with "
                             "the expert bias) | node_limited / node_limited_sender (at most group-topk nodes per "
                             "token, the nodes from the topology), or a name added with @register_gate.")
    score_function: str = _opt("softmax", "Router score function: softmax, sigmoid (DeepSeek-V3, Llama-4) or "
                                          "sqrtsoftplus (sqrt(softplus(logit)), Nemotron).", SCORE_FUNCTIONS)
    normalize_top_k: bool = _opt(True, "Weights of the chosen experts sum to 1 (k > 1). softmax: on = softmax over the "
                                       "k chosen logits, off = the full softmax's probabilities (Megatron's "
                                       "--moe-router-pre-softmax; group scores are then summed probabilities "
                                       "instead of logits); sigmoid / sqrtsoftplus: on = the k scores divided by "
                                       "their sum.")
    topk_scaling_factor: float = _opt(0.0, "Multiply the chosen experts' weights by this (DeepSeek-V3's routed "
                                           "scaling factor, 2.5); 0 = no scaling.")
    num_groups: int = _opt(0, "Group-limited routing (DeepSeek-V2/V3): the experts form this many equal groups "
                              "(e.g. the nodes or ranks of the expert-parallel layout); 0 = off.")
    group_topk: int = _opt(0, "Group-limited routing: each token chooses among the experts of this many groups, "
                              "those with the highest sum of their top (k / group-topk) scores; with the "
                              "node_limited gates: the most nodes a token may use.")
    router_expert_bias: bool = _opt(False, "Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, an fp32 buffer, "
                                           "is added to the scores for choosing the experts only (the weights stay "
                                           "the scores) and moved by the sign of each expert's load error once per "
                                           "global batch; sigmoid or sqrtsoftplus scores.")
    router_bias_update_rate: float = _opt(1e-3, "Aux-loss-free balancing: step of the expert-bias update "
                                                "(DeepSeek-V3: 1e-3).")
    load_balancing_type: str = _opt("aux_loss", "Balancing, a comma list of type[:coefficient]: aux_loss (the gate's "
                                                "balance loss per micro-batch: Switch's for topk, GShard's for "
                                                "gshard, TA-MoE's for ta_moe), seq_aux_loss (per sequence, "
                                                "DeepSeek-V2/V3), global_aux_loss (over the global batch), none; "
                                                "or one of sinkhorn (S-BASE) / quantile_balancing (a per-expert "
                                                "bias from the scores' quantiles), which choose the experts "
                                                "themselves and take no loss. A loss without :coefficient uses "
                                                "--moe-aux-loss-coeff.")
    quantile_balancing_ema: float = _opt(0.0, "quantile_balancing: weight of the previous bias in its update once "
                                              "per global batch (0 = the latest quantiles only).")
    jitter_eps: float = _opt(0.0, "Multiplicative jitter noise on the gate input in training, "
                                  "x * U(1-eps, 1+eps) (Switch Transformer uses 1e-2); 0 disables.")
    second_expert_policy: str = _opt("random", "gshard: 'random' keeps the 2nd expert with probability "
                                               "2*p2 (GShard random routing); 'all' always keeps it.",
                                     SECOND_EXPERT_POLICIES)
    aux_loss_coeff: float = _opt(0.01, "Weight of the balance losses of --moe-load-balancing-type that name no "
                                       "coefficient of their own.")
    gate_sync: str = _opt("auto", "Gate synchronisation over data-parallel ranks: all (gradients averaged every step), "
                                  "local (each rank's gate learns from its own gradient, as TA-MoE's per-rank "
                                  "targets need), average:K (local, plus the gate parameters averaged over ranks every "
                                  "K optimizer steps), or auto (local for ta_moe, all for every other gate).")
    z_loss_coeff: float = _opt(0.0, "Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0 disables.")
    router_dtype: str = _opt("fp32", "Data type of the router's logits and weights: fp32, fp64 (the linear layer "
                                     "in fp64; scores in fp32), or input (the model's dtype).", ROUTER_DTYPES)
    # --- dispatch ------------------------------------------------------------------------------------------------
    dispatch: str = _opt("dropless", "Token dispatch: dropless (dynamic gating, no capacity, nothing dropped) or "
                                     "capacity (GShard fixed per-expert capacity with drop and pad).",
                         DISPATCH_NAMES)
    capacity_factor: float = _opt(1.0, "capacity mode: per-expert capacity = ceil(tokens * k / experts * CF), "
                                       "tokens = this rank's.")
    eval_capacity_factor: float = _opt(0.0, "capacity mode, eval: capacity factor at inference; "
                                            "0 = run dropless at inference (default).")
    min_capacity: int = _opt(4, "capacity mode: lower bound of every expert's capacity.")
    drop_policy: str = _opt("choice", "capacity mode, which assignments an expert keeps: choice (GShard, fairseq: all "
                                      "first choices in token order, then all second choices, ...), probs (the "
                                      "highest weights; Megatron's default) or position (the first tokens).",
                            DROP_POLICIES)
    pad_to_capacity: bool = _opt(True, "capacity mode: every expert computes exactly its capacity of rows (padding "
                                       "included; static shapes, as GShard and DynaMoE need); off = the kept tokens "
                                       "only (Megatron without --moe-pad-expert-input-to-capacity).")
    probs_on_input: bool = _opt(False, "Multiply each token by its weight before the expert instead of weighting the "
                                       "expert's output (Megatron's --moe-apply-probs-on-input; top-1 only).")
    schedule: str = _opt("plain", "Exchange schedule with expert parallelism: plain (all-to-all, experts, all-to-all) "
                                  "or smart (FasterMoE §4.2: grouped pairwise exchange pipelined with the expert "
                                  "computation; dropless dispatch only; same outputs and gradients) with one "
                                  "group per rank (measured faster than one per node on the emulated cluster); "
                                  "smart:node = one group per node of the topology (the paper's grouping), "
                                  "smart:N = N groups (N divides the expert-parallel size).")
    # --- experts -------------------------------------------------------------------------------------------------
    expert_ffn_hidden_size: int = _opt(0, "FFN hidden size of each expert; 0 = the model's FFN hidden size.")
    activation: str = _opt("gelu", "Expert activation: gelu | relu | swiglu (silu-gated) | squared_relu "
                                   "(Nemotron) | quick_geglu (x*sigmoid(1.702x)-gated, gpt-oss).", ACTIVATIONS)
    glu_linear_offset: float = _opt(0.0, "Gated activations: act(gate) * (linear + offset) (gpt-oss: 1).")
    activation_clamp: float = _opt(0.0, "Gated activations: clamp gate to <= c and linear to [-c, c] before the "
                                        "activation (gpt-oss: 7); 0 = no clamp.")
    linear_bias: bool = _opt(False, "Give the router's linear layer and the experts' fc1/fc2 biases (Megatron's "
                                    "add_bias_linear; gpt-oss).")
    expert_kernel: str = _opt("auto", "How the experts compute: grouped_mm (torch's grouped GEMM, every expert in "
                                      "one kernel per product, group offsets on the device: no host sync), loop "
                                      "(one GEMM per expert; on CPU with lanes and oneDNN), auto = whichever "
                                      "measured faster for the layer's shape (timed once per process; on CUDA "
                                      "the loop only when clearly faster).",
                              EXPERT_KERNELS)
    # --- parallelism and topology --------------------------------------------------------------------------------
    expert_parallel_size: int = _opt(1, "Ranks the experts are sharded over (the expert-parallel group size).")
    world_size: int = _opt(0, "Ranks in the job; 0 = from the launcher (WORLD_SIZE), else 1.")
    topology: str = _opt("", "Nested-list topology of the ranks, e.g. '[[0,1],[2,3]]' = 2 nodes x 2 devices; "
                             "empty = from the launcher (WORLD_SIZE, LOCAL_WORLD_SIZE).")
    topology_bandwidth_gbps: str = _opt("", "Comma list of bandwidths in GB/s per topology level, innermost "
                                            "first (e.g. '100,12.5'); empty = defaults per level.")
    topology_latency_us: str = _opt("", "Comma list of latencies in microseconds per topology level, innermost "
                                        "first; empty = defaults per level.")
    # --- placement (between optimizer steps) ----------------------------------------------------------------------
    placement: str = _opt("none", "Expert placement between optimizer steps: none | flexmoe (FlexMoE vExperts: "
                                  "Expand/Shrink/Migrate experts with their optimizer state when the cost model "
                                  "predicts a gain) | shadow (FasterMoE: replicate hot experts on every rank for the "
                                  "next step) | eplb (DeepSeek's EPLB: redundant experts by load per replica, packed "
                                  "onto nodes then ranks, from a moving average; kept when the cost model predicts a "
                                  "gain), or a policy added with @register_placement_policy, or package.module:attr.")
    placement_interval: int = _opt(0, "Run the placement policy every this many optimizer steps (it plans from their "
                                      "summed routing); 0 = automatic: 10 for flexmoe and eplb (their moves pay off "
                                      "over the interval, and each run costs collectives), 1 for shadow (FasterMoE "
                                      "decides per iteration).")
    placement_threshold: float = _opt(1.2, "flexmoe: balance ratio (FlexMoE Eq. 6: the most loaded rank's tokens "
                                           "over the mean) above which experts are expanded and shrunk.")
    placement_spare_slots: int = _opt(-1, "vExpert slots per rank beyond the experts it starts with (room for "
                                          "replicas); -1 = 1 with --moe-placement flexmoe or eplb, else 0.")
    placement_guard: float = _opt(0.03, "Keep a placement change only when the measured steps after it (plus the "
                                        "change's own time over the interval) are at most this fraction slower "
                                        "than those before it; otherwise undo it and pause the policy (2, 4, ... "
                                        "runs). Negative: keep every change the cost model proposes.")
    placement_overlap_sync: bool = _opt(True, "flexmoe / eplb: all-reduce the replicated experts' gradients, "
                                              "shadow: reduce the shadow copies' gradients to their owners, "
                                              "asynchronously, behind the backward of the layers below, and "
                                              "complete them at the end of the backward pass (FlexMoE §4), "
                                              "instead of synchronously in the layer's backward (off, and "
                                              "automatically with Megatron's --overlap-grad-reduce).")
    placement_profile: str = _opt("auto", "Hardware profile whose cost model the placement policies consult: auto "
                                          "(calibrate the running job's own process groups at the first placement "
                                          "run, cached per cluster), a name from `megamoe perf profiles`, or a JSON file "
                                          "written by `megamoe perf calibrate`.")
    # --- dynamic shapes (DynaMoE: RECOMPILE, dynamic capacity, sample-assignment caching) --------------------------
    capacity_policy: str = _opt("static", "capacity mode: static (every expert's capacity from the capacity factor), "
                                          "dynamic (DynaMoE §4.1: each expert's capacity follows its observed "
                                          "demand, its moving average plus a spread of its deviation, changed "
                                          "between steps by RECOMPILE) or quantile (the same, each expert's "
                                          "capacity the 0.9-quantile of its demand over the last 32 steps: it "
                                          "overflows in about 10% of the steps whatever its demand's spread).",
                                CAPACITY_POLICIES)
    expert_graph: str = _opt("none", "capacity mode: run the experts' static-shape computation as a torch.compile "
                                     "graph (compile) or a captured CUDA graph (cuda-graph), re-compiled / "
                                     "re-captured when dynamic capacity changes the shapes; weights are never "
                                     "reallocated.", EXPERT_GRAPHS)
    assignment_cache: bool = _opt(False, "DynaMoE §4.2: cache each training sample's expert assignment by dataset "
                                         "index; once converged, dispatch uses the cached assignment (the gate keeps "
                                         "training and refreshing the cache).")
    assignment_cache_on: float = _opt(0.96, "assignment cache: switch caching on when at least this fraction of "
                                            "the tokens kept their assignment over the last epoch.")
    assignment_cache_off: float = _opt(0.90, "assignment cache: switch caching off when fewer than this fraction "
                                             "kept their assignment.")
    assignment_cache_min_epoch: int = _opt(10, "assignment cache: never switch caching on before this epoch.")
    # --- inference deployment (paper 004: expert buffering, expert load balancing) ---------------------------------
    expert_cache_size: int = _opt(0, "Inference, expert buffering (paper 004 §VI): expert slots per device; every "
                                     "expert's weights live in (pinned) CPU memory and the active ones are copied "
                                     "into the slots per batch; 0 = off (all local experts stay on the device).")
    expert_cache_policy: str = _opt("lifo", "Expert buffering: which cached expert to evict first once the experts "
                                            "inactive in the batch are gone: lifo (paper 004) | fifo | lru | lfu.",
                                    EXPERT_CACHE_POLICIES)
    placement_file: str = _opt("", "Inference, expert load balancing (paper 004 §VII): a JSON placement written by "
                                   "`megamoe balance` (per layer, which expert goes to which slot); applied as an "
                                   "expert permutation when the checkpoint is loaded, outputs unchanged.")
    # --- observability -------------------------------------------------------------------------------------------
    nonfinite: str = _opt("raise", "Non-finite router outputs (NaN/inf in a MoE layer's combine weights or aux loss, "
                                   "checked once per training step): raise (stop, naming the layer, step and rank), "
                                   "skip (drop that step's update, where the trainer can) or off.", NONFINITE_ACTIONS)
    trace_path: str = _opt("", "Write routing traces (per layer and step [source rank x expert] counts) here.")

    def __post_init__(self):
        self._coerce_types()
        self.validate()

    # ------------------------------------------------------------------------------------------------------------
    def _coerce_types(self):
        """Accept strings from command lines (e.g. '8' for an int option) but reject what cannot be converted."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            typ = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
            if isinstance(v, typ) and not (typ is int and isinstance(v, bool)):
                continue
            try:
                if typ is bool:
                    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                        v = v.lower() in ("1", "true", "yes", "on")
                    elif isinstance(v, int):
                        v = bool(v)
                    else:
                        raise ValueError
                elif typ is int and isinstance(v, float) and not v.is_integer():
                    raise ValueError
                else:
                    v = typ(v)
            except (TypeError, ValueError):
                raise ConfigError(f"{flag(f.name)}: expected {typ.__name__}, got {v!r}") from None
            setattr(self, f.name, v)

    def validate(self):
        """Every option checked; a ``ConfigError`` names the flag and the value. Called by the constructor."""
        gate_cls = self._validate_routing()
        world = self._validate_experts_and_parallel()
        self._validate_placement()
        self._validate_dynamic()
        self._validate_inference_and_topology(gate_cls, world)

    def _bad(self, name, msg):
        raise ConfigError(f"{flag(name)}={getattr(self, name)!r}: {msg}")

    def _validate_routing(self):
        """Gate, top-k, the choices, capacity and loss coefficients."""
        if self.num_experts < 1:
            self._bad("num_experts", "must be >= 1")
        gate_cls = gate_class(self.gate)
        if gate_cls is None:
            self._bad("gate", f"unknown gate; known: {', '.join(sorted(registered_gates()))}")
        if self.top_k < 1:
            self._bad("top_k", "must be >= 1")
        if self.top_k > self.num_experts:
            self._bad("top_k", f"cannot exceed --moe-num-experts={self.num_experts}")
        gate_cls.validate_config(self)                  # the gate's own rules (top-k, ...)
        for name in ("dispatch", "activation", "second_expert_policy", "expert_kernel",
                     "nonfinite", "score_function", "router_dtype", "drop_policy"):
            choices = _field(name).metadata["choices"]
            if getattr(self, name) not in choices:
                self._bad(name, f"must be one of {', '.join(choices)}")
        try:
            parse_gate_sync(self.gate_sync, self.gate)
        except ValueError as e:
            self._bad("gate_sync", str(e))
        if not self.capacity_factor > 0:
            self._bad("capacity_factor", "must be > 0")
        if self.eval_capacity_factor < 0:
            self._bad("eval_capacity_factor", "must be >= 0 (0 = dropless at inference)")
        if self.min_capacity < 0:
            self._bad("min_capacity", "must be >= 0")
        if self.jitter_eps < 0 or self.jitter_eps >= 1:
            self._bad("jitter_eps", "must be in [0, 1)")
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            if getattr(self, name) < 0:
                self._bad(name, "must be >= 0")
        validate_router(self, self._bad)
        return gate_cls

    def _validate_experts_and_parallel(self):
        """Experts, expert parallelism and the smart schedule."""
        if self.expert_ffn_hidden_size < 0:
            self._bad("expert_ffn_hidden_size", "must be >= 0")
        if self.expert_parallel_size < 1:
            self._bad("expert_parallel_size", "must be >= 1")
        if self.world_size < 0:
            self._bad("world_size", "must be >= 0")
        world = self.resolved_world_size()
        if world % self.expert_parallel_size:
            self._bad("expert_parallel_size", f"does not fit a world of {world} rank(s): the expert-parallel size must "
                                        f"divide the world size")
        if self.num_experts % self.expert_parallel_size:
            self._bad("num_experts", f"must be divisible by --moe-expert-parallel-size={self.expert_parallel_size}")
        try:
            smart, groups = parse_schedule(self.schedule)
        except ValueError as e:
            self._bad("schedule", str(e))
        if smart and self.dispatch != "dropless":
            self._bad("schedule", "the smart schedule pipelines dropless dispatch only, not capacity dispatch "
                            "(see --moe-dispatch)")
        if groups > 0 and self.expert_parallel_size % groups:
            self._bad("schedule", f"{groups} groups must divide --moe-expert-parallel-size={self.expert_parallel_size}")
        return world

    def _validate_placement(self):
        """FlexMoE / shadowing placement."""
        if self.placement_interval < 0:
            self._bad("placement_interval", "must be >= 1, or 0 for automatic")
        if not self.placement:
            self._bad("placement", "must not be empty (use 'none')")
        if self.placement_threshold < 1.0:
            self._bad("placement_threshold", "must be >= 1 (the balance ratio is >= 1)")
        if self.placement_spare_slots < -1:
            self._bad("placement_spare_slots", "must be >= 0, or -1 for automatic")

    def _validate_dynamic(self):
        """DynaMoE: dynamic capacity, static graphs, assignment cache."""
        for name in ("capacity_policy", "expert_graph"):
            if getattr(self, name) not in _field(name).metadata["choices"]:
                self._bad(name, f"must be one of {', '.join(_field(name).metadata['choices'])}")
        if self.dynamic_capacity and self.dispatch != "capacity":
            self._bad("capacity_policy", "dynamic capacity changes the capacity dispatch's shapes; use "
                                   "--moe-dispatch capacity (dropless dispatch has no capacity)")
        if self.expert_graph != "none" and self.dispatch != "capacity":
            self._bad("expert_graph", "static-shape expert graphs need --moe-dispatch capacity (dropless shapes change "
                                "every call)")
        if self.expert_graph != "none" and not self.pad_to_capacity:
            self._bad("expert_graph", "static-shape expert graphs need every expert to compute its capacity of rows "
                                      "(--moe-pad-to-capacity)")

    def _validate_inference_and_topology(self, gate_cls, world):
        """Inference deployment options and the topology."""
        if self.expert_cache_size < 0:
            self._bad("expert_cache_size", "must be >= 0 (0 = expert buffering off)")
        if self.expert_cache_policy not in EXPERT_CACHE_POLICIES:
            self._bad("expert_cache_policy", f"must be one of {', '.join(EXPERT_CACHE_POLICIES)}")
        if self.placement_file and not os.path.isfile(self.placement_file):
            self._bad("placement_file", "no such file (write one with `megamoe balance`)")
        for name in ("assignment_cache_on", "assignment_cache_off"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                self._bad(name, "must be a fraction in [0, 1]")
        if self.assignment_cache_off > self.assignment_cache_on:
            self._bad("assignment_cache_off", f"must not exceed --moe-assignment-cache-on={self.assignment_cache_on}")
        if self.assignment_cache_min_epoch < 0:
            self._bad("assignment_cache_min_epoch", "must be >= 0")
        if gate_cls.needs_topology or self.topology:
            try:
                topo = self.build_topology()
            except ValueError as e:
                raise ConfigError(f"{flag('topology')}={self.topology!r}: {e}") from None
            if topo.num_ranks != world:
                self._bad("topology", f"describes {topo.num_ranks} ranks but the world size is {world}")

    # ------------------------------------------------------------------------------------------------------------
    def resolved_world_size(self) -> int:
        return self.world_size or int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def placement_every(self) -> int:
        """--moe-placement-interval resolved: 10 for flexmoe and eplb and 1 otherwise when 0 (automatic)."""
        return self.placement_interval or (10 if self.placement in REPLICA_PLACEMENTS else 1)

    @property
    def smart_schedule(self) -> bool:
        """--moe-schedule smart[:...]: FasterMoE's pipelined exchange (dispatch/smart.py)."""
        return parse_schedule(self.schedule)[0]

    @property
    def smart_groups(self) -> int:
        """The smart schedule's groups: 0 = one per rank, -1 = one per node of the topology, N > 0 = N groups."""
        return parse_schedule(self.schedule)[1]

    @property
    def dynamic_capacity(self) -> bool:
        """--moe-capacity-policy dynamic or quantile: capacities follow the demand (DynaMoE §4.1)."""
        return self.capacity_policy in ("dynamic", "quantile")

    @property
    def placement_plan_window(self) -> int:
        """The steps whose routing the planners plan from: FlexMoE the last 3 (where the hot experts drift, the last
        steps predict the next ones better than the interval's sum: an interleaved A/B in the planners
        benchmark), the others the whole interval (EPLB keeps its own moving average of it)."""
        every = self.placement_every
        return min(every, 3) if self.placement == "flexmoe" else every

    @property
    def gate_sync_mode(self):
        """(mode, K) of --moe-gate-sync for this gate: ('all'|'local'|'average', K); auto resolved."""
        return parse_gate_sync(self.gate_sync, self.gate, self)

    @property
    def local_gates(self) -> bool:
        """Whether each rank's gate learns from its own gradient (local, average:K, or auto with ta_moe)."""
        return self.gate_sync_mode[0] != "all"

    @property
    def per_rank_gate_state(self) -> bool:
        """Whether checkpoints keep every rank's own gate state: local gates, or a gate with per-rank buffers
        (ta_moe steered by bias: each sender's bias)."""
        cls = gate_class(self.gate)
        return self.local_gates or (cls is not None and cls.has_per_rank_state(self))

    @property
    def balance_losses(self):
        """[(type, coefficient)] of --moe-load-balancing-type's losses with a coefficient > 0."""
        return parse_balancing(self.load_balancing_type, self.aux_loss_coeff)[0]

    @property
    def balance_routing(self):
        """'sinkhorn' or 'quantile_balancing' when one of them chooses the experts, else None."""
        return parse_balancing(self.load_balancing_type, self.aux_loss_coeff)[1]

    def balance_coeff(self, kind: str) -> float:
        """The coefficient of one balance loss type (0 when it is not on)."""
        return dict(self.balance_losses).get(kind, 0.0)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.expert_parallel_size

    @property
    def slots_per_rank(self) -> int:
        """vExpert slots of every rank's ExpertBank: its experts + the spare slots replicas can use."""
        spare = self.placement_spare_slots
        if spare < 0:
            spare = 1 if self.placement in REPLICA_PLACEMENTS else 0
        return self.num_local_experts + spare

    def build_topology(self):
        """The Topology of the job's ranks: from --moe-topology if given, else from the launcher's environment."""

        bw = _floats(self.topology_bandwidth_gbps, "topology_bandwidth_gbps")
        lat = _floats(self.topology_latency_us, "topology_latency_us")
        if self.topology:
            return Topology.parse(self.topology, bandwidth_gbps=bw, latency_us=lat)
        return Topology.from_env(world_size=self.resolved_world_size(), bandwidth_gbps=bw, latency_us=lat)

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        d = upgrade_options(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown MoE option(s): {', '.join(sorted(unknown))}")
        return cls(**d)


# options of earlier releases, as a saved option dict may hold them: renamed ones, and those that became constants
# (DynamicSettings, the placement and TA-MoE modules' constants), automatic choices or the trainer's (init_std: the
# layers' init std, which Megatron's adapter takes from --init-method-std)
RENAMED_OPTIONS = {"expert_bias": "linear_bias", "router_bias": "linear_bias"}
RETIRED_OPTIONS = ("capacity_headroom", "capacity_spread", "capacity_window", "capacity_smoothing",
                   "capacity_hysteresis", "capacity_quantum", "capacity_min_interval", "recompile_delta_launch",
                   "assignment_cache_positions", "trace_token_ids", "placement_prefetch", "placement_plan_steps",
                   "placement_max_moves", "cpu_expert_lanes", "cpu_gemm", "ta_moe_smoothing", "ta_moe_exchange_mb",
                   "placement_overlap_moves", "capacity_rank_budget", "ta_moe_later_choice_bias", "ta_moe_warmup",
                   "hir_budget_scale", "placement_group_cache", "init_std", "capacity_quantile", "smart_groups")


def upgrade_options(d: dict) -> dict:
    """A saved option dict in this release's names: renamed options mapped (either bias of an earlier release
    turns ``linear_bias`` on; the smart groups and the capacity quantile become their spellings in
    ``schedule`` and ``capacity_policy``), retired ones dropped."""
    out = {k: v for k, v in d.items() if k not in RETIRED_OPTIONS and k not in RENAMED_OPTIONS}
    for old, new in RENAMED_OPTIONS.items():
        if old in d:
            out[new] = bool(out.get(new)) or bool(d[old])
    groups = int(d.get("smart_groups") or 0)
    if out.get("schedule") == "smart" and groups:
        out["schedule"] = "smart:node" if groups < 0 else f"smart:{groups}"
    if out.get("capacity_policy") == "dynamic" and float(d.get("capacity_quantile") or 0.0) > 0:
        out["capacity_policy"] = "quantile"
    return out


def parse_schedule(text: str):
    """--moe-schedule: 'plain' -> (False, 0), 'smart' -> (True, 0: a group per rank), 'smart:node' -> (True, -1),
    'smart:N' -> (True, N)."""
    t = str(text).strip().lower()
    if t in ("plain", "smart"):
        return t == "smart", 0
    kind, _, groups = t.partition(":")
    if kind == "smart" and groups == "node":
        return True, -1
    if kind == "smart" and groups.isdigit() and int(groups) >= 1:
        return True, int(groups)
    raise ValueError("must be plain, smart, smart:node or smart:N with N >= 1")


def parse_gate_sync(text: str, gate: str = "", cfg=None):
    """--moe-gate-sync: 'all' -> ('all', 0), 'local' -> ('local', 0), 'average:K' -> ('average', K); 'auto' is
    the gate's own default (``gate_sync_default(cfg)``: local for ta_moe steered by its loss, whose per-rank
    targets cancel under averaged gradients, all for the others)."""
    t = str(text).strip().lower()
    if t == "auto":
        cls = gate_class(gate)
        return (cls.gate_sync_default(cfg) if cls is not None else "all"), 0
    if t in ("all", "local"):
        return t, 0
    if t.startswith("average:"):
        k = t.split(":", 1)[1]
        if k.isdigit() and int(k) >= 1:
            return "average", int(k)
    raise ValueError("must be all, local, average:K with K >= 1 (e.g. average:100), or auto")


def flag(name: str) -> str:
    """The command-line spelling of an option, as the adapters render it: --moe-<name-with-dashes>."""
    return "--moe-" + name.replace("_", "-")


def _field(name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(MoEConfig)}[name]


def iter_options() -> Iterator[dict]:
    """Name, type, default, help and choices of every option: what adapters render into trainer flags."""
    for f in dataclasses.fields(MoEConfig):
        typ = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
        yield {"name": f.name, "flag": flag(f.name), "type": typ, "default": f.default,
               "help": f.metadata["help"], "choices": f.metadata.get("choices")}


def _floats(text: str, name: str):
    if not text:
        return None
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag(name)}={text!r}: expected a comma-separated list of numbers") from None
    if any(v <= 0 for v in vals) and name.startswith("topology_bandwidth"):
        raise ConfigError(f"{flag(name)}={text!r}: bandwidths must be > 0")
    if any(v < 0 for v in vals):
        raise ConfigError(f"{flag(name)}={text!r}: values must be >= 0")
    return vals
