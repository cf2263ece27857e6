"""Test doubles shipped with the package: ``fake_upstream``, a scriptable vLLM stand-in for fault tests."""
