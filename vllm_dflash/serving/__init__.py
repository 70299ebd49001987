"""vLLM side of vllm-dflash: the only package that touches vLLM internals, each place through
a named seam (``seams/``).

``plugin.register`` (vLLM's plugin loader) hands over to ``activate.py``, which decides per
engine configuration and either installs what serving needs (``install.py``) or leaves vLLM
as it was. vLLM itself then loads our drafter (its registry), our V1 proposer or runner-V2
speculator (its model runner), and our stat logger (its stat-logger plugins).
"""
