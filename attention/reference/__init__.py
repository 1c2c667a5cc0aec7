"""The reference backends: the readable math (naive), the same under torch.compile (compiled), PyTorch's own fused
kernels (sdpa) and FlexAttention (flex, imported on first use). Everything else is checked against them."""
