"""muse-stack: the reproducible training stack for Muse Spark Open (816B-A42B)."""

__version__ = "0.1.0"
