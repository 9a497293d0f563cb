"""Hugging Face transformers prefix reuse: ``prefix`` (way (a): the fetched
prefix decoded into a DynamicCache; ``kvtier.hf``), ``paged`` (way (b): kept
K16/V8 in a paged cache with kvtier's decode attention; ``kvtier.hf_paged``),
``cache`` (the caches a fetch returns), ``_gpu`` (the GPU half of both) and
``fidelity`` (a codec's effect on a real model; ``kvtier.fidelity``,
the ``kvtier-fidelity`` command). docs/hf.md describes them.
"""
