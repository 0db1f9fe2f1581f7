"""fairseq ``--user-dir`` entry of megamoe-plugin (``megamoe fairseq-user-dir`` prints this folder's path).
fairseq imports this folder as a top-level package by its name, so the name must be unique: the plugin's code
lives in ``megamoe_plugin.fairseq_adapter``."""
import megamoe_plugin.fairseq_adapter.register  # noqa: F401
