"""Pieces every task reuses: the training loop, checkpoints, EMA, optimizers, logging, distributed set-up."""
