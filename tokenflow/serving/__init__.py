"""Serving layer: the engine-client seam, the OpenAI-compatible server and its protocol models."""
