"""`muse-stack run`: validate, fingerprint, train, and write results beside the fingerprint."""
