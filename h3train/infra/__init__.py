"""Small infrastructure helpers the trainer builds on: atomic writes, content digests, free-space
checks, the run lock, and the quieting of known third-party notices."""
