"""ultrad, the per-node agent, and ultractl, its admin CLI."""

from parallel.cli_common import version

__version__ = version()
