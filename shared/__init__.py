"""Pieces every Kaiten process shares: wire protocol, Redis names, config."""
