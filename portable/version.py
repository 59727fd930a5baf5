"""The version of portable, as archives and manifests record it (the `writer` field)."""

__version__ = "0.1.0"
