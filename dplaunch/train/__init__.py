"""The training package: runs inside every rank (imports torch & friends)."""
