"""The stable import path of the engine connectors' core, kvtier/integrations/engine.py."""
from kvtier.integrations.engine import *  # noqa: F403
from kvtier.integrations.engine import __all__  # noqa: F401
