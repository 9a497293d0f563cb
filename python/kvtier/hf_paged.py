"""The stable import path of way (b) of Hugging Face prefix reuse
(``PagedPrefixReuse``, attention ``kvtier_paged``), kvtier/integrations/hf/paged.py."""
from kvtier.integrations.hf.paged import *  # noqa: F403
from kvtier.integrations.hf.paged import __all__  # noqa: F401
