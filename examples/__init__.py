"""Worked examples that extend the code from outside it: an attention (docs/adding_an_attention.md), a task
(docs/adding_a_task.md) and a table's configs (docs/adding_a_table.md)."""
