"""kvtier inside inference engines: the engine-neutral connector core
(``engine``), the vLLM KV connector (``vllm``), the SGLang HiCache storage
backend (``sglang``) and Hugging Face transformers prefix reuse (``hf``).

Each imports torch and its engine; the torch-free core (``kvtier``) imports
none of them. Users import them by their stable paths, ``kvtier.engine``,
``kvtier.vllm``, ``kvtier.sglang``, ``kvtier.hf``, ``kvtier.hf_paged`` and
``kvtier.fidelity``, which re-export these modules.
"""
