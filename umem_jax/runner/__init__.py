"""The runner: packs a scheduled batch into one int32 metadata array, launches the one jitted
step (model -> kernels -> arena -> sampler) and relocates pages the allocator moved."""
