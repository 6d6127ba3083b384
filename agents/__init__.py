"""One agent per node: lease, worker supervision, warm hot spares, chaos execution."""

from .agent import Agent, store_from_env

__all__ = ["Agent", "store_from_env"]
