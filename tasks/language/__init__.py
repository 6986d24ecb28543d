"""Language modelling: packed token streams, the LM task for the shared trainer, evaluation helpers."""
