"""Test doubles for the gateway: a small, deterministic fake of ``vllm serve`` (see ``fake_upstream``)."""
