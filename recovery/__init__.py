"""In the training process: the Session API and the reconfigurable process group."""

from .process_group import ReconfigurableProcessGroup
from .session import Fenced, Session

__all__ = ["Fenced", "ReconfigurableProcessGroup", "Session"]
