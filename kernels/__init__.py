"""Pallas kernels behind one small interface: per operation, a validated entry point with an
``impl`` switch, a check of which shapes the kernel takes, and a plain-JAX reference (the
CPU path and the kernel's oracle).

| operation | entry points (module) | kernel | reference |
|---|---|---|---|
| decode attention | ``paged_attention``, ``paged_attention_write``, ``kernel_unsupported`` (``paged_attention``) | ``paged_attention_pallas`` (launch: ``paged_attention_launch``); ``paged_attention_mosaic`` (Mosaic GPU, Hopper: ``backend="mosaic"``; launch: ``paged_attention_mosaic_launch``) | ``paged_attention_ref`` |
| prefill attention | ``paged_prefill_attention`` (``prefill_attention``) | ``paged_prefill_attention_pallas`` (same module) | ``paged_attention_ref`` |
| decode projections | ``skinny_matmul``, ``gated_up``, ``kernel_unsupported`` (``skinny_matmul``) | ``skinny_matmul_pallas`` (Triton); ``skinny_matmul_mosaic`` (Mosaic GPU, Hopper: ``backend="mosaic"``) | ``skinny_matmul_ref``, ``gated_up_ref`` |
| residual add + RMSNorm | ``residual_norm``, ``kernel_unsupported`` (``residual_norm``) | same module | ``residual_norm_ref`` |
 ``impl="pallas"`` runs the kernel (``interpret=True``:
on the CPU), ``"xla"`` the reference and ``"auto"`` the kernel on a GPU where it takes the
shapes. Another backend replaces a module's "pallas" branch and nothing else: decode attention
and the decode projections take ``backend="mosaic"`` for their Mosaic GPU kernels (shared helpers:
``mosaic_common``; interpret mode: Mosaic GPU's CPU interpreter), where the Triton ones remain the
default. The attention kernels' key splits (decode on both backends, prefill as a launch option)
share ``split_merge``: each split's block range, its log-sum-exp and the merge in XLA.
The engine reaches them only through ``rltjax.cache.paged_kv.PagedKVBackend``.
"""

BACKENDS = ("triton", "mosaic")     # kernel backends: Pallas Triton (the default) and Mosaic GPU
