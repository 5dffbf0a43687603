"""Stack fingerprints: what this process actually runs on, captured inside every run."""

from muse_stack.fingerprint.absent import absent, is_absent
from muse_stack.fingerprint.capture import capture
from muse_stack.fingerprint.document import SCHEMA_VERSION, load_fingerprint
from muse_stack.fingerprint.ranks import merge_ranks

__all__ = ["SCHEMA_VERSION", "absent", "capture", "is_absent", "load_fingerprint", "merge_ranks"]
