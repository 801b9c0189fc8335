"""Tensor parallelism (``--tp``: one process per rank, rank 0 the engine) and data-parallel replicas
(``--dp``: whole engines behind one server), on torch.distributed (NCCL on CUDA, gloo on CPU)."""
