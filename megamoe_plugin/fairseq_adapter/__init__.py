"""fairseq adapter: a ``--user-dir`` with MoE models, architectures and criteria, expert parallelism over fairseq's
data-parallel ranks, expert-sharded checkpoints and the after-step placement hook.

    fairseq-train data-bin --user-dir $(megamoe fairseq-user-dir) --task language_modeling \
        --arch moe_transformer_lm_tiny --criterion moe_cross_entropy --moe-expert-count 4 --moe-gate gshard ...

``user_dir()`` is the folder to pass to ``--user-dir`` (``megamoe_fairseq/``: a package whose only job is to
import ``register``). Modules: ``args`` (flags <-> MoEConfig), ``layers`` (MoE FFN inside fairseq's layers,
checkpoint format), ``models``, ``criteria``, ``distributed`` (groups, expert gradients, clipping),
``trainer_hooks`` (the trainer wrappers). Importing this package does not import fairseq.
"""
import os


def user_dir() -> str:
    """The directory to pass to fairseq's ``--user-dir``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "megamoe_fairseq")
