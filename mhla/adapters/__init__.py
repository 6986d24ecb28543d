"""Adapters that put MHLA (or any registered attention) into third-party models without forking them."""
