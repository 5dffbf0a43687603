"""Training data: sources, chat rendering with the loss mask, fixed/packed/synthetic rows, batches."""

from muse_stack.data.build import BuiltData, build_for_recipe, default_cache_dir, plan_for_recipe
from muse_stack.data.packing import pack_alignment
from muse_stack.data.rows import rows_sha256

__all__ = ["BuiltData", "build_for_recipe", "default_cache_dir", "pack_alignment", "plan_for_recipe", "rows_sha256"]
