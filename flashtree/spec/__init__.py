"""Speculative decoding: draft trees (DDTree), chains (DFlash) and the accept walk."""
