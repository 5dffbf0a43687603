"""What every part of muse-stack shares: errors, atomic writes, bounded reads, shell and manifest
quoting, the one credential rule, and the process set-up a recipe's ``numerics`` asks for."""
