"""Verification apart from the engines: the parity harnesses that run an engine against the
reference model (bf16 and strict float32 parity, adapter parity), each a ``python -m`` entry point
that writes its JSON verdict."""
