"""Model weight files: which a peer needs, and peers giving them to each other (verified by sha256)."""
