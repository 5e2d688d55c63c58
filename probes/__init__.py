"""Kernel probes (bcc): C sources and their loader."""
