"""The stable import path of the SGLang HiCache storage backend (``module_path:
"kvtier.sglang"``, class ``KvtierHiCacheStorage``), kvtier/integrations/sglang.py."""
from kvtier.integrations.sglang import *  # noqa: F403
from kvtier.integrations.sglang import __all__  # noqa: F401
