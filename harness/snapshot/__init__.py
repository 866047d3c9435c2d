"""Snapshots of one device call (docs/snapshot.md): the call behind a check's or bisect's first
failing point, written whole and sealed as goldens are (`write`, harness/inputs/sealed.py), read
back only once every hash, identity and shape agrees (`read`), replayed off-chip on any backend
and judged by the check's own judge (`replay`), and turned into a standalone script that needs
neither this package nor the checkpoint (`repro`).

Modules are named for what they are. The operations on a device call's snapshot are verbs:
`record`, `write`, `read`, `replay`, `repro`. What they share are nouns: `target` (which call),
`calls` (the engine's calls as it made them), `fields` (the snapshot's format), `traced_layer`
(the port's layer traced for the repro), `hlo_bundle` (its HLO bundle). The other kinds of
snapshot carry their kind's name: `bits` (a bit-exact layer alone: recorded and replayed), and the
host step's `host` (found, recorded, checked on read), `host_replay`, `host_repro` and
`host_raises` (its `raises` kind)."""
