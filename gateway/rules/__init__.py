"""Routing rules: the YAML schema (pydantic), the loader with path-named errors, and the watcher."""
