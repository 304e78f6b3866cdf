"""GLM-5.3-Flash blocks in plain PyTorch, each reading its cache through `PagedCache` views and
computing through the kernel dispatch (`glm_integration.kernels.ops`)."""
