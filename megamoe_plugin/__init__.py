"""megamoe-plugin: MoE research systems (FasterMoE, TA-MoE, FlexMoE, DynaMoE, Meta's MoE deployment) for
Megatron and fairseq. The core (everything outside ``megatron/`` and ``fairseq/``) is pure PyTorch +
torch.distributed; see README.md for the architecture."""
from .config import ConfigError, MoEConfig
from .layer import MoELayer, collect_aux_loss, moe_layers
from .stats import StatsSink, TraceRecorder, load_trace
from .topology import Topology

__version__ = "0.2.0"
__all__ = ["ConfigError", "MoEConfig", "MoELayer", "collect_aux_loss", "moe_layers", "StatsSink", "TraceRecorder",
           "load_trace", "Topology"]
