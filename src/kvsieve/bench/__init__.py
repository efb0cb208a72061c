"""GPU microbenchmarks (``kvsieve bench``): decode-step attention kernels against FlashInfer and SDPA."""
