"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA): rank 0 is the
engine; worker ranks only run their shard of each step (see ``tp``)."""
