"""Worked examples that extend the library from outside it (docs/adding_an_attention.md)."""
