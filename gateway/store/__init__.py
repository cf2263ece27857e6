"""Shared state of the gateway: the ``Store`` protocol and its in-memory and Redis implementations."""
