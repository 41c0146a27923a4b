"""Admission's OpenAI-compatible HTTP face (docs/PROTOCOL.md "The OpenAI-compatible HTTP API"): the same front
door as gRPC (door.py), reached over HTTP/JSON and Server-Sent Events."""
