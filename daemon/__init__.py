"""ultrad, the per-node agent, and ultractl, its admin CLI."""

__version__ = "0.1.0"
