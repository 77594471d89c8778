"""Offline builders: model import and per-layer fragment sets."""
