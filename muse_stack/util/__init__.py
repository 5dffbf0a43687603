"""What every part of muse-stack shares: errors, atomic writes, bounded reads, shell and manifest
quoting, and the one credential rule."""
