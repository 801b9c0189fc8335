"""Attention over the paged KV cache: the contract (``metadata``), the backends (``sdpa``,
``triton``) and the factory that picks one (``factory``)."""
