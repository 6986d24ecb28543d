"""Model definitions. Attention is swapped through adapters (``mhla.adapters``), never by forking a model."""
