"""Transports: one module per way of moving bytes (self, MPI, NCCL). They see plain buffers, not arrays."""
