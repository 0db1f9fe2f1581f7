"""Registers the plugin's fairseq models, architectures and criteria, and installs the trainer hooks.
Imported by the ``--user-dir`` package (``megamoe_fairseq``) or directly by code that builds fairseq objects."""
from . import criteria, models  # noqa: F401  (registration happens at import)
from .trainer_hooks import install

install()
