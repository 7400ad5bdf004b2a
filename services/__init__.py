"""Skiff's role processes; each imports only the project's shared/ code, never another service."""
