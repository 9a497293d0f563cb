"""The stable import path of Hugging Face prefix reuse (way (a), ``PrefixReuse``),
kvtier/integrations/hf/prefix.py."""
from kvtier.integrations.hf.prefix import *  # noqa: F403
from kvtier.integrations.hf.prefix import __all__  # noqa: F401
