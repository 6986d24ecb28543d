"""Image classification: MNIST (embedded default), ImageNet-style folders; top-1 / top-5 with torchmetrics."""
