"""hotspare control plane: CLI, job spec, etcd store, controller, launchers, chaos.

Never imports torch at module level: the CLI must start fast.
"""

__version__ = "0.1.0"
