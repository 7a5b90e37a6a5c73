"""Speculative decoding: n-gram proposals, verification and the draft model."""
