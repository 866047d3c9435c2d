"""Snapshots of one device call (docs/snapshot.md): the call behind a check's or bisect's first
failing point, written whole and sealed (`write`), read back only once every hash, identity and
shape agrees (`read`), replayed off-chip on any backend and judged by the check's own judge
(`replay`), and turned into a standalone script that needs neither this package nor the
checkpoint (`repro`)."""
