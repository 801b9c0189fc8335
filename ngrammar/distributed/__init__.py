"""Tensor parallelism (``--tp``): one process per rank, rank 0 the engine's, on torch.distributed
(NCCL on CUDA, gloo on CPU). The layer between the runner and the engine; the collectives the model
calls live in ``model.parallel`` and the data-parallel replicas (``--dp``) beside the server."""
