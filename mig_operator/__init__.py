"""mig-operator: a slice of an NVIDIA GPU on demand (dynamic MIG, or a hard-limited fraction)."""

__version__ = "0.1.0"
