"""The stable import path of the vLLM KV connector (``kv_connector_module_path:
"kvtier.vllm"``, class ``KvtierConnector``), kvtier/integrations/vllm.py."""
from kvtier.integrations.vllm import *  # noqa: F403
from kvtier.integrations.vllm import __all__  # noqa: F401
